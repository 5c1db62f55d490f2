"""A consumer's connection to one owner: requests and replies, and what the owner tells it.

:meth:`OwnerConnection.request` sends ``(kind, req, ...)`` and waits (up to
``REQUEST_TIMEOUT``) for the reader thread to hand it ``ok``, ``err`` or
``okfd`` (then the fd itself, by SCM_RIGHTS); :meth:`~OwnerConnection.ask` and
:meth:`~OwnerConnection.answer` are its two halves, for a caller with work to
do while the owner answers. The owner serves a connection's messages in the
order they were sent.

The reader thread also handles what the owner sends unasked: ``unmap`` (it
asks the link, through ``on_unmap``, to close the mapping if no buffer uses
it, and answers ``unmapped``), ``claim_failed`` (kept in ``failed`` for the
buffer to report), and the end -- ``bye``, ``refused`` or a closed socket --
which marks the owner gone, wakes every waiter and tells the link
(``on_gone``).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError, connection, reduction
from typing import Any

from .._authsocket import connect, shutdown_socket
from .._errors import DescriptorError, OwnerGoneError
from ._protocol import REQUEST_TIMEOUT

__all__ = ["OwnerConnection"]

# A request waiting for its reply: [event, "ok" | "err" | None, value, request id].
_Waiter = list[Any]


class OwnerConnection:
    """This process's authenticated socket to one owner, with its reader thread."""

    def __init__(
        self,
        address: str,
        token: bytes,
        authkey: bytes,
        journal_fd: int | None,
        on_unmap: Callable[[int], bool],
        on_gone: Callable[[], None],
    ) -> None:
        self.address = address
        self.gone: str | None = None  # why the owner is gone, once it is
        self.shut_down = False  # it is gone because its Manager was shut down (its process may live on)
        self.closed_here = False  # it is gone because this process closed the connection
        self.refused: str | None = None  # the owner said the descriptor was not its own
        self.failed: dict[int, str] = {}  # lease id -> why the owner refused an asynchronous claim
        self._on_unmap = on_unmap
        self._on_gone = on_gone
        self._send_lock = threading.Lock()
        self._waiting: dict[int, _Waiter] = {}
        self._wait_lock = threading.Lock()
        self._reqs = itertools.count(1)
        try:
            self.conn: connection.Connection = connect(address, authkey)
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
        self._reader: threading.Thread | None = None
        self.send(("hello", os.getpid(), token, journal_fd is not None))
        if journal_fd is not None:
            try:
                reduction.sendfds(self._sock, [journal_fd])
            except OSError as exc:
                self.mark_gone(f"connection lost: {exc}")
                raise OwnerGoneError(f"cannot reach the owner of this buffer ({exc})") from exc

    def start(self) -> None:
        """Start reading (once the link that owns this connection is ready for its callbacks)."""
        self._reader = threading.Thread(target=self._read_loop, name="gpushare-link-reader", daemon=True)
        self._reader.start()

    # -- sending --------------------------------------------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError) as exc:
            self.mark_gone(f"connection lost: {exc}")
            # An owner that refused this process (the descriptor named another Manager)
            # says so and closes: a send can fail before the reader thread has read why.
            reader = self._reader
            if reader is not None and reader is not threading.current_thread():
                reader.join(timeout=1.0)
            if self.refused is not None:
                raise DescriptorError(self.refused) from exc
            raise self.gone_error() from exc

    def send_quietly(self, message: tuple[Any, ...]) -> None:
        """Send if the owner is still there; a gone owner is no error here (it learns nothing new)."""
        if self.gone is None:
            try:
                self.send(message)
            except OwnerGoneError:
                pass

    def request(self, kind: str, *args: Any) -> Any:
        return self.answer(self.ask(kind, *args))

    def ask(self, kind: str, *args: Any) -> _Waiter:
        """Send a request without waiting; :meth:`answer` waits for its reply. Requests are
        served in the order they were sent, so a later one may depend on it."""
        if self.refused is not None:
            raise DescriptorError(self.refused)
        if self.gone is not None:
            raise self.gone_error()
        req = next(self._reqs)
        waiter: _Waiter = [threading.Event(), None, None, req]
        with self._wait_lock:
            self._waiting[req] = waiter
        try:
            self.send((kind, req, *args))
        except BaseException:
            with self._wait_lock:
                self._waiting.pop(req, None)
            raise
        return waiter

    def answer(self, waiter: _Waiter, timeout: float = REQUEST_TIMEOUT) -> Any:
        """The reply to a request made with :meth:`ask` (raises what the owner refused)."""
        try:
            if not waiter[0].wait(timeout):
                raise OwnerGoneError(f"the owner of this buffer did not answer within {timeout:g} s")
        finally:
            with self._wait_lock:
                self._waiting.pop(waiter[3], None)
        if waiter[1] == "ok":
            return waiter[2]
        if waiter[1] == "err":
            raise DescriptorError(waiter[2])
        if self.refused is not None:
            raise DescriptorError(self.refused)
        raise self.gone_error()

    # -- receiving ------------------------------------------------------------------
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
                        waiter = self._waiting.get(message[1])
                    if waiter is not None:
                        waiter[1], waiter[2] = kind, value
                        waiter[0].set()
                    elif message[0] == "okfd":
                        os.close(value)  # the requester gave up waiting
                elif kind == "unmap":
                    ok = self._on_unmap(message[1])
                    try:
                        self.send(("unmapped", message[1], ok))
                    except OwnerGoneError:
                        return
                elif kind == "claim_failed":
                    self.failed[message[1]] = message[2]
                elif kind == "bye":
                    self.shut_down = True
                    self.mark_gone(message[1])
                    self._on_gone()
                    return
                elif kind == "refused":
                    self.refused = message[1]
                    self.mark_gone(message[1])
                    return
        except (EOFError, OSError):
            self.mark_gone("its process exited or closed the connection")
            self._on_gone()

    def gone_error(self) -> OwnerGoneError:
        """The error for a use of this owner's memory once it is gone, saying which way it went:
        its Manager was shut down (its process may well be running), this process closed the
        connection, or the owner's process exited or stopped answering."""
        if self.shut_down:
            return OwnerGoneError(
                "the Manager that owns this buffer was shut down: it shares no memory any more, and this "
                "buffer's may be freed (the process that made the Manager may still be running). Keep the "
                "Manager open (inside its 'with' block, before shutdown()) until workers are done with its buffers"
            )
        if self.closed_here:
            return OwnerGoneError(
                f"this process closed its connection to the owner of this buffer ({self.gone}); its memory "
                "may no longer be used here"
            )
        return OwnerGoneError(
            f"the process that owns this buffer is gone ({self.gone}); its memory may be freed. Keep the "
            "owner's process and its Manager running until workers are done with its buffers"
        )

    def mark_gone(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason
        with self._wait_lock:
            for waiter in self._waiting.values():
                waiter[0].set()

    def close(self) -> None:
        """Close the connection and wait for the reader thread (unless it is the caller)."""
        if self.gone is None:
            self.closed_here = True
        self.mark_gone("this process's Manager shut down, or it is exiting")
        try:
            # Shut down before closing: the reader thread is blocked reading this socket,
            # and a close alone would neither wake it nor send EOF.
            shutdown_socket(self.conn.fileno())
        except OSError:
            pass
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5.0)
        try:
            self.conn.close()
            self._sock.close()
        except OSError:
            pass
