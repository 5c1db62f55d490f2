"""gpushare: multiprocessing for GPU buffers.

``import gpushare as mp`` in place of ``import multiprocessing as mp``:
every public name of :mod:`multiprocessing` is here, bound to gpushare's
default context (spawn start method, gpushare Process and Manager), and
buffers made by ``mp.Manager()`` travel through queues, pipes and process
arguments as small descriptors that the receiver maps with no copy.

This module is only a facade: the implementation lives in private modules.
"""

from __future__ import annotations

import multiprocessing as _multiprocessing

from . import _reduction  # registers the Buffer reducers with copyreg and multiprocessing
from ._buffer import Buffer
from ._context import _default_context
from ._errors import (
    BackendUnavailableError,
    BufferReleasedError,
    CUDAError,
    CUDAOutOfMemoryError,
    DescriptorError,
    GpushareError,
    LeakWarning,
    LeaseExpiredWarning,
    LoaderError,
    ManagerClosedError,
    NoDeviceError,
    OutOfMemoryError,
    OwnerGoneError,
    RingClosedError,
    StartMethodError,
)
from ._loader import SlotLoader
from ._manager import GRANULARITY, BufferManager
from ._ring import Ring
from ._slots import SlotArray, SlotWriter
from ._version import __version__ as __version__


def _ray_form(buf: Buffer) -> tuple[object, tuple[object, ...]]:
    """A buffer pickled inside a connected Ray process takes Ray's form (gpushare.ray),
    handed down to _reduction so that the lower layer never imports the upper one."""
    from .ray import reduce_for_ray

    return reduce_for_ray(buf)


_reduction.ray_form = _ray_form

_MULTIPROCESSING_NAMES = list(_multiprocessing.__all__)
globals().update((name, getattr(_default_context, name)) for name in _MULTIPROCESSING_NAMES)

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
    "StartMethodError",
]

__all__ += [name for name in _MULTIPROCESSING_NAMES if name not in __all__]
