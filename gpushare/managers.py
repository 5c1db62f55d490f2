"""gpushare.managers: :mod:`multiprocessing.managers`, plus gpushare's BufferManager.

``BufferManager`` is added: a ``SyncManager`` that also allocates buffers
(``gpushare.Manager()`` returns one, started), and ``get_context`` is
gpushare's. ``BaseManager``, ``SyncManager``, ``SharedMemoryManager``, the
proxies and the rest are multiprocessing's, by the rule of
:mod:`gpushare._mirror`; made without ``ctx=``, those managers use
multiprocessing's default context, as there.
"""

from __future__ import annotations

from multiprocessing import managers as _stdlib

from ._manager import BufferManager as BufferManager
from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.managers import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib, added=("BufferManager",))
