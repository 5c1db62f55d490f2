"""How gpushare's public submodules mirror multiprocessing's.

Each ``gpushare.<name>`` (``gpushare._SUBMODULES``) is a small real module that calls
:func:`mirror`, which applies one rule:

- every public name of ``multiprocessing.<name>`` is there (its imported modules aside);
- a top-level name of multiprocessing, for the same object, is gpushare's top-level object;
- any other is the stdlib's own object, except gpushare's, defined before :func:`mirror` runs.
``__all__`` is the stdlib module's plus gpushare's additions. Left out (``gpushare._LEFT_OUT``):
the start-method and bookkeeping modules (docs/multiprocessing.md lists them).
"""

from __future__ import annotations

import multiprocessing
import types

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["mirror"]


def mirror(namespace: dict[str, Any], module: types.ModuleType, added: tuple[str, ...] = ()) -> list[str]:
    """Copy ``module``'s public names into ``namespace`` by the rule above, keeping those
    ``namespace`` defines already (gpushare's); return ``module.__all__`` plus ``added``,
    the names gpushare adds."""
    from ._context import _default_context

    top = vars(multiprocessing)
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, types.ModuleType) or name in namespace:
            continue
        if name in multiprocessing.__all__ and top.get(name) is value:
            value = getattr(_default_context, name)
        namespace[name] = value
    return [*getattr(module, "__all__", ()), *added]
