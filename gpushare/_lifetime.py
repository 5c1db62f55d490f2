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
  unpickled) and a reader thread for replies and ``unmap`` requests.
* Claims of allocations this process already maps, and all releases, are
  records in a shared-memory lease journal (:mod:`gpushare._journal`) that
  the owner reads when it needs to: a steady-state handoff sends no
  message and wakes no thread. A release may run inside the garbage
  collector, so recording never blocks: what cannot be written at once
  goes, in order, through a writer thread (which also nudges the owner
  when the journal fills). Without ``memfd_create`` the writer sends the
  same records as ``batch`` messages.
* Mappings are cached per allocation and *retained* after their last
  buffer goes, so a recycled allocation arrives with no new open; they are
  closed when the owner asks (``unmap``) or the process exits. The owner's
  ready events (a few per device, recorded in turn) are opened once per
  process.
* When the connection closes, the owner is gone: every buffer of that owner
  raises :class:`OwnerGoneError` when touched.

Wire messages are pickled tuples on an authenticated connection:
consumer -> owner ``("hello", pid, owner token, has_journal)`` (then, if it
has one, the journal's file descriptor by SCM_RIGHTS; a token that is not
this owner's is answered by ``("refused", message)`` and the connection
closed: the descriptor named another Manager), ``("claim", req, lease, alloc)``
(first arrival of an allocation: answered), ``("drain",)`` (read my
journal), ``("batch", [lease...], [lease...])`` (no journal: claims, then
releases), ``("lease", req, alloc, generation, lease it came under)``
(re-sharing: answered with the new lease; the re-sharing process records
its own ready event),
``("fd", req, alloc)``, ``("unmapped", alloc, ok)``; owner -> consumer
``("ok", req, value)``, ``("okfd", req, None)`` immediately followed on the
socket by one file descriptor (SCM_RIGHTS: the fd-based backends'
allocation or pool handle, sent only for an allocation the consumer holds
a lease on), ``("err", req, message)``, ``("claim_failed", lease, message)``
(an asynchronous claim was refused), ``("unmap", alloc)``, ``("bye", reason)``.
The owner reads a consumer's journal before it handles any message from
it, so records always count before whatever the consumer sent after them.
"""

from __future__ import annotations

import atexit
import collections
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

from . import _backends, _cuda, _journal
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

__all__ = ["Link", "Owner", "attach", "close_link", "close_links", "link_for", "owner_for"]

log = logging.getLogger("gpushare")

LOCAL = 0  # holder id of leases claimed inside the owner's own process
_CLAIM, _RELEASE = _journal.CLAIM, _journal.RELEASE  # kinds of the consumer's lease records
_NUDGE = -1  # the consumer's writer: tell the owner to read the journal
REQUEST_TIMEOUT = 30.0
READY_EVENTS = 4  # interprocess ready events per device and process (see _ReadyEvents)


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
    # Expires without a warning and is dropped at shutdown: a Ray object's lease (read
    # many times or never, as Ray decides), or one that receivers leased through.
    quiet: bool = False


@dataclass(eq=False)
class _Peer:
    conn_id: int
    conn: connection.Connection
    pid: int = 0
    leases: set[int] = field(default_factory=set)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None  # the connection's socket, for SCM_RIGHTS
    journal: _journal.JournalReader | None = None  # its lease records (read under the owner lock)

    def socket(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        return self.sock

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
                sock = self.socket()
                self.conn.send(("okfd", req, None))
                reduction.sendfds(sock, [fd])
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.journal is not None:
            self.journal.close()
        self.conn.close()


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


class _ReadyEvents:
    """Interprocess ready events of one process: a few per device, recorded in turn.

    A sharer records one on the legacy default stream (where torch's and
    CuPy's default work runs) each time it pickles a CUDA buffer, and the
    descriptor carries its handle; the receiver waits on it. Creating and
    recording cost about 2 us, but opening one in another process a third
    of a millisecond, so each process keeps ``READY_EVENTS`` per device and
    a receiver opens each once: after that, even the first share of a new
    allocation opens no event. A receiver that waits late may find its
    event recorded again by a later share: it then waits for more of the
    sharer's work, never for less.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[int, list[tuple[Any, bytes]]] = {}
        self._turn = itertools.count()

    def record(self, device: int | None) -> bytes:
        """Record the next event of ``device`` now; return its handle."""
        assert device is not None
        with self._lock:
            events = self._events.setdefault(device, [])
            if len(events) < READY_EVENTS:
                events.append(_cuda.event_create_ipc(device))
                event, handle = events[-1]
            else:
                event, handle = events[next(self._turn) % READY_EVENTS]
            _cuda.event_record(event, device)
        return handle

    def close(self) -> None:
        with self._lock:
            events, self._events = self._events, {}
        for device, pairs in events.items():
            for event, _ in pairs:
                try:
                    _cuda.event_destroy(event, device)
                except Exception:
                    log.exception("gpushare: destroying a ready event failed")


_process_ready = _ReadyEvents()  # for buffers this process re-shares (it owns none of them)
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

    # -- deferred work (finalizers must never block on the owner lock) ----------
    def _defer(self, fn: Callable[..., None], *args: Any) -> None:
        self._pending.put((fn, args))
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()

    def _drain_locked(self) -> None:
        """Lock held. Catch up: deferred finalizer work, then every consumer's lease records."""
        while True:
            try:
                fn, args = self._pending.get_nowait()
            except queue.Empty:
                break
            fn(*args)
        for peer in self._peers.values():
            if peer.journal is not None:
                self._read_journal_locked(peer)

    def _read_journal_locked(self, peer: _Peer) -> None:
        """Lock held. Apply a consumer's claims and releases, in the order it made them."""
        assert peer.journal is not None
        for kind, lease_id in peer.journal.read():
            if kind == _RELEASE:
                self._release_lease(lease_id, peer.conn_id)
                continue
            try:
                self._claim(lease_id, None, peer.conn_id)
            except DescriptorError as exc:
                self._refusals.put((peer, lease_id, str(exc)))

    def _send_refusals(self) -> None:
        """Tell consumers which of their claims were refused (never under the lock)."""
        while True:
            try:
                peer, lease_id, why = self._refusals.get_nowait()
            except queue.Empty:
                return
            peer.send(("claim_failed", lease_id, why))

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
    def take_lease(self, slot: _Slot, generation: int, record: bool = True) -> tuple[int, bytes]:
        """A new unclaimed lease on ``slot`` (one pickling of a buffer), and the ready
        event the receiver waits on (empty for host memory, or when ``record`` is
        false: a re-sharing process records its own)."""
        with self._lock:
            self._drain_locked()
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

    def attach_local(self, desc: Descriptor) -> Buffer:
        """Rebuild a buffer unpickled in the owner's own process."""
        with self._lock:
            self._drain_locked()
            lease = self._claim(desc.lease_id, desc.alloc_id, LOCAL)
            memory = self._memory(lease.slot, _LocalLeaseSource(self, lease.slot, lease.lease_id))
        return Buffer(memory, desc.offset, desc.shape, np.dtype(desc.dtype))

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
                if peer.journal is not None:  # its records come before anything it sends after them
                    with self._lock:
                        self._read_journal_locked(peer)
                self._handle(peer, message)
                self._send_refusals()
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
                peer.send(("ok", req, self.lease_via(alloc_id, generation, via, peer.conn_id)))
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
        elif kind == "drain":
            pass  # the journal was read above
        elif kind == "hello":
            _, pid, token, has_journal = message
            peer.pid = int(pid)
            journal_fd = reduction.recvfds(peer.socket(), 1)[0] if has_journal else None
            if token != self.token:
                if journal_fd is not None:
                    os.close(journal_fd)
                peer.send(
                    (
                        "refused",
                        f"this buffer's descriptor names another Manager than the one serving {self.address} "
                        "(the bytes were altered, or mixed up between Managers); send the buffer again",
                    )
                )
                shutdown_socket(peer.conn.fileno())
                return
            if journal_fd is not None:
                journal = _journal.JournalReader(journal_fd)
                with self._lock:
                    peer.journal = journal
        else:
            log.warning("gpushare: ignoring unknown message %r from pid %s", kind, peer.pid)

    def _drop_peer(self, peer: _Peer) -> None:
        """The peer's connection closed (exit, crash, SIGKILL): release all it held."""
        with self._lock:
            if peer.journal is not None:
                self._read_journal_locked(peer)  # claims it made before it went count, then go
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
            self._send_refusals()
            for lease in expired:
                if lease.quiet:  # a Ray object's, or read through: its expiry is the end of its use
                    log.debug("gpushare: lease %d (quiet) expired", lease.lease_id)
                    continue
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
        slot.backend.free(slot.allocation)

    def _destroy(self, slot: _Slot) -> bool:
        if not self._unmap_everywhere(slot):
            return False
        with self._lock:
            self._free_locked(slot)
        return True

    def trim(self) -> int:
        """Free every pooled allocation; return the bytes given back."""
        return self._trim(lambda slot: True)

    def _trim_device(self, backend: _backends.Backend, device: int | None) -> int:
        """Free the pooled allocations that share ``device``'s memory (out-of-memory retry)."""
        return self._trim(lambda slot: slot.backend.is_cuda == backend.is_cuda and slot.allocation.device == device)

    def _trim(self, which: Callable[[_Slot], bool]) -> int:
        with self._lock:
            self._drain_locked()
            victims = [s for lst in self._pool.values() for s in lst if which(s)]
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
            # An unclaimed quiet lease (a Ray object's) serves no one once sharing
            # stops: its readers hold leases of their own.
            for lease in [x for x in self._leases.values() if x.holder is None and x.quiet]:
                del self._leases[lease.lease_id]
                lease.slot.leases.discard(lease.lease_id)
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


# ---------------------------------------------------------------------------
# Consumer side
# ---------------------------------------------------------------------------


class _LeaseSource:
    """A lease claimed by this (non-owner) process over its link."""

    def __init__(self, link: Link, lease_id: int) -> None:
        self.link = link
        self.lease_id = lease_id

    def drop(self, memory: Memory) -> None:
        self.link._note(_RELEASE, self.lease_id, memory.alloc_id)

    def share(self, memory: Memory) -> tuple[int, bytes]:
        """Re-share a received buffer (A -> B -> C): a new lease from the owner, and a
        ready event recorded here, after this process's own work on the buffer (and,
        if this process never waited for the producer, after the producer's too)."""
        lease_id = int(self.link.request("lease", memory.alloc_id, memory.generation, self.lease_id))
        if memory.device is None:
            return lease_id, b""
        memory.order_stream(0)  # the legacy default stream waits for the producer's ready event
        return lease_id, _process_ready.record(memory.device)

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
        self.authkey = bytes(authkey)
        self._address = address
        self.gone: str | None = None
        self.refused: str | None = None  # the owner said the descriptor was not its own
        self._send_lock = threading.Lock()
        self._map_lock = threading.Lock()
        self._mappings: dict[int, _backends.Mapping] = {}
        self._events: dict[tuple[bytes, int], Any] = {}  # (event handle, device) -> opened event
        self._failed: dict[int, str] = {}  # lease id -> why the owner refused an asynchronous claim
        self._held: set[int] = set()  # lease ids claimed by this process and not yet released
        self._waiting: dict[int, list[Any]] = {}
        self._wait_lock = threading.Lock()
        self._reqs = itertools.count(1)
        # Lease records (see _journal): written straight into the journal when that
        # can be done without blocking, else queued here, in order, for the writer
        # thread: (_CLAIM | _RELEASE, lease, alloc, accounted).
        self._journal = _journal.create_writer()
        self._journal_lock = threading.Lock()
        self._backlog: collections.deque[tuple[int, int, int, bool]] = collections.deque()
        self._nudged_at = 0  # journal head when the owner was last nudged
        # Wakes the writer: 1 (backlog), _NUDGE, or None (stop). SimpleQueue.put is
        # safe inside the garbage collector, where releases may run.
        self._wake: queue.SimpleQueue[int | None] = queue.SimpleQueue()
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
        self._send(("hello", os.getpid(), token, self._journal is not None))
        if self._journal is not None:
            assert self._journal.fd is not None
            try:
                reduction.sendfds(self._sock, [self._journal.fd])
            except OSError as exc:
                self._mark_gone(f"connection lost: {exc}")
                raise OwnerGoneError(f"cannot reach the owner of this buffer ({exc})") from exc
            finally:
                self._journal.close_fd()
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
        if self.refused is not None:
            raise DescriptorError(self.refused)
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
        if self.refused is not None:
            raise DescriptorError(self.refused)
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
                elif kind == "refused":
                    self.refused = message[1]
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

    # -- lease records ------------------------------------------------------------
    def _note(self, kind: int, lease_id: int, alloc_id: int) -> None:
        """Record a claim or a release of ``lease_id``. Never blocks.

        Runs in user code and inside the garbage collector, on any thread,
        possibly one that already holds these locks: so it only ever *tries*
        them. The fast path accounts for a release and appends the record to
        the journal at once; anything else goes to the backlog, which the
        writer thread empties in order (a record is never written before one
        queued earlier).
        """
        journal = self._journal
        if journal is not None and self._map_lock.acquire(blocking=False):
            try:
                if kind == _RELEASE:
                    self._unhold(lease_id, alloc_id)
                if self._journal_lock.acquire(blocking=False):
                    try:
                        if self._journal is journal and not self._backlog and journal.unconsumed() < _journal.CAPACITY:
                            journal.append(kind, lease_id)
                            if journal.head - self._nudged_at >= _journal.NUDGE_AT:
                                if journal.unconsumed() >= _journal.NUDGE_AT:
                                    self._nudged_at = journal.head
                                    self._wake.put(_NUDGE)
                            return
                    finally:
                        self._journal_lock.release()
            finally:
                self._map_lock.release()
            self._backlog.append((kind, lease_id, alloc_id, True))
        else:
            self._backlog.append((kind, lease_id, alloc_id, False))
        self._wake.put(1)

    def _unhold(self, lease_id: int, alloc_id: int) -> None:
        """Map lock held. A released lease no longer keeps its mapping in use.

        Done before the release record is written: an owner that has read the
        release and asks this process to unmap must find the mapping unused.
        """
        self._held.discard(lease_id)
        mapping = self._mappings.get(alloc_id)
        if mapping is not None:
            mapping.refs -= 1

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            signals = [self._wake.get()]
            while True:
                try:
                    signals.append(self._wake.get_nowait())
                except queue.Empty:
                    break
            stop = None in signals
            if self._journal is None:
                self._send_backlog()
                continue
            if _NUDGE in signals:
                self._send_quietly(("drain",))
            # Journal full: hold the backlog, nudge, retry, until it is written or the owner is gone.
            deadline = time.monotonic() + REQUEST_TIMEOUT
            while not self._write_backlog() and self.gone is None:
                self._send_quietly(("drain",))
                if time.monotonic() > deadline:
                    log.error(
                        "gpushare: the owner (address %s) has not read this process's lease records for %g s",
                        self._address,
                        REQUEST_TIMEOUT,
                    )
                    deadline = time.monotonic() + REQUEST_TIMEOUT
                time.sleep(0.001)

    def _write_backlog(self) -> bool:
        """Move backlog records into the journal, in order; False if it filled up first."""
        with self._journal_lock:
            journal = self._journal
            if journal is None:  # closed: the owner learns the rest from the connection's end
                return True
            while self._backlog:
                if journal.unconsumed() >= _journal.CAPACITY:
                    return False
                kind, lease_id, alloc_id, accounted = self._backlog[0]
                if kind == _RELEASE and not accounted:
                    with self._map_lock:
                        self._unhold(lease_id, alloc_id)
                journal.append(kind, lease_id)
                self._backlog.popleft()
        return True

    def _send_backlog(self) -> None:
        """No journal: send the backlog as one ``batch`` message (claims, then releases)."""
        batch = []
        while self._backlog:
            batch.append(self._backlog.popleft())
        if not batch:
            return
        with self._map_lock:
            for kind, lease_id, alloc_id, accounted in batch:
                if kind == _RELEASE and not accounted:
                    self._unhold(lease_id, alloc_id)
        claims = [lease_id for kind, lease_id, _, _ in batch if kind == _CLAIM]
        releases = [lease_id for kind, lease_id, _, _ in batch if kind == _RELEASE]
        self._send_quietly(("batch", claims, releases))

    def _send_quietly(self, message: tuple[Any, ...]) -> None:
        if self.gone is None:
            try:
                self._send(message)
            except OwnerGoneError:
                pass

    def _unmap(self, alloc_id: int) -> bool:
        with self._map_lock:
            mapping = self._mappings.get(alloc_id)
            if mapping is None:
                return True
            if mapping.refs > 0:
                return False
            del self._mappings[alloc_id]
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
            # Claimed by a record in the journal: the caller pays for a few
            # bytes of shared memory, not a socket message.
            self._note(_CLAIM, desc.lease_id, desc.alloc_id)
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
                self._note(_RELEASE, desc.lease_id, -1)
                raise
        event = None
        if desc.event:
            try:
                event = self._event(desc.event, mapping.device)
            except BaseException:
                self._note(_RELEASE, desc.lease_id, desc.alloc_id)
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

    def _event(self, handle: bytes, device: int | None) -> Any:
        """A sharer's ready event (the owner's, or a re-sharing process's), opened once
        per process: each sharer records a few per device in turn."""
        assert device is not None
        key = (handle, device)
        event = self._events.get(key)
        if event is None:
            event = _cuda.event_open(handle, device)
            with self._map_lock:
                event, duplicate = self._events.setdefault(key, event), event
            if duplicate is not event:  # another thread opened it first
                _cuda.event_destroy(duplicate, device)
        return event

    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    def close(self) -> None:
        """Flush releases, close the connection, unmap everything."""
        self._wake.put(None)
        self._writer.join(timeout=5.0)
        self._mark_gone("this process closed its connection to the owner (Manager shut down, or exiting)")
        try:
            # Shut down before closing: the reader thread is blocked reading this
            # socket, and a close alone would neither wake it nor send EOF.
            shutdown_socket(self.conn.fileno())
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5.0)
        try:
            self.conn.close()
            self._sock.close()
        except OSError:
            pass
        with self._journal_lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()
        with self._map_lock:
            events, self._events = self._events, {}
        for (_, device), event in events.items():
            try:
                _cuda.event_destroy(event, device)
            except Exception:
                log.exception("gpushare: destroying an opened event failed")
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
    return link_for(desc.address, desc.owner_token).attach(desc)


def link_for(address: str, token: bytes, authkey: bytes | None = None) -> Link:
    """This process's link to the owner ``token`` (made on first use). ``authkey``
    defaults to the process authkey, which processes of the Manager's tree share;
    others (Ray workers) are given the owner's."""
    link = _links.get(token)
    if link is None or link.gone is not None:
        with _links_lock:
            link = _links.get(token)
            if link is None or link.gone is not None:
                key = bytes(current_process().authkey) if authkey is None else authkey
                link = Link(address, token, key)
                _links[token] = link
    return link


def link_stats() -> dict[str, Any]:
    """Per-process figures of the consumer side (opens, cached mappings)."""
    return {
        "owners": len(_links),
        "open_mappings": sum(link.open_mappings for link in _links.values()),
        "opens": {name: _backends.get(name).opens for name in _backends._instances},
    }


def close_link(token: bytes) -> None:
    """Release every lease this process holds from one owner and close that connection."""
    with _links_lock:
        link = _links.pop(token, None)
    if link is not None:
        link.close()


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
