"""The owner's records and the state its parts share.

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

Plain data. A peer's ``send`` takes its channel's send lock, never the
owner's, so replies never wait for the owner.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import _backends
from .._service import Channel

__all__ = ["AllocRecord", "Consumers", "Lease", "OwnerState", "Peer"]


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
