"""The ``cuda_vmm`` backend: VMM allocations shared as POSIX file descriptors.

Owner side: ``cuMemCreate`` (pinned device memory, POSIX-fd handle type
requested; the device must report both VMM and POSIX-fd support), reserve
an address range, map, set access, all aligned to the allocation
granularity (2 MiB on current GPUs; the Manager rounds sizes to 2 MiB and
this backend rounds further if a device needs more). The fd is exported
with ``cuMemExportToShareableHandle`` once per allocation, on first share
(it costs about 0.7 ms), and kept until the allocation is freed.

The fd travels with SCM_RIGHTS over the connection between the consumer
and the owner's lifetime service (never ``pidfd_getfd``, which ordinary
containers forbid). Descriptors carry no handle bytes: the consumer asks
the owner for the fd when it first maps the allocation.

Consumer side: import + reserve + map + set access, once per process per
allocation (the mapping is cached by the lifetime layer). Every
construction is all-or-nothing: a failing step undoes the earlier ones,
so a half-built mapping never leaks.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .. import _cuda
from .._errors import BackendUnavailableError
from . import _base
from ._cudabase import CudaBackend, placement

__all__ = ["CudaVmmBackend"]


class CudaVmmBackend(CudaBackend):
    name = "cuda_vmm"

    def __init__(self) -> None:
        super().__init__()
        self._granularity: dict[int, int] = {}

    def check_device(self, device: int) -> None:
        if not _cuda.supports(device, "posix_fd"):
            raise BackendUnavailableError(
                f"backend 'cuda_vmm' needs virtual memory management with POSIX file-descriptor handles, "
                f"which device {device} does not support; use backend='cuda_ipc'"
            )

    def _round(self, nbytes: int, device: int) -> int:
        gran = self._granularity.get(device)
        if gran is None:
            gran = self._granularity[device] = _cuda.vmm_granularity(device)
        return math.ceil(nbytes / gran) * gran

    def allocate(self, nbytes: int, device: int | None) -> _base.Allocation:
        assert device is not None
        size = self._round(nbytes, device)
        ptr, handle = _cuda.vmm_alloc(size, device)
        # native: [generic allocation handle, exported fd or None, mapped size]
        return _base.Allocation(self.name, ptr, nbytes, device, _cuda.device_uuid(device), b"", [handle, None, size])

    def export(self, allocation: _base.Allocation) -> bytes:
        return b""  # the fd travels separately (export_fd)

    def export_fd(self, allocation: _base.Allocation) -> int:
        native = allocation.native
        with self._lock:  # several consumers may ask at once: export exactly once
            if native[1] is None:
                assert allocation.device is not None
                native[1] = _cuda.vmm_export(native[0], allocation.device)
        return int(native[1])

    def free(self, allocation: _base.Allocation) -> None:
        assert allocation.device is not None
        handle, fd, size = allocation.native
        _cuda.vmm_free(allocation.ptr, handle, size, allocation.device)
        if fd is not None:
            os.close(fd)

    def _map(self, handle: bytes, nbytes: int, device_uuid: bytes, fetch_fd: Any, scope: bytes) -> _base.Mapping:
        _, ordinals = placement(device_uuid)
        size = self._round(nbytes, ordinals[0])
        fd = fetch_fd()
        try:
            ptr, generic = _cuda.vmm_import(fd, size, ordinals)
        finally:
            os.close(fd)  # the imported handle keeps the memory; the fd is no longer needed
        return _base.Mapping(self.name, ptr, nbytes, ordinals[0], device_uuid, [generic, size])

    def close(self, mapping: _base.Mapping) -> None:
        assert mapping.device is not None
        generic, size = mapping.native
        _cuda.vmm_free(mapping.ptr, generic, size, mapping.device)

    def capabilities(self) -> dict[str, Any]:
        caps = super().capabilities()
        caps["mechanism"] = "VMM allocations (cuMemCreate) shared as POSIX fds over SCM_RIGHTS"
        return caps
