"""Slots that readers hold: the mechanism under both fan-outs.

A *slot* is one of a fan-out's buffers, mapped once by each reader. A reader
holds a slot under a *stamp* (the ring: the publication's sequence; a tensor
set: the grant's id) and gives it back by writing ``stamp + 1`` into the slot's
release word in its channel (:mod:`._channel`), then poking the producer's
release eventfd. The producer writes a slot nobody holds. On CUDA, readers wait
on the slot's ready event, and the producer's next write of the slot waits on
the release events of its last readers. :class:`Slots` is the producer's side,
:class:`ReaderEnd` a reader's. Policies decide who gets which slot.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import weakref
from typing import Any

from .. import _cuda
from .._buffer import Buffer
from .._service import shutdown_socket
from . import _channel
from ._channel import Channel, poke, soak

__all__ = ["FREE", "WRITING", "ReaderEnd", "Slots", "destroy_events"]

log = logging.getLogger("gpushare")

#: A slot's state in the producer, as far as the mechanism knows it: free to write, or
#: being written (its epoch names the writer). A policy may add states of its own.
FREE, WRITING = 0, 1


def destroy_events(events: list[Any], device: int | str) -> None:
    for event in events:
        try:
            _cuda.event_destroy(event, device)  # type: ignore[arg-type]
        except Exception:
            log.exception("gpushare: destroying a fan-out event failed")


class Slots:
    """The producer's side of the slots.

    Per slot: ``state``, ``epoch`` (bumped by each write), ``holders`` (the
    readers holding it), ``last`` (the readers whose release event its next
    write waits for), and a ready event (CUDA). Also the release eventfd every
    reader pokes, and a wake pipe for this process's own threads. ``io`` lets
    one writer at a time wait for a slot; ``lock`` guards the reader table and
    what the policy says. Order: ``io`` before ``lock``.
    """

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers
        self.n = n = len(buffers)
        self.device = buffers[0].device
        self.cuda = isinstance(self.device, int)
        self.events: list[Any] = []  # ready events: recorded by a write, waited on by readers
        self.handles: list[bytes] = []
        if self.cuda:
            try:
                for _ in range(n):
                    event, handle = _cuda.event_create_ipc(self.device)  # type: ignore[arg-type]
                    self.events.append(event)
                    self.handles.append(handle)
            except BaseException:
                destroy_events(self.events, self.device)
                raise
            # Destroyed only when the slots go: readers may still wait on them.
            weakref.finalize(self, destroy_events, self.events, self.device)
        self.state = [FREE] * n
        self.epoch = [0] * n
        self.holders: list[set[Any]] = [set() for _ in range(n)]
        self.last: list[list[Any]] = [[] for _ in range(n)]
        self.io = threading.Lock()
        self.lock = threading.Lock()
        # Slots given back unwritten by a finalizer, which only enqueues and wakes.
        self.deferred: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.release_fd = _channel.eventfd()
        # Closed only when the slots go: a finalizer of a hold handed out earlier may
        # still write to them, and a reused fd number must never be.
        for fd in (self.wake_r, self.wake_w, self.release_fd):
            weakref.finalize(self, os.close, fd)

    # -- waking ------------------------------------------------------------------------------
    def wake(self) -> None:
        """Wake a thread of this process waiting for a slot."""
        try:
            os.write(self.wake_w, b"!")
        except OSError:  # pipe full (already woken) or closed
            pass

    def poller(self) -> Any:
        """A ``select.poll`` on the wake pipe and the release eventfd."""
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        poller.register(self.release_fd, select.POLLIN)
        return poller

    def soak(self, fd: int) -> bool:
        """Reset ``fd`` if it is the wake pipe or the release eventfd; False if it is neither."""
        if fd == self.release_fd:
            soak(fd)
        elif fd == self.wake_r:
            try:
                os.read(fd, 4096)
            except BlockingIOError:
                pass
        else:
            return False
        return True

    # -- writing -------------------------------------------------------------------------------
    def unheld(self, slot: int) -> bool:
        """Whether ``slot`` is free to write: nobody writes it and no reader holds it."""
        return self.state[slot] == FREE and not self.holders[slot]

    def begin_write(self, slot: int) -> int:
        """Take ``slot`` to write; the write's epoch."""
        self.state[slot] = WRITING
        epoch = self.epoch[slot] = self.epoch[slot] + 1
        return epoch

    def writing(self, slot: int, epoch: int) -> bool:
        """Whether write ``epoch`` still has ``slot``."""
        return self.state[slot] == WRITING and self.epoch[slot] == epoch

    def abandon_later(self, slot: int, epoch: int) -> None:
        """A finalizer's :meth:`abandon`: done by the next ``apply_deferred``."""
        self.deferred.put((slot, epoch))
        self.wake()

    def abandon(self, slot: int, epoch: int) -> bool:
        """Write ``epoch`` of ``slot`` ends unpublished: free the slot if that write still has it."""
        if self.writing(slot, epoch):
            self.state[slot] = FREE
            return True
        return False

    def apply_deferred(self) -> list[int]:
        """Apply the finalizers' :meth:`abandon_later`; the slots that went free."""
        freed = []
        deferred = self.deferred
        while not deferred.empty():  # one thread at a time (the policy's lock) takes from it: never Empty
            slot, epoch = deferred.get_nowait()
            if self.abandon(slot, epoch):
                freed.append(slot)
        return freed

    def order_write(self, slot: int, stream: int | None) -> None:
        """Forget ``slot``'s last readers; on CUDA, make ``stream`` wait for their release events.

        Only readers whose reads were still queued at release recorded one; an event
        already complete is skipped too (a GPU wait on another process's event ties the
        two contexts' work together). Called under the lock that readers are closed under.
        """
        readers, self.last[slot] = self.last[slot], []
        if stream is None or not self.cuda:
            return
        device: int = self.device  # type: ignore[assignment]
        for reader in readers:
            if reader.dead or not reader.events:
                continue
            event = reader.events[slot]
            if not _cuda.event_done(event, device):
                _cuda.stream_wait_event(stream, event, device)

    def record_ready(self, slot: int, stream: int) -> bool:
        """Record ``slot``'s ready event on ``stream``, unless that stream is idle (its writes are
        then done, and readers wait for nothing); whether it recorded. CUDA only."""
        device: int = self.device  # type: ignore[assignment]
        recorded = not _cuda.stream_idle(device, stream)
        if recorded:
            _cuda.event_record(self.events[slot], device, stream)
        return recorded


def _close_handles(handles: list[Any]) -> None:
    """A reader's end collected without close(): its raw fds, its channel and its connection."""
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


class ReaderEnd:
    """A reader's side of the slots: its connection, channel and fds, the slot buffers (mapped
    once), the producer's ready events and its own release events. Filled by
    ``_registry.register``; the policy's end object keeps it."""

    def __init__(self) -> None:
        self.conn: Any = None  # a _service.Channel of the fan-out protocol
        self.channel: Channel | None = None
        self.release_fd = -1  # the producer's release eventfd: poked per release
        self.wake = -1  # the ring's item eventfd (-1 in a tensor set's reader)
        self.buffers: list[Buffer] = []
        self.device: int | str = "cpu"
        self.slot_events: list[Any] = []  # the producer's ready events, opened here
        self.release_events: list[Any] = []  # ours, recorded at release (CUDA)
        # Per slot: whether a hold borrows the slot's Buffer instead of taking a count (a ring
        # item; a tensor set's grant keeps a view of its own). Once the end is shut, ``orphans``
        # holds the Buffers still borrowed; each goes when its hold is released.
        self.lent: list[bool] = []
        self.orphans: list[Buffer] | None = None
        # Raw fds and the channel: closed by close(), or by the finalizer when the end is
        # collected without it (no hold of it is alive then: holds refer to their end).
        self.handles: list[Any] = []
        weakref.finalize(self, _close_handles, self.handles).atexit = False  # at exit the process closes them

    def release(self, slot: int, stamp: int, after: tuple[Any, int] | None = None) -> None:
        """Give the hold ``stamp`` of ``slot`` back: maybe from the garbage collector, so no lock
        and no message. On CUDA the release event is recorded first, on the default stream (after
        ``after``, an ``(event, ordinal)`` of this process's own copies), unless that stream is idle."""
        self.lent[slot] = False  # before orphans is read (see RingConsumer._shut)
        orphans = self.orphans
        if orphans is not None:  # shut: the hold was the last user of the slot's Buffer
            orphans[slot].release()
            return
        channel = self.channel
        if channel is None:  # closed here
            return
        recorded = False
        if self.release_events:
            try:
                device: int = self.device  # type: ignore[assignment]
                if after is not None:
                    event, ordinal = after
                    if not _cuda.event_done(event, ordinal):
                        _cuda.stream_wait_event(0, event, device)
                # Idle default stream: our reads are done; the release word says so, and the
                # producer orders nothing after us.
                recorded = not _cuda.stream_idle(device)
                if recorded:
                    _cuda.event_record(self.release_events[slot], device)
            except Exception:  # e.g. at interpreter exit; keep the slot rather than free it under our reads
                log.exception("gpushare: could not record the release of slot %d; keeping it", slot)
                return
        try:
            channel.release(slot, stamp, recorded)
        except ValueError:  # closed meanwhile by another thread
            return
        poke(self.release_fd)

    def close(self) -> None:
        """Close the connection (waking a thread blocked on it), the fds and the channel. Our
        release events stay open until this process exits: the producer may still order its
        next write of a slot after one of them."""
        conn, self.conn = self.conn, None
        channel, self.channel = self.channel, None
        wake, release_fd, self.wake, self.release_fd = self.wake, self.release_fd, -1, -1
        self.handles.clear()  # closed here: not again by the finalizer
        if conn is not None:
            shutdown_socket(conn.fileno())  # wakes a thread blocked in a read; closing alone would not
            conn.close()
        if wake >= 0:
            poke(wake)  # a thread blocked in poll on it
            os.close(wake)
        if release_fd >= 0:
            os.close(release_fd)
        if channel is not None:
            channel.close()
