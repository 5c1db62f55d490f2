"""gpushare.pool: :mod:`multiprocessing.pool`, with gpushare's Pool.

gpushare's in the stdlib's place: ``Pool`` (gpushare's processes; tasks
and results pickled as a Process's arguments are, so lambdas and closures
work; without ``context=``, gpushare's default context; see
:mod:`gpushare._pool`) and ``get_context`` (gpushare's). ``ThreadPool``, the
result classes and the rest are multiprocessing's, by the rule of
:mod:`gpushare._mirror`.
"""

from __future__ import annotations

from multiprocessing import pool as _stdlib

from ._mirror import mirror as _mirror
from ._pool import Pool as Pool

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.pool import ApplyResult as ApplyResult
    from multiprocessing.pool import AsyncResult as AsyncResult
    from multiprocessing.pool import IMapIterator as IMapIterator
    from multiprocessing.pool import IMapUnorderedIterator as IMapUnorderedIterator
    from multiprocessing.pool import MapResult as MapResult
    from multiprocessing.pool import ThreadPool as ThreadPool

__all__ = _mirror(globals(), _stdlib)
