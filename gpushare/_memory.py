"""Memory: this process's one reference to one allocation incarnation.

The lifetime service (:mod:`gpushare._lifetime`) makes a Memory for each reference it
hands out -- the owner's own, a lease claimed from the owner, or a lease the owner holds
for itself -- and :class:`~gpushare._buffer.Buffer` objects view it (each takes a count;
when the last goes, the Memory is dropped, which gives the reference back through its
*source*). It knows the allocation's address *in this process*, the backend that maps
it, and, for CUDA memory that arrived from another process, the producer's ready event.
It sits below both the buffers and the lifetime service, so neither imports the other's
layer the wrong way.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from . import _cuda

__all__ = ["Memory", "Source"]


class Source(Protocol):
    """What a Memory's kind of reference means (owner's, leased, ...)."""

    def drop(self, memory: Memory) -> None: ...

    def share(self, memory: Memory) -> tuple[int, bytes]: ...

    def check(self, memory: Memory) -> None: ...


class Memory:
    """This process's one reference to one allocation incarnation."""

    __slots__ = (
        "_count",
        "_lock",
        "address",
        "alloc_id",
        "alloc_nbytes",
        "backend",
        "base",
        "device",
        "device_uuid",
        "event",
        "generation",
        "handle",
        "native",
        "owner_token",
        "pending",
        "source",
    )

    def __init__(
        self,
        *,
        backend: Any,
        base: int,
        alloc_nbytes: int,
        device: int | None,
        device_uuid: bytes,
        owner_token: bytes,
        address: str,
        alloc_id: int,
        generation: int,
        handle: bytes,
        native: Any,
        source: Source,
        event: Any = None,
    ) -> None:
        self.backend = backend
        self.base = base
        self.alloc_nbytes = alloc_nbytes
        self.device = device
        self.device_uuid = device_uuid
        self.owner_token = owner_token
        self.address = address
        self.alloc_id = alloc_id
        self.generation = generation
        self.handle = handle
        self.native = native  # host: the mmap, kept alive while any Buffer or NumPy view uses it
        self.source = source
        # Consumer side of CUDA buffers: the producer's ready event (opened once per
        # process) and whether this arrival has not been waited for on the host yet.
        self.event = event
        self.pending = event is not None
        self._count = 0
        self._lock = threading.Lock()

    def ready(self) -> None:
        """Block until the producer's work queued before it shared this buffer is done."""
        if self.pending:
            assert self.device is not None  # events exist only for CUDA memory
            _cuda.event_synchronize(self.event, self.device)
            self.pending = False

    def order_stream(self, stream: int) -> None:
        """Make ``stream`` (an int handle in this process) wait for the producer's work."""
        if self.pending:
            assert self.device is not None
            _cuda.stream_wait_event(stream, self.event, self.device)

    def acquire(self) -> None:
        with self._lock:
            self._count += 1

    def drop_one(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self.source.drop(self)
