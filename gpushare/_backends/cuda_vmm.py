"""The ``cuda_vmm`` backend: VMM allocations shared as POSIX file descriptors.

- Owner: ``cuMemCreate`` (POSIX-fd handle type) + reserve + map + access, aligned to the
  device's granularity. ``export`` starts the fd export on a background thread at the first
  share; ``export_fd`` waits for it (or exports) and keeps the fd until the allocation is freed.
- The fd travels by SCM_RIGHTS over the owner connection; descriptors carry no handle bytes.
- Consumer: import + reserve + map + access, once per process per allocation.
- Every construction is all or nothing: a failing step undoes the earlier ones.
Why: dev/design-notes.md, "Backends".
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from typing import Any

from .. import _cuda
from .._errors import BackendUnavailableError
from . import _base
from ._cudabase import CudaBackend, placement

__all__ = ["CudaVmmBackend"]

log = logging.getLogger("gpushare")

# native: [generic allocation handle (None once freed), exported fd or None, mapped size,
# export queued on the background thread]
_HANDLE, _FD, _SIZE, _QUEUED = range(4)
#: Seconds the export thread waits for work before it ends.
_EXPORTER_IDLE_S = 2.0


class CudaVmmBackend(CudaBackend):
    name = "cuda_vmm"

    def __init__(self) -> None:
        super().__init__()
        self._granularity: dict[int, int] = {}
        self._ahead: queue.SimpleQueue[_base.Allocation] | None = None  # the exporter thread's work
        self._ahead_lock = threading.Lock()  # starts the exporter thread once

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
        return _base.Allocation(
            self.name, ptr, nbytes, device, _cuda.device_uuid(device), b"", [handle, None, size, False]
        )

    def export(self, allocation: _base.Allocation) -> bytes:
        """Called as each lease is taken: the first one starts exporting the fd ahead."""
        native = allocation.native
        if native[_FD] is None and not native[_QUEUED]:
            native[_QUEUED] = True
            self._export_ahead(allocation)
        return b""  # the fd travels separately (export_fd)

    def _export_ahead(self, allocation: _base.Allocation) -> None:
        # Not the backend's lock, which an export in progress holds throughout: the
        # caller (taking a lease) holds the owner's lock, and must never wait on one.
        with self._ahead_lock:
            if self._ahead is None:
                self._ahead = queue.SimpleQueue()
                threading.Thread(
                    target=self._exporter, args=(self._ahead,), name="gpushare-vmm-export", daemon=True
                ).start()
            self._ahead.put(allocation)

    def _exporter(self, work: queue.SimpleQueue[_base.Allocation]) -> None:
        """Export what is queued; after a few idle seconds, end (the next lease starts
        another), so a process that stopped sharing keeps no thread of ours."""
        while True:
            try:
                allocation = work.get(timeout=_EXPORTER_IDLE_S)
            except queue.Empty:
                with self._ahead_lock:  # _export_ahead queues under this lock
                    if work.empty():
                        self._ahead = None
                        return
                continue
            try:
                self.export_fd(allocation)
            except Exception as exc:  # freed meanwhile, or a driver error: the request will say
                log.debug("gpushare: exporting an allocation ahead failed: %r", exc)

    def export_fd(self, allocation: _base.Allocation) -> int:
        native = allocation.native
        with self._lock:  # the exporter thread and several consumers: export exactly once
            if native[_HANDLE] is None:
                raise ValueError("the allocation was freed")
            if native[_FD] is None:
                assert allocation.device is not None
                native[_FD] = _cuda.vmm_export(native[_HANDLE], allocation.device)
            return int(native[_FD])

    def free(self, allocation: _base.Allocation) -> None:
        assert allocation.device is not None
        native = allocation.native
        with self._lock:  # never while the exporter thread exports it
            handle, fd, size = native[_HANDLE], native[_FD], native[_SIZE]
            native[_HANDLE] = native[_FD] = None
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
