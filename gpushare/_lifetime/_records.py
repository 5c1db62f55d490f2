"""The owner's records: an allocation (:class:`_Slot`), a lease, a connected consumer (:class:`_Peer`).

Plain data, read and changed only under the owner's lock (a peer's ``send`` takes the
peer's own send lock, so replies never wait for the owner).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from multiprocessing import connection, reduction
from typing import Any

from .. import _backends, _journal


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
