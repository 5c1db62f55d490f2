"""The ring's policy, consumer side: every published slot, in publication order.

:meth:`RingConsumer.get` takes the next entry of this consumer's channel
(spinning, then sleeping on its item eventfd and its socket) and hands its
slot out as a :class:`~._item.RingItem`; releasing the item gives the slot
back (:meth:`~._slots.ReaderEnd.release`). The socket brings metas too long
for their entry, the end, or EOF.
"""

from __future__ import annotations

import collections
import os
import select
import time
from collections.abc import Iterator
from multiprocessing import current_process
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from .._buffer import Buffer
from .._errors import GpushareError, OwnerGoneError, RingClosedError, WaitTimeoutError
from .._spin import SpinPolicy
from ._channel import SLOT_RECORDED, Channel, soak
from ._item import RingItem, SlotView, slot_view
from ._registry import CLOSED, META, RING, Frames, read_frame, register
from ._slots import ReaderEnd
from ._wire import SPIN_LOOKS, poll_ms

__all__ = ["RingConsumer", "attach"]


def attach(address: str, info: dict[str, Any]) -> RingConsumer:
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
        self._spin = SpinPolicy(float(info.get("spin", 0.0)), bool(info.get("adaptive", False)))
        self._end = end = ReaderEnd()
        self._index = 0  # entries taken
        self._metas: collections.deque[bytes] = collections.deque()  # metas that came on the socket
        self._ending: tuple[type[GpushareError], str] | None = None  # seen on the socket; raised once drained
        self._error: tuple[type[GpushareError], str] | None = None
        self._closed: str | None = None
        try:
            closed = register(end, address, bytes(current_process().authkey), int(info["pid"]), RING)
        except GpushareError as exc:
            closed, self._error = None, (type(exc), str(exc))
        # What get() reads per item, bound once: the channel (None once shut), what each
        # slot's items are made from, the producer's ready events, and which slots have an
        # item out (at most one each: the producer republishes a slot only once this end
        # released it). An item borrows its slot's Buffer (ReaderEnd.lent) and gives the
        # slot back through the end itself.
        self._channel: Channel | None = end.channel
        self._views: list[SlotView] = [slot_view(b) for b in end.buffers]
        self._slot_events = end.slot_events
        self._lent = end.lent
        self._release = end.release
        self._frames = Frames(-1)
        self._poller: Any = None
        if closed is not None:
            self._closed = f"the ring was closed: {closed.reason}"
        if self._error is not None or closed is not None:
            self._shut()
            return
        fd = end.conn.fileno()
        self._frames = Frames(fd)
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._poller.register(end.wake, select.POLLIN)

    @property
    def slots(self) -> int:
        return int(self._info["slots"])

    @property
    def spin(self) -> float | str:
        """The ring's ``spin=``: ``"auto"``, or seconds this end spins before it sleeps."""
        return self._spin.setting

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._info["shape"])

    @property
    def dtype(self) -> Any:
        import numpy as np

        return np.dtype(self._info["dtype"])

    @property
    def closed(self) -> bool:
        return self._channel is None

    @property
    def received(self) -> int:
        """Items received so far."""
        return self._index

    # -- receiving --------------------------------------------------------------
    def _raise_unusable(self) -> NoReturn:
        if self._error is not None:
            kind, message = self._error
            raise kind(message)
        raise RingClosedError(f"{self._closed or 'this consumer end is closed'}; no more items will come")

    def get(self, timeout: float | None = None) -> Buffer:
        """The next published slot, in publication order.

        Waits at most ``timeout`` seconds (then :class:`~gpushare.WaitTimeoutError`, a ``TimeoutError``).
        Raises :class:`RingClosedError` once the producer closed the ring
        and every item published before was received, and
        :class:`OwnerGoneError` if the producer's process is gone.
        """
        channel = self._channel
        views = self._views
        if channel is None:
            self._raise_unusable()
        index = self._index
        entry = channel.take(index)
        if entry is None:
            entry = self._wait(channel, index, timeout)
        slot, seq, meta = entry
        if meta is None:
            meta = self._socket_meta()
        if slot & SLOT_RECORDED:
            slot ^= SLOT_RECORDED
            recorded = True
        else:
            recorded = False
        self._lent[slot] = True
        if self._end.orphans is not None:  # shut by another thread meanwhile (see _shut)
            self._lent[slot] = False
            self._raise_unusable()
        self._index = index + 1
        view = views[slot]
        if self._slot_events:
            # One item per slot at a time, so the slot's Memory waits for this publication:
            # on its event if the producer recorded it (else its writes were done at publish).
            view[0].arm(self._slot_events[slot], recorded)
        return RingItem(view, self, slot, seq, seq, ForkingPickler.loads(meta) if meta else None, self._release)

    def _wait(self, channel: Channel, index: int, timeout: float | None) -> tuple[int, int, bytes | None]:
        """Entry ``index`` once it is written: spin, then sleep on the eventfd and the socket."""
        start = time.monotonic()
        spin = self._spin.budget()
        if spin:
            spin_until = start + min(spin, timeout if timeout is not None else spin)
            take, monotonic, sched_yield = channel.take, time.monotonic, os.sched_yield
            looks = 0
            while True:
                entry = take(index)  # an entry not there yet fails its first comparison
                if entry is not None:
                    return entry  # sooner than the spin time: still a quick wait
                looks += 1
                if looks % SPIN_LOOKS == 0:
                    if monotonic() >= spin_until:
                        break
                    sched_yield()  # free: returns at once unless another process waits for this core
        deadline = None if timeout is None else start + timeout
        while True:
            entry = channel.take(index)
            if entry is not None:
                self._spin.waited(time.monotonic() - start)
                return entry
            if self._ending is not None:  # every item published before it was taken
                self._error = self._ending if self._ending[0] is not RingClosedError else None
                if self._error is None:
                    self._closed = self._ending[1]
                self._shut()
                self._raise_unusable()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise WaitTimeoutError(
                    f"no ring item arrived within {timeout:g} s (the producer, pid {self._info['pid']}, "
                    "published nothing new for this consumer)"
                )
            for fd, _ in self._poller.poll(poll_ms(remaining)):
                if fd == self._end.wake:
                    soak(fd)
                else:
                    self._read_socket()
            if self._channel is None:  # closed by this process meanwhile
                self._raise_unusable()

    def _read_socket(self) -> None:
        """Read what the producer sent on the socket: metas, the end, or EOF."""
        try:
            alive = self._frames.read()
        except OSError as exc:
            alive, why = False, repr(exc)
        else:
            why = "EOF"
        while (data := self._frames.pop()) is not None:
            kind, body = read_frame(data)
            if kind == META:
                self._metas.append(body)
            elif kind == CLOSED:
                self._ending = (RingClosedError, f"the ring was closed: {body.decode(errors='replace')}")
            else:
                self._ending = (OwnerGoneError, f"the ring's producer sent a message of unknown kind {data[:1]!r}")
        if not alive and self._ending is None:
            self._ending = (
                OwnerGoneError,
                f"the ring's producer (pid {self._info['pid']}) exited without closing the ring "
                f"({why}); no more items will come",
            )
        if not alive:
            self._poller.unregister(self._frames.fd)

    def _socket_meta(self) -> bytes:
        """The meta of an entry whose meta went on the socket (written before the entry)."""
        while not self._metas:
            if self._ending is not None or self._channel is None:
                self._error = (OwnerGoneError, "the ring's producer went away in the middle of an item")
                self._shut()
                self._raise_unusable()
            self._read_socket()
        return self._metas.popleft()

    def release(self, item: Buffer) -> None:
        """Give ``item`` (from :meth:`get`) back to the producer; same as ``item.release()``."""
        if not isinstance(item, RingItem) or not item._belongs_to(self):
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

    # -- ending ---------------------------------------------------------------------
    def _shut(self) -> None:
        self._channel = None  # first: a get() in another thread stops here
        frames, self._frames = self._frames, Frames(-1)
        frames.fd = -1  # a get() in another thread must never read a closed (maybe reused) fd number
        self._poller = None
        end = self._end
        buffers, end.buffers = end.buffers, []
        self._views = []
        # Items still out keep their slot's Buffer until they go (ReaderEnd.release). orphans
        # is set before lent is read, and a release clears lent before it reads orphans:
        # whichever runs second releases the Buffer (release() is idempotent). Set once: a
        # second _shut (its buffers already empty) must not replace it.
        if end.orphans is None:
            end.orphans = buffers
            for slot, b in enumerate(buffers):
                if not self._lent[slot]:
                    b.release()
        end.close()  # wakes a get() blocked in another thread

    def close(self) -> None:
        """Leave the ring: the producer frees every slot this consumer holds. Idempotent."""
        if self._channel is not None:
            self._closed = "this consumer was closed in this process"
            self._shut()

    def stats(self) -> dict[str, Any]:
        """``slots``, ``received`` (items so far), ``held`` (not yet released), ``closed``."""
        return {"slots": self.slots, "received": self.received, "held": self._lent.count(True), "closed": self.closed}

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (attach, (self._address, self._info))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.received} received"
        return f"<gpushare.RingConsumer slots={self.slots} shape={self.shape} dtype={self.dtype} {state}>"
