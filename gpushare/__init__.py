"""gpushare: multiprocessing for GPU buffers.

``import gpushare as mp`` in place of ``import multiprocessing as mp``:
every public name of :mod:`multiprocessing` is here, bound to gpushare's
default context (spawn start method, gpushare Process and Manager), and
buffers made by ``mp.Manager()`` travel through queues, pipes and process
arguments as small descriptors that the receiver maps with no copy.

This module is only a facade: the implementation lives in private modules.
Importing it costs about what importing :mod:`multiprocessing` costs: the
names that need more (``Buffer``, ``BufferManager``, ``Ring``, the loader)
load their modules when first used, and so do NumPy, the CUDA bindings and
the lifetime service. It is also the one place where the seams between the
layers are connected (:mod:`gpushare._seams`), in the block below.
"""

from __future__ import annotations

import multiprocessing as _multiprocessing
from importlib import import_module as _import_module

from . import _seams
from ._context import _default_context, get_context
from ._errors import (
    BackendUnavailableError,
    BufferReleasedError,
    CUDAError,
    CUDAOutOfMemoryError,
    DescriptorError,
    GpushareError,
    LayoutError,
    LeakWarning,
    LeaseExpiredWarning,
    LoaderError,
    ManagerClosedError,
    NoDeviceError,
    OutOfMemoryError,
    OwnerGoneError,
    RingClosedError,
    StartMethodError,
    TensorSetClosedError,
    WaitTimeoutError,
)
from ._version import __version__ as __version__

# typing is not imported at run time: it costs every process about 3 ms (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _ray_form(buf: Any) -> tuple[Any, tuple[Any, ...]]:
    """A buffer pickled inside a connected Ray process takes Ray's form (gpushare.ray)."""
    from .ray import reduce_for_ray

    return reduce_for_ray(buf)


# -- the seams (see gpushare._seams) ------------------------------------------------------
_seams.set_default_context(get_context)
_seams.set_ray_form(_ray_form)

_MULTIPROCESSING_NAMES = list(_multiprocessing.__all__)
globals().update((name, getattr(_default_context, name)) for name in _MULTIPROCESSING_NAMES)

#: Public names whose modules load on first use: name -> (module, attribute).
_LAZY = {
    "Buffer": ("._reduction", "Buffer"),  # _reduction: the Buffer with its reducers registered
    "BufferManager": ("._manager", "BufferManager"),
    "GRANULARITY": ("._manager", "GRANULARITY"),
    "Ring": ("._fanout", "Ring"),
    "SlotArray": ("._batch", "SlotArray"),
    "SlotLoader": ("._loader", "SlotLoader"),
    "SlotWriter": ("._batch", "SlotWriter"),
    "Snapshot": ("._fanout", "Snapshot"),
    "TensorSet": ("._fanout", "TensorSet"),
    "prepare_loaders": ("._loader_workers", "prepare_loaders"),
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'gpushare' has no attribute {name!r}")
    value = getattr(_import_module(where[0], __name__), where[1])
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "GRANULARITY",
    "BackendUnavailableError",
    "Buffer",
    "BufferManager",
    "BufferReleasedError",
    "CUDAError",
    "CUDAOutOfMemoryError",
    "DescriptorError",
    "GpushareError",
    "LayoutError",
    "LeakWarning",
    "LeaseExpiredWarning",
    "LoaderError",
    "ManagerClosedError",
    "NoDeviceError",
    "OutOfMemoryError",
    "OwnerGoneError",
    "Ring",
    "RingClosedError",
    "SlotArray",
    "SlotLoader",
    "SlotWriter",
    "Snapshot",
    "StartMethodError",
    "TensorSet",
    "TensorSetClosedError",
    "WaitTimeoutError",
    "prepare_loaders",
]

__all__ += [name for name in _MULTIPROCESSING_NAMES if name not in __all__]
