"""The owner's lease table, and the consumers' lease journals it reads.

Each pickling takes an unclaimed lease (:meth:`LeaseTable.take`, which also
records the ready event the receiver waits on). The receiving process claims
it -- by a message for a first arrival, by a journal record otherwise -- and
releases it by a journal record. A released lease may leave its allocation
unreferenced: it is offered to the pool.

The table owns every lease fact: the leases, which holder (a consumer's
connection id, or ``LOCAL``) holds which, each consumer's journal, the
journalled claims it refused (for the service to tell the consumer), and the
owner's ready events. A consumer's end is :meth:`LeaseTable.drop_holder_locked`.

Finalizers never wait for the owner's lock: their work is deferred
(:meth:`LeaseTable.defer`) and done by whoever next holds the lock, which also
reads the consumers' journals first (:meth:`LeaseTable.catch_up_locked`), so
records always count before anything that depends on them. Methods named
``*_locked`` run under the owner's lock; the others take it.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from typing import Any

from .._errors import DescriptorError, ManagerClosedError
from ._protocol import LOCAL, RELEASE, JournalReader
from ._ready import ReadyEvents
from ._records import AllocationPool, AllocRecord, Lease, OwnerState

__all__ = ["LeaseTable", "check_alive"]


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

    def __len__(self) -> int:
        return len(self._leases)

    def values(self) -> list[Lease]:
        return list(self._leases.values())

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
                    emptied.append(record)
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
    def take(self, record: AllocRecord, generation: int, record_event: bool = True) -> tuple[int, bytes, bytes]:
        """A new unclaimed lease on ``record`` (one pickling of a buffer): ``(lease id, ready
        event, handle)``. The event is empty for host memory, or when ``record_event`` is
        false (a re-sharing process records its own); the handle is what another process
        maps the allocation with (exported on the first share)."""
        state = self._state
        with state.lock:
            # Not the journals: a new lease on an allocation the caller holds depends on
            # no consumer's record, and reading every journal per put makes a fan-out to N
            # consumers cost N*N reads (the housekeeper reads them every 0.2 s).
            self.catch_up_locked(journals=False)
            check_alive(record)
            if not self._sharing:
                raise ManagerClosedError("the Manager is shutting down; it shares no more buffers")
            if record.generation != generation:
                raise DescriptorError("this buffer's allocation was recycled; it cannot be shared any more")
            allocation = record.allocation
            handle = allocation.handle = record.backend.export(allocation)
            event = self.ready.record(allocation.device) if record_event and record.backend.is_cuda else b""
            lease = Lease(next(self._ids), record, generation, time.monotonic())
            self._leases[lease.lease_id] = lease
            record.leases.add(lease.lease_id)
            return lease.lease_id, event, handle

    def claim_locked(self, lease_id: int, alloc_id: int | None, holder: int) -> Lease:
        """``holder`` claims ``lease_id``. ``alloc_id`` None: the claimer already maps the allocation."""
        lease = self._leases.get(lease_id)
        if lease is None or (alloc_id is not None and lease.record.alloc_id != alloc_id):
            raise DescriptorError(
                f"lease {lease_id} is unknown to its owner: a pickled buffer can be unpickled once, "
                f"and only within lease_timeout ({self.timeout:g} s) of being pickled. Pickle it again"
            )
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

    def lease_via(self, alloc_id: int, generation: int, via: int, holder: int) -> int:
        """A new unclaimed lease on the allocation that lease ``via`` is on, for ``holder``,
        who must hold ``via`` or see it unclaimed: re-sharing a received buffer, or one of
        several receivers of a pickled form that is read many times (a Ray object keeps
        its lease unclaimed and each reader leases through it)."""
        with self._state.lock:
            lease = self._leases.get(via)
            held = lease is not None and lease.record.alloc_id == alloc_id and lease.holder in (holder, None)
            if lease is not None and held:
                lease.quiet = True
        if lease is None or not held:
            raise DescriptorError(f"allocation {alloc_id} is not leased to this process")
        return self.take(lease.record, generation, record_event=False)[0]

    def quiet(self, lease_id: int) -> None:
        """Mark an unclaimed lease quiet (see ``Lease.quiet``): a Ray object's."""
        with self._state.lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.quiet = True

    def release_locked(self, lease_id: int, holder: int) -> None:
        """``holder`` gives ``lease_id`` back (a no-op if it does not hold it)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.holder != holder:
            return
        del self._leases[lease_id]
        lease.record.leases.discard(lease_id)
        if holder != LOCAL:
            held = self._held.get(holder)
            if held is not None:
                held.discard(lease_id)
        self._pool.offer(lease.record)
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
        """Drop the leases left unclaimed for longer than ``timeout``; return them."""
        deadline = time.monotonic() - self.timeout
        expired = [lease for lease in self._leases.values() if lease.holder is None and lease.created < deadline]
        for lease in expired:
            self._forget_locked(lease)
        return expired

    def stop_sharing_locked(self) -> None:
        """At shutdown: no lease is taken any more, and an unclaimed quiet lease (a Ray
        object's) serves no one -- its readers hold leases of their own."""
        self._sharing = False
        for lease in [x for x in self._leases.values() if x.holder is None and x.quiet]:
            self._forget_locked(lease)

    def _forget_locked(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        lease.record.leases.discard(lease.lease_id)
        self._pool.offer(lease.record)

    def unclaimed(self) -> int:
        return sum(1 for lease in self._leases.values() if lease.holder is None)

    def close(self) -> None:
        """The owner is gone: its ready events go too."""
        self.ready.close()
