"""The ``cuda_ipc`` backend: legacy CUDA IPC memory handles (the default).

Owner side: ``cuMemAlloc`` of a size the Manager already rounded up to a
multiple of 2 MiB, so no other allocation ever shares an exported block
(a handle exports the whole driver allocation it points into; a consumer
given buffer A can never reach a neighbour B through A's handle), then
``cuIpcGetMemHandle`` once per allocation: 64 bytes that travel through
any transport.

Consumer side: ``cuIpcOpenMemHandle`` with lazy peer access, in the
primary context of the device the memory lives on when this process sees
that device, else in this process's own device (a peer mapping). The
caller caches the mapping per process, because opening is the expensive
step (tens of microseconds, milliseconds for large or peer allocations).

The driver requires every importer to close before the owner frees; the
lifetime service (``_lifetime``) enforces that order.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from .. import _cuda
from .._errors import NoDeviceError
from . import _base

__all__ = ["CudaIpcBackend"]


class CudaIpcBackend(_base.Backend):
    name = "cuda_ipc"
    is_cuda = True

    def allocate(self, nbytes: int, device: int | None) -> _base.Allocation:
        assert device is not None
        ptr = _cuda.mem_alloc(nbytes, device)
        try:
            uuid = _cuda.device_uuid(device)
        except BaseException:
            _cuda.mem_free(ptr, device)
            raise
        return _base.Allocation(self.name, ptr, nbytes, device, uuid)

    def export(self, allocation: _base.Allocation) -> bytes:
        if not allocation.handle:
            assert allocation.device is not None
            allocation.handle = _cuda.ipc_get_handle(allocation.ptr, allocation.device)
        return allocation.handle

    def free(self, allocation: _base.Allocation) -> None:
        assert allocation.device is not None
        _cuda.mem_free(allocation.ptr, allocation.device)

    def _map(self, handle: bytes, nbytes: int, device_uuid: bytes) -> _base.Mapping:
        try:
            device = _cuda.ordinal_from_uuid(device_uuid)
        except NoDeviceError:
            # The memory's GPU is hidden from this process: map it as a peer
            # in this process's own device.
            device = int(os.environ.get("GPUSHARE_DEVICE", "0") or 0)
        ptr = _cuda.ipc_open(handle, device)
        return _base.Mapping(self.name, ptr, nbytes, device, device_uuid)

    def close(self, mapping: _base.Mapping) -> None:
        assert mapping.device is not None
        _cuda.ipc_close(mapping.ptr, mapping.device)

    def fill(self, ptr: int, pattern: bytes, nbytes: int, device: int | None) -> None:
        assert device is not None
        if len(set(pattern)) <= 1:
            _cuda.memset(ptr, pattern[0] if pattern else 0, nbytes, device)
        elif len(pattern) == 4:
            _cuda.memset32(ptr, int.from_bytes(pattern, "little"), nbytes // 4, device)
        else:  # wider patterns (float64, complex): stage one copy on the host
            staged = ctypes.create_string_buffer(pattern * (nbytes // len(pattern)), nbytes)
            _cuda.memcpy_htod(ptr, ctypes.addressof(staged), nbytes, device)

    def copy_in(self, ptr: int, host_ptr: int, nbytes: int, device: int | None) -> None:
        assert device is not None
        _cuda.memcpy_htod(ptr, host_ptr, nbytes, device)

    def copy_out(self, host_ptr: int, ptr: int, nbytes: int, device: int | None) -> None:
        assert device is not None
        _cuda.memcpy_dtoh(host_ptr, ptr, nbytes, device)

    def capabilities(self) -> dict[str, Any]:
        caps = super().capabilities()
        caps["mechanism"] = "legacy CUDA IPC memory handles (cuIpcGetMemHandle / cuIpcOpenMemHandle)"
        return caps
