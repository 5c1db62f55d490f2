"""gpushare.connection: :mod:`multiprocessing.connection`, which gpushare uses unchanged.

Connections pickle what they send with multiprocessing's ForkingPickler, so
a lambda or a closure does not go through a Pipe; gpushare's queues and
processes carry them (``conn.send_bytes(gpushare.reduction.dumps(obj))``
sends one through a Pipe, read with ``pickle.loads(conn.recv_bytes())``).

Every public name is multiprocessing's, by the rule of :mod:`gpushare._mirror`
(the one all of gpushare's submodules follow).
"""

from __future__ import annotations

from multiprocessing import connection as _stdlib

from ._mirror import mirror as _mirror

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.connection import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib)
