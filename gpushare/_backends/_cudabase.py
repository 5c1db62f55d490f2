"""What every CUDA backend shares: placement of mappings and memory operations.

:func:`placement` picks the device contexts a CUDA mapping is made in. The memory's GPU is
found by UUID. A mapping goes in that GPU's context when this process sees it, plus the bound
device (``GPUSHARE_DEVICE``) as a peer when that is another GPU that reaches the memory.
When the memory's GPU is hidden, the mapping goes in the bound device, as a peer mapping.
"""

from __future__ import annotations

import ctypes
import os

from .. import _cuda
from .._errors import NoDeviceError
from . import _base

__all__ = ["CudaBackend", "bound_device", "placement"]


def bound_device() -> int | None:
    value = os.environ.get("GPUSHARE_DEVICE", "")
    return int(value) if value.isdigit() else None


def placement(device_uuid: bytes) -> tuple[int | None, list[int]]:
    """(the memory's ordinal here or None when hidden, device ordinals to map it for)."""
    try:
        home: int | None = _cuda.ordinal_from_uuid(device_uuid)
    except NoDeviceError:
        home = None
    bound = bound_device()
    if home is None:
        if bound is None:
            raise NoDeviceError(
                f"the buffer lives on GPU {_cuda.format_uuid(device_uuid)}, which this process cannot see; "
                "make it visible (CUDA_VISIBLE_DEVICES) or start the worker with Process(device=N) on a GPU "
                "with peer access to it"
            )
        return None, [bound]
    ordinals = [home]
    if bound is not None and bound != home and bound < _cuda.device_count() and _cuda.can_access_peer(bound, home):
        ordinals.append(bound)
    return home, ordinals


class CudaBackend(_base.Backend):
    """Memory operations on device pointers, the same for every CUDA backend."""

    is_cuda = True

    # A Memory with a ready event (only CUDA memory has one) waits through its backend:
    # gpushare._memory imports nothing of the CUDA layer. The driver calls themselves,
    # so a wait costs no more than calling gpushare._cuda directly.
    event_synchronize = staticmethod(_cuda.event_synchronize)
    stream_wait_event = staticmethod(_cuda.stream_wait_event)

    def fill(self, ptr: int, pattern: bytes, nbytes: int, device: int | None) -> None:
        assert device is not None
        if len(set(pattern)) <= 1:
            _cuda.memset(ptr, pattern[0] if pattern else 0, nbytes, device)
        elif len(pattern) == 4:
            _cuda.memset32(ptr, int.from_bytes(pattern, "little"), nbytes // 4, device)
        else:  # other patterns (float16, float64, complex): stage one copy on the host
            staged = ctypes.create_string_buffer(pattern * (nbytes // len(pattern)), nbytes)
            _cuda.memcpy_htod(ptr, ctypes.addressof(staged), nbytes, device)

    def copy_in(self, ptr: int, host_ptr: int, nbytes: int, device: int | None) -> None:
        assert device is not None
        _cuda.memcpy_htod(ptr, host_ptr, nbytes, device)

    def copy_out(self, host_ptr: int, ptr: int, nbytes: int, device: int | None) -> None:
        assert device is not None
        _cuda.memcpy_dtoh(host_ptr, ptr, nbytes, device)
