"""gpushare: multiprocessing for GPU buffers.

``import gpushare as mp`` in place of ``import multiprocessing as mp``: every public name
of :mod:`multiprocessing` is here, bound to gpushare's default context (spawn, gpushare's
Process and Manager). Buffers made by ``mp.Manager()`` travel through queues, pipes and
process arguments as small descriptors the receiver maps with no copy. multiprocessing's
public submodules have counterparts (``gpushare.connection``, ... : :mod:`gpushare._mirror`).

This module is the facade: ``__all__``, names loaded on first use, and the one block
that connects the seams (:mod:`gpushare._seams`).
"""

from __future__ import annotations

import multiprocessing as _multiprocessing
from importlib import import_module as _import_module

from . import _seams
from ._context import _default_context, get_context
from ._errors import (
    BackendUnavailableError,
    BufferReleasedError,
    CompiledCoreWarning,
    CUDAError,
    CUDAOutOfMemoryError,
    DescriptorError,
    GpushareError,
    LayoutError,
    LeakWarning,
    LeaseExpiredWarning,
    LoaderError,
    MainGuardError,
    ManagerClosedError,
    NoDeviceError,
    OutOfMemoryError,
    OwnerGoneError,
    ReentrantCallError,
    RingClosedError,
    StartMethodError,
    TensorSetClosedError,
    WaitTimeoutError,
)

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    # The submodules, loaded on first use by __getattr__ (see _SUBMODULES), for type checkers.
    from . import connection as connection
    from . import context as context
    from . import dummy as dummy
    from . import managers as managers
    from . import pool as pool
    from . import process as process
    from . import queues as queues
    from . import reduction as reduction
    from . import shared_memory as shared_memory
    from . import sharedctypes as sharedctypes
    from . import synchronize as synchronize
    from . import util as util

    # The lazy names below, for type checkers and the API reference (docs/reference/).
    from ._batch import SlotArray as SlotArray
    from ._batch import SlotWriter as SlotWriter
    from ._buffer import Buffer as Buffer
    from ._context import Process as Process
    from ._fanout import Ring as Ring
    from ._fanout import Snapshot as Snapshot
    from ._fanout import TensorSet as TensorSet
    from ._loader import SlotLoader as SlotLoader
    from ._loader_workers import prepare_loaders as prepare_loaders
    from ._manager import GRANULARITY as GRANULARITY
    from ._manager import BufferManager as BufferManager
    from ._version import __version__ as __version__


def _ray_form(buf: Any) -> tuple[Any, tuple[Any, ...]]:
    """A buffer pickled inside a connected Ray process takes Ray's form (gpushare.ray)."""
    from .ray import reduce_for_ray

    return reduce_for_ray(buf)


# -- the seams (see gpushare._seams) ------------------------------------------------------
_seams.set_default_context(get_context)
_seams.set_ray_form(_ray_form)

_MULTIPROCESSING_NAMES = list(_multiprocessing.__all__)
globals().update((name, getattr(_default_context, name)) for name in _MULTIPROCESSING_NAMES)

#: multiprocessing's public submodules, mirrored by gpushare's (loaded on first use; see gpushare._mirror).
_SUBMODULES = frozenset(
    ("connection", "context", "dummy", "managers", "pool", "process", "queues", "reduction", "shared_memory",
     "sharedctypes", "synchronize", "util")
)  # fmt: skip
#: multiprocessing's other submodules: they implement start methods and resource bookkeeping, which
#: the Python documentation does not describe as interfaces, and gpushare uses them unchanged.
_LEFT_OUT = frozenset(
    ("forkserver", "heap", "popen_fork", "popen_forkserver", "popen_spawn_posix", "popen_spawn_win32",
     "resource_sharer", "resource_tracker", "spawn")
)  # fmt: skip

#: Public names whose modules load on first use: name -> (module, attribute).
_LAZY = {
    "Buffer": ("._buffer", "Buffer"),
    "BufferManager": ("._manager", "BufferManager"),
    "GRANULARITY": ("._manager", "GRANULARITY"),
    "Ring": ("._fanout", "Ring"),
    "SlotArray": ("._batch", "SlotArray"),
    "SlotLoader": ("._loader", "SlotLoader"),
    "SlotWriter": ("._batch", "SlotWriter"),
    "Snapshot": ("._fanout", "Snapshot"),
    "TensorSet": ("._fanout", "TensorSet"),
    "__version__": ("._version", "__version__"),
    "prepare_loaders": ("._loader_workers", "prepare_loaders"),
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # gpushare.connection, gpushare.pool ...: multiprocessing's, mirrored
        return _import_module(f".{name}", __name__)  # the import binds it here
    where = _LAZY.get(name)
    if where is None:
        hint = ""
        if name in _LEFT_OUT:
            hint = f" (multiprocessing.{name} is multiprocessing's machinery, used unchanged: import it from there)"
        raise AttributeError(f"module 'gpushare' has no attribute {name!r}{hint}")
    value = getattr(_import_module(where[0], __name__), where[1])
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = [
    "GRANULARITY",
    "BackendUnavailableError",
    "Buffer",
    "BufferManager",
    "BufferReleasedError",
    "CUDAError",
    "CUDAOutOfMemoryError",
    "CompiledCoreWarning",
    "DescriptorError",
    "GpushareError",
    "LayoutError",
    "LeakWarning",
    "LeaseExpiredWarning",
    "LoaderError",
    "MainGuardError",
    "ManagerClosedError",
    "NoDeviceError",
    "OutOfMemoryError",
    "OwnerGoneError",
    "ReentrantCallError",
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
