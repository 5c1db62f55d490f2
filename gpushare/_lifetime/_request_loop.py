"""The owner's service: one handler per consumer connection, plus housekeeping.

Each connection authenticates and speaks the lease protocol (:data:`~._protocol.LEASE`,
served by :class:`gpushare._service.Server`). It says :class:`~._protocol.Hello` first
(with the owner token it expects, and its journal's fd); before each message the owner
reads that consumer's journal, so its records count before anything it sent after them.
When the connection closes (exit, crash, SIGKILL) everything the consumer held is
released at once. Housekeeping (every 0.2 s, and at once when a transient allocation
falls unused) reads the journals, expires leases never claimed within ``lease_timeout``
and frees unused transient allocations and what the pool holds over its limit.

The service decides nothing about leases or memory itself: it hands each message to
the part of the :class:`~gpushare._lifetime._owner.Owner` it concerns (the lease table,
the unmapper, the pool), and the requests a process makes of the owner as a whole
(``Alloc``, ``Stats``, ``Trim``, ``Shutdown``) to the functions the Owner gave it.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

from .._errors import DescriptorError, GpushareError, LeaseExpiredWarning, ManagerClosedError
from .._service import Channel, Err, Handler, Ok, OkFd, Server, handles
from ._protocol import (
    LEASE,
    SHUT_BEFORE_CLAIM,
    Alloc,
    Batch,
    Bye,
    Claim,
    ClaimFailed,
    Drain,
    ExportFd,
    Hello,
    JournalReader,
    LeaseVia,
    Refused,
    Shutdown,
    Stats,
    Trim,
    Unmapped,
    log,
    warn,
)
from ._records import AllocationPool, Consumers, LeaseTable, OwnerState, Peer
from ._unmapper import Unmapper

__all__ = ["HOUSEKEEPING_INTERVAL", "RequestLoop"]

HOUSEKEEPING_INTERVAL = 0.2

#: What the Owner serves as requests of another process: ``Alloc``, ``Stats``, ``Trim``
#: (called with the request's fields after ``req``) and ``Shutdown`` (with its timeout and
#: a function that answers the asker, called just before the owner says Bye to everyone).
Calls = dict[type, Callable[..., Any]]


class RequestLoop:
    """Serving consumers: the socket service, a peer's end, housekeeping."""

    def __init__(
        self,
        state: OwnerState,
        token: bytes,
        authkey: bytes,
        leases: LeaseTable,
        pool: AllocationPool,
        unmapper: Unmapper,
        consumers: Consumers,
        calls: Calls,
    ) -> None:
        self._state = state
        self._token = token  # the Hello of a consumer that expects another owner is refused
        self._leases = leases
        self._pool = pool
        self._unmapper = unmapper
        self._consumers = consumers
        self._calls = calls
        self._conn_ids = itertools.count(1)
        self._stop = threading.Event()
        self._kick = threading.Event()  # housekeeping now: a transient allocation is unused
        pool.kick = self._kick.set
        self._server = Server("owner", authkey, LEASE, self._connect)
        self.address = self._server.address
        self._housekeeper = threading.Thread(target=self._housekeeping, name="gpushare-owner-housekeeping", daemon=True)
        self._housekeeper.start()

    def close(self) -> None:
        """Stop accepting and stop housekeeping (connections end when the owner says ``Bye``)."""
        self._stop.set()
        self._kick.set()
        self._server.close()
        if threading.current_thread() is not self._housekeeper:
            self._housekeeper.join(timeout=2.0)

    def _connect(self, channel: Channel) -> _Consumer | None:
        """A new connection: a peer of this owner, unless the owner is closed."""
        peer = Peer(next(self._conn_ids), channel)
        with self._state.lock:
            if not self._consumers.add_locked(peer):
                peer.send(Bye(SHUT_BEFORE_CLAIM))
                return None
        return _Consumer(self, peer)

    def drop_peer(self, peer: Peer) -> None:
        """The peer's connection closed (exit, crash, SIGKILL): release all it held."""
        with self._state.lock:
            self._leases.drop_holder_locked(peer.conn_id)
            self._consumers.remove_locked(peer.conn_id)
            self._unmapper.peer_gone_locked(peer.conn_id)

    def send_refusals(self) -> None:
        """Tell consumers which of their journalled claims the lease table refused."""
        for holder, lease_id, why in self._leases.refusals():
            peer = self._consumers.get(holder)
            if peer is not None:
                peer.send(ClaimFailed(lease_id, why))

    # -- housekeeping -------------------------------------------------------------------
    def _housekeeping(self) -> None:
        state = self._state
        while True:
            if self._kick.wait(HOUSEKEEPING_INTERVAL):
                self._kick.clear()
            if self._stop.is_set():
                break
            with state.lock:
                expired = self._leases.expire_locked()  # reads the journals first
                unused = self._pool.to_free()
            self.send_refusals()
            for lease in expired:
                if lease.quiet:  # a Ray object's, or read through: its expiry is the end of its use
                    log.debug("gpushare: lease %d (quiet) expired", lease.lease_id)
                    continue
                warn(
                    f"gpushare: a lease on allocation {lease.record.alloc_id} ({lease.record.label}) was never "
                    f"claimed within {self._leases.timeout:g} s and expired; the pickled buffer was probably "
                    "dropped. Unpickling it now raises DescriptorError",
                    LeaseExpiredWarning,
                )
            for record in unused:
                self._unmapper.destroy(record)


class _Consumer(Handler):
    """One consumer's connection: each message of the lease protocol, handed to the part it concerns."""

    def __init__(self, loop: RequestLoop, peer: Peer) -> None:
        self.peer = peer
        self._loop = loop
        self._state = loop._state
        self._leases = loop._leases
        self._unmapper = loop._unmapper
        self._calls = loop._calls

    def on_message(self, message: Any) -> None:
        with self._state.lock:  # its records come before anything it sends after them
            self._leases.read_journal_locked(self.peer.conn_id)
        super().on_message(message)
        self._loop.send_refusals()

    def on_unknown(self, message: Any) -> None:
        log.warning("gpushare: ignoring unknown message %.200r from pid %s", message, self.peer.pid)

    def on_close(self) -> None:
        self._loop.drop_peer(self.peer)
        self.peer.close()

    @handles(Hello)
    def _hello(self, message: Hello) -> None:
        peer = self.peer
        peer.pid = int(message.pid)
        journal_fd = message.journal_fd
        if message.token != self._loop._token:
            if journal_fd is not None:
                os.close(journal_fd)
            peer.send(
                Refused(
                    f"this buffer's descriptor names another Manager than the one serving {self._loop.address} "
                    "(the bytes were altered, or mixed up between Managers); send the buffer again"
                )
            )
            peer.channel.shutdown()
            return
        if journal_fd is not None:
            journal = JournalReader(journal_fd)
            with self._state.lock:
                self._leases.add_journal_locked(peer.conn_id, journal)

    @handles(Batch)
    def _batch(self, message: Batch) -> None:
        peer = self.peer
        leases = self._leases
        refused = []
        with self._state.lock:
            for lease_id in message.claims:
                try:
                    leases.claim_locked(lease_id, None, peer.conn_id)
                except DescriptorError as exc:
                    refused.append((lease_id, str(exc)))
            for lease_id in message.releases:
                leases.release_locked(lease_id, peer.conn_id)
            leases.catch_up_locked()
        for lease_id, why in refused:
            peer.send(ClaimFailed(lease_id, why))

    @handles(Claim)
    def _claim(self, message: Claim) -> None:
        # A first arrival waits for this answer: its own journal was read above, and
        # no other consumer's record bears on it (a rival claim of the same lease is
        # refused if read second), so the other journals wait for the next reader
        # (every 0.2 s at most, the housekeeper).
        try:
            with self._state.lock:
                self._leases.catch_up_locked(journals=False)
                self._leases.claim_locked(message.lease, message.alloc, self.peer.conn_id)
            self.peer.send(Ok(message.req, None))
        except DescriptorError as exc:
            self.peer.send(Err(message.req, str(exc)))

    @handles(LeaseVia)
    def _lease_via(self, message: LeaseVia) -> None:
        # Re-sharing a buffer this peer received: it must hold the lease it received
        # it under, or have its claim of that lease still in flight.
        peer = self.peer
        try:
            lease_id = self._leases.lease_via(
                message.alloc, message.generation, message.via, peer.conn_id, message.claims
            )
        except (DescriptorError, ManagerClosedError) as exc:
            peer.send(Err(message.req, str(exc)))
            return
        peer.send(Ok(message.req, lease_id))

    @handles(ExportFd)
    def _export_fd(self, message: ExportFd) -> None:
        """The fd-based backends' allocation (or pool) fd, only for an allocation the peer holds a lease on."""
        peer, req, alloc_id = self.peer, message.req, message.alloc
        with self._state.lock:
            record = self._leases.held_record_locked(peer.conn_id, alloc_id)
        if record is None:
            peer.send(Err(req, f"allocation {alloc_id} is not leased to this process"))
            return
        try:
            fd = record.backend.export_fd(record.allocation)
        except Exception as exc:  # a driver error must reach the consumer, not kill this thread
            peer.send(Err(req, f"the owner could not export allocation {alloc_id}: {exc}"))
            return
        peer.send(OkFd(req, fd))

    @handles(Unmapped)
    def _unmapped(self, message: Unmapped) -> None:
        with self._state.lock:
            self._unmapper.answered_locked(self.peer.conn_id, message.alloc, message.ok)

    @handles(Drain)
    def _drain(self, message: Drain) -> None:
        pass  # the journal was read before this message was handled

    @handles(Alloc, Stats, Trim, Shutdown)
    def _call(self, message: Alloc | Stats | Trim | Shutdown) -> None:
        # On a thread of its own: a call may unmap (trim, an out-of-memory retry, shutdown),
        # and this peer's own Unmapped answers arrive on the connection this thread reads.
        threading.Thread(target=self._serve_call, args=(message,), name="gpushare-owner-call", daemon=True).start()

    def _serve_call(self, message: Alloc | Stats | Trim | Shutdown) -> None:
        """A request another process makes of this owner as a whole: allocate memory for
        it (``Alloc``: a descriptor under a new lease, which it claims like any), report
        ``Stats``, ``Trim`` the pool, ``Shutdown`` (answered just before the owner says Bye
        to everyone, the asker included). Any error goes back to the caller as ``Err``."""
        peer, req = self.peer, message.req
        call = self._calls[type(message)]
        if type(message) is Shutdown:
            call(message.timeout, lambda messages: peer.send(Ok(req, messages)))
            return
        try:
            value = call(*message[1:])
        except (GpushareError, MemoryError, ValueError) as exc:
            peer.send(Err(req, f"{type(exc).__name__}: {exc}"))
            return
        peer.send(Ok(req, value))
