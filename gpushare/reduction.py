"""gpushare.reduction: :mod:`multiprocessing.reduction`, plus gpushare's dumps.

``ForkingPickler`` and ``register`` are multiprocessing's own: one registry, which gpushare's
pickling uses too. ``dumps`` is added: how gpushare pickles what it sends to another process
(ForkingPickler's bytes where that carries the object, else cloudpickle's with every registered
reducer); ``pickle.loads`` reads it. The rest is multiprocessing's, by the rule of :mod:`gpushare._mirror`.
"""

from __future__ import annotations

from multiprocessing import reduction as _stdlib

from ._mirror import mirror as _mirror
from ._process import dumps as dumps

# typing is not imported at run time (see gpushare._seams); type checkers see the stdlib's names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from multiprocessing.reduction import *  # noqa: F403

__all__ = _mirror(globals(), _stdlib, added=("dumps",))
