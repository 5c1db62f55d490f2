"""Seams: what a lower layer needs from a higher one, handed down instead of imported.

Each seam is one registration function here and one reader:

- ``set_default_context`` / :func:`default_context` and ``set_ray_form`` / :func:`ray_form`:
  filled by the facade (:mod:`gpushare`) at import, in one block.
- ``mark_cuda_initialized`` / :func:`cuda_initialized`: set by the CUDA layer when the driver loads.
- ``at_worker_exit`` / :func:`worker_exit`: hooks the lifetime service's first link registers.
This module imports nothing of gpushare, so any layer may read it. Why each: dev/design-notes.md, "Layers".
"""

from __future__ import annotations

# typing is not imported at run time: importing it is a measurable share of a child's start (the
# `startup` benchmark scenario), and this module (like the facade and the context and process
# modules) is imported by every child.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = [
    "at_worker_exit",
    "cuda_initialized",
    "default_context",
    "mark_cuda_initialized",
    "ray_form",
    "set_default_context",
    "set_ray_form",
    "worker_exit",
]

_default_context: Callable[[], Any] | None = None
_ray_form: Callable[[Any], tuple[Any, tuple[Any, ...]]] | None = None
_cuda_initialized = False
_worker_exit: list[Callable[[], None]] = []


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


def mark_cuda_initialized() -> None:
    """Record that the CUDA driver is initialised in this process."""
    global _cuda_initialized
    _cuda_initialized = True


def cuda_initialized() -> bool:
    """Whether gpushare initialised the CUDA driver in this process."""
    return _cuda_initialized


def at_worker_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` when a gpushare worker's target returns (once, however often registered)."""
    if hook not in _worker_exit:
        _worker_exit.append(hook)


def worker_exit() -> None:
    """Run the hooks of :func:`at_worker_exit`, in order."""
    for hook in list(_worker_exit):
        hook()
