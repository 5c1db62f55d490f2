"""The owner: one per Manager, in the process that allocates its memory.

:class:`Owner` is its parts stacked: the pool (:mod:`._pool`), the lease table
(:mod:`._leases`), the unmap protocol (:mod:`._unmap`) and the socket service
(:mod:`._serve`); this module adds allocation and the owner's own references
(:class:`_OwnerSource`), statistics and shutdown: stop sharing, wait (bounded) for leases,
report what is still out with a :class:`~gpushare.LeakWarning`, free what is free, and
tell every consumer ``bye``.
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _backends
from .._descriptor import Descriptor
from .._errors import LeakWarning, ManagerClosedError
from .._memory import Memory
from .._service import UnixListener, shutdown_socket
from ._common import LOCAL, _ReadyEvents, _warn
from ._records import _Lease, _Peer, _Slot
from ._serve import _Service


class _OwnerSource:
    """The owner's own reference: dropping it lets the slot be recycled."""

    def __init__(self, owner: Owner, slot: _Slot) -> None:
        self.owner = owner
        self.slot = slot

    def drop(self, memory: Memory) -> None:
        self.owner._defer(self.owner._drop_owner_ref, self.slot)

    def share(self, memory: Memory) -> tuple[int, bytes]:
        lease = self.owner.take_lease(self.slot, memory.generation)
        memory.handle = self.slot.allocation.handle  # exported on first share
        return lease

    def check(self, memory: Memory) -> None:
        self.owner._check_slot(self.slot)


class _LocalLeaseSource(_OwnerSource):
    """A lease claimed inside the owner's process (a buffer unpickled where it was made)."""

    def __init__(self, owner: Owner, slot: _Slot, lease_id: int) -> None:
        super().__init__(owner, slot)
        self.lease_id = lease_id

    def drop(self, memory: Memory) -> None:
        self.owner._defer(self.owner._release_lease, self.lease_id, LOCAL)


_owners: dict[bytes, Owner] = {}
_owners_lock = threading.Lock()


def owner_for(token: bytes) -> Owner | None:
    return _owners.get(token)


class Owner(_Service):
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
        self.token = secrets.token_bytes(16)
        self.authkey = bytes(authkey)
        self.lease_timeout = float(lease_timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        self.unmap_timeout = float(unmap_timeout)
        self.pool_limit = pool_limit
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._refusals: queue.SimpleQueue[tuple[_Peer, int, str]] = queue.SimpleQueue()
        self._slots: dict[int, _Slot] = {}
        self._pool: dict[tuple[str, int | None, int], list[_Slot]] = {}
        self._leases: dict[int, _Lease] = {}
        self._peers: dict[int, _Peer] = {}
        self._unmap_waits: dict[int, dict[int, bool | None]] = {}
        self._leaked: list[_Slot] = []
        self._ready = _ReadyEvents()
        self._ids = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._closed = False
        self._stop = threading.Event()
        self.reused = 0
        self._listener = UnixListener("owner", self._serve)
        self.address = self._listener.address
        self._housekeeper = threading.Thread(target=self._housekeeping, name="gpushare-owner-housekeeping", daemon=True)
        self._housekeeper.start()
        with _owners_lock:
            _owners[self.token] = self

    def allocate(self, backend: _backends.Backend, nbytes: int, device: int | None, label: str) -> Memory:
        """The owner's reference to ``nbytes`` (a multiple of 2 MiB) from the pool or the backend."""
        with self._lock:
            self._drain_locked()
            if self._closed:
                raise ManagerClosedError("the Manager was shut down; make a new Manager to allocate buffers")
            free = self._pool.get((backend.name, device, nbytes))
            slot = free.pop() if free else None
            if slot is not None:
                slot.pooled = False
                slot.generation += 1
                self.reused += 1
        if slot is None:
            try:
                allocation = backend.allocate(nbytes, device)
            except MemoryError as exc:
                freed = self._trim_device(backend, device)
                if not freed:
                    raise
                try:  # once more, now that the pool's unused memory on this device is free
                    allocation = backend.allocate(nbytes, device)
                except MemoryError as again:
                    raise again from exc
            slot = _Slot(next(self._ids), allocation, backend)
        with self._lock:
            self._slots[slot.alloc_id] = slot
            slot.owner_ref = True
            slot.label = label
            return self._memory(slot, _OwnerSource(self, slot))

    def _drop_owner_ref(self, slot: _Slot) -> None:
        """Lock held."""
        slot.owner_ref = False
        if slot.detached and not slot.leases:
            # Shut down while this process still used it: free it now that it is unused.
            self._free_locked(slot)
            return
        self._maybe_recycle(slot)

    def attach_local(self, desc: Descriptor) -> Memory:
        """The memory of a buffer unpickled in the owner's own process (the caller makes the Buffer)."""
        with self._lock:
            self._drain_locked()
            lease = self._claim(desc.lease_id, desc.alloc_id, LOCAL)
            return self._memory(lease.slot, _LocalLeaseSource(self, lease.slot, lease.lease_id))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._drain_locked()
            slots = list(self._slots.values())
            pooled = [s for s in slots if s.pooled]
            live = [s for s in slots if not s.pooled and not s.dead]
            backends: dict[str, int] = {}
            for s in live:
                backends[s.backend.name] = backends.get(s.backend.name, 0) + 1
            return {
                "live_buffers": len(live),
                "bytes_allocated": sum(s.allocation.nbytes for s in slots if not s.dead),
                "bytes_in_use": sum(s.allocation.nbytes for s in live),
                "bytes_pooled": sum(s.allocation.nbytes for s in pooled),
                "pooled_buffers": len(pooled),
                "leases": len(self._leases),
                "unclaimed_leases": sum(1 for lease in self._leases.values() if lease.holder is None),
                "consumers": len(self._peers),
                "consumer_pids": sorted(p.pid for p in self._peers.values()),
                "backends": backends,
                "reused": self.reused,
                "leaked_buffers": len(self._leaked),
                "closed": self._closed,
            }

    def shutdown(self, timeout: float | None = None) -> None:
        """Wait (bounded) for leases, report leaks, free everything free, stop serving."""
        timeout = self.shutdown_timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drain_locked()
            deadline = time.monotonic() + timeout
            while self._leases and time.monotonic() < deadline:
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                self._drain_locked()
            outstanding = list(self._leases.values())
            unleased = [s for s in self._slots.values() if not s.leases and not s.dead]
            for slot in unleased:
                if slot.pooled:
                    self._unpool_locked(slot)
        if outstanding:
            names = sorted({f"allocation {lease.slot.alloc_id} ({lease.slot.label})" for lease in outstanding})
            holders = sorted({self._holder_name(lease) for lease in outstanding})
            with self._lock:
                self._leaked.extend({lease.slot for lease in outstanding})
            _warn(
                f"gpushare: Manager shut down with {len(outstanding)} lease(s) outstanding after {timeout:g} s: "
                f"{', '.join(names)}, held by {', '.join(holders)}. That memory is leaked (not freed under "
                "its users) until this process exits; release buffers in workers before shutting down",
                LeakWarning,
            )
        for slot in unleased:
            if not self._unmap_everywhere(slot):
                continue
            with self._lock:
                if slot.owner_ref:
                    slot.detached = True  # still used here: freed when its last Buffer goes
                else:
                    self._free_locked(slot)
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            peer.send(("bye", "the owning Manager was shut down"))
            try:
                shutdown_socket(peer.conn.fileno())
            except OSError:  # its connection closed meanwhile
                pass
        self._stop.set()
        self._listener.close()
        self._housekeeper.join(timeout=2.0)
        self._ready.close()
        with _owners_lock:
            _owners.pop(self.token, None)

    def _holder_name(self, lease: _Lease) -> str:
        if lease.holder is None:
            return "an unclaimed pickle"
        if lease.holder == LOCAL:
            return "this process"
        peer = self._peers.get(lease.holder)
        return f"pid {peer.pid}" if peer else "a closed connection"


def _after_fork_in_child() -> None:
    # A forked child shares none of its parent's threads or sockets: it owns nothing.
    global _owners_lock
    _owners.clear()
    _owners_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
