"""gpushare.dummy: :mod:`multiprocessing.dummy`, which gpushare uses unchanged.

multiprocessing's API over threads (``Pool`` is a ``ThreadPool``): nothing
is pickled and no process starts, so there is nothing for gpushare to
change. Every public name is multiprocessing's, by the rule of
:mod:`gpushare._mirror`, and ``connection`` is
:mod:`multiprocessing.dummy.connection` (``import gpushare.dummy.connection``
finds it too).
"""

from __future__ import annotations

import sys
from multiprocessing import dummy as _stdlib
from multiprocessing.dummy import connection

from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.dummy import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib)
sys.modules.setdefault(f"{__name__}.connection", connection)  # this module is no package: the import finds it here
