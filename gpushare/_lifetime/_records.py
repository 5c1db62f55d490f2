"""The owner's records and the state its parts share.

* :class:`AllocRecord` -- one allocation: its backend memory, its generation
  (bumped each time the pool hands it out again), whether the owner's own
  Buffers reference it, the leases on it and the processes that map it.
* :class:`Lease` -- one pickling of a buffer: unclaimed until the receiving
  process claims it, then held by that process until released.
* :class:`Peer` -- one connected consumer process: its channel, its
  leases and its lease journal.
* :class:`OwnerState` -- what every part of an :class:`~gpushare._lifetime._owner.Owner`
  reads and changes, always under ``lock``: the allocation table, the
  connected peers, whether the owner is closed, and the owner's ready events.

Plain data. A peer's ``send`` takes its channel's send lock, never the
owner's, so replies never wait for the owner.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from .. import _backends, _journal
from .._service import Channel
from ._ready import ReadyEvents

__all__ = ["AllocRecord", "Lease", "OwnerState", "Peer"]


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
    """One connected consumer process, as the owner sees it."""

    __slots__ = ("channel", "conn_id", "journal", "leases", "pid")

    def __init__(self, conn_id: int, channel: Channel) -> None:
        self.conn_id = conn_id
        self.channel = channel
        self.pid = 0
        self.leases: set[int] = set()
        self.journal: _journal.JournalReader | None = None  # its lease records (read under the owner lock)

    def send(self, message: tuple[Any, ...]) -> bool:
        """Send a message of the lease protocol; False if the connection is gone."""
        return self.channel.try_send(message)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        self.channel.close()


class OwnerState:
    """What every part of an Owner shares; each field is read and changed under ``lock``
    (``cond`` waits on it), except the immutable ``token`` and ``authkey``."""

    __slots__ = ("address", "authkey", "closed", "cond", "lock", "peers", "ready", "records", "token")

    def __init__(self, authkey: bytes) -> None:
        self.token = secrets.token_bytes(16)  # which Manager: in every descriptor, and the key of every cache
        self.authkey = bytes(authkey)
        self.address = ""  # the owner's socket, set once its service listens
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.records: dict[int, AllocRecord] = {}  # live or pooled allocations by id
        self.peers: dict[int, Peer] = {}  # connected consumers by connection id
        self.closed = False
        self.ready = ReadyEvents()  # recorded at each share of a CUDA buffer
