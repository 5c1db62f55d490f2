"""The ``cuda_ipc`` backend: legacy CUDA IPC memory handles (the default).

- Owner: ``cuMemAlloc`` of a size the Manager rounded to 2 MiB, then ``cuIpcGetMemHandle``
  once per allocation: 64 bytes that travel in the descriptor.
- Consumer: ``cuIpcOpenMemHandle`` with lazy peer access, placed by
  :func:`~gpushare._backends._cudabase.placement`; the caller caches the mapping per process.
- Every importer closes before the owner frees; the lifetime service enforces that order.
"""

from __future__ import annotations

from typing import Any

from .. import _cuda
from . import _base
from ._cudabase import CudaBackend, placement

__all__ = ["FOREIGN_IPC", "CudaIpcBackend", "ForeignIpcBackend"]


class CudaIpcBackend(CudaBackend):
    name = "cuda_ipc"

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

    def _map(self, handle: bytes, nbytes: int, device_uuid: bytes, fetch_fd: Any, scope: bytes) -> _base.Mapping:
        _, ordinals = placement(device_uuid)
        # Opened in the memory's own GPU when visible, else in the bound GPU as a peer
        # (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS does the enabling).
        ptr = _cuda.ipc_open(handle, ordinals[0])
        return _base.Mapping(self.name, ptr, nbytes, ordinals[0], device_uuid)

    def close(self, mapping: _base.Mapping) -> None:
        assert mapping.device is not None
        _cuda.ipc_close(mapping.ptr, mapping.device)

    def capabilities(self) -> dict[str, Any]:
        caps = super().capabilities()
        caps["mechanism"] = "legacy CUDA IPC memory handles (cuIpcGetMemHandle / cuIpcOpenMemHandle)"
        return caps


class ForeignIpcBackend(CudaIpcBackend):
    """Memory another allocator owns (torch's caching allocator), shared by the same handles.

    The owner never allocates or frees such memory: ``allocation.native`` holds what keeps
    it allocated (a torch storage), and :meth:`free` drops that, once every importer has
    closed its mapping. Receivers see an ordinary ``cuda_ipc`` descriptor.
    """

    def allocate(self, nbytes: int, device: int | None) -> _base.Allocation:
        raise TypeError("foreign memory is adopted (Owner.share_foreign), never allocated by gpushare")

    def free(self, allocation: _base.Allocation) -> None:
        allocation.native = None  # the allocator that made it may now reuse it


#: The one instance the owner's foreign records use.
FOREIGN_IPC = ForeignIpcBackend()
