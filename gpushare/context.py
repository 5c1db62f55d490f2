"""gpushare.context: :mod:`multiprocessing.context`, with gpushare's contexts.

gpushare's in the stdlib's place: ``SpawnContext``, ``ForkServerContext``,
``ForkContext`` and ``DefaultContext`` (their Process, Pool, queues and
Manager are gpushare's), ``SpawnProcess``, ``ForkServerProcess``,
``ForkProcess`` and ``Process`` (the default context's; all take
``device=``). The rest (``BaseContext``, ``assert_spawning``, the
exceptions ...) is multiprocessing's, by the rule of :mod:`gpushare._mirror`.
gpushare's default context is ``gpushare.get_context()``.
"""

from __future__ import annotations

from multiprocessing import context as _stdlib

from ._context import DefaultContext as DefaultContext
from ._context import ForkContext as ForkContext
from ._context import ForkProcess as ForkProcess
from ._context import ForkServerContext as ForkServerContext
from ._context import ForkServerProcess as ForkServerProcess
from ._context import Process as Process
from ._context import SpawnContext as SpawnContext
from ._context import SpawnProcess as SpawnProcess
from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.context import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib)
