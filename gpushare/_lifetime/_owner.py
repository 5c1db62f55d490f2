"""The owner: one per Manager, in the process that allocates its memory.

An :class:`Owner` is composed of parts, each an object that owns its facts
and asks the others for theirs, all under one lock (:class:`~._records.OwnerState`,
which also holds the allocation table):

* ``pool`` (:class:`~._records.AllocationPool`): unreferenced allocations
  by size class, handed out again;
* ``leases`` (:class:`~._records.LeaseTable`): taking, claiming and
  releasing leases, who holds which, the consumers' journals, the ready
  events, deferred finalizer work;
* ``consumers`` (:class:`~._records.Consumers`): who is connected;
* ``unmapper`` (:class:`~._unmapper.Unmapper`): freeing only after every
  mapper unmapped;
* ``loop`` (:class:`~._request_loop.RequestLoop`): the socket service, one
  thread per consumer, and housekeeping.

This module owns which Manager this is (``token``), its authkey and whether it
is shutting down, and adds allocation (for this process, and for another
process that asks: ``Alloc``), the owner's own references (:class:`_OwnerSource`),
statistics and shutdown: stop sharing (telling the pool, the lease table and
the consumers), wait (bounded) for the leases of other processes, report what is
still out with a :class:`~gpushare.LeakWarning`, free what is free (what this
process still uses is freed when it lets go), and tell every consumer ``Bye``.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _backends
from .._errors import LeakWarning, ManagerClosedError
from .._memory import Descriptor, Memory, Template
from ._protocol import LOCAL, Alloc, Bye, Shutdown, Stats, Trim, owner_for, owners, warn
from ._records import AllocationPool, AllocRecord, Consumers, Lease, LeaseTable, OwnerState, check_alive
from ._request_loop import Calls, RequestLoop
from ._unmapper import Unmapper

__all__ = ["Owner", "owner_for"]


class _OwnerSource:
    """The owner's own reference to an allocation: dropping it lets the allocation be recycled."""

    __slots__ = ("owner", "record")

    def __init__(self, owner: Owner, record: AllocRecord) -> None:
        self.owner = owner
        self.record = record

    def drop(self, memory: Memory) -> None:
        self.owner.leases.defer(self.owner._drop_owner_ref_locked, self.record)

    def share(self, memory: Memory) -> tuple[int, bytes, bytes]:
        return self.owner.leases.take(self.record, memory.generation)

    def check(self, memory: Memory) -> None:
        check_alive(self.record)

    def share_parts(self) -> tuple[Any, ...]:
        """See :meth:`LeaseTable.share_parts`: a buffer of this Manager put on a Queue."""
        return self.owner.leases.share_parts(self.record)

    @property
    def authkey(self) -> bytes:
        return self.owner.authkey


class _LocalLeaseSource(_OwnerSource):
    """A lease claimed inside the owner's process (a buffer unpickled where it was made)."""

    __slots__ = ("lease_id",)

    def __init__(self, owner: Owner, record: AllocRecord, lease_id: int) -> None:
        super().__init__(owner, record)
        self.lease_id = lease_id

    def drop(self, memory: Memory) -> None:
        self.owner.leases.defer(self.owner._release_local_locked, self.record, self.lease_id)


_owners = owners  # this process's Owners by token, in _protocol: the consumer side looks there first
_owners_lock = threading.Lock()
#: Pointers whose segment, and foreign descriptors, the owner remembers (Owner._segment,
#: Owner.share_foreign); all forgotten at this many.
_FOREIGN_AT_MAX = 4096


class Owner:
    """Allocations, leases and the pool of one Manager, plus its socket service."""

    def __init__(
        self,
        *,
        authkey: bytes,
        lease_timeout: float = 60.0,
        shutdown_timeout: float = 5.0,
        unmap_timeout: float = 5.0,
        pool_limit: int | None = None,
    ) -> None:
        self.token = secrets.token_bytes(16)  # which Manager: in every descriptor, and the key of every cache
        self.authkey = bytes(authkey)
        self.shutdown_timeout = float(shutdown_timeout)
        self._closed = False  # shutting down or shut down (changed under the lock)
        state = self._state = OwnerState()
        self.pool = AllocationPool(state, pool_limit)
        self.leases = LeaseTable(state, self.pool, lease_timeout)
        self.consumers = Consumers()
        self.unmapper = Unmapper(state, self.pool, self.leases, self.consumers, unmap_timeout)
        self._ids = itertools.count(1)
        # Foreign segments shared now, by (device, base, buffer id): see share_foreign.
        self._foreign: dict[tuple[int, int, int], AllocRecord] = {}
        # (device, pointer) shared before -> the key of its segment's record (see _segment); a
        # stale entry is harmless (its record is checked), so entries go only at the cap.
        self._foreign_at: dict[tuple[int, int], tuple[int, int, int]] = {}
        # (record id, offset, bytes) -> its descriptor with the lease id and event left open.
        self._foreign_templates: dict[tuple[int, int, int], Template] = {}
        # (device, base, buffer id) -> the segment's IPC handle: a segment's records come and
        # go as it is retired and shared again, and the driver's buffer id names one allocation
        # for this process's life, so its handle holds (an export is 11-28 us on an H100).
        self._foreign_handles: dict[tuple[int, int, int], bytes] = {}
        calls: Calls = {Alloc: self.allocate_for_peer, Stats: self.stats, Trim: self.trim, Shutdown: self.shutdown}
        self.loop = RequestLoop(
            state, self.token, self.authkey, self.leases, self.pool, self.unmapper, self.consumers, calls
        )
        with _owners_lock:
            _owners[self.token] = self

    @property
    def address(self) -> str:
        """The owner's socket (its service's)."""
        return self.loop.address

    # -- allocation ---------------------------------------------------------------------
    def allocate(
        self, backend: _backends.Backend, nbytes: int, device: int | None, label: str, transient: bool = False
    ) -> Memory:
        """The owner's reference to ``nbytes`` (a multiple of 2 MiB) from the pool or the backend
        (``transient``: freed once unused, never pooled)."""
        record = self._allocate_record(backend, nbytes, device, label, transient)
        return self._memory(record, _OwnerSource(self, record))

    def allocate_for_peer(
        self,
        backend: str,
        device_uuid: bytes | None,
        nbytes: int,
        label: str,
        dtype: str,
        shape: tuple[int, ...],
        transient: bool = False,
    ) -> bytes:
        """Another process's ``Alloc`` request: the descriptor of new memory under a lease it
        claims like any other. The owner keeps no reference of its own, so the memory lives
        exactly as long as some process holds it (then it is pooled, or freed if
        ``transient``)."""
        chosen = _backends.get(backend)
        device = None
        if device_uuid:
            from .. import _cuda

            device = _cuda.ordinal_from_uuid(device_uuid)
            chosen.check_device(device)
        record = self._allocate_record(chosen, nbytes, device, label, bool(transient))
        try:
            # Fresh from the backend or the pool: no work of this process is queued on it.
            lease_id, _, handle = self.leases.take(record, record.generation, record_event=False)
        finally:
            with self._state.lock:
                self._drop_owner_ref_locked(record)
        a = record.allocation
        desc = Descriptor(
            chosen.name, self.token, self.address, record.alloc_id, record.generation, lease_id,
            a.nbytes, 0, a.device_uuid, handle, dtype, tuple(shape), b"",
        )  # fmt: skip
        return desc.to_bytes()

    def share_foreign(
        self, ptr: int, nbytes: int, device: int, keep: Any, stream: int = 0, held: Callable[[Any], bool] | None = None
    ) -> bytes:
        """Descriptor bytes, under a new lease, of ``nbytes`` at ``ptr`` on ``device``: memory
        another allocator made (torch's caching allocator) and ``keep`` keeps allocated.

        The segment that holds it becomes a transient record shared by legacy IPC handles.
        Each lease keeps its ``keep`` until released; the record's last one stays, as the
        anchor, until every importer has unmapped the segment, so the allocator can neither
        reuse the part nor free the segment under a receiver. ``held(anchor)``: whether the
        sharer itself still uses the anchor's memory. A record whose leases all went stays
        open while it does (receivers keep their mappings, so the next share of that memory
        opens nothing); once it does not, or with no ``held``, the record is set aside to be
        retired. A share of the segment before housekeeping has retired it revives it; after
        that it makes a new record, which receivers open again. The ready event is recorded
        on ``stream``."""
        from .. import _cuda
        from .._backends.cuda_ipc import FOREIGN_IPC

        base, size, buffer_id = self._segment(ptr, device)
        key = (device, base, buffer_id)
        state = self._state
        with state.lock:
            # The receivers' journalled releases first: their parts go back to torch's
            # allocator now, as pooled allocations go back before each Manager allocation.
            self.leases.catch_up_locked()
            if self._closed:
                raise ManagerClosedError("the process's CUDA tensor sharing was shut down; it shares no more tensors")
            record = self._foreign.get(key)
            if record is not None and not record.dead and not record.leases and self.pool.revive(record):
                # Unused, and still open: the new lease's part (``keep``) pins the segment
                # from here on, so the old anchor's part goes back to torch's allocator.
                record.allocation.native = None
            elif record is None or record.dead or not record.leases:
                allocation = _backends.Allocation("cuda_ipc", base, size, device, _cuda.device_uuid(device))
                allocation.handle = self._foreign_handles.get(key, b"")
                record = AllocRecord(next(self._ids), allocation, FOREIGN_IPC)
                record.transient = True
                record.held = held
                record.label = f"a torch segment of {size} bytes on cuda:{device}"
                state.records[record.alloc_id] = record
                for stale in [k for k, r in self._foreign.items() if r.dead]:
                    del self._foreign[stale]
                self._foreign[key] = record
        try:
            lease_id, event, handle = self.leases.take(record, record.generation, stream=stream, keep=keep)
        except BaseException:
            with state.lock:
                self.pool.offer(record)  # unused: freed if no other share took a lease on it
            raise
        if key not in self._foreign_handles:
            with state.lock:
                if len(self._foreign_handles) >= _FOREIGN_AT_MAX:
                    self._foreign_handles.clear()
                self._foreign_handles[key] = handle
        where = (record.alloc_id, ptr - base, nbytes)
        template = self._foreign_templates.get(where)
        if template is None:
            template = Descriptor(
                "cuda_ipc", self.token, self.address, record.alloc_id, record.generation, 0,
                size, ptr - base, record.allocation.device_uuid, handle, "|u1", (nbytes,), b"",
            ).template()  # fmt: skip
            with state.lock:
                if len(self._foreign_templates) >= _FOREIGN_AT_MAX:
                    self._foreign_templates.clear()
                self._foreign_templates[where] = template
        return template.fill(lease_id, event)

    def _segment(self, ptr: int, device: int) -> tuple[int, int, int]:
        """``(base, size, buffer id)`` of the segment that holds ``ptr`` on ``device``.

        The caller keeps the memory at ``ptr`` allocated, so a segment that held it before
        and is still pinned (by a lease's part, or by its anchor) holds it now: the driver
        is asked only about a pointer not shared before, or whose segment may have been
        freed since. A recycled tensor's share asks it nothing."""
        from .. import _cuda
        from .._errors import BackendUnavailableError

        state = self._state
        key = self._foreign_at.get((device, ptr))
        if key is not None:
            with state.lock:
                record = self._foreign.get(key)
                if record is not None and not record.dead and (record.leases or self.pool.idle(record)):
                    return key[1], record.allocation.nbytes, key[2]
        base, size, buffer_id, capable = _cuda.segment_of(ptr, device)
        if not capable:
            raise BackendUnavailableError(
                f"the CUDA memory at {ptr:#x} (cuda:{device}) cannot be shared with legacy CUDA IPC handles: "
                "it was not made by cudaMalloc. torch makes such memory with expandable segments "
                "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): unset that setting in the process "
                "that allocates the tensors, or allocate them as gpushare buffers (Manager.empty, then "
                "gpushare.torch.as_tensor)"
            )
        with state.lock:
            if len(self._foreign_at) >= _FOREIGN_AT_MAX:
                self._foreign_at.clear()
            self._foreign_at[(device, ptr)] = (device, base, buffer_id)
        return base, size, buffer_id

    def _allocate_record(
        self, backend: _backends.Backend, nbytes: int, device: int | None, label: str, transient: bool = False
    ) -> AllocRecord:
        state = self._state
        with state.lock:
            self.leases.catch_up_locked()
            if self._closed:
                raise ManagerClosedError("the Manager was shut down; make a new Manager to allocate buffers")
            record = self.pool.take((backend.name, device, nbytes))
        if record is None:
            try:
                allocation = backend.allocate(nbytes, device)
            except MemoryError as exc:
                if not self._trim_device(backend, device):
                    raise
                try:  # once more, now that the pool's unused memory on this device is free
                    allocation = backend.allocate(nbytes, device)
                except MemoryError as again:
                    raise again from exc
            record = AllocRecord(next(self._ids), allocation, backend)
        with state.lock:
            state.records[record.alloc_id] = record
            record.owner_ref = True
            record.label = label
            record.transient = transient
        return record

    def _memory(self, record: AllocRecord, source: Any) -> Memory:
        a = record.allocation
        return Memory(
            record.backend, a.ptr, a.nbytes, a.device, a.device_uuid, self.token, self.address,
            record.alloc_id, record.generation, a.handle, a.native, source,
        )  # fmt: skip

    def _drop_owner_ref_locked(self, record: AllocRecord) -> None:
        record.owner_ref = False
        if not self._free_detached_locked(record):
            self.pool.offer(record)

    def _release_local_locked(self, record: AllocRecord, lease_id: int) -> None:
        """A lease this process claimed on its own allocation went (``_LocalLeaseSource``)."""
        self.leases.release_locked(lease_id, LOCAL)
        self._free_detached_locked(record)

    def _free_detached_locked(self, record: AllocRecord) -> bool:
        """Free ``record`` if shutdown left it to this process and nothing here uses it any more."""
        if record.detached and not record.leases and not record.owner_ref:
            self.unmapper.free_locked(record)
            return True
        return False

    def attach_local(self, desc: Descriptor) -> Memory:
        """The memory of a buffer unpickled in the owner's own process (the caller makes the Buffer)."""
        with self._state.lock:
            self.leases.catch_up_locked()
            lease = self.leases.claim_locked(desc.lease_id, desc.alloc_id, LOCAL)
            record = lease.record
        return self._memory(record, _LocalLeaseSource(self, record, lease.lease_id))

    # -- upkeep -------------------------------------------------------------------------
    def trim(self) -> int:
        """Free every pooled allocation; return the bytes given back."""
        return self.unmapper.trim(lambda record: True)

    def _trim_device(self, backend: _backends.Backend, device: int | None) -> int:
        """Free the pooled allocations that share ``device``'s memory (out-of-memory retry)."""
        return self.unmapper.trim(
            lambda record: record.backend.is_cuda == backend.is_cuda and record.allocation.device == device
        )

    def stats(self) -> dict[str, Any]:
        state = self._state
        with state.lock:
            self.leases.catch_up_locked()
            records = list(state.records.values())
            pooled = [r for r in records if r.pooled]
            live = [r for r in records if not r.pooled and not r.dead]
            backends: dict[str, int] = {}
            for r in live:
                backends[r.backend.name] = backends.get(r.backend.name, 0) + 1
            return {
                "live_buffers": len(live),
                "bytes_allocated": sum(r.allocation.nbytes for r in records if not r.dead),
                "bytes_in_use": sum(r.allocation.nbytes for r in live),
                "bytes_pooled": sum(r.allocation.nbytes for r in pooled),
                "pooled_buffers": len(pooled),
                "leases": len(self.leases),
                "unclaimed_leases": self.leases.unclaimed(),
                "consumers": len(self.consumers),
                "consumer_pids": sorted(p.pid for p in self.consumers.all()),
                "backends": backends,
                "reused": self.pool.reused,
                "leaked_buffers": len(self.unmapper.leaked),
                "closed": self._closed,
            }

    def shutdown(
        self,
        timeout: float | None = None,
        before_bye: Callable[[list[str]], object] | None = None,
        *,
        sender_exit: bool = False,
        may_claim: Callable[[], bool] | None = None,
    ) -> list[str]:
        """Wait (bounded) for leases, report leaks, free everything free, stop serving.

        Returns the text of the leak warning it gave, if any, and hands it to
        ``before_bye`` just before telling the consumers ``Bye`` (a client of a
        server-owned Manager asked for this shutdown over its own connection,
        and raises the warning again in its process). ``sender_exit``: the torch
        drop-in's owner, at its process's exit; the warning speaks of sent tensors, and an
        unclaimed lease is waited for only while some process may still claim it: a consumer
        is connected, or ``may_claim()`` says so (a tensor left in a queue that no process can
        read any more must not hold the exit up).

        While it waits, a process holding a lease may still lease the memory again for a
        process it sends it on to (``LeaseVia``): a relay delivers what was sent before the
        shutdown."""
        timeout = self.shutdown_timeout if timeout is None else timeout
        state = self._state
        leases = self.leases
        with state.lock:
            if self._closed:
                if before_bye is not None:
                    before_bye([])
                return []
            # Stop sharing: no new lease, nothing pooled. Consumers still connect while it
            # waits: a share already in flight (a buffer put just before the shutdown, its
            # receiver not connected yet) is still claimed and used.
            self._closed = True
            self.pool.close()
            leases.catch_up_locked()
            leases.stop_sharing_locked()
            # Leases held in this process are waited for no more than the owner's own
            # references: their memory stays valid here until they go, then it is freed.
            deadline = time.monotonic() + timeout
            while self._awaited_locked(sender_exit, may_claim) and time.monotonic() < deadline:
                state.cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                leases.catch_up_locked()
            self.consumers.close_locked()
            outstanding = leases.held_elsewhere_locked()
            elsewhere = {lease.record for lease in outstanding}
            # Every allocation no other process holds: freed now, or when this process lets go.
            ours = [r for r in state.records.values() if r not in elsewhere and not r.dead]
            for record in ours:
                if record.pooled:
                    self.pool.remove(record)
        messages = []
        if outstanding:
            names = sorted({f"allocation {lease.record.alloc_id} ({lease.record.label})" for lease in outstanding})
            holders = sorted({self._holder_name(lease) for lease in outstanding})
            with state.lock:
                self.unmapper.leaked.extend({lease.record for lease in outstanding})
            waited = (
                f"after {timeout:g} s"
                if time.monotonic() >= deadline
                else "with no consumer connected and no process left that could take them"
            )
            if sender_exit:
                what = f"this process exits with {len(outstanding)} lease(s) on CUDA tensors it sent outstanding"
                then = (
                    "One not yet claimed can no longer be (its receiver's get() raises OwnerGoneError); one held "
                    "stays mapped in its receiver but cannot be sent on. Keep the sender running until receivers "
                    "let go, raise gpushare.torch.multiprocessing.set_release_timeout(), or send tensors over "
                    "Manager(owner='server') buffers, which outlive it"
                )
            else:
                what = f"Manager shut down with {len(outstanding)} lease(s) outstanding"
                then = (
                    "That memory is leaked (not freed under its users) until this process exits; release buffers "
                    "in workers before shutting down"
                )
            message = f"gpushare: {what} {waited}: {', '.join(names)}, held by {', '.join(holders)}. {then}"
            messages.append(message)
            warn(message, LeakWarning)
        for record in ours:
            if not self.unmapper.unmap_everywhere(record):
                continue
            with state.lock:
                if record.owner_ref or record.leases:
                    record.detached = True  # still used here: freed when its last Buffer goes
                else:
                    self.unmapper.free_locked(record)
        if before_bye is not None:
            before_bye(messages)
        with state.lock:
            peers = self.consumers.all()
        for peer in peers:
            peer.send(Bye("the owning Manager was shut down"))
            try:
                peer.channel.shutdown()
            except OSError:  # its connection closed meanwhile
                pass
        self.loop.close()
        leases.close()
        with _owners_lock:
            _owners.pop(self.token, None)
        return messages

    def _awaited_locked(self, sender_exit: bool, may_claim: Callable[[], bool] | None) -> bool:
        """Whether shutdown still waits: a lease held elsewhere, or unclaimed (and, at a
        ``sender_exit``, some process that may claim it: a consumer connected, or
        ``may_claim()``)."""
        held = self.leases.held_elsewhere_locked()
        if sender_exit and not len(self.consumers) and not (may_claim is not None and may_claim()):
            return any(lease.holder is not None for lease in held)
        return bool(held)

    def _holder_name(self, lease: Lease) -> str:
        if lease.holder is None:
            return "an unclaimed pickle"
        if lease.holder == LOCAL:
            return "this process"
        peer = self.consumers.get(lease.holder)
        return f"pid {peer.pid}" if peer else "a closed connection"


def _after_fork_in_child() -> None:
    # A forked child shares none of its parent's threads or sockets: it owns nothing.
    global _owners_lock
    _owners.clear()
    _owners_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
