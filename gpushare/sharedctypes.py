"""gpushare.sharedctypes: :mod:`multiprocessing.sharedctypes`, defaulting to gpushare's context.

gpushare's in the stdlib's place: ``Value``, ``Array`` and ``synchronized``,
which make their lock with gpushare's default context when ``ctx=`` is not
given (multiprocessing's make it with multiprocessing's default, fork on
Linux before Python 3.14, and such a lock cannot go to a spawned gpushare
process), and ``get_context`` (gpushare's). ``RawValue``, ``RawArray``,
``copy`` and the rest are multiprocessing's, by the rule of
:mod:`gpushare._mirror`.
"""

from __future__ import annotations

from multiprocessing import sharedctypes as _stdlib

from ._context import get_context as _get_context
from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.sharedctypes import RawArray as RawArray
    from multiprocessing.sharedctypes import RawValue as RawValue
    from multiprocessing.sharedctypes import copy as copy
    from typing import Any


def Value(typecode_or_type: Any, *args: Any, lock: Any = True, ctx: Any = None) -> Any:
    """A synchronized shared ctypes object (see multiprocessing.sharedctypes.Value)."""
    return _stdlib.Value(typecode_or_type, *args, lock=lock, ctx=ctx or _get_context())


def Array(typecode_or_type: Any, size_or_initializer: Any, *, lock: Any = True, ctx: Any = None) -> Any:
    """A synchronized shared ctypes array (see multiprocessing.sharedctypes.Array)."""
    return _stdlib.Array(typecode_or_type, size_or_initializer, lock=lock, ctx=ctx or _get_context())


def synchronized(obj: Any, lock: Any = None, ctx: Any = None) -> Any:
    """``obj`` wrapped with a lock (see multiprocessing.sharedctypes.synchronized)."""
    return _stdlib.synchronized(obj, lock, ctx or _get_context())


__all__ = _mirror(globals(), _stdlib)
