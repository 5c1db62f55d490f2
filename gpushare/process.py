"""gpushare.process: :mod:`multiprocessing.process`, plus gpushare's Process.

``Process`` is added: gpushare's (``device=``; the start method of
gpushare's default context). ``BaseProcess``, ``current_process``,
``active_children`` and ``parent_process`` are multiprocessing's, by the rule
of :mod:`gpushare._mirror`: every process, gpushare's included, is a
``BaseProcess``.
"""

from __future__ import annotations

from multiprocessing import process as _stdlib

from ._context import Process as Process
from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.process import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib, added=("Process",))
