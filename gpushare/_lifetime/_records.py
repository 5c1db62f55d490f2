"""The owner's records, and the tables of them that its parts share.

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
* :class:`LeaseTable` -- the leases, who holds which, the consumers' lease
  journals, the owner's ready events, and finalizer work deferred to the lock.

The records are plain data. A peer's ``send`` takes its channel's send lock, never
the owner's, so replies never wait for the owner.

The pool. An allocation with no owner reference and no lease goes back to the pool,
keyed by (backend, device, size); the next allocation of that key takes it with its
generation bumped, so descriptors of its previous life are refused. Over ``limit``
bytes, the oldest pooled allocations are taken out to be freed (by the unmap
protocol, :mod:`._unmapper`). A *transient* allocation (asked for as such: a loader
worker's scratch for its first batch, a size no later request asks for) is never
pooled: once unused it is freed the same way, by a housekeeping round that ``kick``
starts at once -- unless it is foreign memory its sharer still ``held``: that one stays
open, idle, until a housekeeping round finds it let go. A share of foreign memory
revives its idle or set-aside record rather than making a new one. Every method of the
pool runs under the owner's lock.

The lease table. Each pickling takes an unclaimed lease (:meth:`LeaseTable.take`,
which also records the ready event the receiver waits on). The receiving process
claims it -- by a message for a first arrival, by a journal record otherwise -- and
releases it by a journal record. A released lease may leave its allocation
unreferenced: it is offered to the pool. A consumer's end is
:meth:`LeaseTable.drop_holder_locked`. Finalizers never wait for the owner's lock:
their work is deferred (:meth:`LeaseTable.defer`) and done by whoever next holds the
lock, which also reads the consumers' journals first (:meth:`LeaseTable.catch_up_locked`),
so records always count before anything that depends on them. Methods named
``*_locked`` run under the owner's lock; the others take it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _backends
from .._errors import DescriptorError, ManagerClosedError
from .._service import Channel
from ._protocol import DROP_GRACE, LOCAL, RELEASE, JournalReader
from ._ready import ReadyEvents

__all__ = ["AllocRecord", "AllocationPool", "Consumers", "Lease", "LeaseTable", "OwnerState", "Peer", "check_alive"]


class AllocRecord:
    """One allocation of an owner, across every life the pool gives it."""

    __slots__ = (
        "alloc_id",
        "allocation",
        "backend",
        "dead",
        "detached",
        "generation",
        "held",
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
        # Foreign memory only: whether its sharer still uses the memory its anchor (the
        # allocation's ``native``) keeps, apart from the leases. While it does, the record
        # stays open once unused, so receivers keep their mappings (see Owner.share_foreign).
        self.held: Callable[[Any], bool] | None = None

    @property
    def pool_key(self) -> tuple[str, int | None, int]:
        return (self.backend.name, self.allocation.device, self.allocation.nbytes)

    def __repr__(self) -> str:
        return f"<allocation {self.alloc_id} ({self.label}) generation {self.generation}>"


class Lease:
    """One pickling of a buffer: a reference the receiving process claims."""

    __slots__ = ("created", "generation", "holder", "keep", "lease_id", "quiet", "record")

    def __init__(self, lease_id: int, record: AllocRecord, generation: int, created: float, keep: Any = None) -> None:
        self.lease_id = lease_id
        self.record = record
        self.generation = generation
        self.holder: int | None = None  # None: unclaimed; LOCAL; or a connection id
        self.created = created
        # Foreign memory only: what keeps the leased part allocated (a torch storage),
        # dropped when the lease goes (the record's last one keeps it as its anchor).
        self.keep = keep
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
        self._idle_held: set[AllocRecord] = set()  # unused transient records their sharer still holds
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
            if record.held is not None and record.held(record.allocation.native):
                self._idle_held.add(record)  # open until revived, or found let go by to_free
                return
            if record not in self._unused_transient:
                self._unused_transient.append(record)
                self.kick()
            return
        record.pooled = True
        self._free.setdefault(record.pool_key, []).append(record)
        self._state.cond.notify_all()

    def revive(self, record: AllocRecord) -> bool:
        """Take an unused transient ``record`` back for a new lease: one its sharer still
        holds, or one set aside that housekeeping has not yet taken to be freed. False if
        it is neither (in use, or on its way to be freed)."""
        if record in self._idle_held:
            self._idle_held.discard(record)
            return True
        if record in self._unused_transient:
            self._unused_transient.remove(record)
            return True
        return False

    def idle(self, record: AllocRecord) -> bool:
        """Whether ``record`` is unused but still open: held by its sharer, or set aside and
        not yet taken to be freed (its anchor still keeps its memory allocated)."""
        return record in self._idle_held or record in self._unused_transient

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
        """What housekeeping frees: the unused transient allocations (with the idle held ones
        whose sharer let go), then the oldest pooled allocations until the pool holds at
        most ``limit`` bytes."""
        unused, self._unused_transient = self._unused_transient, []
        unused = [r for r in unused if not (r.owner_ref or r.leases or r.dead)]
        for record in list(self._idle_held):
            if record.dead or record.leases:  # freed at shutdown meanwhile
                self._idle_held.discard(record)
            elif record.held is None or not record.held(record.allocation.native):
                self._idle_held.discard(record)  # its sharer let go: freed like any unused transient record
                unused.append(record)
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


# -- the lease table: taking, claiming, releasing; the journals ------------------------------


def check_alive(record: AllocRecord) -> None:
    """Raise if ``record``'s memory was freed (its Manager was shut down)."""
    if record.dead:
        raise ManagerClosedError(
            "the memory of this buffer was freed (its Manager was shut down); "
            "keep the Manager open while buffers are in use"
        )


class LeaseTable:
    """Leases: taken at pickling, claimed and released by their holders, read from journals."""

    def __init__(self, state: OwnerState, pool: AllocationPool, lease_timeout: float) -> None:
        self._state = state
        self._pool = pool
        self.timeout = float(lease_timeout)
        self._leases: dict[int, Lease] = {}
        self._held: dict[int, set[int]] = {}  # connection id -> the lease ids it holds
        self._journals: dict[int, JournalReader] = {}  # connection id -> its lease records
        self._ids = itertools.count(1)
        self._pending: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._refusals: queue.SimpleQueue[tuple[int, int, str]] = queue.SimpleQueue()
        self.ready = ReadyEvents()  # recorded at each share of a CUDA buffer
        self._sharing = True  # False once the owner is shutting down
        # Expiry in two steps (see expire_locked): the highest lease id announced to every
        # journal as one that may be dropped, and when each announcement was made.
        self._dropped = 0
        self._announced: list[tuple[float, int]] = []
        self._safe = 0  # announced long enough ago: dropped if due and still unclaimed

    def __len__(self) -> int:
        return len(self._leases)

    def held_elsewhere_locked(self) -> list[Lease]:
        """The leases not held in the owner's own process: claimed by a consumer, or unclaimed."""
        return [lease for lease in self._leases.values() if lease.holder != LOCAL]

    # -- keeping up: deferred finalizer work and the journals -------------------------------
    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` under the owner's lock: now if the lock is free, else by its next holder."""
        self._pending.put((fn, args))
        lock = self._state.lock
        if lock.acquire(blocking=False):
            try:
                self.catch_up_locked()
            finally:
                lock.release()

    def catch_up_locked(self, journals: bool = True) -> None:
        """Deferred finalizer work, then (``journals``) every consumer's lease records."""
        pending = self._pending
        while not pending.empty():  # only lock holders take from it: empty() is exact here
            fn, args = pending.get_nowait()  # (and costs no raised Empty on every put)
            fn(*args)
        if not journals:
            return
        for holder in self._journals:
            self.read_journal_locked(holder)

    def add_journal_locked(self, holder: int, journal: JournalReader) -> None:
        """Consumer ``holder``'s lease journal, read from now on (it came with its Hello)."""
        journal.announce(self._dropped)
        self._journals[holder] = journal

    def read_journal_locked(self, holder: int) -> None:
        """Apply a consumer's claims and releases, in the order it made them.

        A streaming consumer leaves thousands of records between two reads, two
        per handoff, so they are applied inline here (what :meth:`claim_locked`
        and :meth:`release_locked` do, less their per-call overhead, which was
        most of a record's cost: the `throughput` benchmark scenario streams such
        records; figures in dev/performance.md); allocations whose last lease
        went are offered to the pool, and waiters woken, once per read.
        """
        journal = self._journals.get(holder)
        if journal is None:
            return
        records = journal.read()
        if not records:
            return
        leases = self._leases
        held = self._held.setdefault(holder, set())
        emptied: list[AllocRecord] = []
        for kind, lease_id in records:
            lease = leases.get(lease_id)
            if kind == RELEASE:
                if lease is None or lease.holder != holder:
                    continue
                del leases[lease_id]
                held.discard(lease_id)
                record = lease.record
                record.leases.discard(lease_id)
                if not record.leases:
                    if lease.keep is not None:  # foreign memory: the anchor, as _forget_locked keeps it
                        record.allocation.native = lease.keep
                    emptied.append(record)
                lease.keep = None
            elif lease is not None and lease.holder is None:  # a claim, as claim_locked accepts it
                lease.holder = holder
                held.add(lease_id)
                lease.record.mappers.add(holder)
            else:
                try:
                    self.claim_locked(lease_id, None, holder)  # says why it is refused
                except DescriptorError as exc:
                    self._refusals.put((holder, lease_id, str(exc)))
        for record in emptied:
            self._pool.offer(record)
        self._state.cond.notify_all()

    def refusals(self) -> list[tuple[int, int, str]]:
        """The journalled claims refused since last asked, as (holder, lease id, why): the
        service tells each consumer (never under the lock)."""
        refused = []
        while True:
            try:
                refused.append(self._refusals.get_nowait())
            except queue.Empty:
                return refused

    # -- taking, claiming, releasing -----------------------------------------------------
    def take(
        self,
        record: AllocRecord,
        generation: int,
        record_event: bool = True,
        stream: int = 0,
        keep: Any = None,
        reshare: bool = False,
    ) -> tuple[int, bytes, bytes]:
        """A new unclaimed lease on ``record`` (one pickling of a buffer): ``(lease id, ready
        event, handle)``. The event, recorded on ``stream`` (0: the legacy default stream), is
        empty for host memory, or when ``record_event`` is false (a re-sharing process records
        its own); the handle is what another process maps the allocation with (exported on
        the first share). ``keep``: see ``Lease.keep``. ``reshare``: a lease for a process that
        re-shares what it holds (:meth:`lease_via`), still taken while a shutdown waits: a relay
        delivers what its source sent before it stopped."""
        state = self._state
        with state.lock:
            # Not the journals: a new lease on an allocation the caller holds depends on
            # no consumer's record, and reading every journal per put makes a fan-out to N
            # consumers cost N*N reads (the housekeeper reads them every 0.2 s).
            self.catch_up_locked(journals=False)
            check_alive(record)
            if not self._sharing and not reshare:
                raise ManagerClosedError("the Manager is shutting down; it shares no more buffers")
            if record.generation != generation:
                raise DescriptorError("this buffer's allocation was recycled; it cannot be shared any more")
            allocation = record.allocation
            handle = allocation.handle = record.backend.export(allocation)
            event = self.ready.record(allocation.device, stream) if record_event and record.backend.is_cuda else b""
            lease = Lease(next(self._ids), record, generation, time.monotonic(), keep)
            self._leases[lease.lease_id] = lease
            record.leases.add(lease.lease_id)
            return lease.lease_id, event, handle

    def share_parts(self, record: AllocRecord) -> tuple[Any, ...]:
        """What the C share (``gpushare._handoff.c``) needs to take a lease on ``record`` as
        :meth:`take` does: ``(lock, pending, table, leases, ids, record, record's leases,
        allocation, backend, ready events or None, device)``."""
        ready = self.ready if record.backend.is_cuda else None
        allocation = record.allocation
        return (self._state.lock, self._pending, self, self._leases, self._ids, record, record.leases, allocation,
                record.backend, ready, allocation.device)  # fmt: skip

    def claim_locked(self, lease_id: int, alloc_id: int | None, holder: int) -> Lease:
        """``holder`` claims ``lease_id``. ``alloc_id`` None: the claimer already maps the allocation."""
        lease = self._leases.get(lease_id)
        if lease is None or (alloc_id is not None and lease.record.alloc_id != alloc_id):
            raise DescriptorError(
                f"lease {lease_id} is unknown to its owner: a pickled buffer can be unpickled once, "
                f"and only within lease_timeout ({self.timeout:g} s) of being pickled. Pickle it again"
            )
        if lease.holder == holder and holder != LOCAL:
            return lease  # claimed by its journal record already: the consumer asks to be sure
        if lease.holder is not None:
            raise DescriptorError(
                f"lease {lease_id} was already claimed: a pickled buffer can be unpickled once; "
                "pickle the buffer once per receiver"
            )
        lease.holder = holder
        if holder != LOCAL:
            self._held.setdefault(holder, set()).add(lease_id)
            lease.record.mappers.add(holder)
        return lease

    def lease_via(self, alloc_id: int, generation: int, via: int, holder: int, claims: bool = False) -> int:
        """A new unclaimed lease on the allocation that lease ``via`` is on, for ``holder``,
        who must hold ``via`` or see it unclaimed. ``claims``: ``holder`` re-shares a buffer
        it received under ``via`` (its claim may not be read yet: ``via`` is its from here
        on); else it is one of several receivers of a pickled form that is read many times
        (a Ray object keeps its lease unclaimed, quiet, and each reader leases through it)."""
        with self._state.lock:
            lease = self._leases.get(via)
            held = lease is not None and lease.record.alloc_id == alloc_id and lease.holder in (holder, None)
            if lease is not None and held:
                if claims:
                    self.claim_locked(via, alloc_id, holder)
                else:
                    lease.quiet = True
        if lease is None or not held:
            raise DescriptorError(f"allocation {alloc_id} is not leased to this process")
        # Foreign memory: the new lease keeps the part allocated too, whoever lets go first.
        return self.take(lease.record, generation, record_event=False, keep=lease.keep, reshare=True)[0]

    def quiet(self, lease_id: int) -> None:
        """Mark an unclaimed lease quiet (see ``Lease.quiet``): a Ray object's."""
        with self._state.lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.quiet = True

    def drop_unclaimed(self, lease_id: int) -> None:
        """The sharer gives back a lease no process claimed, kept for readers that lease
        through it (a Ray transport's object, once Ray dropped it); a no-op once it is gone."""
        with self._state.lock:
            self.release_locked(lease_id, None)

    def release_locked(self, lease_id: int, holder: int | None) -> None:
        """``holder`` gives ``lease_id`` back (a no-op if it does not hold it)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.holder != holder:
            return
        if holder is not None and holder != LOCAL:
            held = self._held.get(holder)
            if held is not None:
                held.discard(lease_id)
        self._forget_locked(lease)
        self._state.cond.notify_all()

    def held_record_locked(self, holder: int, alloc_id: int) -> AllocRecord | None:
        """The allocation ``alloc_id`` if ``holder`` holds a lease on it, else None."""
        for lease_id in self._held.get(holder, ()):
            record = self._leases[lease_id].record
            if record.alloc_id == alloc_id:
                return record
        return None

    def drop_holder_locked(self, holder: int) -> None:
        """Consumer ``holder``'s connection closed (exit, crash, SIGKILL): the claims it
        journalled before it went count, then everything it held is released."""
        self.read_journal_locked(holder)
        journal = self._journals.pop(holder, None)
        for lease_id in list(self._held.get(holder, ())):
            self.release_locked(lease_id, holder)
        self._held.pop(holder, None)
        if journal is not None:
            journal.close()

    # -- expiry and shutdown ----------------------------------------------------------------
    def expire_locked(self) -> list[Lease]:
        """Drop the leases left unclaimed for longer than ``timeout``; return them.

        A lease is dropped only where no journal record can still claim it unread: a lease
        unclaimed for half the timeout is announced in every journal (``dropped``, see
        _protocol), and dropped once it is due and was announced half the timeout (at least
        :data:`DROP_GRACE`) before the journals were last read. A consumer that claims an
        announced lease asks the owner first; a claim of any other lease is read in time,
        even from its writer thread's backlog."""
        read_at = time.monotonic()
        self.catch_up_locked()
        half = self.timeout / 2
        aging = [lease for lease in self._leases.values() if lease.holder is None and lease.created < read_at - half]
        if not aging:
            return []
        announced = self._announced
        while announced and announced[0][0] <= read_at - max(half, DROP_GRACE):
            self._safe = announced.pop(0)[1]
        due = read_at - self.timeout
        expired = [lease for lease in aging if lease.created < due and lease.lease_id <= self._safe]
        for lease in expired:
            self._forget_locked(lease)
        top = max(lease.lease_id for lease in aging)
        if top > self._dropped:
            self._dropped = top
            for journal in self._journals.values():
                journal.announce(top)
            announced.append((time.monotonic(), top))
        return expired

    def stop_sharing_locked(self) -> None:
        """At shutdown: no lease is taken any more, and an unclaimed quiet lease (a Ray
        object's) serves no one -- its readers hold leases of their own."""
        self._sharing = False
        for lease in [x for x in self._leases.values() if x.holder is None and x.quiet]:
            self._forget_locked(lease)

    def _forget_locked(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        record = lease.record
        record.leases.discard(lease.lease_id)
        if lease.keep is not None and not record.leases:
            # Foreign memory: the last lease's part stays allocated, and with it the
            # allocation, until every importer has unmapped it (the backend's free drops it).
            record.allocation.native = lease.keep
        lease.keep = None
        self._pool.offer(record)

    def unclaimed(self) -> int:
        return sum(1 for lease in self._leases.values() if lease.holder is None)

    def close(self) -> None:
        """The owner is gone: its ready events go too."""
        self.ready.close()
