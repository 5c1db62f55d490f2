"""The consumer's end of a ring: registration, taking entries, releasing slots.

See :mod:`gpushare._fanout` for the protocol and :mod:`._channel` for the
shared segment this end reads entries from and writes release words to.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import time
import weakref
from collections.abc import Iterator
from multiprocessing import AuthenticationError, connection, current_process, reduction
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

from .. import _cuda
from .._authsocket import connect, shutdown_socket, socket_timeouts
from .._buffer import Buffer
from .._errors import GpushareError, OwnerGoneError, RingClosedError, WaitTimeoutError
from ._channel import SLOT_RECORDED, Channel, poke, soak
from ._item import RingItem, SlotView, slot_view
from ._wire import CLOSED, META, REGISTER_TIMEOUT, SPIN_LOOKS, Frames, SpinPolicy, poll_ms

__all__ = ["RingConsumer", "attach"]

log = logging.getLogger("gpushare")


def _close_handles(handles: list[Any]) -> None:
    """A consumer end collected without close(): its raw fds and its channel."""
    for handle in handles:
        try:
            if isinstance(handle, int):
                if handle >= 0:
                    os.close(handle)
            else:
                handle.close()
        except OSError:
            pass
    handles.clear()


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
        self._conn: connection.Connection | None = None
        self._frames = Frames(-1)
        self._poller: Any = None
        self._channel: Channel | None = None
        self._wake = -1  # eventfd the producer pokes per item
        self._release_fd = -1  # eventfd this end pokes per release
        self._index = 0  # entries taken
        self._metas: collections.deque[bytes] = collections.deque()  # metas that came on the socket
        self._ending: tuple[type[GpushareError], str] | None = None  # seen on the socket; raised once drained
        self._buffers: list[Buffer] = []
        self._views: list[SlotView] = []  # what each slot's items are made from
        # Per slot: whether an item of it is out (a slot has at most one at a time:
        # the producer republishes it only after this end released it). Once the end
        # is shut, _orphans holds the slots' Buffers that items still use; each goes
        # when its item does.
        self._out: list[bool] = []
        self._orphans: list[Buffer] | None = None
        self._device: int | str = "cpu"
        self._slot_events: list[Any] = []  # the producer's per-slot ready events, opened here
        self._release_events: list[Any] = []  # ours, recorded at each release (CUDA)
        self._error: tuple[type[GpushareError], str] | None = None
        self._closed: str | None = None
        # Raw fds and the channel: closed by _shut, or, for an end dropped without close(),
        # when it is collected (no item of it is alive then: items refer to their end).
        self._handles: list[Any] = []
        weakref.finalize(self, _close_handles, self._handles).atexit = False  # at exit the process closes them
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
            self._views = [slot_view(b) for b in self._buffers]
            self._out = [False] * len(self._buffers)
            with socket.socket(fileno=os.dup(conn.fileno())) as raw:
                fd, self._wake, self._release_fd = reduction.recvfds(raw, 3)
            try:
                self._channel = Channel.attach(fd, self.slots)
            except ValueError as exc:
                raise OSError(str(exc)) from exc
            self._handles += [self._wake, self._release_fd, self._channel]
            self._device = self._buffers[0].device if self._buffers else "cpu"
            handles = self._cuda_events(reply[2])
            conn.send(("ready", handles))
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
        self._frames = Frames(conn.fileno())
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)
        self._poller.register(self._wake, select.POLLIN)

    def _cuda_events(self, handles: list[bytes]) -> list[bytes]:
        """Open the producer's slot events; make ours (their handles go to the producer)."""
        device = self._device
        if not isinstance(device, int) or self._info["pid"] == os.getpid():
            # Host memory needs no events. A consumer in the producer's own process
            # cannot open the producer's interprocess events (the driver refuses), and
            # needs none: both ends share the context's legacy default stream.
            return []
        self._slot_events = [_cuda.event_open(h, device) for h in handles]
        mine = []
        for _ in range(self.slots):
            event, handle = _cuda.event_create_ipc(device)
            self._release_events.append(event)
            mine.append(handle)
        return mine

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
        return self._conn is None

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
        if channel is None or self._conn is None:
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
        self._out[slot] = True
        if self._orphans is not None:  # shut by another thread meanwhile (see _shut)
            self._out[slot] = False
            self._raise_unusable()
        self._index = index + 1
        view = views[slot]
        if self._slot_events:
            # One item per slot at a time, so the slot's Memory waits for this publication:
            # on its event if the producer recorded it (else its writes were done at publish).
            view[0].arm(self._slot_events[slot], recorded)
        return RingItem(view, self, slot, seq, seq, ForkingPickler.loads(meta) if meta else None, self._on_release)

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
                if fd == self._wake:
                    soak(fd)
                else:
                    self._read_socket()
            if self._conn is None:  # closed by this process meanwhile
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
            if data[:1] == bytes([META]):
                self._metas.append(data[1:])
            elif data[:1] == bytes([CLOSED]):
                self._ending = (RingClosedError, f"the ring was closed: {data[1:].decode(errors='replace')}")
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
            if self._ending is not None or self._conn is None:
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

    # -- releasing ----------------------------------------------------------------
    def _on_release(self, slot: int, seq: int) -> None:
        """An item was released or collected: tell the producer (maybe from a finalizer).

        Lock-free: a release word per slot in shared memory, then a poke. On
        CUDA our release event is recorded first, on the default stream, so
        the producer's next write of the slot waits for our reads there."""
        self._out[slot] = False  # before _orphans is read: see _shut
        orphans = self._orphans
        if orphans is not None:  # shut: the item was the last user of the slot's Buffer
            orphans[slot].release()
            return
        channel = self._channel
        if channel is None:
            return
        recorded = False
        if self._release_events:
            try:
                # Idle default stream: our reads are done; the release word says so,
                # and the producer orders nothing after us.
                recorded = not _cuda.stream_idle(self._device)  # type: ignore[arg-type]
                if recorded:
                    _cuda.event_record(self._release_events[slot], self._device)  # type: ignore[arg-type]
            except Exception:  # e.g. at interpreter exit; keep the slot rather than free it under our reads
                log.exception("gpushare: could not record the release of ring slot %d; keeping it", slot)
                return
        try:
            channel.release(slot, seq, recorded)
        except ValueError:  # closed meanwhile by another thread
            return
        poke(self._release_fd)

    # -- ending ---------------------------------------------------------------------
    def _shut(self) -> None:
        conn, self._conn = self._conn, None
        frames, self._frames = self._frames, Frames(-1)
        frames.fd = -1  # a get() in another thread must never read a closed (maybe reused) fd number
        self._poller = None
        channel, self._channel = self._channel, None
        wake, release_fd, self._wake, self._release_fd = self._wake, self._release_fd, -1, -1
        self._handles.clear()  # closed here, below: not again by the finalizer
        buffers, self._buffers = self._buffers, []
        self._views = []
        # Items still out keep their slot's Buffer until they go (_on_release). _orphans
        # is set before _out is read, and _on_release clears _out before it reads
        # _orphans: whichever runs second releases the Buffer (release() is idempotent).
        # Set once: a second _shut (its _buffers already empty) must not replace it.
        if self._orphans is None:
            self._orphans = buffers
            for slot, b in enumerate(buffers):
                if not self._out[slot]:
                    b.release()
        if conn is not None:
            shutdown_socket(conn.fileno())  # wakes a get() blocked in another thread; closing alone would not
            conn.close()
        if wake >= 0:
            poke(wake)  # a get() blocked in another thread
            os.close(wake)
        if release_fd >= 0:
            os.close(release_fd)
        if channel is not None:
            channel.close()
        # Our release events stay open until this process exits: the producer may
        # still order its next write of a slot after one of them.

    def close(self) -> None:
        """Leave the ring: the producer frees every slot this consumer holds. Idempotent."""
        if self._conn is not None:
            self._closed = "this consumer was closed in this process"
            self._shut()

    def stats(self) -> dict[str, Any]:
        """``slots``, ``received`` (items so far), ``held`` (not yet released), ``closed``."""
        return {"slots": self.slots, "received": self.received, "held": self._out.count(True), "closed": self.closed}

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (attach, (self._address, self._info))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.received} received"
        return f"<gpushare.RingConsumer slots={self.slots} shape={self.shape} dtype={self.dtype} {state}>"
