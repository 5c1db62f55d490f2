"""The ring's policy, producer side: every consumer gets every slot, in order, with back-pressure.

:meth:`RingProducer.acquire` takes the free slot freed first, waiting while
consumers hold them all; :meth:`RingProducer.publish` writes one entry per
registered consumer into its channel. A slot is free again once every consumer
it went to released it. Locks (the slots'): ``io`` serializes all that touches
slot states, channels and consumer sockets or closes them; ``lock`` guards the
consumer table, ``_targets`` and ``closed``, which registration threads touch too.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from .._buffer import Buffer
from .._errors import RingClosedError, WaitTimeoutError
from .._spin import SpinPolicy
from ._channel import INLINE_META, RECORDED, poke
from ._item import RingItem, slot_view
from ._registry import RING, Closed, Frames, Reader, Registry, closed_frame, meta_frame, send_frame
from ._slots import FREE, WRITING, Slots
from ._wire import MAX_META, SPIN_LOOKS, poll_ms

__all__ = ["RingProducer"]

log = logging.getLogger("gpushare")

PUBLISHED = 2  # the ring's own state: held by the consumers it was published to


@dataclass(eq=False)
class _Consumer(Reader):
    head: int = 0  # entries published to it
    # Its socket after registration (EOF, or a broken consumer), through a descriptor of its
    # own: the registration's thread ends and closes the connection (see Registrant).
    frames: Frames = field(init=False)

    def __post_init__(self) -> None:
        self.frames = Frames(os.dup(self.conn.fileno()))

    def close(self, device: int | str) -> None:
        fd, self.frames.fd = self.frames.fd, -1  # never write to a closed (maybe reused) fd number
        if fd >= 0:
            os.close(fd)
        super().close(device)


def _by_rid(consumers: set[Any]) -> list[Any]:
    return sorted(consumers, key=lambda c: c.rid)


class RingProducer:
    """The ring's state and service; :class:`~._ring.Ring` is its public handle."""

    def __init__(
        self, buffers: list[Buffer], wanted: int, authkey: bytes, spin: float = 0.0, adaptive: bool = False
    ) -> None:
        self.slots = slots = Slots(buffers)
        self.buffers = buffers
        self._views = [slot_view(b) for b in buffers]  # what each slot's items are made from
        self.n = slots.n
        self.wanted = wanted
        self.spin = SpinPolicy(spin, adaptive)  # acquire()'s; each consumer has its own
        self.device = slots.device
        self._cuda = slots.cuda
        self.info = {
            "slots": self.n,
            "shape": buffers[0].shape,
            "dtype": buffers[0].dtype.str,
            "pid": os.getpid(),
            "spin": spin,
            "adaptive": adaptive,
        }
        # The slots' state, bound once: acquire() and publish() run per item.
        self._lock = slots.lock
        self._cond = threading.Condition(self._lock)
        self._io = slots.io
        self._state = slots.state
        self._epoch = slots.epoch
        self._holders = slots.holders
        self._last = slots.last
        self._deferred = slots.deferred
        self._seq = [0] * self.n  # the sequence of each slot's last publication: its holders' stamp
        self._busy: set[int] = set()  # published slots some consumer still holds
        self._free = collections.deque(range(self.n))
        self._targets: tuple[Any, ...] = ()  # the consumers, what publish() sends to
        self._version = 0  # bumped whenever the consumers change; the poller follows it
        self._registered = 0
        self._published = 0
        self.closed: str | None = None
        self._poller: Any = None
        self._poll_version = -1
        self._by_fd: dict[int, Any] = {}
        self._registry = Registry(RING, slots, authkey, self, _Consumer)
        self._consumers: dict[int, Any] = self._registry.readers
        self.address = self._registry.address

    # -- registration (the registry's threads; the producer's own calls read the sockets after it: _drain)
    def closed_message(self) -> Closed:
        return Closed(str(self.closed))

    def admit(self, consumer: _Consumer) -> None:
        self._refresh()
        self._registered += 1
        self._cond.notify_all()

    def _refresh(self) -> None:
        """The consumer table changed. Under _lock."""
        self._targets = tuple(self._consumers.values())
        self._version += 1

    # -- releases (under _io) ----------------------------------------------------------------
    def unpublished(self, slot: int, epoch: int) -> None:
        """Finalizer of an acquired item: if it was not published, its slot is free again.

        Once the ring is closed the slot's Buffer goes with it: close() left it to
        this item (the queue is written before ``closed`` is read)."""
        self.slots.abandon_later(slot, epoch)
        if self.closed is not None:
            self.buffers[slot].release()

    def _apply_deferred(self) -> bool:
        """Free the slots acquired and released unpublished; True if one went free. Under _io."""
        freed = self.slots.apply_deferred()
        self._free.extend(freed)
        return bool(freed)

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
                self._state[slot] = FREE
                self._free.append(slot)
                freed = True
        return freed

    def _current_poller(self) -> Any:
        if self._poll_version != self._version:
            with self._lock:
                consumers = list(self._consumers.values())
                self._poll_version = self._version
            poller = self.slots.poller()
            for c in consumers:
                poller.register(c.frames.fd, select.POLLIN)
            self._poller = poller
            self._by_fd = {c.frames.fd: c for c in consumers}
        return self._poller

    def _drain(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` (0: do not wait) for a release, an EOF or a wakeup,
        then apply everything that is there."""
        self._apply_deferred()
        slots = self.slots
        for fd, events in self._current_poller().poll(poll_ms(timeout)):
            if not slots.soak(fd):
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
            self._consumers.pop(consumer.rid, None)
            self._refresh()
            for slot in tuple(self._busy):  # the slots it still held
                holders = self._holders[slot]
                holders.discard(consumer)
                if not holders and self._state[slot] == PUBLISHED:
                    self._busy.discard(slot)
                    self._state[slot] = FREE
                    self._free.append(slot)
        log.info("gpushare: ring consumer pid %s is gone; its slots are free again", consumer.pid)
        # Under _io, like acquire()'s waits on its release events: left open, every consumer
        # that came and went would keep its events, and their driver memory, for the ring's life.
        consumer.close(self.device)

    # -- producer API ----------------------------------------------------------------------------
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
                    self._state[slot] = WRITING
                    epoch = self._epoch[slot] = self._epoch[slot] + 1
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
            if self._last[slot]:
                # The producer's writes (default stream) wait for the consumers' reads of
                # this slot's last publication, without blocking the host.
                self.slots.order_write(slot, 0)
            # Made under _io: close() releases the slot buffers only after taking it.
            return RingItem(self._views[slot], owner, slot, None, epoch, None, self.unpublished)
        finally:
            io.release()

    def _busy_message(self, timeout: float | None) -> str:
        with self._lock:
            held = [
                f"slot {i} (sequence {self._seq[i]}) by pid(s) {', '.join(str(c.pid) for c in _by_rid(h))}"
                for i, h in enumerate(self._holders)
                if self._state[i] == PUBLISHED
            ]
            acquired = self._state.count(WRITING)
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
        frame = b""
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
            if inline is None:
                frame = meta_frame(payload)
        if self._registered < self.wanted:
            self._await_consumers(timeout)
        slot = item.slot
        # Consumers wait on this slot's event, never on the whole device.
        recorded = self._cuda and self.slots.record_ready(slot, 0 if stream is None else int(stream))
        with self._io:
            if self.closed is not None:
                self._raise_closed()
            if self._state[slot] != WRITING or self._epoch[slot] != item._epoch:
                raise ValueError(f"slot {slot} is not acquired by this buffer any more; acquire() again")
            seq = self._published
            self._published = seq + 1
            self._seq[slot] = seq
            with self._lock:
                # Registration sends Registered and adds the consumer under this lock:
                # every publish that starts after the consumer heard it reaches it.
                targets = self._targets
            # The entries go first, the bookkeeping after: a consumer may release the
            # slot at once, but its release word is read only under _io, held here.
            dropped: list[_Consumer] | None = None
            for c in targets:
                if inline is None:
                    try:
                        send_frame(c.frames.fd, frame)  # before its entry
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
                self._state[slot] = PUBLISHED
                self._holders[slot].update(targets)  # empty while the slot is not published
                self._busy.add(slot)
            else:
                self._state[slot] = FREE
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
                    "acquired": self._state.count(WRITING),
                    "busy": self._state.count(PUBLISHED),
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
        self.slots.wake()  # a thread blocked in acquire() sees the close and leaves _io
        with self._io:
            with self._lock:
                consumers = list(self._consumers.values())
                self._consumers.clear()
                self._refresh()
            message = closed_frame(reason)
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
                c.close(self.device)
            self._poller = None
            self._by_fd = {}
            # A slot acquired here and not yet published keeps its Buffer until its item
            # goes (unpublished() releases it then). Its queue entry is applied here if
            # it came before ``closed`` was set; after that, unpublished() sees ``closed``.
            self._apply_deferred()
            for slot, b in enumerate(self.buffers):
                if self._state[slot] != WRITING:
                    b.release()
        self._registry.close()
