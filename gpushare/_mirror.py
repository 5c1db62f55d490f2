"""How gpushare's public submodules mirror multiprocessing's.

For each public submodule of :mod:`multiprocessing` (listed in the
facade, ``gpushare._SUBMODULES``) there is a ``gpushare.<name>``, a small
real module, so that code written for multiprocessing switches by its
import line alone: ``import gpushare.connection``, ``from gpushare.pool
import Pool`` and ``gpushare.queues`` (loaded on first use by the facade)
all work. Each applies one rule, through :func:`mirror`:

* every public name of ``multiprocessing.<name>`` (no leading underscore;
  the modules it imports aside) is there, the stdlib's own object;
* a name that is also one of multiprocessing's top-level names, for the
  same object (``get_context``, ``Process``, ``TimeoutError`` ...), is
  gpushare's top-level object of that name, bound to gpushare's default
  context;
* where gpushare changes behaviour, the module defines gpushare's object
  under the stdlib's name before it calls :func:`mirror`, which keeps it,
  and it may add names of its own (each module's docstring lists both).
  ``__all__`` is the stdlib module's plus those additions.

Left out (``gpushare._LEFT_OUT``): the modules that implement start
methods and resource bookkeeping (``forkserver``, ``heap``, ``popen_*``,
``resource_sharer``, ``resource_tracker``, ``spawn``), which the Python
documentation does not describe as interfaces and gpushare uses unchanged.
Import them from multiprocessing (``gpushare.spawn`` says so).
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
