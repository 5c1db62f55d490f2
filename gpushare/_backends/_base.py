"""The contract every sharing backend fulfils.

- Owner side: :meth:`Backend.allocate` returns an :class:`Allocation`; its ``handle``
  (:meth:`Backend.export`, once) is all another process needs; :meth:`Backend.free` runs
  only once no other process maps the memory (the lifetime service guarantees it).
- Consumer side: :meth:`Backend.open` returns a :class:`Mapping`, cached per process by the
  caller; :meth:`Backend.close` unmaps it.
- Both sides: fill, copy in, copy out, so a Buffer never asks which backend it sits on.
Backends know nothing of leases, pickling or processes.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Allocation", "Backend", "Mapping"]


class Allocation:
    """Memory owned by this process. ``ptr`` is valid here.

    A plain class with slots rather than a dataclass: importing ``dataclasses``
    (it imports ``inspect``) would be a measurable share of the start of every
    process that imports gpushare (the `startup` benchmark scenario).
    """

    __slots__ = ("backend", "device", "device_uuid", "handle", "native", "nbytes", "ptr")

    def __init__(
        self,
        backend: str,
        ptr: int,
        nbytes: int,
        device: int | None,
        device_uuid: bytes,
        handle: bytes = b"",
        native: Any = None,
    ) -> None:
        self.backend = backend
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device  # CUDA ordinal in this process; None on the host
        self.device_uuid = device_uuid  # 16 bytes; empty on the host
        self.handle = handle  # what another process needs to map it (export())
        self.native = native  # backend-private (host: the mmap)

    def __repr__(self) -> str:
        return f"Allocation({self.backend}, {self.nbytes} bytes, device={self.device})"


class Mapping:
    """Another process's memory, mapped into this one. ``ptr`` is valid here."""

    __slots__ = ("backend", "device", "device_uuid", "native", "nbytes", "ptr", "refs")

    def __init__(
        self, backend: str, ptr: int, nbytes: int, device: int | None, device_uuid: bytes, native: Any = None
    ) -> None:
        self.backend = backend
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.device_uuid = device_uuid
        self.native = native
        self.refs = 0  # live buffers of this process using it

    def __repr__(self) -> str:
        return f"Mapping({self.backend}, {self.nbytes} bytes, device={self.device}, refs={self.refs})"


class Backend(abc.ABC):
    """One way of sharing memory between processes of one node."""

    name: str = ""
    #: True when allocations live on a CUDA device.
    is_cuda: bool = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.opens = 0  # handles actually mapped by this process (not cache hits)

    # -- owner side -------------------------------------------------------
    @abc.abstractmethod
    def allocate(self, nbytes: int, device: int | None) -> Allocation:
        """Allocate ``nbytes`` (already rounded by the caller) on ``device``."""

    @abc.abstractmethod
    def export(self, allocation: Allocation) -> bytes:
        """The bytes another process needs to map ``allocation``."""

    @abc.abstractmethod
    def free(self, allocation: Allocation) -> None:
        """Give the memory back. Only called once no other process maps it."""

    def export_fd(self, allocation: Allocation) -> int:
        """A file descriptor a consumer needs too (sent by SCM_RIGHTS), for fd-based backends.

        The other backends share none: a request for one comes from a descriptor that names
        the wrong backend for its allocation."""
        from .._errors import DescriptorError

        raise DescriptorError(
            f"backend {self.name!r} shares no file descriptors: the descriptor that asked for one names the "
            "wrong backend for its allocation"
        )

    def check_device(self, device: int) -> None:
        """Raise BackendUnavailableError when this backend cannot allocate on ``device``.

        The default accepts every device the backend is asked for.
        """
        return None

    # -- consumer side ----------------------------------------------------
    def open(
        self, handle: bytes, nbytes: int, device_uuid: bytes, fetch_fd: Callable[[], int], scope: bytes
    ) -> Mapping:
        """Map an exported allocation. ``fetch_fd()`` asks the owner for the fd
        (fd-based backends only; each call returns a new fd the callee closes);
        ``scope`` names the owner, for caches that outlive one allocation."""
        mapping = self._map(handle, nbytes, device_uuid, fetch_fd, scope)
        with self._lock:
            self.opens += 1
        return mapping

    @abc.abstractmethod
    def _map(
        self, handle: bytes, nbytes: int, device_uuid: bytes, fetch_fd: Callable[[], int], scope: bytes
    ) -> Mapping:
        """Map the memory ``handle`` names into this process."""

    @abc.abstractmethod
    def close(self, mapping: Mapping) -> None:
        """Unmap a mapping made by :meth:`open`."""

    def forget(self, scope: bytes) -> None:
        """This process is done with owner ``scope`` (its link closed, every mapping
        of it closed): drop what was cached for it. The default caches nothing."""
        return None

    # -- memory operations (either side) ------------------------------------
    @abc.abstractmethod
    def fill(self, ptr: int, pattern: bytes, nbytes: int, device: int | None) -> None:
        """Fill ``nbytes`` at ``ptr`` with the repeated ``pattern``."""

    @abc.abstractmethod
    def copy_in(self, ptr: int, host_ptr: int, nbytes: int, device: int | None) -> None:
        """Copy ``nbytes`` from host memory at ``host_ptr`` to ``ptr``."""

    @abc.abstractmethod
    def copy_out(self, host_ptr: int, ptr: int, nbytes: int, device: int | None) -> None:
        """Copy ``nbytes`` from ``ptr`` to host memory at ``host_ptr``."""

    def capabilities(self) -> dict[str, Any]:
        """What this backend can do on this machine."""
        return {"name": self.name, "cuda": self.is_cuda, "available": True}
