"""Seams: what a lower layer needs from a higher one, handed down instead of imported.

Imports only go down the layers of ``docs/design.md``. In two places a lower
layer needs something that only a higher one can give; each is a seam with
one registration function here, and :mod:`gpushare` (the facade, which every
import of the package runs first) calls all of them, in one block, at import:

``set_default_context(get_context)``
    :class:`~gpushare.BufferManager` made without ``ctx=`` uses gpushare's
    default context (:mod:`gpushare._context`, which sits above the Manager:
    the context's ``Manager()`` makes one). Read with :func:`default_context`.
``set_ray_form(reduce)``
    A buffer pickled inside a connected Ray process takes Ray's form
    (:mod:`gpushare.ray`, the top layer). Read with :func:`ray_form`.

Nothing else is handed down. This module imports nothing of gpushare, so any
layer may read it.
"""

from __future__ import annotations

from collections.abc import Callable

# typing is not imported at run time: importing it is a measurable share of a child's start (the
# `startup` benchmark scenario), and this module (like the facade and the context and process
# modules) is imported by every child.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["default_context", "ray_form", "set_default_context", "set_ray_form"]

_default_context: Callable[[], Any] | None = None
_ray_form: Callable[[Any], tuple[Any, tuple[Any, ...]]] | None = None


def set_default_context(get_context: Callable[[], Any]) -> None:
    """Register the function that returns gpushare's default context."""
    global _default_context
    _default_context = get_context


def default_context() -> Any:
    """gpushare's default context (spawn unless the user chose another start method)."""
    if _default_context is None:
        raise RuntimeError("gpushare's facade did not run; import gpushare, not only its private modules")
    return _default_context()


def set_ray_form(reduce: Callable[[Any], tuple[Any, tuple[Any, ...]]]) -> None:
    """Register the reducer that gives a Buffer its form inside Ray."""
    global _ray_form
    _ray_form = reduce


def ray_form() -> Callable[[Any], tuple[Any, tuple[Any, ...]]] | None:
    """The Ray reducer, or None before the facade registered it."""
    return _ray_form
