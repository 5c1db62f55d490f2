"""The owner's allocations and the state its parts share.

* :class:`AllocRecord` -- one allocation: its backend memory, its generation
  (bumped each time the pool hands it out again), whether the owner's own
  Buffers reference it, the leases on it and the processes that map it.
* :class:`Lease` -- one pickling of a buffer: unclaimed until the receiving
  process claims it, then held by that process until released.
* :class:`Peer` -- one connected consumer process: its channel and its pid.
* :class:`Consumers` -- the connected consumers: the service adds and removes
  them, the other parts ask.
* :class:`OwnerState` -- the owner's lock, which every part's ``*_locked``
  methods run under, and the allocation table.
* :class:`AllocationPool` -- the size-class pool: the allocations that the table
  holds and nothing references wait there to be handed out again.

The records are plain data. A peer's ``send`` takes its channel's send lock, never
the owner's, so replies never wait for the owner.

The pool. An allocation with no owner reference and no lease goes back to the pool,
keyed by (backend, device, size); the next allocation of that key takes it with its
generation bumped, so descriptors of its previous life are refused. Over ``limit``
bytes, the oldest pooled allocations are taken out to be freed (by the unmap
protocol, :mod:`._unmapper`). A *transient* allocation (asked for as such: a loader
worker's scratch for its first batch, a size no later request asks for) is never
pooled: once unused it is freed the same way, by a housekeeping round that ``kick``
starts at once. Every method of the pool runs under the owner's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .. import _backends
from .._service import Channel

__all__ = ["AllocRecord", "AllocationPool", "Consumers", "Lease", "OwnerState", "Peer"]


class AllocRecord:
    """One allocation of an owner, across every life the pool gives it."""

    __slots__ = (
        "alloc_id",
        "allocation",
        "backend",
        "dead",
        "detached",
        "generation",
        "label",
        "leases",
        "mappers",
        "owner_ref",
        "pooled",
        "transient",
    )

    def __init__(self, alloc_id: int, allocation: _backends.Allocation, backend: _backends.Backend) -> None:
        self.alloc_id = alloc_id
        self.allocation = allocation
        self.backend = backend
        self.generation = 0
        self.owner_ref = False  # the owner's own Buffers reference it
        self.leases: set[int] = set()  # lease ids on it, claimed or not
        self.mappers: set[int] = set()  # connection ids of the processes that map it
        self.pooled = False  # waiting in the pool for its next life
        self.transient = False  # freed, never pooled, once unused (a loader worker's scratch)
        self.dead = False  # memory freed
        self.detached = False  # the owner shut down while its own Buffers used it: freed when they go
        self.label = ""  # "(64, 1024) float32 on cuda:0", for messages

    @property
    def pool_key(self) -> tuple[str, int | None, int]:
        return (self.backend.name, self.allocation.device, self.allocation.nbytes)

    def __repr__(self) -> str:
        return f"<allocation {self.alloc_id} ({self.label}) generation {self.generation}>"


class Lease:
    """One pickling of a buffer: a reference the receiving process claims."""

    __slots__ = ("created", "generation", "holder", "lease_id", "quiet", "record")

    def __init__(self, lease_id: int, record: AllocRecord, generation: int, created: float) -> None:
        self.lease_id = lease_id
        self.record = record
        self.generation = generation
        self.holder: int | None = None  # None: unclaimed; LOCAL; or a connection id
        self.created = created
        # Expires without a warning and is dropped at shutdown: a Ray object's lease (read
        # many times or never, as Ray decides), or one that receivers leased through.
        self.quiet = False


class Peer:
    """One connected consumer process, as the owner sees it: its channel and its pid."""

    __slots__ = ("channel", "conn_id", "pid")

    def __init__(self, conn_id: int, channel: Channel) -> None:
        self.conn_id = conn_id
        self.channel = channel
        self.pid = 0

    def send(self, message: tuple[Any, ...]) -> bool:
        """Send a message of the lease protocol; False if the connection is gone."""
        return self.channel.try_send(message)

    def close(self) -> None:
        self.channel.close()


class Consumers:
    """The connected consumers, by connection id.

    The service adds each consumer that connects and removes it when it goes; the
    other parts ask (the unmapper, to talk to the processes that map an allocation;
    the owner, for statistics and to say Bye). Changed under the owner's lock; ``get``
    is one dict lookup, safe without it.
    """

    __slots__ = ("_closed", "_peers")

    def __init__(self) -> None:
        self._peers: dict[int, Peer] = {}
        self._closed = False

    def add_locked(self, peer: Peer) -> bool:
        """Count ``peer`` in; False once the owner stopped taking consumers."""
        if self._closed:
            return False
        self._peers[peer.conn_id] = peer
        return True

    def remove_locked(self, conn_id: int) -> None:
        self._peers.pop(conn_id, None)

    def close_locked(self) -> None:
        """The owner is shutting down: no consumer is added any more."""
        self._closed = True

    def get(self, conn_id: int) -> Peer | None:
        return self._peers.get(conn_id)

    def __contains__(self, conn_id: object) -> bool:
        return conn_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def all(self) -> list[Peer]:
        return list(self._peers.values())


class OwnerState:
    """The owner's lock (``cond`` waits on it) and its allocation table, read and changed under it."""

    __slots__ = ("cond", "lock", "records")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.records: dict[int, AllocRecord] = {}  # live or pooled allocations by id


class AllocationPool:
    """Pooled allocations by size class; ``reused`` counts the allocations served from it."""

    def __init__(self, state: OwnerState, limit: int | None) -> None:
        self._state = state
        self.limit = limit
        self._free: dict[tuple[str, int | None, int], list[AllocRecord]] = {}
        self._unused_transient: list[AllocRecord] = []  # to be freed by housekeeping, started by kick()
        self.kick: Callable[[], object] = lambda: None  # the request loop's: housekeep now
        self.reused = 0
        self._closed = False  # the owner is shutting down: nothing is pooled any more

    def take(self, key: tuple[str, int | None, int]) -> AllocRecord | None:
        """A pooled allocation of ``key`` for a new life, or None."""
        free = self._free.get(key)
        if not free:
            return None
        record = free.pop()
        record.pooled = False
        record.generation += 1
        self.reused += 1
        return record

    def offer(self, record: AllocRecord) -> None:
        """Pool ``record`` if nothing references it any more (and the owner is not shutting down);
        a transient one is set aside to be freed instead."""
        if record.owner_ref or record.leases or record.pooled or record.dead or self._closed:
            return
        if record.transient:
            if record not in self._unused_transient:
                self._unused_transient.append(record)
                self.kick()
            return
        record.pooled = True
        self._free.setdefault(record.pool_key, []).append(record)
        self._state.cond.notify_all()

    def close(self) -> None:
        """The owner is shutting down: nothing is pooled any more."""
        self._closed = True

    def remove(self, record: AllocRecord) -> None:
        """Take a pooled ``record`` out (to be freed)."""
        self._free[record.pool_key].remove(record)
        record.pooled = False

    def select(self, which: Callable[[AllocRecord], bool]) -> list[AllocRecord]:
        """Take out and return every pooled allocation ``which`` accepts."""
        victims = [r for records in self._free.values() for r in records if which(r)]
        for record in victims:
            self.remove(record)
        return victims

    def to_free(self) -> list[AllocRecord]:
        """What housekeeping frees: the unused transient allocations, then the oldest pooled
        allocations until the pool holds at most ``limit`` bytes."""
        unused, self._unused_transient = self._unused_transient, []
        unused = [r for r in unused if not (r.owner_ref or r.leases or r.dead)]
        if self.limit is None:
            return unused
        pooled = sorted((r for records in self._free.values() for r in records), key=lambda r: r.alloc_id)
        total = sum(r.allocation.nbytes for r in pooled)
        victims = unused
        while pooled and total > self.limit:
            record = pooled.pop(0)
            total -= record.allocation.nbytes
            self.remove(record)
            victims.append(record)
        return victims
