"""The ``cuda_pool`` backend: an IPC-enabled CUDA memory pool per device.

- Owner: one pool per device (POSIX-fd handle type), exported once; buffers are
  ``cuMemAllocFromPoolAsync`` allocations, synchronised before the pointer is handed out,
  and travel as 8 bytes naming the pool plus 64 bytes of ``cuMemPoolExportPointer`` data.
- Consumer: imports the pool once per process (its fd by SCM_RIGHTS, cached by owner and
  pool), then one pointer import per allocation; the pool goes when the link to its owner closes.
- Importers free their pointers before the owner frees; the lifetime service enforces that order.
Why: dev/design-notes.md, "Backends".
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

from .. import _cuda
from .._errors import BackendUnavailableError
from . import _base
from ._cudabase import CudaBackend, placement

__all__ = ["CudaPoolBackend"]

_POOL_ID = 8  # bytes naming a pool in a descriptor's handle


class CudaPoolBackend(CudaBackend):
    name = "cuda_pool"

    def __init__(self) -> None:
        super().__init__()
        self._pools: dict[int, tuple[Any, int, bytes]] = {}  # device -> (pool, fd, pool id)
        self._imported: dict[tuple[bytes, bytes], tuple[Any, int]] = {}  # (owner, pool id) -> (pool, ordinal)
        self._pool_lock = threading.Lock()

    def check_device(self, device: int) -> None:
        if not _cuda.supports(device, "pool_ipc"):
            raise BackendUnavailableError(
                f"backend 'cuda_pool' needs memory pools exportable as POSIX file descriptors, which "
                f"device {device} does not support; use backend='cuda_ipc'"
            )

    def _pool(self, device: int) -> tuple[Any, int, bytes]:
        with self._pool_lock:
            entry = self._pools.get(device)
            if entry is None:
                pool, fd = _cuda.pool_create(device)
                entry = self._pools[device] = (pool, fd, secrets.token_bytes(_POOL_ID))
            return entry

    def allocate(self, nbytes: int, device: int | None) -> _base.Allocation:
        assert device is not None
        pool, _, pool_id = self._pool(device)
        ptr, export = _cuda.pool_alloc(pool, nbytes, device)
        return _base.Allocation(self.name, ptr, nbytes, device, _cuda.device_uuid(device), pool_id + export)

    def export(self, allocation: _base.Allocation) -> bytes:
        return allocation.handle

    def export_fd(self, allocation: _base.Allocation) -> int:
        assert allocation.device is not None
        return self._pool(allocation.device)[1]

    def free(self, allocation: _base.Allocation) -> None:
        assert allocation.device is not None
        _cuda.pool_free(allocation.ptr, allocation.device)
        _cuda.pool_trim(self._pool(allocation.device)[0], allocation.device)

    def _map(self, handle: bytes, nbytes: int, device_uuid: bytes, fetch_fd: Any, scope: bytes) -> _base.Mapping:
        pool_id, export = handle[:_POOL_ID], handle[_POOL_ID:]
        home, ordinals = placement(device_uuid)
        key = (scope, pool_id)
        with self._pool_lock:
            entry = self._imported.get(key)
            if entry is None:
                fd = fetch_fd()
                try:
                    entry = (_cuda.pool_import(fd, ordinals, home), ordinals[0])
                finally:
                    os.close(fd)
                self._imported[key] = entry
            pool = entry[0]
        ptr = _cuda.pool_import_pointer(pool, export, ordinals[0])
        return _base.Mapping(self.name, ptr, nbytes, ordinals[0], device_uuid)

    def close(self, mapping: _base.Mapping) -> None:
        assert mapping.device is not None
        _cuda.pool_free(mapping.ptr, mapping.device)  # importers free first (driver rule)

    def forget(self, scope: bytes) -> None:
        """Destroy the pools imported from owner ``scope`` (its mappings are all closed)."""
        with self._pool_lock:
            gone = [key for key in self._imported if key[0] == scope]
            pools = [self._imported.pop(key) for key in gone]
        for pool, ordinal in pools:
            _cuda.pool_destroy(pool, ordinal)

    def capabilities(self) -> dict[str, Any]:
        caps = super().capabilities()
        caps["mechanism"] = "IPC memory pool (pool fd by SCM_RIGHTS once, 64-byte pointer export per buffer)"
        return caps
