"""gpushare.util: :mod:`multiprocessing.util`, which gpushare uses unchanged.

Logging (``get_logger``, ``log_to_stderr``), ``Finalize`` and the exit and
fork hooks that gpushare's own modules use too.

Every public name is multiprocessing's, by the rule of :mod:`gpushare._mirror`
(the one all of gpushare's submodules follow).
"""

from __future__ import annotations

from multiprocessing import util as _stdlib

from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.util import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib)
