"""Memory: this process's one reference to one allocation incarnation.

The lifetime service (:mod:`gpushare._lifetime`) makes a Memory for each reference it
hands out -- the owner's own, a lease claimed from the owner, or a lease the owner holds
for itself -- and :class:`~gpushare._buffer.Buffer` objects view it (each takes a count;
when the last goes, the Memory is dropped, which gives the reference back through its
*source*). It knows the allocation's address *in this process*, the backend that maps
it, and, for CUDA memory that arrived from another process, the producer's ready event.
It sits below both the buffers and the lifetime service, so neither imports the other's
layer the wrong way. It imports nothing of gpushare: waiting on a ready event goes
through the Memory's backend (a CUDA backend), so host memory never loads the CUDA layer.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Memory", "Source"]


class Source(Protocol):
    """What a Memory's kind of reference means (owner's, leased, ...)."""

    def drop(self, memory: Memory) -> None: ...

    def share(self, memory: Memory) -> tuple[int, bytes, bytes]:
        """A new lease for one receiver: (lease id, ready event, handle)."""
        ...

    def check(self, memory: Memory) -> None: ...

    @property
    def authkey(self) -> bytes:
        """The owner's authkey (a Ray object carries it to readers outside the process tree)."""
        ...


class Memory:
    """This process's one reference to one allocation incarnation."""

    __slots__ = (
        "_refs",
        "address",
        "alloc_id",
        "alloc_nbytes",
        "backend",
        "base",
        "device",
        "device_uuid",
        "event",
        "exit_release",
        "generation",
        "handle",
        "native",
        "owner_token",
        "pending",
        "source",
        "templates",
    )

    # Every caller passes the arguments by position, in this order: a consumer makes one
    # Memory per arriving buffer, and a keyword call costs more (dev/performance.md,
    # "Hot-path choices").
    def __init__(
        self,
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
        exit_release: bool = True,
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
        # Sharer side: descriptor templates per (offset, shape, dtype, handle) view,
        # filled with a lease id and a ready event at each pickling (_buffer.share_bytes).
        self.templates: dict[tuple[Any, ...], Any] | None = None
        # Whether Buffers of this memory must also be released by the interpreter's exit
        # hook (see gpushare._buffer): false for a lease claimed over a link.
        self.exit_release = exit_release
        # The count of Buffers, kept as a list (one entry per Buffer, the first True):
        # Buffers are dropped inside the garbage collector, on any thread, where a lock
        # could deadlock; list.append and list.pop are each one atomic step under the
        # GIL, so exactly one drop -- the one that pops the first entry -- is the last.
        # It is also cheaper than a lock and an int (dev/performance.md, "Hot-path choices").
        self._refs: list[bool] = []

    def arm(self, event: Any, pending: bool) -> None:
        """Wait on ``event`` before the next use (``pending``), or on nothing: a ring slot
        arriving again, with its publication's event (the ring reuses one Memory per slot)."""
        self.event = event
        self.pending = pending

    def ready(self) -> None:
        """Block until the producer's work queued before it shared this buffer is done."""
        if self.pending:
            assert self.device is not None  # events exist only for CUDA memory
            self.backend.event_synchronize(self.event, self.device)
            self.pending = False

    def order_stream(self, stream: int) -> None:
        """Make ``stream`` (an int handle in this process) wait for the producer's work."""
        if self.pending:
            assert self.device is not None
            self.backend.stream_wait_event(stream, self.event, self.device)

    def acquire(self) -> None:
        """Count one more Buffer. Made while another Buffer still holds a count (the
        first by whoever made this Memory), so the list is empty only for the first."""
        refs = self._refs
        refs.append(not refs)

    def drop_one(self) -> None:
        if self._refs.pop():
            self.source.drop(self)
