"""The lifetime service: leases, recycling, and who may free what, when.

The driver's rule is that freeing exported memory before every importer
has closed it is undefined behaviour. This module makes the order explicit.

Owner side (:class:`Owner`, one per Manager, in the process that allocates)
---------------------------------------------------------------------------
* Every allocation is a *slot* with an id and a *generation* (bumped each
  time the pool hands the slot out again).
* The owner's own Buffers hold one *owner reference* on the slot.
* Each pickling of a buffer takes a *lease* on the slot (:meth:`Owner.take_lease`).
  The lease is *unclaimed* until the process that unpickles the buffer
  claims it over its authenticated connection; an unclaimed lease expires
  after ``lease_timeout`` seconds with a :class:`LeaseExpiredWarning`.
* A lease is released by its holder (``release()``, garbage collection,
  worker exit), or when the holder's connection closes: a SIGKILLed
  worker's socket closes at once, so nothing stays pinned.
* When a slot has neither an owner reference nor a lease it goes back to a
  size-class pool and is reused by the next allocation of that size.
* Memory is freed (``trim()``, shutdown, pool over its limit) only after
  every process that mapped it has unmapped: the owner sends ``unmap`` to
  each mapper and waits for ``unmapped``; a mapper that cannot unmap, or
  does not answer in time, makes the owner leak the slot rather than free
  memory someone may still reach.
* At shutdown the owner waits (bounded) for leases to come back, then
  reports what is still leased with a :class:`LeakWarning` naming it.

Consumer side (:class:`Link`, one per owner per process)
--------------------------------------------------------
* One authenticated Unix-socket connection to the owner (multiprocessing's
  HMAC challenge with the process authkey, both ways, before anything is
  unpickled), a reader thread for replies and ``unmap`` requests, and a
  writer thread that batches lease releases off the caller's path (release
  may run inside the garbage collector, so it only enqueues).
* Mappings are cached per allocation and *retained* after their last
  buffer goes, so a recycled allocation arrives with no new open; they are
  closed when the owner asks (``unmap``) or the process exits.
* When the connection closes, the owner is gone: every buffer of that owner
  raises :class:`OwnerGoneError` when touched.

Wire messages are pickled tuples on an authenticated connection:
consumer -> owner ``("hello", pid)``, ``("claim", req, lease, alloc)``
(first arrival of an allocation: answered), ``("batch", [lease...], [lease...])``
(claims of allocations this process already maps, then releases; a refused
claim is answered by ``("claim_failed", lease, message)``),
``("lease", req, alloc, generation, lease it came under)``, ``("fd", req, alloc)``,
``("unmapped", alloc, ok)``; owner ->
consumer ``("ok", req, value)``, ``("okfd", req, None)`` immediately
followed on the socket by one file descriptor (SCM_RIGHTS: the fd-based
backends' allocation or pool handle, sent only for an allocation the
consumer holds a lease on), ``("err", req, message)``, ``("unmap", alloc)``,
``("bye", reason)``.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, connection, current_process, reduction
from typing import Any

import numpy as np

from . import _backends, _cuda
from ._buffer import Buffer, Memory
from ._descriptor import Descriptor
from ._errors import (
    DescriptorError,
    LeakWarning,
    LeaseExpiredWarning,
    ManagerClosedError,
    OwnerGoneError,
)
from ._service import UnixListener, accept, connect, shutdown_socket

__all__ = ["Link", "Owner", "attach", "close_links", "owner_for"]

log = logging.getLogger("gpushare")

LOCAL = 0  # holder id of leases claimed inside the owner's own process
_CLAIM, _RELEASE = 0, 1  # kinds of the consumer's batched lease traffic
REQUEST_TIMEOUT = 30.0


def _warn(message: str, category: type[Warning]) -> None:
    """Warn from any thread without letting a warnings filter kill that thread."""
    log.warning(message)
    try:
        warnings.warn(message, category, stacklevel=3)
    except Warning:
        pass


# ---------------------------------------------------------------------------
# Owner side
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    alloc_id: int
    allocation: _backends.Allocation
    backend: _backends.Backend
    generation: int = 0
    owner_ref: bool = False
    leases: set[int] = field(default_factory=set)
    mappers: set[int] = field(default_factory=set)
    pooled: bool = False
    dead: bool = False  # memory freed
    detached: bool = False  # Manager shut down while the owner still used it: free on drop
    event: Any = None  # CUDA: interprocess ready event, recorded at every share
    event_handle: bytes = b""
    label: str = ""

    @property
    def pool_key(self) -> tuple[str, int | None, int]:
        return (self.backend.name, self.allocation.device, self.allocation.nbytes)


@dataclass(eq=False)
class _Lease:
    lease_id: int
    slot: _Slot
    generation: int
    holder: int | None  # None = unclaimed, LOCAL, or a connection id
    created: float


@dataclass(eq=False)
class _Peer:
    conn_id: int
    conn: connection.Connection
    pid: int = 0
    leases: set[int] = field(default_factory=set)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None  # the connection's socket, for SCM_RIGHTS

    def send(self, message: tuple[Any, ...]) -> bool:
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError):
            return False

    def send_fd(self, req: int, fd: int) -> bool:
        """Reply to request ``req`` with a file descriptor: a message, then the fd itself."""
        try:
            with self.send_lock:
                if self.sock is None:
                    self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
                self.conn.send(("okfd", req, None))
                reduction.sendfds(self.sock, [fd])
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.conn.close()


class _OwnerSource:
    """The owner's own reference: dropping it lets the slot be recycled."""

    def __init__(self, owner: Owner, slot: _Slot) -> None:
        self.owner = owner
        self.slot = slot

    def drop(self, memory: Memory) -> None:
        self.owner._defer(self.owner._drop_owner_ref, self.slot)

    def share(self, memory: Memory) -> int:
        lease_id = self.owner.take_lease(self.slot, memory.generation)
        memory.handle = self.slot.allocation.handle  # exported on first share
        memory.event_handle = self.slot.event_handle
        return lease_id

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
        self.token = secrets.token_bytes(16)
        self.authkey = bytes(authkey)
        self.lease_timeout = float(lease_timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        self.unmap_timeout = float(unmap_timeout)
        self.pool_limit = pool_limit
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._slots: dict[int, _Slot] = {}
        self._pool: dict[tuple[str, int | None, int], list[_Slot]] = {}
        self._leases: dict[int, _Lease] = {}
        self._peers: dict[int, _Peer] = {}
        self._unmap_waits: dict[int, dict[int, bool | None]] = {}
        self._leaked: list[_Slot] = []
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

    # -- deferred work (finalizers must never block on the owner lock) ----------
    def _defer(self, fn: Callable[..., None], *args: Any) -> None:
        self._pending.put((fn, args))
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()

    def _drain_locked(self) -> None:
        while True:
            try:
                fn, args = self._pending.get_nowait()
            except queue.Empty:
                return
            fn(*args)

    # -- allocation -----------------------------------------------------------
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
            allocation = backend.allocate(nbytes, device)
            slot = _Slot(next(self._ids), allocation, backend)
        with self._lock:
            self._slots[slot.alloc_id] = slot
            slot.owner_ref = True
            slot.label = label
            return self._memory(slot, _OwnerSource(self, slot))

    def _memory(self, slot: _Slot, source: Any) -> Memory:
        a = slot.allocation
        return Memory(
            backend=slot.backend,
            base=a.ptr,
            alloc_nbytes=a.nbytes,
            device=a.device,
            device_uuid=a.device_uuid,
            owner_token=self.token,
            address=self.address,
            alloc_id=slot.alloc_id,
            generation=slot.generation,
            handle=a.handle,
            native=a.native,
            source=source,
        )

    def _check_slot(self, slot: _Slot) -> None:
        if slot.dead:
            raise ManagerClosedError(
                "the memory of this buffer was freed (its Manager was shut down); "
                "keep the Manager open while buffers are in use"
            )

    def _drop_owner_ref(self, slot: _Slot) -> None:
        """Lock held."""
        slot.owner_ref = False
        if slot.detached and not slot.leases:
            # Shut down while this process still used it: free it now that it is unused.
            self._free_locked(slot)
            return
        self._maybe_recycle(slot)

    def _maybe_recycle(self, slot: _Slot) -> None:
        """Lock held. Put an unreferenced slot back in the pool."""
        if slot.owner_ref or slot.leases or slot.pooled or slot.dead or self._closed:
            return
        slot.pooled = True
        self._pool.setdefault(slot.pool_key, []).append(slot)
        self._cond.notify_all()

    # -- leases ----------------------------------------------------------------
    def take_lease(self, slot: _Slot, generation: int) -> int:
        """A new unclaimed lease on ``slot`` (one pickling of a buffer)."""
        with self._lock:
            self._drain_locked()
            self._check_slot(slot)
            if self._closed:
                raise ManagerClosedError("the Manager is shutting down; it shares no more buffers")
            if slot.generation != generation:
                raise DescriptorError("this buffer's allocation was recycled; it cannot be shared any more")
            slot.allocation.handle = slot.backend.export(slot.allocation)
            if slot.backend.is_cuda:
                self._record_ready(slot)
            lease = _Lease(next(self._lease_ids), slot, generation, None, time.monotonic())
            self._leases[lease.lease_id] = lease
            slot.leases.add(lease.lease_id)
            return lease.lease_id

    def _record_ready(self, slot: _Slot) -> None:
        """Lock held. Mark, on the default stream, the point the consumer must wait for.

        One interprocess event per allocation, created on first share and
        recorded at every share: recording costs microseconds, opening one in a
        consumer a third of a millisecond, so consumers open it once.
        """
        device = slot.allocation.device
        assert device is not None
        if slot.event is None:
            slot.event, slot.event_handle = _cuda.event_create_ipc(device)
        _cuda.event_record(slot.event, device)

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

    def attach_local(self, desc: Descriptor) -> Buffer:
        """Rebuild a buffer unpickled in the owner's own process."""
        with self._lock:
            self._drain_locked()
            lease = self._claim(desc.lease_id, desc.alloc_id, LOCAL)
            memory = self._memory(lease.slot, _LocalLeaseSource(self, lease.slot, lease.lease_id))
        return Buffer(memory, desc.offset, desc.shape, np.dtype(desc.dtype))

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

    # -- the socket service -------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = accept(sock, self.authkey)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("gpushare: refused a connection that did not authenticate: %s", exc)
            sock.close()
            return
        peer = _Peer(next(self._conn_ids), conn)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._peers[peer.conn_id] = peer
        try:
            while True:
                message = conn.recv()
                self._handle(peer, message)
        except (EOFError, OSError):
            pass
        except Exception:  # a bug must not leave leases pinned: drop the peer
            log.exception("gpushare: internal error serving a consumer; dropping its connection")
        finally:
            self._drop_peer(peer)
            peer.close()

    def _handle(self, peer: _Peer, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "batch":
            _, claims, releases = message
            refused = []
            with self._lock:
                for lease_id in claims:
                    try:
                        self._claim(lease_id, None, peer.conn_id)
                    except DescriptorError as exc:
                        refused.append((lease_id, str(exc)))
                for lease_id in releases:
                    self._release_lease(lease_id, peer.conn_id)
                self._drain_locked()
            for lease_id, why in refused:
                peer.send(("claim_failed", lease_id, why))
        elif kind == "claim":
            _, req, lease_id, alloc_id = message
            try:
                with self._lock:
                    self._drain_locked()
                    self._claim(lease_id, alloc_id, peer.conn_id)
                peer.send(("ok", req, None))
            except DescriptorError as exc:
                peer.send(("err", req, str(exc)))
        elif kind == "lease":
            # Re-sharing a buffer this peer received: it must hold the lease it
            # received it under, or have its claim of that lease still in flight.
            _, req, alloc_id, generation, via = message
            try:
                with self._lock:
                    slot = self._slots.get(alloc_id)
                    lease = self._leases.get(via)
                    held = lease is not None and lease.slot is slot and lease.holder in (peer.conn_id, None)
                if slot is None or not held:
                    raise DescriptorError(f"allocation {alloc_id} is not leased to this process")
                peer.send(("ok", req, self.take_lease(slot, generation)))
            except (DescriptorError, ManagerClosedError) as exc:
                peer.send(("err", req, str(exc)))
        elif kind == "fd":
            _, req, alloc_id = message
            with self._lock:
                slot = self._slots.get(alloc_id)
                held = slot is not None and any(self._leases[i].slot is slot for i in peer.leases)
            if slot is None or not held:
                peer.send(("err", req, f"allocation {alloc_id} is not leased to this process"))
                return
            try:
                fd = slot.backend.export_fd(slot.allocation)
            except Exception as exc:  # a driver error must reach the consumer, not kill this thread
                peer.send(("err", req, f"the owner could not export allocation {alloc_id}: {exc}"))
                return
            peer.send_fd(req, fd)
        elif kind == "unmapped":
            _, alloc_id, ok = message
            with self._lock:
                waits = self._unmap_waits.get(alloc_id)
                if waits is not None and peer.conn_id in waits:
                    waits[peer.conn_id] = bool(ok)
                if ok:
                    slot = self._slots.get(alloc_id)
                    if slot is not None:
                        slot.mappers.discard(peer.conn_id)
                self._cond.notify_all()
        elif kind == "hello":
            peer.pid = int(message[1])
        else:
            log.warning("gpushare: ignoring unknown message %r from pid %s", kind, peer.pid)

    def _drop_peer(self, peer: _Peer) -> None:
        """The peer's connection closed (exit, crash, SIGKILL): release all it held."""
        with self._lock:
            self._peers.pop(peer.conn_id, None)
            for lease_id in list(peer.leases):
                self._release_lease(lease_id, peer.conn_id)
            for slot in self._slots.values():
                slot.mappers.discard(peer.conn_id)
            for waits in self._unmap_waits.values():
                if peer.conn_id in waits:
                    waits[peer.conn_id] = True  # its mappings died with it
            self._cond.notify_all()

    def _housekeeping(self) -> None:
        while not self._stop.wait(0.2):
            expired: list[_Lease] = []
            with self._lock:
                self._drain_locked()
                deadline = time.monotonic() - self.lease_timeout
                for lease in list(self._leases.values()):
                    if lease.holder is None and lease.created < deadline:
                        expired.append(lease)
                        del self._leases[lease.lease_id]
                        lease.slot.leases.discard(lease.lease_id)
                        self._maybe_recycle(lease.slot)
                over = self._over_limit_locked()
            for lease in expired:
                _warn(
                    f"gpushare: a lease on allocation {lease.slot.alloc_id} ({lease.slot.label}) was never "
                    f"claimed within {self.lease_timeout:g} s and expired; the pickled buffer was probably "
                    "dropped. Unpickling it now raises DescriptorError",
                    LeaseExpiredWarning,
                )
            for slot in over:
                self._destroy(slot)

    def _over_limit_locked(self) -> list[_Slot]:
        if self.pool_limit is None:
            return []
        pooled = sorted((s for lst in self._pool.values() for s in lst), key=lambda s: s.alloc_id)
        total = sum(s.allocation.nbytes for s in pooled)
        victims = []
        while pooled and total > self.pool_limit:
            slot = pooled.pop(0)
            total -= slot.allocation.nbytes
            self._unpool_locked(slot)
            victims.append(slot)
        return victims

    def _unpool_locked(self, slot: _Slot) -> None:
        self._pool[slot.pool_key].remove(slot)
        slot.pooled = False

    # -- freeing ---------------------------------------------------------------
    def _unmap_everywhere(self, slot: _Slot) -> bool:
        """Ask every process that mapped ``slot`` to unmap it; True once all have.

        A process that refuses (it still uses the memory) or does not answer
        within ``unmap_timeout`` makes the slot leak: it is never freed.
        """
        with self._lock:
            waits: dict[int, bool | None] = {c: (None if c in self._peers else True) for c in slot.mappers}
            self._unmap_waits[slot.alloc_id] = waits
            peers = [self._peers[c] for c in slot.mappers if c in self._peers]
        for peer in peers:
            if not peer.send(("unmap", slot.alloc_id)):
                with self._lock:
                    waits[peer.conn_id] = True
        deadline = time.monotonic() + self.unmap_timeout
        with self._lock:
            while any(v is None for v in waits.values()) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            del self._unmap_waits[slot.alloc_id]
            refused = [c for c, ok in waits.items() if not ok]
            if not refused:
                return True
            self._leaked.append(slot)
            pids = [self._peers[c].pid for c in refused if c in self._peers]
        _warn(
            f"gpushare: allocation {slot.alloc_id} ({slot.label}) is still mapped by process(es) "
            f"{pids or refused}, which did not unmap it within {self.unmap_timeout:g} s; it is leaked "
            "rather than freed under them",
            LeakWarning,
        )
        return False

    def _free_locked(self, slot: _Slot) -> None:
        """Give a slot's memory back to its backend. Nobody maps it any more."""
        if slot.dead:
            return
        slot.dead = True
        self._slots.pop(slot.alloc_id, None)
        if slot.event is not None:
            assert slot.allocation.device is not None
            _cuda.event_destroy(slot.event, slot.allocation.device)
        slot.backend.free(slot.allocation)

    def _destroy(self, slot: _Slot) -> bool:
        if not self._unmap_everywhere(slot):
            return False
        with self._lock:
            self._free_locked(slot)
        return True

    def trim(self) -> int:
        """Free every pooled allocation; return the bytes given back."""
        with self._lock:
            self._drain_locked()
            victims = [s for lst in self._pool.values() for s in lst]
            for slot in victims:
                self._unpool_locked(slot)
        return sum(slot.allocation.nbytes for slot in victims if self._destroy(slot))

    # -- observability ------------------------------------------------------------
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

    # -- shutdown ----------------------------------------------------------------
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
            shutdown_socket(peer.conn.fileno())
        self._stop.set()
        self._listener.close()
        self._housekeeper.join(timeout=2.0)
        with _owners_lock:
            _owners.pop(self.token, None)

    def _holder_name(self, lease: _Lease) -> str:
        if lease.holder is None:
            return "an unclaimed pickle"
        if lease.holder == LOCAL:
            return "this process"
        peer = self._peers.get(lease.holder)
        return f"pid {peer.pid}" if peer else "a closed connection"


# ---------------------------------------------------------------------------
# Consumer side
# ---------------------------------------------------------------------------


class _LeaseSource:
    """A lease claimed by this (non-owner) process over its link."""

    def __init__(self, link: Link, lease_id: int) -> None:
        self.link = link
        self.lease_id = lease_id

    def drop(self, memory: Memory) -> None:
        self.link._writes.put((_RELEASE, self.lease_id, memory.alloc_id))

    def share(self, memory: Memory) -> int:
        return int(self.link.request("lease", memory.alloc_id, memory.generation, self.lease_id))

    def check(self, memory: Memory) -> None:
        refused = self.link._failed.get(self.lease_id)
        if refused is not None:
            raise DescriptorError(f"the owner refused this buffer's lease: {refused}")
        if self.link.gone is not None:
            raise OwnerGoneError(
                f"the process that owns this buffer is gone ({self.link.gone}); its memory may be freed. "
                "Keep the owner's Manager open until workers are done with its buffers"
            )


_links: dict[bytes, Link] = {}
_links_lock = threading.Lock()


class Link:
    """This process's connection to one owner, with its mapping cache."""

    def __init__(self, address: str, token: bytes, authkey: bytes) -> None:
        self.token = token
        self.gone: str | None = None
        self._send_lock = threading.Lock()
        self._map_lock = threading.Lock()
        self._mappings: dict[int, _backends.Mapping] = {}
        self._events: dict[int, tuple[bytes, Any, int]] = {}  # alloc id -> (handle, opened event, device)
        self._failed: dict[int, str] = {}  # lease id -> why the owner refused an asynchronous claim
        self._held: set[int] = set()  # lease ids claimed by this process and not yet released
        self._waiting: dict[int, list[Any]] = {}
        self._wait_lock = threading.Lock()
        self._reqs = itertools.count(1)
        # Lease traffic, sent by the writer thread in batches: (_CLAIM | _RELEASE, lease, alloc).
        self._writes: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        try:
            self.conn = connect(address, authkey)
        except AuthenticationError as exc:
            raise OwnerGoneError(
                "the owner of this buffer refused this process: authentication failed. Processes "
                "share buffers only with processes started from the Manager's process tree (same "
                "multiprocessing authkey)"
            ) from exc
        except (OSError, EOFError) as exc:
            raise OwnerGoneError(
                f"cannot reach the owner of this buffer at {address} ({exc}): the process that made it "
                "exited or shut its Manager down"
            ) from exc
        self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self._send(("hello", os.getpid()))
        self._reader = threading.Thread(target=self._read_loop, name="gpushare-link-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="gpushare-link-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError) as exc:
            self._mark_gone(f"connection lost: {exc}")
            raise OwnerGoneError(f"the owner of this buffer is gone ({self.gone})") from exc

    def request(self, kind: str, *args: Any) -> Any:
        if self.gone is not None:
            raise OwnerGoneError(f"the owner of this buffer is gone ({self.gone})")
        req = next(self._reqs)
        slot: list[Any] = [threading.Event(), None, None]
        with self._wait_lock:
            self._waiting[req] = slot
        try:
            self._send((kind, req, *args))
            if not slot[0].wait(REQUEST_TIMEOUT):
                raise OwnerGoneError(f"the owner of this buffer did not answer within {REQUEST_TIMEOUT:g} s")
        finally:
            with self._wait_lock:
                self._waiting.pop(req, None)
        if slot[1] == "ok":
            return slot[2]
        if slot[1] == "err":
            raise DescriptorError(slot[2])
        raise OwnerGoneError(f"the owner of this buffer is gone ({self.gone})")

    def _read_loop(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind in ("ok", "err", "okfd"):
                    value = message[2]
                    if kind == "okfd":  # the fd follows the message on the socket
                        kind, value = "ok", reduction.recvfds(self._sock, 1)[0]
                    with self._wait_lock:
                        slot = self._waiting.get(message[1])
                    if slot is not None:
                        slot[1], slot[2] = kind, value
                        slot[0].set()
                    elif kind == "ok" and message[0] == "okfd":
                        os.close(value)  # the requester gave up waiting
                elif kind == "unmap":
                    ok = self._unmap(message[1])
                    try:
                        self._send(("unmapped", message[1], ok))
                    except OwnerGoneError:
                        return
                elif kind == "claim_failed":
                    self._failed[message[1]] = message[2]
                elif kind == "bye":
                    self._mark_gone(message[1])
                    return
        except (EOFError, OSError):
            self._mark_gone("its process exited or closed the connection")

    def _mark_gone(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason
        with self._wait_lock:
            for slot in self._waiting.values():
                slot[0].set()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            batch = []
            stop = False
            while True:
                if item is None:
                    stop = True
                else:
                    batch.append(item)
                try:
                    item = self._writes.get_nowait()
                except queue.Empty:
                    break
            if batch:
                claims = [lease_id for kind, lease_id, _ in batch if kind == _CLAIM]
                releases = [(lease_id, alloc_id) for kind, lease_id, alloc_id in batch if kind == _RELEASE]
                with self._map_lock:
                    for lease_id, alloc_id in releases:
                        self._held.discard(lease_id)
                        mapping = self._mappings.get(alloc_id)
                        if mapping is not None:
                            mapping.refs -= 1
                if self.gone is None:
                    try:
                        self._send(("batch", claims, [lease_id for lease_id, _ in releases]))
                    except OwnerGoneError:
                        pass
            if stop:
                return

    def _unmap(self, alloc_id: int) -> bool:
        with self._map_lock:
            mapping = self._mappings.get(alloc_id)
            if mapping is None:
                return True
            if mapping.refs > 0:
                return False
            del self._mappings[alloc_id]
        self._forget_event(alloc_id)
        try:
            _backends.get(mapping.backend).close(mapping)
        except Exception:
            log.exception("gpushare: closing a mapping failed")
        return True

    def attach(self, desc: Descriptor) -> Buffer:
        """Claim the descriptor's lease, map its memory (cached), return the Buffer.

        Steady state (the allocation is already mapped here, so the owner
        already counts this process among its mappers and cannot free it
        under us) costs one message and no wait: the claim is sent and the
        owner answers only if it refuses it, which marks the buffer bad.
        A first arrival claims synchronously before it maps anything.
        """
        backend = _backends.get(desc.backend)
        with self._map_lock:
            if desc.lease_id in self._held:
                raise DescriptorError(
                    f"lease {desc.lease_id} is already held by a buffer in this process: a pickled buffer "
                    "can be unpickled once; pickle the buffer once per receiver"
                )
            mapping = self._mappings.get(desc.alloc_id)
            if mapping is not None:
                mapping.refs += 1
                self._held.add(desc.lease_id)
        if mapping is not None:
            # Claimed by the writer thread, batched with releases: the caller pays
            # for a queue put, not a socket write.
            self._writes.put((_CLAIM, desc.lease_id, desc.alloc_id))
        else:
            self.request("claim", desc.lease_id, desc.alloc_id)
            with self._map_lock:
                self._held.add(desc.lease_id)
            try:
                # Opened without the map lock: an fd-based open waits on the reader
                # thread, which takes that lock to answer the owner's unmap requests.
                opened = backend.open(
                    desc.handle,
                    desc.alloc_nbytes,
                    desc.device_uuid,
                    lambda: int(self.request("fd", desc.alloc_id)),
                    desc.owner_token,
                )
                with self._map_lock:
                    mapping = self._mappings.setdefault(desc.alloc_id, opened)
                    mapping.refs += 1
                if mapping is not opened:  # another thread mapped it first
                    backend.close(opened)
            except BaseException:
                self._writes.put((_RELEASE, desc.lease_id, -1))
                raise
        event = None
        if desc.event:
            try:
                event = self._event(desc.alloc_id, desc.event, mapping.device)
            except BaseException:
                self._writes.put((_RELEASE, desc.lease_id, desc.alloc_id))
                raise
        memory = Memory(
            backend=backend,
            base=mapping.ptr,
            alloc_nbytes=desc.alloc_nbytes,
            device=mapping.device,
            device_uuid=desc.device_uuid,
            owner_token=desc.owner_token,
            address=desc.address,
            alloc_id=desc.alloc_id,
            generation=desc.generation,
            handle=desc.handle,
            native=mapping.native,
            source=_LeaseSource(self, desc.lease_id),
            event=event,
        )
        return Buffer(memory, desc.offset, desc.shape, np.dtype(desc.dtype))

    def _event(self, alloc_id: int, handle: bytes, device: int | None) -> Any:
        """The producer's ready event for an allocation, opened once per process."""
        with self._map_lock:
            cached = self._events.get(alloc_id)
        if cached is not None and cached[0] == handle:
            return cached[1]
        assert device is not None
        event = _cuda.event_open(handle, device)
        with self._map_lock:
            old = self._events.get(alloc_id)
            self._events[alloc_id] = (handle, event, device)
        if old is not None:
            _cuda.event_destroy(old[1], old[2])
        return event

    def _forget_event(self, alloc_id: int) -> None:
        with self._map_lock:
            entry = self._events.pop(alloc_id, None)
        if entry is not None:
            try:
                _cuda.event_destroy(entry[1], entry[2])
            except Exception:
                log.exception("gpushare: destroying an opened event failed")

    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    def close(self) -> None:
        """Flush releases, close the connection, unmap everything."""
        self._writes.put(None)
        self._writer.join(timeout=5.0)
        try:
            self.conn.close()
            self._sock.close()
        except OSError:
            pass
        self._mark_gone("this process closed its connection")
        for alloc_id in list(self._events):
            self._forget_event(alloc_id)
        with self._map_lock:
            mappings = list(self._mappings.values())
            self._mappings.clear()
        for mapping in mappings:
            try:
                _backends.get(mapping.backend).close(mapping)
            except Exception:
                pass


def attach(desc: Descriptor) -> Buffer:
    """Rebuild a buffer from a descriptor in this process."""
    owner = owner_for(desc.owner_token)
    if owner is not None:
        return owner.attach_local(desc)
    link = _links.get(desc.owner_token)
    if link is None or link.gone is not None:
        with _links_lock:
            link = _links.get(desc.owner_token)
            if link is None or link.gone is not None:
                authkey = bytes(current_process().authkey)
                link = Link(desc.address, desc.owner_token, authkey)
                _links[desc.owner_token] = link
    return link.attach(desc)


def link_stats() -> dict[str, Any]:
    """Per-process figures of the consumer side (opens, cached mappings)."""
    return {
        "owners": len(_links),
        "open_mappings": sum(link.open_mappings for link in _links.values()),
        "opens": {name: _backends.get(name).opens for name in _backends._instances},
    }


def close_links() -> None:
    """Release every lease this process holds and close its connections (worker exit)."""
    with _links_lock:
        links = list(_links.values())
        _links.clear()
    for link in links:
        link.close()


atexit.register(close_links)


def _after_fork_in_child() -> None:
    # A forked child shares none of its parent's threads or sockets: it owns
    # nothing and has no links until it makes its own.
    global _owners_lock, _links_lock
    _owners.clear()
    _links.clear()
    _owners_lock = threading.Lock()
    _links_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
