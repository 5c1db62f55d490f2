"""Ring: pre-shared slots for steady producer -> N consumers pipelines.

A :class:`Ring` is ``slots`` buffers of one shape and dtype, allocated by a
Manager in the producer's process, plus a small authenticated Unix-socket
service (owned by the ring, in that process) that hands slots to every
registered consumer. Each consumer maps each slot once, when it registers;
after that a handoff moves only a slot index: no descriptor, no lease, no
open per item.

Roles
-----
* The producer (the process that called ``manager.ring(...)``) acquires a
  free slot, writes it, and publishes it to every registered consumer.
* A consumer is what a worker gets by unpickling the ring (as a Process
  argument, through a queue or a pipe): a :class:`RingConsumer`. *Each
  unpickling registers one consumer*, and every registered consumer receives
  every slot published after it registered, so a consumer end nobody reads
  from must be closed, or it holds slots until its process exits.

Registration (pickled messages, after multiprocessing's HMAC challenge both
ways with the process authkey, like the lifetime service)
--------------------------------------------------------------------------
consumer -> producer ``("hello", pid)``; producer -> consumer
``("slots", [buffer, ...])`` -- the slot buffers, pickled as usual (one
lease each, claimed by the consumer: the lifetime service keeps the memory
alive while the consumer maps it); consumer -> producer ``("ready",)``
once it mapped them; producer -> consumer ``("registered",)``, sent under
the lock that :meth:`Ring.publish` takes its list of consumers with. From
that moment the consumer receives exactly the slots published after it,
and unpickling returns only then. Either producer message may instead be
``("closed", reason)``.

Handoffs (struct-packed little-endian ints, no pickle)
------------------------------------------------------
On the same connection, in multiprocessing's framing (what ``send_bytes``
writes), but written with one ``os.write`` and read with one ``os.read``
for everything pending, so that a handoff costs about one Pipe round trip.
producer -> consumer ``ITEM``: ``u8 1 | u32 slot | u64 sequence``, followed
by the pickled ``meta`` when the producer passed one (at most 1 MiB);
``CLOSED``: ``u8 2 | reason (utf-8)``. consumer -> producer ``RELEASE``:
one or more ``u32 slot | u64 sequence`` pairs (releases batch when several
are due; a release whose sequence is not the slot's current one is ignored).

States of a slot (kept by the producer)
---------------------------------------
``free`` -> :meth:`Ring.acquire` -> ``acquired`` (the producer writes it)
-> :meth:`Ring.publish` -> ``published`` to the set of consumers registered
at that moment -> ``free`` again when every one of them has released it.
An acquired slot whose buffer is released (or collected) without being
published goes straight back to ``free``; a slot published while no
consumer is registered is free again at once.

Who frees what
--------------
* A consumer releases each item it got: ``item.release()``,
  ``ring.release(item)``, ``with ring.get() as item:``, the end of a loop
  iteration (``for item in ring``), or garbage collection of the item.
* A consumer that exits or dies closes its socket: the producer sees EOF
  the next time it drains (:meth:`Ring.acquire` drains when no slot is
  free, :meth:`Ring.stats` always; a :meth:`Ring.publish` to it fails at
  once) and frees every slot that consumer held; it goes on with the
  remaining consumers. A consumer whose socket stays full for
  ``SEND_TIMEOUT`` seconds is dropped the same way.
* The producer never frees memory itself: the slots are Manager buffers.
  :meth:`Ring.close` sends ``CLOSED`` to every consumer and releases the
  ring's own references; consumers release theirs when they read
  ``CLOSED``; the Manager recycles each slot when the last reference goes.

Waiting for consumers
---------------------
``consumers=N`` (default 1) makes :meth:`Ring.publish` wait until N
consumers have registered (counting every registration since the ring was
made), so the first items are not published into a ring nobody listens to
yet. Once N have registered, publish never waits for registrations again: a
consumer that dies is not waited for, and the producer goes on with the
others (with none, a published slot is simply free again).

Ending
------
A consumer's :meth:`RingConsumer.get` returns every item published before
the producer closed the ring, then raises :class:`RingClosedError`
(iteration just stops). If the producer's process exits or dies without
closing the ring, ``get`` raises :class:`OwnerGoneError` instead: a crash
never looks like a clean end.

Device memory (CUDA slots)
--------------------------
:meth:`Ring.publish` synchronizes the slot's device (``cuCtxSynchronize``)
before it sends, and a consumer synchronizes its device before its release
goes out, so work queued on any stream (torch, CuPy) that writes or reads a
slot is finished before the other side may touch it. That is a few
microseconds on an idle device, but it also waits for unrelated work in
that process; per-slot interprocess events would order streams instead.
On the host backend neither is needed.

Every call that can block takes a ``timeout`` and raises
:class:`TimeoutError` saying what it waited for.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import queue
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError, connection, current_process
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from ._buffer import Buffer
from ._errors import GpushareError, OwnerGoneError, RingClosedError
from ._service import UnixListener, accept, connect, shutdown_socket, socket_timeouts

__all__ = ["Ring", "RingConsumer", "create_ring"]

log = logging.getLogger("gpushare")

#: Seconds a registration step (either side) may take before it is abandoned.
REGISTER_TIMEOUT = 30.0
#: Seconds a send to one consumer may stay blocked (its socket full) before that consumer is dropped.
SEND_TIMEOUT = 30.0
_MAX_SLOTS = 1 << 16
_MAX_META = 1 << 20

_ITEM = 1
_CLOSED = 2
_HEAD = struct.Struct("<BIQ")  # kind, slot, sequence
_RELEASE = struct.Struct("<IQ")  # slot, sequence
_LENGTH = struct.Struct("!i")  # multiprocessing.connection's message header
_LONG_LENGTH = struct.Struct("!Q")

_FREE, _ACQUIRED, _PUBLISHED = 0, 1, 2


def _poll_ms(timeout: float | None) -> int:
    return -1 if timeout is None else max(0, math.ceil(timeout * 1000))


def _synchronize(device: int | str) -> None:
    """Finish all work queued on a CUDA device in this process (no-op for host memory)."""
    if isinstance(device, int):
        from . import _cuda

        _cuda.synchronize(device)


def _send_frame(fd: int, message: bytes) -> None:
    """Write one message in multiprocessing's Connection framing (what ``send_bytes`` writes,
    without its per-call overhead); raises OSError like it."""
    data = memoryview(_LENGTH.pack(len(message)) + message)
    while data:
        data = data[os.write(fd, data) :]


class _Frames:
    """Messages in multiprocessing's Connection framing, read with one ``os.read`` per wakeup.

    ``Connection.recv_bytes`` costs two reads per message; on the hot path
    this reads whatever is there at once (the fd is readable, or the caller
    is willing to block) and splits it. Only used after registration, which
    goes through the Connection itself (it buffers nothing, so no byte is lost).
    """

    __slots__ = ("buf", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def read(self) -> bool:
        """Read what is available (blocks until something is); False at EOF."""
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)

    def pop(self) -> bytes | None:
        """The next complete message, or None."""
        buf = self.buf
        if len(buf) < 4:
            return None
        (size,) = _LENGTH.unpack_from(buf)
        start = 4
        if size == -1:  # Connection's header for messages over 2 GiB
            if len(buf) < 12:
                return None
            (size,) = _LONG_LENGTH.unpack_from(buf, 4)
            start = 12
        end = start + size
        if len(buf) < end:
            return None
        message = bytes(buf[start:end])
        del buf[:end]
        return message


class _SlotBuffer(Buffer):
    """A ring slot as handed out: by :meth:`Ring.acquire` (producer) or :meth:`RingConsumer.get`.

    A Buffer viewing the slot's memory, plus ``slot`` (the index),
    ``sequence`` (the publication number; None in the producer) and
    ``meta`` (what the producer published with it). ``release()`` gives
    the slot back to the ring, then releases this view: touching it
    afterwards raises BufferReleasedError, because the slot may already
    be rewritten.
    """

    __slots__ = ("_epoch", "_on_release", "_ring", "meta", "sequence", "slot")

    def __init__(
        self, base: Buffer, ring: object, slot: int, sequence: int | None, epoch: int, meta: Any, on_release: Any
    ) -> None:
        super().__init__(base._memory, base._offset, base._shape, base._dtype)
        self._ring = ring
        self.slot = slot
        self.sequence = sequence
        self.meta = meta
        self._epoch = epoch
        self._on_release: Any = on_release  # None once the slot went back (or was published)

    def _give_back(self) -> None:
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback(self.slot, self._epoch)

    def release(self) -> None:
        """Give the slot back to the ring (once), then release this view. Idempotent."""
        self._give_back()
        super().release()

    def __del__(self) -> None:
        # Cheaper than a second weakref.finalize per item; the callbacks only
        # enqueue or send, and never raise.
        if getattr(self, "_on_release", None) is not None:
            try:
                self._give_back()
            except Exception:  # interpreter shutdown
                pass

    def __repr__(self) -> str:
        state = "released" if self.released else self.backend
        return (
            f"<gpushare ring slot {self.slot} sequence={self.sequence} shape={self.shape} dtype={self.dtype} "
            f"device={self.device!r} {state}>"
        )


# ---------------------------------------------------------------------------
# Producer side
# ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Consumer:
    cid: int
    conn: connection.Connection
    pid: int
    frames: _Frames
    holds: set[int] = field(default_factory=set)
    dead: bool = False


class _Producer:
    """The producer's state and service; :class:`Ring` is its public handle.

    Locks: ``_io`` serializes everything that reads from or writes to
    consumer connections and closes them (acquire, publish, stats, close);
    ``_lock`` guards the slot states and the consumer table, which
    registration threads also touch. Order: ``_io`` before ``_lock``.
    Finalizers only enqueue and wake (``_deferred``), never take a lock.
    """

    def __init__(self, buffers: list[Buffer], wanted: int, authkey: bytes) -> None:
        self.buffers = buffers
        self.n = len(buffers)
        self.wanted = wanted
        self.authkey = authkey
        self.device = buffers[0].device
        self.info = {
            "slots": self.n,
            "shape": buffers[0].shape,
            "dtype": buffers[0].dtype.str,
            "pid": os.getpid(),
        }
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._io = threading.Lock()
        self._state = [_FREE] * self.n
        self._seq = [0] * self.n
        self._epoch = [0] * self.n
        self._holders: list[set[int]] = [set() for _ in range(self.n)]
        self._free = collections.deque(range(self.n))
        self._consumers: dict[int, _Consumer] = {}
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
        # Closed only when the core goes: a finalizer of a buffer handed out
        # earlier may still write to it, and a reused fd number must never be.
        for fd in (self._wake_r, self._wake_w):
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
        try:
            socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
            hello = conn.recv()
            pid = int(hello[1])
            if self.closed is not None:
                conn.send(("closed", self.closed))
                conn.close()
                return
            conn.send(("slots", self.buffers))  # one lease per slot, claimed by the consumer
            if conn.recv() != ("ready",):
                raise EOFError("the consumer did not confirm its registration")
            socket_timeouts(conn.fileno(), 0, SEND_TIMEOUT)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("gpushare: a ring consumer failed to register: %s", exc)
            conn.close()
            return
        except Exception as exc:  # e.g. the ring closed while its slots were being pickled
            log.warning("gpushare: a ring consumer failed to register: %r", exc)
            conn.close()
            return
        with self._lock:
            if self.closed is None:
                try:
                    # Sent under the lock that publish() snapshots consumers with, so
                    # no item can reach this consumer before it.
                    conn.send(("registered",))
                except OSError as exc:
                    log.warning("gpushare: a ring consumer failed to register: %s", exc)
                    conn.close()
                    return
                consumer = _Consumer(next(self._cids), conn, pid, _Frames(conn.fileno()))
                self._consumers[consumer.cid] = consumer
                self._version += 1
                self._registered += 1
                self._cond.notify_all()
                return
            reason = self.closed
        try:  # closed while this consumer registered
            conn.send(("closed", reason))
        except OSError:
            pass
        conn.close()

    # -- draining releases (under _io) ----------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except OSError:  # pipe full (already woken) or closed
            pass

    def unpublished(self, slot: int, epoch: int) -> None:
        """Finalizer of an acquired buffer: if it was not published, its slot is free again."""
        self._deferred.put((slot, epoch))
        self._wake()

    def _apply_deferred(self) -> None:
        while True:
            try:
                slot, epoch = self._deferred.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if self._state[slot] == _ACQUIRED and self._epoch[slot] == epoch:
                    self._state[slot] = _FREE
                    self._free.append(slot)

    def _current_poller(self) -> Any:
        if self._poll_version != self._version:
            with self._lock:
                consumers = list(self._consumers.values())
                self._poll_version = self._version
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for c in consumers:
                poller.register(c.conn.fileno(), select.POLLIN)
            self._poller = poller
            self._by_fd = {c.conn.fileno(): c for c in consumers}
        return self._poller

    def _drain(self, timeout: float | None) -> None:
        """Apply what arrived: wait at most ``timeout`` (0: do not wait) for anything, then
        apply every release (and EOF) that is there."""
        self._apply_deferred()
        for fd, events in self._current_poller().poll(_poll_ms(timeout)):
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            consumer = self._by_fd.get(fd)
            if consumer is not None and not consumer.dead:
                self._read(consumer, bool(events & select.POLLHUP))
        self._apply_deferred()

    def _read(self, consumer: _Consumer, hung_up: bool) -> None:
        """Apply the releases that are there; drop the consumer at EOF.

        ``hung_up`` (POLLHUP: the peer closed) means every byte it sent is
        already here: read through to the EOF now rather than at the next drain.
        """
        frames = consumer.frames
        try:
            alive = frames.read()
            while alive and hung_up:
                alive = frames.read()
        except OSError:
            alive = False
        while True:
            data = frames.pop()
            if data is None:
                break
            if not data or len(data) % _RELEASE.size:
                log.warning("gpushare: malformed ring message from pid %s; dropping that consumer", consumer.pid)
                alive = False
                break
            with self._lock:
                for slot, seq in _RELEASE.iter_unpack(data):
                    holders = self._holders[slot] if slot < self.n else None
                    if holders is None or self._seq[slot] != seq or consumer.cid not in holders:
                        continue  # stale or foreign: never free a slot someone else still holds
                    holders.discard(consumer.cid)
                    consumer.holds.discard(slot)
                    if not holders and self._state[slot] == _PUBLISHED:
                        self._state[slot] = _FREE
                        self._free.append(slot)
        if not alive:
            self._drop(consumer)

    def _drop(self, consumer: _Consumer) -> None:
        """The consumer exited, died or broke the protocol: free everything it held. Under _io."""
        with self._lock:
            if consumer.dead:
                return
            consumer.dead = True
            self._consumers.pop(consumer.cid, None)
            self._version += 1
            for slot in consumer.holds:
                holders = self._holders[slot]
                holders.discard(consumer.cid)
                if not holders and self._state[slot] == _PUBLISHED:
                    self._state[slot] = _FREE
                    self._free.append(slot)
            consumer.holds.clear()
        log.info("gpushare: ring consumer pid %s is gone; its slots are free again", consumer.pid)
        consumer.frames.fd = -1  # never write to a closed (maybe reused) fd number
        consumer.conn.close()

    # -- producer API ---------------------------------------------------------
    def _raise_closed(self) -> NoReturn:
        raise RingClosedError(f"this ring was closed ({self.closed}); make a new ring with manager.ring(...)")

    def acquire(self, owner: Ring, timeout: float | None) -> _SlotBuffer:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._io.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError(f"acquire() waited {timeout:g} s for another thread using this ring")
        try:
            # Releases are applied only when no slot is free: they wait in the
            # sockets meanwhile (at most one per slot per consumer).
            while True:
                with self._lock:
                    if self.closed is not None:
                        self._raise_closed()
                    if self._free:
                        slot = self._free.popleft()
                        self._state[slot] = _ACQUIRED
                        self._epoch[slot] += 1
                        epoch = self._epoch[slot]
                        break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(self._busy_message(timeout))
                self._drain(remaining)
            # Made under _io: close() releases the slot buffers only after taking it.
            return _SlotBuffer(self.buffers[slot], owner, slot, None, epoch, None, self.unpublished)
        finally:
            self._io.release()

    def _busy_message(self, timeout: float | None) -> str:
        with self._lock:
            pids = {c.cid: c.pid for c in self._consumers.values()}
            held = [
                f"slot {i} (sequence {self._seq[i]}) by pid(s) {', '.join(str(pids.get(c, '?')) for c in sorted(h))}"
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

    def publish(self, buf: Buffer, meta: Any, timeout: float | None) -> int:
        if self.closed is not None:
            self._raise_closed()
        if not isinstance(buf, _SlotBuffer) or not isinstance(buf._ring, Ring) or buf._ring._core is not self:
            raise ValueError("publish() takes a buffer returned by this ring's acquire()")
        if buf._on_release is None:
            raise ValueError(f"slot {buf.slot} was already published or released; acquire() a slot for each publish()")
        payload = b"" if meta is None else bytes(ForkingPickler.dumps(meta))  # unpicklable meta fails here
        if len(payload) > _MAX_META:
            raise ValueError(
                f"meta pickles to {len(payload)} bytes; it travels with every handoff and must stay "
                f"under {_MAX_META} bytes. Put bulk data in the slot itself"
            )
        self._await_consumers(timeout)
        _synchronize(self.device)  # writes queued on any stream are done before consumers read
        slot = buf.slot
        with self._io:
            with self._lock:
                if self.closed is not None:
                    self._raise_closed()
                if self._state[slot] != _ACQUIRED or self._epoch[slot] != buf._epoch:
                    raise ValueError(f"slot {slot} is not acquired by this buffer any more; acquire() again")
                seq = self._published
                self._published += 1
                self._seq[slot] = seq
                targets = list(self._consumers.values())
                if targets:
                    self._state[slot] = _PUBLISHED
                    self._holders[slot] = {c.cid for c in targets}
                    for c in targets:
                        c.holds.add(slot)
                else:
                    self._state[slot] = _FREE
                    self._free.append(slot)
            message = _HEAD.pack(_ITEM, slot, seq) + payload
            for c in targets:
                try:
                    _send_frame(c.frames.fd, message)
                except OSError:  # gone, or stuck for SEND_TIMEOUT: drop it
                    self._drop(c)
        buf._on_release = None  # published: the slot is the consumers' now, not free
        Buffer.release(buf)
        return seq

    def _await_consumers(self, timeout: float | None) -> None:
        if self._registered >= self.wanted:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._registered < self.wanted and self.closed is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"publish() waited {timeout:g} s for {self.wanted} consumer(s) to register; "
                        f"{self._registered} did. A consumer registers when a worker unpickles the ring "
                        "(pass it as a Process argument or through a queue); start the consumers, wait "
                        "longer, or make the ring with a smaller consumers="
                    )
                self._cond.wait(remaining)
        if self.closed is not None:
            self._raise_closed()

    def stats(self) -> dict[str, Any]:
        if self._io.acquire(timeout=1.0):  # another thread blocked in acquire() drains anyway
            try:
                if self.closed is None:
                    self._drain(0)
            finally:
                self._io.release()
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
                self._version += 1
            message = bytes([_CLOSED]) + reason.encode()
            for c in consumers:
                c.dead = True
                try:
                    # After every item: the consumer reads those first. Non-blocking: a
                    # consumer that stopped reading sees EOF instead, and close() never waits.
                    os.set_blocking(c.frames.fd, False)
                    _send_frame(c.frames.fd, message)
                except OSError:
                    pass
                c.frames.fd = -1
                c.conn.close()
            self._poller = None
            self._by_fd = {}
        self._listener.close()
        for b in self.buffers:
            b.release()  # acquired, unpublished buffers keep their memory until they go too


class Ring:
    """The producer end of a ring of pre-shared slots (made by ``manager.ring(...)``).

    ::

        with manager.ring((64, 1024), "float32", slots=4, consumers=2) as ring:
            workers = [mp.Process(target=consume, args=(ring,)) for _ in range(2)]
            ...
            for step in range(steps):
                buf = ring.acquire(timeout=10)   # a free slot (blocks while all are busy)
                buf.copy_from(batch)             # write it
                ring.publish(buf, meta=step)     # hand it to every registered consumer

        def consume(ring):                       # the ring unpickles as a RingConsumer
            for item in ring:                    # until the producer closes the ring
                use(item, item.meta)             # released when the loop moves on

    Pickling a Ring gives a consumer end (:class:`RingConsumer`); each
    unpickling registers one consumer. See :mod:`gpushare._ring` for the
    protocol. The producer's methods are meant for one thread; ``close()``
    and ``stats()`` may come from another.
    """

    def __init__(self, core: _Producer) -> None:
        self._core = core
        self._finalizer = weakref.finalize(
            self, core.close, "the producer's Ring was garbage collected without close()"
        )

    @property
    def slots(self) -> int:
        return self._core.n

    @property
    def shape(self) -> tuple[int, ...]:
        return self._core.buffers[0].shape

    @property
    def dtype(self) -> Any:
        return self._core.buffers[0].dtype

    @property
    def device(self) -> int | str:
        """The CUDA ordinal of the slots in this process, or ``"cpu"``."""
        return self._core.device

    @property
    def backend(self) -> str:
        return self._core.buffers[0].backend

    @property
    def closed(self) -> bool:
        return self._core.closed is not None

    def acquire(self, timeout: float | None = None) -> Buffer:
        """A free slot's buffer, to write and then :meth:`publish`.

        Blocks while every slot is held by some consumer (or acquired and
        not yet published), applying releases as they arrive; after
        ``timeout`` seconds raises :class:`TimeoutError` naming who holds
        what. Releasing the returned buffer without publishing it returns
        the slot. Raises :class:`RingClosedError` once the ring is closed.
        """
        return self._core.acquire(self, timeout)

    def publish(self, buf: Buffer, meta: Any = None, *, timeout: float | None = None) -> int:
        """Hand ``buf`` (from :meth:`acquire`) to every registered consumer; return its sequence number.

        ``meta`` (small and picklable; no Buffers: it is pickled once for
        every consumer) travels with it as ``item.meta``. Until
        ``consumers`` consumers have registered, waits for them, for at
        most ``timeout`` seconds (then :class:`TimeoutError`). On CUDA the
        slot's device is synchronized first. ``buf`` is released here:
        the slot belongs to the consumers until they all release it.
        """
        return self._core.publish(buf, meta, timeout)

    def close(self) -> None:
        """End the ring: consumers get every item already published, then RingClosedError
        (their iteration stops). Idempotent; never blocks on consumers."""
        self._core.close("the producer called close()")

    def stats(self) -> dict[str, Any]:
        """Slots ``free``/``acquired``/``busy`` (held by consumers), ``consumers`` (live, with
        ``consumer_pids``), ``registered`` (ever), ``published`` (items so far), ``closed``."""
        return self._core.stats()

    def _not_a_consumer(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "this is the producer end of the ring (acquire/publish); consumers get theirs by unpickling "
            "it: pass the ring as a spawned Process argument, or through a queue or a pipe. (Under the "
            "fork start method Process arguments are inherited, not pickled: send the ring through a queue)"
        )

    get = items = release = __iter__ = _not_a_consumer

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        if self._core.closed is not None:
            raise RingClosedError(
                f"cannot pickle a closed ring ({self._core.closed}): it has no items left to give a consumer"
            )
        return (_attach, (self._core.address, self._core.info))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._core._consumers)} consumer(s)"
        return (
            f"<gpushare.Ring slots={self.slots} shape={self.shape} dtype={self.dtype} device={self.device!r} {state}>"
        )


def create_ring(
    manager: Any,
    shape: Any,
    dtype: Any = "float32",
    device: Any = None,
    *,
    slots: int = 4,
    consumers: int = 1,
    backend: str | None = None,
) -> Ring:
    """Allocate ``slots`` buffers with ``manager`` and start the ring's service (all or nothing)."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= _MAX_SLOTS:
        raise ValueError(f"slots={slots!r} must be an int from 1 to {_MAX_SLOTS}")
    if isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 0:
        raise ValueError(f"consumers={consumers!r} must be an int >= 0 (how many registrations publish() waits for)")
    buffers: list[Buffer] = []
    try:
        for _ in range(slots):
            buffers.append(manager.empty(shape, dtype, device, backend=backend))
        core = _Producer(buffers, consumers, bytes(current_process().authkey))
    except BaseException:
        for b in buffers:
            b.release()
        raise
    return Ring(core)


# ---------------------------------------------------------------------------
# Consumer side
# ---------------------------------------------------------------------------


def _attach(address: str, info: dict[str, Any]) -> RingConsumer:
    """Unpickling side: connect and register (errors are kept and raised by get())."""
    return RingConsumer(address, info)


class RingConsumer:
    """A consumer's end of a :class:`Ring`: what a worker gets by unpickling one.

    Registers with the producer when unpickled (mapping every slot once),
    then :meth:`get` returns each published slot in order, as a Buffer
    viewing the same mapped memory every time that slot comes round, with
    ``item.slot``, ``item.sequence`` and ``item.meta``. Release each item
    (``item.release()``, ``ring.release(item)``, ``with ring.get() as
    item:``) so the producer can reuse its slot; iterating releases each
    item when the loop moves on. Pickling a consumer end registers another
    consumer wherever it is unpickled.
    """

    def __init__(self, address: str, info: dict[str, Any]) -> None:
        self._address = address
        self._info = info
        self._conn: connection.Connection | None = None
        self._poller: Any = None
        self._frames = _Frames(-1)  # the hot path's reader, once registered
        self._buffers: list[Buffer] = []
        self._device: int | str = "cpu"
        self._error: tuple[type[GpushareError], str] | None = None
        self._closed: str | None = None
        self._pending: collections.deque[bytes] = collections.deque()
        self._send_lock = threading.Lock()
        self.received = 0
        self._held = 0
        try:
            self._register()
        except GpushareError as exc:
            self._error = (type(exc), str(exc))
            self._shut()

    def _register(self) -> None:
        pid = self._info["pid"]
        try:
            self._conn = conn = connect(self._address, bytes(current_process().authkey), REGISTER_TIMEOUT)
            socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
            conn.send(("hello", os.getpid()))
            reply = conn.recv()  # maps every slot (claims one lease each)
            if reply[0] == "closed":
                self._closed = f"the ring was closed: {reply[1]}"
                self._shut()
                return
            self._buffers = list(reply[1])
            conn.send(("ready",))
            reply = conn.recv()
            if reply[0] == "closed":  # closed while this consumer registered
                self._closed = f"the ring was closed: {reply[1]}"
                self._shut()
                return
            socket_timeouts(conn.fileno(), 0, 0)
        except AuthenticationError as exc:
            raise OwnerGoneError(
                f"the ring's producer (pid {pid}) refused this process: authentication failed. A ring "
                "is shared only with processes started from the producer's process tree (same "
                "multiprocessing authkey)"
            ) from exc
        except (OSError, EOFError) as exc:
            raise OwnerGoneError(
                f"cannot register with the ring's producer (pid {pid}) at {self._address} ({exc}): "
                "it closed the ring or exited"
            ) from exc
        self._device = self._buffers[0].device if self._buffers else "cpu"
        self._frames = _Frames(conn.fileno())
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    @property
    def slots(self) -> int:
        return int(self._info["slots"])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._info["shape"])

    @property
    def dtype(self) -> Any:
        import numpy as np

        return np.dtype(self._info["dtype"])

    @property
    def closed(self) -> bool:
        return self._conn is None

    # -- receiving --------------------------------------------------------------
    def _raise_unusable(self) -> NoReturn:
        if self._error is not None:
            kind, message = self._error
            raise kind(message)
        raise RingClosedError(f"{self._closed or 'this consumer end is closed'}; no more items will come")

    def get(self, timeout: float | None = None) -> Buffer:
        """The next published slot, in publication order.

        Waits at most ``timeout`` seconds (then :class:`TimeoutError`).
        Raises :class:`RingClosedError` once the producer closed the ring
        and every item published before was received, and
        :class:`OwnerGoneError` if the producer's process is gone.
        """
        if self._conn is None:
            self._raise_unusable()
        if self._pending:
            self._flush()
        frames = self._frames
        data = frames.pop()
        deadline = None if timeout is None else time.monotonic() + timeout
        while data is None:
            if deadline is not None and not self._poller.poll(_poll_ms(deadline - time.monotonic())):
                raise TimeoutError(
                    f"no ring item arrived within {timeout:g} s (the producer, pid {self._info['pid']}, "
                    "published nothing new for this consumer)"
                )
            try:
                alive = frames.read()
            except OSError as exc:
                alive, why = False, repr(exc)
            else:
                why = "EOF"
            if not alive:
                if self._conn is not None:  # not closed by this process meanwhile: the producer is gone
                    self._error = (
                        OwnerGoneError,
                        f"the ring's producer (pid {self._info['pid']}) exited without closing the ring "
                        f"({why}); no more items will come",
                    )
                    self._shut()
                self._raise_unusable()
            data = frames.pop()
        if data[0] == _ITEM:
            _, slot, seq = _HEAD.unpack_from(data)
            meta = ForkingPickler.loads(data[_HEAD.size :]) if len(data) > _HEAD.size else None
            self.received += 1
            self._held += 1
            return _SlotBuffer(self._buffers[slot], self, slot, seq, seq, meta, self._on_release)
        if data[0] == _CLOSED:
            self._closed = f"the ring was closed: {data[1:].decode(errors='replace')}"
        else:
            self._error = (OwnerGoneError, f"the ring's producer sent a message of unknown kind {data[0]}")
        self._shut()
        self._raise_unusable()

    def release(self, item: Buffer) -> None:
        """Give ``item`` (from :meth:`get`) back to the producer; same as ``item.release()``."""
        if not isinstance(item, _SlotBuffer) or item._ring is not self:
            raise ValueError("release() takes an item returned by this consumer's get()")
        item.release()

    def items(self, timeout: float | None = None) -> Iterator[Buffer]:
        """Iterate until the ring is closed, waiting at most ``timeout`` seconds per item.

        Each item is released when the loop asks for the next one (or
        ends): copy what must outlive an iteration, or use :meth:`get`.
        """
        while True:
            try:
                item = self.get(timeout)
            except RingClosedError:
                return
            try:
                yield item
            finally:
                item.release()

    def __iter__(self) -> Iterator[Buffer]:
        return self.items()

    # -- releasing ----------------------------------------------------------------
    def _on_release(self, slot: int, seq: int) -> None:
        """An item was released or collected: tell the producer (maybe from a finalizer)."""
        self._held -= 1
        if self._conn is None:
            return
        try:
            _synchronize(self._device)  # our reads queued on any stream finish before the slot is rewritten
        except Exception:  # e.g. at interpreter exit; keep the slot rather than free it under our reads
            log.exception("gpushare: could not synchronize before releasing ring slot %d; keeping it", slot)
            return
        self._pending.append(_RELEASE.pack(slot, seq))
        self._flush()

    def _flush(self) -> None:
        # Non-blocking: a finalizer may run while this thread is sending; the
        # sender (or the next get()) then sends what was queued.
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            while self._pending and self._conn is not None:
                chunks = []
                while self._pending:
                    chunks.append(self._pending.popleft())
                try:
                    _send_frame(self._frames.fd, b"".join(chunks))
                except OSError:  # producer gone: get() reports it
                    self._pending.clear()
        finally:
            self._send_lock.release()

    # -- ending ---------------------------------------------------------------------
    def _shut(self) -> None:
        conn, self._conn = self._conn, None
        frames, self._frames = self._frames, _Frames(-1)
        frames.fd = -1  # a get() in another thread must never read a closed (maybe reused) fd number
        self._poller = None
        buffers, self._buffers = self._buffers, []
        for b in buffers:
            b.release()  # items still held keep their memory until they go too
        if conn is not None:
            shutdown_socket(conn.fileno())  # wakes a get() blocked in another thread; closing alone would not
            conn.close()

    def close(self) -> None:
        """Leave the ring: the producer frees every slot this consumer holds. Idempotent."""
        if self._conn is not None:
            self._closed = "this consumer was closed in this process"
            self._shut()

    def stats(self) -> dict[str, Any]:
        """``slots``, ``received`` (items so far), ``held`` (not yet released), ``closed``."""
        return {"slots": self.slots, "received": self.received, "held": self._held, "closed": self.closed}

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach, (self._address, self._info))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.received} received"
        return f"<gpushare.RingConsumer slots={self.slots} shape={self.shape} dtype={self.dtype} {state}>"
