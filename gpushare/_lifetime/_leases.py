"""The owner's lease table, and the consumers' lease journals it reads.

Each pickling takes an unclaimed lease (:meth:`_LeaseTable.take_lease`, which also records
the ready event the receiver waits on). The receiving process claims it -- by a message
for a first arrival, by a journal record otherwise -- and releases it by a journal record.
Finalizers never wait for the owner lock: their work is deferred (:meth:`_defer`) and
done by whoever next holds the lock, which also reads every consumer's journal first
(:meth:`_drain_locked`), so records always count before anything that depends on them.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from .._errors import DescriptorError, ManagerClosedError
from ._common import _RELEASE, LOCAL
from ._pool import _Pool
from ._records import _Lease, _Peer, _Slot


class _LeaseTable(_Pool):
    """Leases: taken at pickling, claimed and released by their holders, read from journals."""

    def _defer(self, fn: Callable[..., None], *args: Any) -> None:
        self._pending.put((fn, args))
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()

    def _drain_locked(self, journals: bool = True) -> None:
        """Lock held. Catch up: deferred finalizer work, then (``journals``) every consumer's
        lease records."""
        pending = self._pending
        while not pending.empty():  # only lock holders take from it: empty() is exact here
            fn, args = pending.get_nowait()  # (and costs no raised Empty on every put)
            fn(*args)
        if not journals:
            return
        for peer in self._peers.values():
            if peer.journal is not None:
                self._read_journal_locked(peer)

    def _read_journal_locked(self, peer: _Peer) -> None:
        """Lock held. Apply a consumer's claims and releases, in the order it made them.

        A streaming consumer leaves thousands of records between two reads, two
        per handoff, so they are applied inline here (what :meth:`_claim` and
        :meth:`_release_lease` do, less their per-call overhead); slots whose
        last lease went are offered to the pool, and waiters woken, once per read.
        """
        assert peer.journal is not None
        records = peer.journal.read()
        if not records:
            return
        leases = self._leases
        holder = peer.conn_id
        held = peer.leases
        emptied: list[_Slot] = []
        for kind, lease_id in records:
            lease = leases.get(lease_id)
            if kind == _RELEASE:
                if lease is None or lease.holder != holder:
                    continue
                del leases[lease_id]
                held.discard(lease_id)
                slot = lease.slot
                slot.leases.discard(lease_id)
                if not slot.leases:
                    emptied.append(slot)
            elif lease is not None and lease.holder is None:  # a claim, as _claim accepts it
                lease.holder = holder
                held.add(lease_id)
                lease.slot.mappers.add(holder)
            else:
                try:
                    self._claim(lease_id, None, holder)  # says why it is refused
                except DescriptorError as exc:
                    self._refusals.put((peer, lease_id, str(exc)))
        for slot in emptied:
            self._maybe_recycle(slot)
        self._cond.notify_all()

    def _send_refusals(self) -> None:
        """Tell consumers which of their claims were refused (never under the lock)."""
        while True:
            try:
                peer, lease_id, why = self._refusals.get_nowait()
            except queue.Empty:
                return
            peer.send(("claim_failed", lease_id, why))

    def take_lease(self, slot: _Slot, generation: int, record: bool = True) -> tuple[int, bytes]:
        """A new unclaimed lease on ``slot`` (one pickling of a buffer), and the ready
        event the receiver waits on (empty for host memory, or when ``record`` is
        false: a re-sharing process records its own)."""
        with self._lock:
            # Not the journals: a new lease on a slot the caller holds depends on no
            # consumer's record, and reading every consumer's journal per put costs a
            # fan-out to N consumers N*N reads (the housekeeper reads them every 0.2 s).
            self._drain_locked(journals=False)
            self._check_slot(slot)
            if self._closed:
                raise ManagerClosedError("the Manager is shutting down; it shares no more buffers")
            if slot.generation != generation:
                raise DescriptorError("this buffer's allocation was recycled; it cannot be shared any more")
            slot.allocation.handle = slot.backend.export(slot.allocation)
            event = self._ready.record(slot.allocation.device) if record and slot.backend.is_cuda else b""
            lease = _Lease(next(self._lease_ids), slot, generation, None, time.monotonic())
            self._leases[lease.lease_id] = lease
            slot.leases.add(lease.lease_id)
            return lease.lease_id, event

    def _claim(self, lease_id: int, alloc_id: int | None, holder: int) -> _Lease:
        """Lock held. ``alloc_id`` None: the claimer already maps the allocation."""
        lease = self._leases.get(lease_id)
        if lease is None or (alloc_id is not None and lease.slot.alloc_id != alloc_id):
            raise DescriptorError(
                f"lease {lease_id} is unknown to its owner: a pickled buffer can be unpickled once, "
                f"and only within lease_timeout ({self.lease_timeout:g} s) of being pickled. Pickle it again"
            )
        if lease.holder is not None:
            raise DescriptorError(
                f"lease {lease_id} was already claimed: a pickled buffer can be unpickled once; "
                "pickle the buffer once per receiver"
            )
        lease.holder = holder
        if holder != LOCAL:
            self._peers[holder].leases.add(lease_id)
            lease.slot.mappers.add(holder)
        return lease

    def lease_via(self, alloc_id: int, generation: int, via: int, holder: int) -> int:
        """A new unclaimed lease on the allocation that lease ``via`` is on, for ``holder``,
        who must hold ``via`` or see it unclaimed: re-sharing a received buffer, or one
        of several receivers of a pickled form that is read many times (a Ray object
        keeps its lease unclaimed and each reader leases through it)."""
        with self._lock:
            slot = self._slots.get(alloc_id)
            lease = self._leases.get(via)
            held = lease is not None and lease.slot is slot and lease.holder in (holder, None)
            if lease is not None and held:
                lease.quiet = True
        if slot is None or not held:
            raise DescriptorError(f"allocation {alloc_id} is not leased to this process")
        return self.take_lease(slot, generation, record=False)[0]

    def quiet_lease(self, lease_id: int) -> None:
        """Mark an unclaimed lease quiet (see ``_Lease.quiet``): a Ray object's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.quiet = True

    def _release_lease(self, lease_id: int, holder: int) -> None:
        """Lock held."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.holder != holder:
            return
        del self._leases[lease_id]
        lease.slot.leases.discard(lease_id)
        if holder != LOCAL:
            peer = self._peers.get(holder)
            if peer is not None:
                peer.leases.discard(lease_id)
        self._maybe_recycle(lease.slot)
        self._cond.notify_all()
