"""The owner's request loop: one thread per consumer connection, plus housekeeping.

Each connection authenticates (:mod:`gpushare._authsocket`), says ``hello``
(with the owner token it expects, and its journal's fd), then sends the
messages listed in :mod:`gpushare._lifetime`; before each one the owner reads
that consumer's journal, so its records count before anything it sent after
them. When the connection closes (exit, crash, SIGKILL) everything the
consumer held is released at once. Housekeeping (every 0.2 s, and at once
when a transient allocation falls unused) reads the journals, expires leases
never claimed within ``lease_timeout`` and frees unused transient
allocations and what the pool holds over its limit.

The loop decides nothing about leases or memory itself: it hands each
message to the part of the :class:`~gpushare._lifetime._owner.Owner` it concerns
(the lease table, the unmapper, the pool), and the requests a process makes
of the owner as a whole (``alloc``, ``stats``, ``trim``, ``shutdown``) to the
functions the Owner gave it.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError, reduction
from typing import Any

from .. import _journal
from .._authsocket import UnixListener, accept, shutdown_socket
from .._errors import DescriptorError, GpushareError, LeaseExpiredWarning, ManagerClosedError
from ._alloc_pool import AllocationPool
from ._lease_table import LeaseTable
from ._protocol import log, warn
from ._records import OwnerState, Peer
from ._unmapper import Unmapper

__all__ = ["HOUSEKEEPING_INTERVAL", "RequestLoop"]

HOUSEKEEPING_INTERVAL = 0.2


class RequestLoop:
    """Serving consumers: accepting, the per-connection loop, a peer's end, housekeeping."""

    def __init__(
        self,
        state: OwnerState,
        leases: LeaseTable,
        pool: AllocationPool,
        unmapper: Unmapper,
        calls: dict[str, Callable[..., Any]],
    ) -> None:
        self._state = state
        self._leases = leases
        self._pool = pool
        self._unmapper = unmapper
        self._calls = calls  # "alloc", "stats", "trim", "shutdown": the Owner's, served as requests
        self._conn_ids = itertools.count(1)
        self._stop = threading.Event()
        self._kick = threading.Event()  # housekeeping now: a transient allocation is unused
        pool.kick = self._kick.set
        self._listener = UnixListener("owner", self._serve)
        state.address = self._listener.address
        self._housekeeper = threading.Thread(target=self._housekeeping, name="gpushare-owner-housekeeping", daemon=True)
        self._housekeeper.start()

    def close(self) -> None:
        """Stop accepting and stop housekeeping (connections end when the owner says ``bye``)."""
        self._stop.set()
        self._kick.set()
        self._listener.close()
        if threading.current_thread() is not self._housekeeper:
            self._housekeeper.join(timeout=2.0)

    # -- one consumer ---------------------------------------------------------------
    def _serve(self, sock: socket.socket) -> None:
        state = self._state
        try:
            conn = accept(sock, state.authkey)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("gpushare: refused a connection that did not authenticate: %s", exc)
            sock.close()
            return
        peer = Peer(next(self._conn_ids), conn)
        with state.lock:
            if state.closed:
                conn.close()
                return
            state.peers[peer.conn_id] = peer
        try:
            while True:
                message = conn.recv()
                if peer.journal is not None:  # its records come before anything it sends after them
                    with state.lock:
                        self._leases.read_journal_locked(peer)
                self._handle(peer, message)
                self._leases.send_refusals()
        except (EOFError, OSError):
            pass
        except Exception:  # a bug must not leave leases pinned: drop the peer
            log.exception("gpushare: internal error serving a consumer; dropping its connection")
        finally:
            self._drop_peer(peer)
            peer.close()

    def _handle(self, peer: Peer, message: tuple[Any, ...]) -> None:
        kind = message[0]
        state = self._state
        leases = self._leases
        if kind == "batch":
            _, claims, releases = message
            refused = []
            with state.lock:
                for lease_id in claims:
                    try:
                        leases.claim_locked(lease_id, None, peer.conn_id)
                    except DescriptorError as exc:
                        refused.append((lease_id, str(exc)))
                for lease_id in releases:
                    leases.release_locked(lease_id, peer.conn_id)
                leases.catch_up_locked()
            for lease_id, why in refused:
                peer.send(("claim_failed", lease_id, why))
        elif kind == "claim":
            # A first arrival waits for this answer: its own journal was read above, and
            # no other consumer's record bears on it (a rival claim of the same lease is
            # refused if read second), so the other journals wait for the next reader
            # (every 0.2 s at most, the housekeeper).
            _, req, lease_id, alloc_id = message
            try:
                with state.lock:
                    leases.catch_up_locked(journals=False)
                    leases.claim_locked(lease_id, alloc_id, peer.conn_id)
                peer.send(("ok", req, None))
            except DescriptorError as exc:
                peer.send(("err", req, str(exc)))
        elif kind == "lease":
            # Re-sharing a buffer this peer received: it must hold the lease it received
            # it under, or have its claim of that lease still in flight.
            _, req, alloc_id, generation, via = message
            try:
                peer.send(("ok", req, leases.lease_via(alloc_id, generation, via, peer.conn_id)))
            except (DescriptorError, ManagerClosedError) as exc:
                peer.send(("err", req, str(exc)))
        elif kind == "fd":
            self._send_fd(peer, message[1], message[2])
        elif kind == "unmapped":
            _, alloc_id, ok = message
            with state.lock:
                self._unmapper.answered_locked(peer, alloc_id, ok)
        elif kind == "drain":
            pass  # the journal was read above
        elif kind in self._calls:
            # On a thread of its own: a call may unmap (trim, an out-of-memory retry, shutdown),
            # and this peer's own "unmapped" answers arrive on the connection this thread reads.
            threading.Thread(
                target=self._serve_call,
                args=(peer, kind, message[1], message[2:]),
                name="gpushare-owner-call",
                daemon=True,
            ).start()
        elif kind == "hello":
            self._hello(peer, message)
        else:
            log.warning("gpushare: ignoring unknown message %r from pid %s", kind, peer.pid)

    def _serve_call(self, peer: Peer, kind: str, req: int, args: tuple[Any, ...]) -> None:
        """A request another process makes of this owner as a whole: allocate memory for
        it (``alloc``: a descriptor under a new lease, which it claims like any), report
        ``stats``, ``trim`` the pool, ``shutdown`` (answered just before the owner says bye
        to everyone, the asker included). Any error goes back to the caller as ``err``."""
        if kind == "shutdown":
            self._calls["shutdown"](args[0], lambda messages: peer.send(("ok", req, messages)))
            return
        try:
            value = self._calls[kind](*args)
        except (GpushareError, MemoryError, ValueError) as exc:
            peer.send(("err", req, f"{type(exc).__name__}: {exc}"))
            return
        peer.send(("ok", req, value))

    def _send_fd(self, peer: Peer, req: int, alloc_id: int) -> None:
        """The fd-based backends' allocation (or pool) fd, only for an allocation the peer holds a lease on."""
        with self._state.lock:
            record = self._state.records.get(alloc_id)
            held = record is not None and self._leases.holds_locked(peer, record)
        if record is None or not held:
            peer.send(("err", req, f"allocation {alloc_id} is not leased to this process"))
            return
        try:
            fd = record.backend.export_fd(record.allocation)
        except Exception as exc:  # a driver error must reach the consumer, not kill this thread
            peer.send(("err", req, f"the owner could not export allocation {alloc_id}: {exc}"))
            return
        peer.send_fd(req, fd)

    def _hello(self, peer: Peer, message: tuple[Any, ...]) -> None:
        _, pid, token, has_journal = message
        peer.pid = int(pid)
        journal_fd = reduction.recvfds(peer.socket(), 1)[0] if has_journal else None
        if token != self._state.token:
            if journal_fd is not None:
                os.close(journal_fd)
            peer.send(
                (
                    "refused",
                    f"this buffer's descriptor names another Manager than the one serving {self._state.address} "
                    "(the bytes were altered, or mixed up between Managers); send the buffer again",
                )
            )
            shutdown_socket(peer.conn.fileno())
            return
        if journal_fd is not None:
            journal = _journal.JournalReader(journal_fd)
            with self._state.lock:
                peer.journal = journal

    def _drop_peer(self, peer: Peer) -> None:
        """The peer's connection closed (exit, crash, SIGKILL): release all it held."""
        leases = self._leases
        with self._state.lock:
            if peer.journal is not None:
                leases.read_journal_locked(peer)  # claims it made before it went count, then go
            self._state.peers.pop(peer.conn_id, None)
            for lease_id in list(peer.leases):
                leases.release_locked(lease_id, peer.conn_id)
            self._unmapper.peer_gone_locked(peer)

    # -- housekeeping -------------------------------------------------------------------
    def _housekeeping(self) -> None:
        state = self._state
        while True:
            if self._kick.wait(HOUSEKEEPING_INTERVAL):
                self._kick.clear()
            if self._stop.is_set():
                break
            with state.lock:
                self._leases.catch_up_locked()
                expired = self._leases.expire_locked()
                unused = self._pool.to_free()
            self._leases.send_refusals()
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
