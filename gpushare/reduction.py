"""gpushare.reduction: :mod:`multiprocessing.reduction`, plus gpushare's dumps.

``ForkingPickler`` and ``register`` are multiprocessing's own, one registry
for both: a reducer registered through either is used by gpushare's
pickling too, and gpushare registers its own there (``gpushare.Buffer``'s;
a ``ProcessPoolExecutor``'s call items once one is given gpushare's
context). ``dumps`` is added: how gpushare pickles what it sends to another
process (a Process's target and arguments, queue items, Pool tasks and
results) -- ForkingPickler's pickle when that carries the object, byte for
byte, and cloudpickle's, with every registered reducer, for lambdas,
closures and the like. ``pickle.loads`` reads it. The rest is
multiprocessing's, by the rule of :mod:`gpushare._mirror`.
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
