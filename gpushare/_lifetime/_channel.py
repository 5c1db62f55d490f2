"""A consumer's connection to one owner: requests and replies, and the owner's unmap requests.

:meth:`_Channel.request` sends ``(kind, req, ...)`` and waits (up to ``REQUEST_TIMEOUT``)
for the reader thread (:meth:`_Channel._read_loop`) to hand it ``ok``, ``err`` or ``okfd``
(then the fd itself, by SCM_RIGHTS); :meth:`_Channel.ask` and :meth:`_Channel.answer` are
its two halves, for a caller with work to do while the owner answers. The owner serves a
connection's messages in the order they were sent. The reader also answers ``unmap``
(closing the mapping if no buffer of this process uses it), records ``claim_failed``
refusals, and on ``bye``, ``refused`` or a closed socket marks the owner gone, waking
every waiter."""

from __future__ import annotations

import collections
import itertools
import os
import queue
import socket
import threading
from multiprocessing import connection, reduction
from typing import Any

from .. import _backends, _journal
from .._errors import DescriptorError, OwnerGoneError
from ._common import REQUEST_TIMEOUT, log


class _LinkState:
    """The state a :class:`~gpushare._lifetime.Link` keeps, shared by its parts
    (set by :meth:`Link.__init__`; see there for what each field holds)."""

    token: bytes
    conn: connection.Connection
    gone: str | None
    refused: str | None
    _address: str
    _sock: socket.socket
    _send_lock: threading.Lock
    _map_lock: threading.Lock
    _mappings: dict[int, _backends.Mapping]
    _failed: dict[int, str]
    _held: set[int]
    _waiting: dict[int, list[Any]]
    _wait_lock: threading.Lock
    _reqs: itertools.count[int]
    _journal: _journal.JournalWriter | None
    _backlog: collections.deque[tuple[int, int, int, bool]]
    _nudged_at: int
    _wake: queue.SimpleQueue[int | None]
    _retired: bool

    def _retire_if_unused(self) -> None:  # Link's (it knows the process's table of links)
        raise NotImplementedError


class _Channel(_LinkState):
    """Requests to the owner, the reader thread, and answering its unmap requests."""

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError) as exc:
            self._mark_gone(f"connection lost: {exc}")
            # An owner that refused this process (the descriptor named another Manager)
            # says so and closes: a send can fail before the reader thread has read why.
            reader = getattr(self, "_reader", None)
            if reader is not None and reader is not threading.current_thread():
                reader.join(timeout=1.0)
            if self.refused is not None:
                raise DescriptorError(self.refused) from exc
            raise OwnerGoneError(f"the owner of this buffer is gone ({self.gone})") from exc

    def request(self, kind: str, *args: Any) -> Any:
        return self.answer(self.ask(kind, *args))

    def ask(self, kind: str, *args: Any) -> list[Any]:
        """Send a request without waiting; :meth:`answer` waits for its reply. Requests
        are served in the order they were sent, so a later one may depend on it."""
        if self.refused is not None:
            raise DescriptorError(self.refused)
        if self.gone is not None:
            raise OwnerGoneError(f"the owner of this buffer is gone ({self.gone})")
        req = next(self._reqs)
        slot: list[Any] = [threading.Event(), None, None, req]
        with self._wait_lock:
            self._waiting[req] = slot
        try:
            self._send((kind, req, *args))
        except BaseException:
            with self._wait_lock:
                self._waiting.pop(req, None)
            raise
        return slot

    def answer(self, slot: list[Any]) -> Any:
        """The reply to a request made with :meth:`ask` (raises what the owner refused)."""
        try:
            if not slot[0].wait(REQUEST_TIMEOUT):
                raise OwnerGoneError(f"the owner of this buffer did not answer within {REQUEST_TIMEOUT:g} s")
        finally:
            with self._wait_lock:
                self._waiting.pop(slot[3], None)
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
                    self._retire_if_unused()
                    return
                elif kind == "refused":
                    self.refused = message[1]
                    self._mark_gone(message[1])
                    return
        except (EOFError, OSError):
            self._mark_gone("its process exited or closed the connection")
            self._retire_if_unused()

    def _mark_gone(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason
        with self._wait_lock:
            for slot in self._waiting.values():
                slot[0].set()

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
