"""The ``host`` backend: POSIX shared memory with the same contract as CUDA.

- For machines without a GPU and ``device="cpu"`` buffers.
- Owner: ``shm_open`` + ``ftruncate`` + ``posix_fallocate`` + ``mmap``; the handle is the
  segment's name. Pages are reserved up front: no room is :class:`~gpushare._errors.OutOfMemoryError`.
- Only the owner unlinks, once (:meth:`HostBackend.free`), and only it registers segments
  with the resource tracker. Consumers map by name and only unmap.
- An ``mmap`` is never closed explicitly: it goes with its last reference (a Buffer, a NumPy view).
Why: dev/design-notes.md, "Backends".
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import secrets
from typing import Any

from .._errors import OutOfMemoryError
from . import _base

try:  # CPython's own binding of shm_open/shm_unlink (POSIX only)
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

from multiprocessing import resource_tracker

__all__ = ["HostBackend", "unlink_segments_of"]

_PREFIX = "/gpushare-"


def _address(mm: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mm)  # an export of the mapping, dropped at once
    addr = ctypes.addressof(view)
    del view
    return addr


class HostBackend(_base.Backend):
    name = "host"
    is_cuda = False

    def __init__(self) -> None:
        super().__init__()
        if _posixshmem is None:  # pragma: no cover
            from .._errors import BackendUnavailableError

            raise BackendUnavailableError("the host backend needs POSIX shared memory (Linux or macOS)")
        self._prefix = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._counter = 0

    def allocate(self, nbytes: int, device: int | None) -> _base.Allocation:
        with self._lock:
            self._counter += 1
            name = f"{self._prefix}{self._counter}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            try:
                os.ftruncate(fd, nbytes)
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                mm = mmap.mmap(fd, nbytes)
            except OSError as exc:
                _posixshmem.shm_unlink(name)
                raise OutOfMemoryError(
                    f"could not create {nbytes} bytes of host shared memory ({exc}); release buffers, "
                    "or enlarge /dev/shm (e.g. docker run --shm-size=...)"
                ) from exc
        finally:
            os.close(fd)
        resource_tracker.register(name, "shared_memory")
        handle = name.encode()
        return _base.Allocation(self.name, _address(mm), nbytes, None, b"", handle, mm)

    def export(self, allocation: _base.Allocation) -> bytes:
        return allocation.handle

    def free(self, allocation: _base.Allocation) -> None:
        # The mmap is not closed: see the module docstring (it goes with its last user).
        name = allocation.handle.decode()
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:  # removed behind our back (e.g. by hand)
            pass
        resource_tracker.unregister(name, "shared_memory")

    def _map(self, handle: bytes, nbytes: int, device_uuid: bytes, fetch_fd: Any, scope: bytes) -> _base.Mapping:
        name = handle.decode()
        fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        try:
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return _base.Mapping(self.name, _address(mm), nbytes, None, b"", mm)

    def close(self, mapping: _base.Mapping) -> None:
        """Nothing to do: the mmap unmaps when its last user (a Buffer, a NumPy view) goes."""

    def fill(self, ptr: int, pattern: bytes, nbytes: int, device: int | None) -> None:
        if len(set(pattern)) <= 1:
            ctypes.memset(ptr, pattern[0] if pattern else 0, nbytes)
            return
        import numpy as np  # only multi-byte patterns need it (float fills)

        count = nbytes // len(pattern)
        target = (ctypes.c_char * nbytes).from_address(ptr)
        np.frombuffer(memoryview(target), dtype=np.uint8).reshape(count, len(pattern))[:] = np.frombuffer(
            pattern, np.uint8
        )

    def copy_in(self, ptr: int, host_ptr: int, nbytes: int, device: int | None) -> None:
        ctypes.memmove(ptr, host_ptr, nbytes)

    def copy_out(self, host_ptr: int, ptr: int, nbytes: int, device: int | None) -> None:
        ctypes.memmove(host_ptr, ptr, nbytes)

    def capabilities(self) -> dict[str, Any]:
        caps = super().capabilities()
        caps["mechanism"] = "POSIX shared memory (shm_open + mmap)"
        return caps


def unlink_segments_of(pid: int) -> list[str]:
    """Unlink every segment that process ``pid`` made; call it only once ``pid`` is dead.

    A SIGKILLed owner cannot unlink its segments, and the resource tracker
    would only do it when the whole process tree ends. Names carry the
    owner's pid (``/gpushare-<pid>-...``); unlinking removes only the name,
    so a process that still maps a segment keeps its memory until it unmaps.
    Returns the names unlinked.
    """
    if _posixshmem is None or not os.path.isdir("/dev/shm"):  # pragma: no cover - no POSIX shm listing
        return []
    # Unregister only in the tracker the dead owner registered with (a spawned child
    # shares its parent's); asking for one here would start a tracker that never saw them.
    shared_tracker = getattr(resource_tracker._resource_tracker, "_fd", None) is not None
    removed = []
    for path in glob.glob(f"/dev/shm{_PREFIX}{int(pid)}-*"):
        name = "/" + os.path.basename(path)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            _posixshmem.shm_unlink(name)
        except OSError:
            continue
        if shared_tracker:
            resource_tracker.unregister(name, "shared_memory")
        removed.append(name)
    return removed
