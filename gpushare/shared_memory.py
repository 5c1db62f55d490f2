"""gpushare.shared_memory: :mod:`multiprocessing.shared_memory`, which gpushare uses unchanged.

For memory a GPU can share, allocate gpushare buffers from a Manager
(``manager.empty(..., device="cpu")`` is host shared memory that travels as a
descriptor).

Every public name is multiprocessing's, by the rule of :mod:`gpushare._mirror`
(the one all of gpushare's submodules follow).
"""

from __future__ import annotations

from multiprocessing import shared_memory as _stdlib

from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.shared_memory import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib)
