"""gpushare.synchronize: :mod:`multiprocessing.synchronize`, which gpushare uses unchanged.

Its classes take ``ctx=``: pass gpushare's (``gpushare.get_context()``), or use
``gpushare.Lock()`` and the like, so that the objects can go to gpushare's
spawned processes.

Every public name is multiprocessing's, by the rule of :mod:`gpushare._mirror`
(the one all of gpushare's submodules follow).
"""

from __future__ import annotations

from multiprocessing import synchronize as _stdlib

from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.synchronize import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib)
