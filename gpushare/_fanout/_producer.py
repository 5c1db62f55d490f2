"""The producer's end of a ring: slot states, registration, publishing, releases.

See :mod:`gpushare._fanout` for the protocol; :class:`~._ring.Ring` is the public handle. Locks: ``_io`` serializes
everything that touches the slot states, consumer channels and sockets or
closes them (acquire, publish, stats, close, dropping a consumer); ``_lock``
guards the consumer table (``_consumers``, and ``_targets``, the tuple of
its values that ``publish`` sends to) and ``closed``, which registration
threads also touch. Order: ``_io`` before ``_lock``. Finalizers only
enqueue and wake (``_deferred``), never take a lock.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import select
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, connection, reduction
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from .. import _cuda
from .._authsocket import UnixListener, accept, socket_timeouts
from .._buffer import Buffer
from .._errors import RingClosedError, WaitTimeoutError
from . import _channel
from ._channel import INLINE_META, RECORDED, Channel, poke, soak
from ._item import RingItem, slot_view
from ._wire import (
    CLOSED,
    MAX_META,
    META,
    REGISTER_TIMEOUT,
    SEND_TIMEOUT,
    SPIN_LOOKS,
    Frames,
    SpinPolicy,
    poll_ms,
    send_frame,
)

__all__ = ["Producer"]

log = logging.getLogger("gpushare")

_FREE, _ACQUIRED, _PUBLISHED = 0, 1, 2


@dataclass(eq=False)
class _Consumer:
    cid: int
    conn: connection.Connection
    pid: int
    frames: Frames
    channel: Channel
    wake: int  # its eventfd: one count per item published to it
    events: list[Any] = field(default_factory=list)  # its per-slot release events, opened here (CUDA)
    head: int = 0  # entries published to it
    dead: bool = False


def _by_cid(consumers: set[_Consumer]) -> list[_Consumer]:
    return sorted(consumers, key=lambda c: c.cid)


def _destroy_events(events: list[Any], device: int | str) -> None:
    for event in events:
        try:
            _cuda.event_destroy(event, device)  # type: ignore[arg-type]
        except Exception:
            log.exception("gpushare: destroying a ring event failed")


class Producer:
    """The producer's state and service; :class:`Ring` is its public handle."""

    def __init__(
        self, buffers: list[Buffer], wanted: int, authkey: bytes, spin: float = 0.0, adaptive: bool = False
    ) -> None:
        self.buffers = buffers
        self._views = [slot_view(b) for b in buffers]  # what each slot's items are made from
        self.n = len(buffers)
        self.wanted = wanted
        self.authkey = authkey
        self.spin = SpinPolicy(spin, adaptive)  # acquire()'s; each consumer has its own
        self.device = buffers[0].device
        self._cuda = isinstance(self.device, int)
        # Per-slot ready events: recorded at publish, waited on by consumers (CUDA only).
        self._events: list[Any] = []
        handles: list[bytes] = []
        if self._cuda:
            try:
                for _ in range(self.n):
                    event, handle = _cuda.event_create_ipc(self.device)  # type: ignore[arg-type]
                    self._events.append(event)
                    handles.append(handle)
            except BaseException:
                _destroy_events(self._events, self.device)
                raise
            # Destroyed only when the core goes: consumers may still wait on them.
            weakref.finalize(self, _destroy_events, self._events, self.device)
        self.info = {
            "slots": self.n,
            "shape": buffers[0].shape,
            "dtype": buffers[0].dtype.str,
            "pid": os.getpid(),
            "spin": spin,
            "adaptive": adaptive,
        }
        self._handles = handles
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._io = threading.Lock()
        self._state = [_FREE] * self.n
        self._seq = [0] * self.n
        self._epoch = [0] * self.n
        self._holders: list[set[_Consumer]] = [set() for _ in range(self.n)]
        # Who read a slot's last publication and recorded a release event for it (CUDA:
        # their reads were still queued); acquire() orders the next write after them.
        self._last: list[list[_Consumer]] = [[] for _ in range(self.n)]
        self._busy: set[int] = set()  # published slots some consumer still holds
        self._free = collections.deque(range(self.n))
        self._consumers: dict[int, _Consumer] = {}
        self._targets: tuple[_Consumer, ...] = ()  # _consumers' values, what publish() sends to
        self._version = 0  # bumped whenever _consumers changes; the poller follows it
        self._registered = 0
        self._published = 0
        self._cids = itertools.count(1)
        self._deferred: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.closed: str | None = None
        self._poller: Any = None
        self._poll_version = -1
        self._by_fd: dict[int, _Consumer] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._release_fd = _channel.eventfd()  # every consumer's releases wake it
        # Closed only when the core goes: a finalizer of a buffer handed out
        # earlier may still write to them, and a reused fd number must never be.
        for fd in (self._wake_r, self._wake_w, self._release_fd):
            weakref.finalize(self, os.close, fd)
        self._listener = UnixListener("ring", self._register, backlog=64)
        self.address = self._listener.address

    # -- registration (service threads) ---------------------------------------
    def _register(self, sock: socket.socket) -> None:
        try:
            conn = accept(sock, self.authkey, REGISTER_TIMEOUT)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("gpushare: a ring consumer failed to register: %s", exc)
            return
        channel: Channel | None = None
        wake = -1
        events: list[Any] = []
        try:
            socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
            hello = conn.recv()
            pid = int(hello[1])
            if self.closed is not None:
                conn.send(("closed", self.closed))
                conn.close()
                return
            channel = Channel.create(self.n)
            wake = _channel.eventfd()
            # One lease per slot, claimed by the consumer; then its channel's fds.
            conn.send(("slots", self.buffers, self._handles))
            with socket.socket(fileno=os.dup(conn.fileno())) as raw:
                reduction.sendfds(raw, [channel.fd, wake, self._release_fd])
            os.close(channel.fd)  # the mapping stays; the consumer has its own fd
            channel.fd = -1
            reply = conn.recv()
            if not (isinstance(reply, tuple) and reply and reply[0] == "ready"):
                raise EOFError("the consumer did not confirm its registration")
            for handle in reply[1] if self._cuda else ():
                events.append(_cuda.event_open(handle, self.device))  # type: ignore[arg-type]
            socket_timeouts(conn.fileno(), 0, SEND_TIMEOUT)
        except Exception as exc:  # e.g. the ring closed while its slots were being pickled
            log.warning("gpushare: a ring consumer failed to register: %r", exc)
            self._discard(conn, channel, wake, events)
            return
        with self._lock:
            if self.closed is None:
                try:
                    # Sent under the lock that publish() reads _targets under, with the
                    # update below: no item reaches this consumer before it, and every
                    # publish that starts after it reaches this consumer.
                    conn.send(("registered",))
                except OSError as exc:
                    log.warning("gpushare: a ring consumer failed to register: %s", exc)
                else:
                    consumer = _Consumer(next(self._cids), conn, pid, Frames(conn.fileno()), channel, wake, events)
                    self._consumers[consumer.cid] = consumer
                    self._targets = tuple(self._consumers.values())
                    self._version += 1
                    self._registered += 1
                    self._cond.notify_all()
                    return
            reason = self.closed
        if reason is not None:  # closed while this consumer registered
            try:
                conn.send(("closed", reason))
            except OSError:
                pass
        self._discard(conn, channel, wake, events)

    def _discard(self, conn: connection.Connection, channel: Channel | None, wake: int, events: list[Any]) -> None:
        conn.close()
        if channel is not None:
            channel.close()
        if wake >= 0:
            os.close(wake)
        _destroy_events(events, self.device)

    # -- releases (under _io) ----------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except OSError:  # pipe full (already woken) or closed
            pass

    def unpublished(self, slot: int, epoch: int) -> None:
        """Finalizer of an acquired buffer: if it was not published, its slot is free again.

        Once the ring is closed the slot's Buffer goes with it: close() left it to
        this item (see close(); the queue is written before ``closed`` is read)."""
        self._deferred.put((slot, epoch))
        if self.closed is not None:
            self.buffers[slot].release()
            return
        self._wake()

    def _apply_deferred(self) -> bool:
        """Free the slots acquired and released unpublished; True if one went free. Under _io."""
        freed = False
        deferred = self._deferred
        while not deferred.empty():  # only a thread holding _io takes from it: never Empty
            slot, epoch = deferred.get_nowait()
            if self._state[slot] == _ACQUIRED and self._epoch[slot] == epoch:
                self._state[slot] = _FREE
                self._free.append(slot)
                freed = True
        return freed

    def _collect(self) -> bool:
        """Apply the release words consumers wrote; True if a slot went free. Under _io."""
        busy = self._busy
        if not busy:
            return False
        freed = False
        for slot in tuple(busy):
            holders = self._holders[slot]
            seq = self._seq[slot]
            for c in tuple(holders):
                word = c.channel.released(slot, seq)
                if word:
                    holders.discard(c)
                    if word & RECORDED:
                        self._last[slot].append(c)
            if not holders:
                busy.discard(slot)
                self._state[slot] = _FREE
                self._free.append(slot)
                freed = True
        return freed

    def _current_poller(self) -> Any:
        if self._poll_version != self._version:
            with self._lock:
                consumers = list(self._consumers.values())
                self._poll_version = self._version
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            poller.register(self._release_fd, select.POLLIN)
            for c in consumers:
                poller.register(c.conn.fileno(), select.POLLIN)
            self._poller = poller
            self._by_fd = {c.conn.fileno(): c for c in consumers}
        return self._poller

    def _drain(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` (0: do not wait) for a release, an EOF or a wakeup,
        then apply everything that is there."""
        self._apply_deferred()
        for fd, events in self._current_poller().poll(poll_ms(timeout)):
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            elif fd == self._release_fd:
                soak(fd)
            else:
                consumer = self._by_fd.get(fd)
                if consumer is not None and not consumer.dead:
                    self._read(consumer, bool(events & select.POLLHUP))
        self._apply_deferred()
        self._collect()

    def _read(self, consumer: _Consumer, hung_up: bool) -> None:
        """A consumer socket is readable: after registration that can only be its end
        (EOF), or a protocol error; either way the consumer goes."""
        try:
            alive = consumer.frames.read()
            while alive and hung_up:
                alive = consumer.frames.read()
        except OSError:
            alive = False
        if alive:
            log.warning("gpushare: unexpected message from ring consumer pid %s; dropping it", consumer.pid)
        self._collect()  # what it released before it went still counts
        self._drop(consumer)

    def _drop(self, consumer: _Consumer) -> None:
        """The consumer exited, died or broke the protocol: free everything it held. Under _io."""
        with self._lock:
            if consumer.dead:
                return
            consumer.dead = True
            self._consumers.pop(consumer.cid, None)
            self._targets = tuple(self._consumers.values())
            self._version += 1
            for slot in tuple(self._busy):  # the slots it still held
                holders = self._holders[slot]
                holders.discard(consumer)
                if not holders and self._state[slot] == _PUBLISHED:
                    self._busy.discard(slot)
                    self._state[slot] = _FREE
                    self._free.append(slot)
        log.info("gpushare: ring consumer pid %s is gone; its slots are free again", consumer.pid)
        self._close_consumer(consumer)

    def _close_consumer(self, consumer: _Consumer) -> None:
        consumer.frames.fd = -1  # never write to a closed (maybe reused) fd number
        consumer.conn.close()
        consumer.channel.close()
        wake, consumer.wake = consumer.wake, -1
        if wake >= 0:
            os.close(wake)
        # Its release events go too (under _io, like acquire(), which skips a dead
        # consumer's): left open, every consumer that came and went would keep its
        # events, and their driver memory, in this process for the ring's life. A wait
        # already queued on one completes normally (the driver defers the destroy).
        events, consumer.events = consumer.events, []
        _destroy_events(events, self.device)

    # -- producer API ---------------------------------------------------------
    def _raise_closed(self) -> NoReturn:
        raise RingClosedError(f"this ring was closed ({self.closed}); make a new ring with manager.ring(...)")

    def acquire(self, owner: object, timeout: float | None) -> RingItem:
        io = self._io
        if not io.acquire(False) and not io.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            raise WaitTimeoutError(f"acquire() waited {timeout:g} s for another thread using this ring")
        try:
            free = self._free
            waiting = slept = False  # the first try found no free slot; a poll() slept since
            started = spin_until = 0.0
            deadline: float | None = None
            looks = 0
            # Releases are applied only when no slot is free: they wait in the
            # release words meanwhile.
            while True:
                if self.closed is not None:
                    self._raise_closed()
                if free:
                    if slept:  # a wait that ended while spinning was a quick one
                        self.spin.waited(time.monotonic() - started)
                    slot = free.popleft()
                    self._state[slot] = _ACQUIRED
                    epoch = self._epoch[slot] = self._epoch[slot] + 1
                    readers = self._last[slot]
                    if readers:
                        self._last[slot] = []
                    break
                if self._collect() or (not self._deferred.empty() and self._apply_deferred()):
                    continue
                if waiting and looks % SPIN_LOOKS:
                    looks += 1  # spinning: look at the release words again before the clock
                    continue
                now = time.monotonic()
                if not waiting:
                    waiting, started = True, now
                    spin_until = now + self.spin.budget()
                    deadline = None if timeout is None else now + timeout
                if now < spin_until:
                    looks += 1
                    os.sched_yield()  # free: returns at once unless another process waits for this core
                    continue
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    raise WaitTimeoutError(self._busy_message(timeout))
                self._drain(remaining)
                slept = True
            if readers:
                # The producer's writes (default stream) wait for the consumers' reads
                # of this slot's last publication, without blocking the host. Only
                # consumers whose reads were still queued at release recorded an event;
                # a read already finished needs no wait either (a wait on another
                # process's event ties the two contexts' GPU work together, which
                # costs far more).
                for c in readers:
                    if not c.dead and c.events and not _cuda.event_done(c.events[slot], self.device):  # type: ignore[arg-type]
                        _cuda.stream_wait_event(0, c.events[slot], self.device)  # type: ignore[arg-type]
            # Made under _io: close() releases the slot buffers only after taking it.
            return RingItem(self._views[slot], owner, slot, None, epoch, None, self.unpublished)
        finally:
            io.release()

    def _busy_message(self, timeout: float | None) -> str:
        with self._lock:
            held = [
                f"slot {i} (sequence {self._seq[i]}) by pid(s) {', '.join(str(c.pid) for c in _by_cid(h))}"
                for i, h in enumerate(self._holders)
                if self._state[i] == _PUBLISHED
            ]
            acquired = self._state.count(_ACQUIRED)
        parts = [f"all {self.n} slots of the ring are still busy after {timeout:g} s"]
        if held:
            parts.append("held: " + "; ".join(held))
        if acquired:
            parts.append(f"{acquired} acquired here and not yet published (publish() or release() them)")
        return (
            ". ".join(parts) + ". Consumers must release every item they get (item.release(), "
            "'with ring.get() as item:' or 'for item in ring'); if they are only slow, wait longer or add slots"
        )

    def publish(self, owner: object, buf: Buffer, meta: Any, timeout: float | None, stream: int | None = None) -> int:
        # A closed ring raises below, under _io (and in _await_consumers). A consumer's
        # items are RingItems too, but they belong to its RingConsumer.
        if buf.__class__ is not RingItem or not buf._belongs_to(owner):  # type: ignore[attr-defined]
            raise ValueError("publish() takes a buffer returned by this ring's acquire()")
        item: RingItem = buf  # type: ignore[assignment]
        if not item._still_acquired():
            raise ValueError(f"slot {item.slot} was already published or released; acquire() a slot for each publish()")
        if meta is None:
            inline: bytes | None = b""
        else:
            payload = bytes(ForkingPickler.dumps(meta))  # unpicklable meta fails here
            if len(payload) > MAX_META:
                raise ValueError(
                    f"meta pickles to {len(payload)} bytes; it travels with every handoff and must stay "
                    f"under {MAX_META} bytes. Put bulk data in the slot itself"
                )
            inline = payload if len(payload) <= INLINE_META else None
        if self._registered < self.wanted:
            self._await_consumers(timeout)
        slot = item.slot
        recorded = False
        if self._cuda:
            # Consumers wait on this event (per slot), not on the whole device. A stream
            # with nothing queued has finished every write: the event is left as it is
            # (its last record is complete, as that stream's work is), so consumers
            # find it done and wait for nothing, as a Queue's receiver of an event-less
            # descriptor does.
            on = 0 if stream is None else int(stream)
            recorded = not _cuda.stream_idle(self.device, on)  # type: ignore[arg-type]
            if recorded:
                _cuda.event_record(self._events[slot], self.device, on)  # type: ignore[arg-type]
        with self._io:
            if self.closed is not None:
                self._raise_closed()
            if self._state[slot] != _ACQUIRED or self._epoch[slot] != item._epoch:
                raise ValueError(f"slot {slot} is not acquired by this buffer any more; acquire() again")
            seq = self._published
            self._published = seq + 1
            self._seq[slot] = seq
            with self._lock:
                # Registration sends "registered" and adds the consumer under this lock:
                # every publish that starts after the consumer heard it reaches it.
                targets = self._targets
            # The entries go first, the bookkeeping after: a consumer may release the
            # slot at once, but its release word is read only under _io, held here.
            dropped: list[_Consumer] | None = None
            for c in targets:
                if inline is None:
                    try:
                        send_frame(c.frames.fd, bytes([META]) + payload)  # before its entry
                    except OSError:  # gone, or stuck for SEND_TIMEOUT: drop it (below)
                        dropped = [c] if dropped is None else [*dropped, c]
                        continue
                head = c.head
                c.channel.put(head, slot, seq, inline, recorded)
                c.head = head + 1
                try:
                    os.eventfd_write(c.wake, 1)  # poke(), inline: one call less per consumer
                except OSError:
                    pass
            if targets:
                self._state[slot] = _PUBLISHED
                self._holders[slot].update(targets)  # empty while the slot is not published
                self._busy.add(slot)
            else:
                self._state[slot] = _FREE
                self._free.append(slot)
            if dropped is not None:
                for c in dropped:
                    self._drop(c)
        item._published()
        return seq

    def _await_consumers(self, timeout: float | None) -> None:
        if self._registered >= self.wanted:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._registered < self.wanted and self.closed is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeoutError(
                        f"publish() waited {timeout:g} s for {self.wanted} consumer(s) to register; "
                        f"{self._registered} did. A consumer registers when a worker unpickles the ring "
                        "(pass it as a Process argument or through a queue); start the consumers, wait "
                        "longer, or make the ring with a smaller consumers="
                    )
                self._cond.wait(remaining)
        if self.closed is not None:
            self._raise_closed()

    def stats(self) -> dict[str, Any]:
        # Another thread blocked in acquire() holds _io and drains anyway; the states are
        # then read without it (each count is still one list's, read under the GIL).
        got = self._io.acquire(timeout=1.0)
        try:
            if got and self.closed is None:
                self._drain(0)
            with self._lock:
                return {
                    "slots": self.n,
                    "free": len(self._free),
                    "acquired": self._state.count(_ACQUIRED),
                    "busy": self._state.count(_PUBLISHED),
                    "consumers": len(self._consumers),
                    "consumer_pids": sorted(c.pid for c in self._consumers.values()),
                    "registered": self._registered,
                    "published": self._published,
                    "closed": self.closed is not None,
                }
        finally:
            if got:
                self._io.release()

    def consumer_count(self) -> int:
        with self._lock:
            return len(self._consumers)

    def close(self, reason: str) -> None:
        with self._lock:
            if self.closed is not None:
                return
            self.closed = reason
            self._cond.notify_all()
        self._wake()  # a thread blocked in acquire() sees the close and leaves _io
        with self._io:
            with self._lock:
                consumers = list(self._consumers.values())
                self._consumers.clear()
                self._targets = ()
                self._version += 1
            message = bytes([CLOSED]) + reason.encode()
            for c in consumers:
                c.dead = True
                try:
                    # After every item: the consumer reads those first. Non-blocking: a
                    # consumer that stopped reading sees EOF instead, and close() never waits.
                    os.set_blocking(c.frames.fd, False)
                    send_frame(c.frames.fd, message)
                except OSError:
                    pass
                poke(c.wake)
                self._close_consumer(c)
            self._poller = None
            self._by_fd = {}
            # A slot acquired here and not yet published keeps its Buffer until its item
            # goes (unpublished() releases it then). Its queue entry is applied here if
            # it came before ``closed`` was set; after that, unpublished() sees ``closed``.
            self._apply_deferred()
            for slot, b in enumerate(self.buffers):
                if self._state[slot] != _ACQUIRED:
                    b.release()
        self._listener.close()
