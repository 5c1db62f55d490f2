"""The trainer's end of a tensor set: version states, the readers' service, publishing.

See :mod:`gpushare._fanout` for the protocol and :class:`~._tensor_set.TensorSet`
for the public handle. One thread per reader (readers are engines: few)
serves its registration and then its requests; the trainer's threads pick
versions to write and publish them.

State of each version (``slot``), kept here under ``_lock``:

* ``FREE`` (published or never written) or ``WRITING`` (a ``publish()``
  copying into it, or a draft being filled);
* which readers hold it (``_holders``), as far as their release words said
  when last read -- each reader's grants (``slot -> grant id``) are the
  truth, read from its release words (``Channel.released``) whenever the
  producer needs current state: before it grants that reader a version,
  before it picks a version to write, for ``stats()``;
* which readers recorded a release event for their reads of it
  (``_last``): the next write of that version waits for them on the GPU.

``_latest`` is the version readers are granted, or -1 while there is none
(nothing published yet, or the only unheld version was taken to be
rewritten: readers that ask meanwhile wait for the new one to land).

Locks: ``_io`` serialises the trainer's threads that wait for a free
version (they poll the one release eventfd); ``_lock`` guards the state
above and the reader table, and is held for driver calls on readers'
events (waits and queries by the trainer, destruction when a reader goes)
so that an event is never destroyed under a wait. Order: ``_io`` before
``_lock``. Finalizers (a draft dropped unpublished) only enqueue and wake.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import select
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing import AuthenticationError, connection, reduction
from typing import Any

from .. import _cuda
from .._authsocket import UnixListener, accept, socket_timeouts
from .._buffer import Buffer, memory_of
from .._errors import TensorSetClosedError, WaitTimeoutError
from . import _channel
from ._channel import RECORDED, Channel, poke, soak
from ._layout import Layout
from ._wire import REGISTER_TIMEOUT, SEND_TIMEOUT, poll_ms

__all__ = ["LOCAL_PRODUCERS", "LOCAL_RELEASE_EVENTS", "SetProducer"]

log = logging.getLogger("gpushare")

_FREE, _WRITING = 0, 1

#: Producers of this process by address: a reader in the trainer's own process uses their
#: events directly (the driver refuses to open a process's own interprocess events).
LOCAL_PRODUCERS: weakref.WeakValueDictionary[str, SetProducer] = weakref.WeakValueDictionary()
#: Release events of readers in the trainer's own process, by the key their hello carried.
LOCAL_RELEASE_EVENTS: dict[int, list[Any]] = {}


@dataclass(eq=False)
class _Reader:
    rid: int
    conn: connection.Connection
    pid: int
    channel: Channel
    wake: int  # eventfd: publish() and close() wake this reader's thread through it
    events: list[Any]  # its per-version release events, opened here (CUDA)
    own_events: bool  # whether they were opened here (and are destroyed here)
    grants: dict[int, int]  # slot -> the grant id it holds
    next_grant: int = 1
    waiting: bool = False  # its thread waits for a version newer than it has
    dead: bool = False


def _destroy_events(events: list[Any], device: int | str) -> None:
    for event in events:
        try:
            _cuda.event_destroy(event, device)  # type: ignore[arg-type]
        except Exception:
            log.exception("gpushare: destroying a tensor set event failed")


class SetProducer:
    """The trainer's state and service; :class:`~._tensor_set.TensorSet` is its public handle."""

    def __init__(self, buffers: list[Buffer], layout: Layout, authkey: bytes) -> None:
        self.buffers = buffers
        self.layout = layout
        self.n = len(buffers)
        self.authkey = authkey
        self.device = buffers[0].device
        self.cuda = isinstance(self.device, int)
        memory = memory_of(buffers[0])
        self.bases = [memory_of(b).base for b in buffers]  # each version's address here
        # Per-version ready events: recorded when a version is published, waited on by readers.
        self.events: list[Any] = []
        handles: list[bytes] = []
        if self.cuda:
            try:
                for _ in range(self.n):
                    event, handle = _cuda.event_create_ipc(self.device)  # type: ignore[arg-type]
                    self.events.append(event)
                    handles.append(handle)
            except BaseException:
                _destroy_events(self.events, self.device)
                raise
            weakref.finalize(self, _destroy_events, self.events, self.device)
        self._handles = handles
        self.info = {
            "pid": os.getpid(),
            "versions": self.n,
            "layout": layout.to_wire(),
            "owner": (memory.address, memory.owner_token),
        }
        self._lock = threading.Lock()
        self._io = threading.Lock()
        self._state = [_FREE] * self.n
        self._slot_version = [0] * self.n
        self._recorded = [False] * self.n
        self._epoch = [0] * self.n
        self._holders: list[set[_Reader]] = [set() for _ in range(self.n)]
        self._last: list[list[_Reader]] = [[] for _ in range(self.n)]
        self._latest = -1
        self.version = 0
        self._published = 0
        self._registered = 0
        self._readers: dict[int, _Reader] = {}
        self._rids = itertools.count(1)
        self._deferred: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.closed: str | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._release_fd = _channel.eventfd()  # every reader's releases poke it
        # Closed only when the core goes: a finalizer of a draft may still write to them,
        # and a reused fd number must never be.
        for fd in (self._wake_r, self._wake_w, self._release_fd):
            weakref.finalize(self, os.close, fd)
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._poller.register(self._release_fd, select.POLLIN)
        self._listener = UnixListener("tensors", self._serve, backlog=64)
        self.address = self._listener.address
        LOCAL_PRODUCERS[self.address] = self

    # -- one thread per reader: registration, then its requests -------------------------
    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = accept(sock, self.authkey, REGISTER_TIMEOUT)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("gpushare: a tensor set reader failed to register: %s", exc)
            return
        reader = self._register(conn)
        if reader is None:
            return
        try:
            self._loop(reader)
        except (EOFError, OSError):
            pass  # the reader exited, died or closed: its versions are free again
        except Exception:
            log.exception("gpushare: serving a tensor set reader (pid %s) failed; dropping it", reader.pid)
        finally:
            self._drop(reader)

    def _register(self, conn: connection.Connection) -> _Reader | None:
        channel: Channel | None = None
        events: list[Any] = []
        own = True
        wake = -1
        try:
            socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
            hello = conn.recv()
            pid, key = int(hello[1]), int(hello[2])
            if self.closed is not None:
                conn.send(self._closed_message())
                conn.close()
                return None
            channel = Channel.create(self.n)
            # One lease per version, claimed by the reader (mapped once); then its channel.
            conn.send(("versions", self.buffers, self._handles))
            with socket.socket(fileno=os.dup(conn.fileno())) as raw:
                reduction.sendfds(raw, [channel.fd, self._release_fd])
            os.close(channel.fd)  # the mapping stays; the reader has its own fd
            channel.fd = -1
            reply = conn.recv()
            if not (isinstance(reply, tuple) and reply and reply[0] == "ready"):
                raise EOFError("the reader did not confirm its registration")
            if self.cuda:
                if pid == os.getpid():  # a reader in this process: its events, as they are
                    events, own = LOCAL_RELEASE_EVENTS.pop(key, []), False
                else:
                    for handle in reply[1]:
                        events.append(_cuda.event_open(handle, self.device))  # type: ignore[arg-type]
            socket_timeouts(conn.fileno(), 0, SEND_TIMEOUT)
            wake = _channel.eventfd()
        except Exception as exc:  # e.g. the set closed while its versions were being pickled
            log.warning("gpushare: a tensor set reader failed to register: %r", exc)
            self._discard(conn, channel, wake, events if own else [])
            return None
        with self._lock:
            if self.closed is None:
                reader = _Reader(next(self._rids), conn, pid, channel, wake, events, own, {})
                self._readers[reader.rid] = reader
                self._registered += 1
            else:
                reader = None
        if reader is None:
            try:
                conn.send(self._closed_message())
            except OSError:
                pass
            self._discard(conn, channel, wake, events if own else [])
            return None
        try:
            conn.send(("registered",))
        except OSError:
            self._drop(reader)
            return None
        return reader

    def _discard(self, conn: connection.Connection, channel: Channel | None, wake: int, events: list[Any]) -> None:
        conn.close()
        if channel is not None:
            channel.close()
        if wake >= 0:
            os.close(wake)
        _destroy_events(events, self.device)

    def _loop(self, reader: _Reader) -> None:
        """Serve ``reader`` until it goes (EOFError/OSError) or the set closes."""
        conn = reader.conn
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        poller.register(reader.wake, select.POLLIN)
        while True:
            if self.closed is not None:
                self._send_closed(reader)
                return
            readable = False
            for fd, _ in poller.poll():
                if fd == reader.wake:
                    soak(fd)
                else:
                    readable = True
            if not readable:
                continue
            message = conn.recv()  # EOFError when the reader went
            if isinstance(message, tuple) and len(message) == 3 and message[0] == "take":
                self._take(reader, poller, int(message[1]), message[2])
            else:
                log.warning("gpushare: unexpected message from tensor set reader pid %s; dropping it", reader.pid)
                return

    def _take(self, reader: _Reader, poller: Any, newer_than: int, timeout: float | None) -> None:
        """Answer one take: grant the latest version once it is newer than ``newer_than``."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        conn = reader.conn
        while True:
            with self._lock:
                self._collect(reader)
                reply: tuple[Any, ...] | None = None
                if self.closed is None and self._latest >= 0 and self.version > newer_than:
                    slot = self._latest
                    grant = reader.grants.get(slot)
                    if grant is None:  # a new hold (one already held is granted again as it is)
                        grant = reader.next_grant
                        reader.next_grant = grant + 1
                        reader.grants[slot] = grant
                        self._holders[slot].add(reader)
                    reply = ("grant", self.version, slot, grant, self._recorded[slot])
                    reader.waiting = False
                elif self.closed is None:
                    reader.waiting = True
                latest = self.version
            if self.closed is not None:
                reader.waiting = False
                self._send_closed(reader)
                raise EOFError("closed")
            if reply is not None:
                conn.send(reply)
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                with self._lock:
                    reader.waiting = False
                conn.send(
                    (
                        "timeout",
                        f"no version newer than {newer_than} was published within {timeout:g} s (the trainer, "
                        f"pid {os.getpid()}, has published {latest} so far)",
                    )
                )
                return
            for fd, _ in poller.poll(poll_ms(remaining)):
                if fd == reader.wake:
                    soak(fd)
                else:  # nothing may come while a take waits: EOF, or a broken reader
                    conn.recv()
                    raise EOFError("protocol: a request while a take waited")

    def _closed_message(self) -> tuple[Any, ...]:
        with self._lock:
            slot = self._latest
            return ("closed", self.closed, self.version, slot, self._recorded[slot] if slot >= 0 else False)

    def _send_closed(self, reader: _Reader) -> None:
        try:
            reader.conn.send(self._closed_message())
        except OSError:
            pass

    # -- releases and readers that go (under _lock) ------------------------------------
    def _collect(self, reader: _Reader) -> None:
        """Apply the release words ``reader`` wrote. Under _lock."""
        grants = reader.grants
        if not grants or reader.dead:
            return
        for slot, grant in tuple(grants.items()):
            word = reader.channel.released(slot, grant)
            if word:
                del grants[slot]
                self._holders[slot].discard(reader)
                if word & RECORDED and reader not in self._last[slot]:
                    self._last[slot].append(reader)

    def _drop(self, reader: _Reader) -> None:
        """The reader exited, died, closed or broke the protocol: everything it held is free."""
        with self._lock:
            if reader.dead:
                return
            self._collect(reader)  # what it released before it went still counts (its events)
            reader.dead = True
            self._readers.pop(reader.rid, None)
            for slot in reader.grants:
                self._holders[slot].discard(reader)
            reader.grants.clear()
            reader.conn.close()
            reader.channel.close()
            wake, reader.wake = reader.wake, -1
            if wake >= 0:
                os.close(wake)
            # Its release events go too (under _lock, where the trainer waits on them: a
            # wait already queued completes normally, the driver defers the destroy).
            events, reader.events = reader.events, []
            if reader.own_events:
                _destroy_events(events, self.device)
        log.info("gpushare: tensor set reader pid %s is gone; its versions are free again", reader.pid)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except OSError:  # pipe full (already woken) or closed
            pass

    def unpublished(self, slot: int, epoch: int) -> None:
        """Finalizer of a draft that was neither published nor released: its version is free again."""
        self._deferred.put((slot, epoch))
        self._wake()

    def _apply_deferred(self) -> None:
        """Free the versions of drafts given back unpublished. Under _lock."""
        deferred = self._deferred
        while not deferred.empty():
            slot, epoch = deferred.get_nowait()
            if self._state[slot] == _WRITING and self._epoch[slot] == epoch:
                self._state[slot] = _FREE

    # -- the trainer's side -------------------------------------------------------------
    def _pick(self) -> int | None:
        """A version no reader holds and nobody writes, not the latest if another is free. Under _lock."""
        self._apply_deferred()
        for reader in tuple(self._readers.values()):
            self._collect(reader)
        free = [s for s in range(self.n) if self._state[s] == _FREE and not self._holders[s]]
        others = [s for s in free if s != self._latest]
        if others:
            return min(others, key=self._slot_version.__getitem__)  # the oldest
        return free[0] if free else None

    def acquire(self, timeout: float | None, wait_stream: int | None) -> tuple[int, int]:
        """A version to write: ``(slot, epoch)``. Waits while every version is held or written;
        on CUDA ``wait_stream`` is made to wait for the reads of the version's readers."""
        io = self._io
        if not io.acquire(False) and not io.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            raise WaitTimeoutError(f"waited {timeout:g} s for another thread writing this tensor set")
        try:
            deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
            while True:
                with self._lock:
                    if self.closed is not None:
                        raise self._closed_error()
                    slot = self._pick()
                    if slot is not None:
                        self._state[slot] = _WRITING
                        epoch = self._epoch[slot] = self._epoch[slot] + 1
                        if slot == self._latest:
                            self._latest = -1  # readers that ask now wait for the new one
                        readers, self._last[slot] = self._last[slot], []
                        if self.cuda and wait_stream is not None:
                            # The writes wait for the reads of readers that recorded a release
                            # event, unless those reads are done (a GPU wait on another process's
                            # event ties the two contexts' work together: skip it when we can).
                            for reader in readers:
                                if reader.dead or not reader.events:
                                    continue
                                event = reader.events[slot]
                                if not _cuda.event_done(event, self.device):  # type: ignore[arg-type]
                                    _cuda.stream_wait_event(wait_stream, event, self.device)  # type: ignore[arg-type]
                        return slot, epoch
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeoutError(self._busy_message(timeout))
                for fd, _ in self._poller.poll(poll_ms(remaining)):
                    if fd == self._release_fd:
                        soak(fd)
                    else:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
        finally:
            io.release()

    def give_back(self, slot: int, epoch: int) -> None:
        """A version acquired and not published (a draft released, a copy that failed): free again."""
        with self._lock:
            if self._state[slot] == _WRITING and self._epoch[slot] == epoch:
                self._state[slot] = _FREE
        self._wake()

    def still_writing(self, slot: int, epoch: int) -> bool:
        return self._state[slot] == _WRITING and self._epoch[slot] == epoch

    def publish(self, slot: int, epoch: int, recorded: bool) -> int:
        """Make the written version ``slot`` the latest; wake the readers waiting for one."""
        with self._lock:
            if self.closed is not None:
                raise self._closed_error()
            if not self.still_writing(slot, epoch):
                raise ValueError(f"version slot {slot} is not being written by this draft any more")
            version = self.version = self.version + 1
            self._slot_version[slot] = version
            self._recorded[slot] = recorded
            self._state[slot] = _FREE
            self._latest = slot
            self._published += 1
            waiting = [r.wake for r in self._readers.values() if r.waiting and r.wake >= 0]
        for fd in waiting:
            poke(fd)
        return version

    def _closed_error(self) -> TensorSetClosedError:
        return TensorSetClosedError(
            f"this tensor set was closed ({self.closed}); make a new one with manager.tensor_set(...)"
        )

    def _busy_message(self, timeout: float | None) -> str:
        with self._lock:
            held = [
                f"version {self._slot_version[s]} held by pid{'s' if len(h) > 1 else ''} "
                + ", ".join(str(p) for p in sorted({r.pid for r in h}))
                for s, h in enumerate(self._holders)
                if h
            ]
            drafts = self._state.count(_WRITING)
        parts = [f"waited {timeout:g} s for a version no reader holds: all {self.n} versions are busy"]
        if held:
            parts.append("; ".join(held))
        if drafts:
            parts.append(f"{drafts} being written here (publish or release the draft)")
        return (
            ": ".join(parts[:2]) + ("" if len(parts) < 3 else f"; {parts[2]}") + ". Readers must release the "
            "snapshots they take (snap.release(), 'with reader.latest() as snap:', or dropping every view); if "
            "they are only slow, wait longer or make the set with more versions"
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            if self.closed is None:
                self._pick()  # reads every release word and draft given back
            held: dict[int, list[int]] = {}
            for s, holders in enumerate(self._holders):
                if holders:
                    held[self._slot_version[s]] = sorted({r.pid for r in holders})
            return {
                "version": self.version,
                "versions": self.n,
                "latest_available": self._latest >= 0,
                "readers": len(self._readers),
                "reader_pids": sorted(r.pid for r in self._readers.values()),
                "held": held,
                "free": sum(1 for s in range(self.n) if self._state[s] == _FREE and not self._holders[s]),
                "writing": self._state.count(_WRITING),
                "published": self._published,
                "registered": self._registered,
                "closed": self.closed is not None,
            }

    def close(self, reason: str, offer: bool = True) -> None:
        """End the set. ``offer``: readers may still take the latest version (a Manager that
        shuts down offers nothing: its memory is about to go, and readers let theirs go at once)."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = reason
            if not offer:
                self._latest = -1
            wakes = [r.wake for r in self._readers.values() if r.wake >= 0]
        for fd in wakes:  # each reader's thread tells its reader, then ends
            poke(fd)
        self._wake()  # a trainer thread waiting for a free version raises
        self._listener.close()
        LOCAL_PRODUCERS.pop(self.address, None)
        # Drafts and readers hold counts of their own on the memory (their views).
        for b in self.buffers:
            b.release()

    def reader_count(self) -> int:
        with self._lock:
            return len(self._readers)
