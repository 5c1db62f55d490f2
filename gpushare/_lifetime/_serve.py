"""The owner's socket service: one thread per consumer connection, plus housekeeping.

Each connection authenticates (:mod:`gpushare._service`), says ``hello`` (with the owner
token it expects, and its journal's fd), then sends the messages listed in
:mod:`gpushare._lifetime`; before each one the owner reads that consumer's journal. When the
connection closes (exit, crash, SIGKILL) everything the consumer held is released at once.
Housekeeping (every 0.2 s) reads the journals, expires leases never claimed within
``lease_timeout`` and frees what the pool holds over its limit.
"""

from __future__ import annotations

import os
import socket
import time
from multiprocessing import AuthenticationError, reduction
from typing import Any

from .. import _journal
from .._errors import DescriptorError, LeaseExpiredWarning, ManagerClosedError
from .._service import accept, shutdown_socket
from ._common import _warn, log
from ._records import _Lease, _Peer
from ._unmap import _Unmapper


class _Service(_Unmapper):
    """Serving consumers: the connection loop, the message handler, a peer's end, housekeeping."""

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
            # A first arrival waits for this answer: its own journal was read above, and
            # no other consumer's record bears on it (a rival claim of the same lease
            # is refused if read second), so the other journals wait for the next
            # reader (every 0.2 s at most, the housekeeper).
            _, req, lease_id, alloc_id = message
            try:
                with self._lock:
                    self._drain_locked(journals=False)
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
