"""The tensor set's policy, trainer side: readers take the latest version; the trainer writes a slot nobody holds.

A *version* is a publication's number (1, 2, ...); the set keeps its latest
ones in its slots (``versions=`` of them). One thread per reader (readers are
engines: few), the registry's Server's, runs its :class:`_ReaderService`: it
answers the reader's takes under the slots' lock, recording each grant as held
before it answers, so the trainer always knows who holds what. A grant's
id is the stamp its release word carries. Locks (the slots'): ``io`` serializes
the trainer's threads that wait for a slot to write; ``lock`` guards the rest,
and driver calls on readers' events, so that none is destroyed under a wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from dataclasses import dataclass, field
from typing import Any

from .._buffer import Buffer, memory_of
from .._errors import TensorSetClosedError, WaitTimeoutError
from .._service import Channel as Connection
from .._service import ProtocolError, handles
from ._channel import RECORDED, poke, soak
from ._layout import Layout
from ._registry import TENSOR_SET, Closed, Grant, Reader, Registrant, Registry, Take, TimedOut
from ._slots import FREE, WRITING, Slots
from ._wire import poll_ms

__all__ = ["SetProducer"]

log = logging.getLogger("gpushare")


@dataclass(eq=False)
class _Reader(Reader):
    grants: dict[int, int] = field(default_factory=dict)  # slot -> the grant id it holds
    next_grant: int = 1
    waiting: bool = False  # its thread waits for a version newer than it has


class _ReaderService(Registrant):
    """A tensor set reader's connection, once registered: its takes, answered on its own thread.

    It waits on the socket and on the reader's eventfd (a version was published while a
    take waited, or the set closed), so it overrides ``serve``; however the connection
    ends, the reader is dropped (``on_close``)."""

    def __init__(self, registry: Registry, conn: Connection, producer: SetProducer) -> None:
        super().__init__(registry, conn)
        self.producer = producer
        self.poller: Any = None

    def serve(self, channel: Connection) -> None:
        reader: _Reader = self.reader
        try:
            self._loop(reader)
        except (EOFError, OSError):
            pass  # the reader exited, died or closed: its slots are free again
        except Exception:
            log.exception("gpushare: serving a tensor set reader (pid %s) failed; dropping it", reader.pid)

    def _loop(self, reader: _Reader) -> None:
        """Serve ``reader`` until it goes (EOFError/OSError) or the set closes."""
        producer, conn = self.producer, self.conn
        poller = self.poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        poller.register(reader.wake, select.POLLIN)
        while True:
            if producer.closed is not None:
                producer._send_closed(reader)
                return
            readable = False
            for fd, _ in poller.poll():
                if fd == reader.wake:
                    soak(fd)
                else:
                    readable = True
            if not readable:
                continue
            try:
                message = conn.recv()  # EOFError when the reader went
            except ProtocolError:
                message = None
            self.on_message(message)

    @handles(Take)
    def take(self, message: Take) -> None:
        self.producer._take(self.reader, self.poller, int(message.newer_than), message.timeout)

    def on_unknown(self, message: Any) -> None:
        log.warning("gpushare: unexpected message from tensor set reader pid %s; dropping it", self.reader.pid)
        raise EOFError("protocol: not a take")

    def on_close(self) -> None:
        if self.reader is not None:
            self.producer._drop(self.reader)


class SetProducer:
    """The trainer's state and service; :class:`~._tensor_set.TensorSet` is its public handle."""

    def __init__(self, buffers: list[Buffer], layout: Layout, authkey: bytes) -> None:
        self.slots = slots = Slots(buffers)
        self.buffers = buffers
        self.layout = layout
        self.n = slots.n
        self.authkey = authkey
        self.device = slots.device
        self.cuda = slots.cuda
        self.events = slots.events  # each slot's ready event, recorded when a version lands in it
        memory = memory_of(buffers[0])
        self.bases = [memory_of(b).base for b in buffers]  # each slot's address here
        self.info = {
            "pid": os.getpid(),
            "versions": self.n,
            "layout": layout.to_wire(),
            "owner": (memory.address, memory.owner_token),
        }
        self._lock = slots.lock
        self._io = slots.io
        self._holders = slots.holders
        self._slot_version = [0] * self.n  # the version each slot holds
        self._recorded = [False] * self.n  # whether its ready event was recorded for it
        self._latest = -1  # the slot readers are granted; -1 while none (see acquire)
        self.version = 0
        self._published = 0
        self._registered = 0
        self.closed: str | None = None
        self._poller = slots.poller()
        self._registry = Registry(
            TENSOR_SET, slots, authkey, self, _Reader, lambda registry, conn: _ReaderService(registry, conn, self)
        )
        self._readers: dict[int, Any] = self._registry.readers
        self.address = self._registry.address

    # -- one thread per reader (its _ReaderService): registration, then its takes -------
    def admit(self, reader: _Reader) -> None:
        self._registered += 1

    def _take(self, reader: _Reader, poller: Any, newer_than: int, timeout: float | None) -> None:
        """Answer one take: grant the latest version once it is newer than ``newer_than``."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        conn = reader.conn
        while True:
            with self._lock:
                self._collect(reader)
                reply: Grant | None = None
                if self.closed is None and self._latest >= 0 and self.version > newer_than:
                    slot = self._latest
                    grant = reader.grants.get(slot)
                    if grant is None:  # a new hold (one already held is granted again as it is)
                        grant = reader.next_grant
                        reader.next_grant = grant + 1
                        reader.grants[slot] = grant
                        self._holders[slot].add(reader)
                    reply = Grant(self.version, slot, grant, self._recorded[slot])
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
                    TimedOut(
                        f"no version newer than {newer_than} was published within {timeout:g} s (the trainer, "
                        f"pid {os.getpid()}, has published {latest} so far)"
                    )
                )
                return
            for fd, _ in poller.poll(poll_ms(remaining)):
                if fd == reader.wake:
                    soak(fd)
                else:  # nothing may come while a take waits: EOF, or a broken reader
                    with contextlib.suppress(ProtocolError):
                        conn.recv()
                    raise EOFError("protocol: a request while a take waited")

    def closed_message(self) -> Closed:
        """The reason, and the last version: readers may still take it (-1: none)."""
        with self._lock:
            slot = self._latest
            return Closed(str(self.closed), self.version, slot, self._recorded[slot] if slot >= 0 else False)

    def _send_closed(self, reader: _Reader) -> None:
        reader.conn.try_send(self.closed_message())

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
                last = self.slots.last[slot]
                if word & RECORDED and reader not in last:
                    last.append(reader)

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
            # Under _lock, where the trainer waits on its release events.
            reader.close(self.device)
        log.info("gpushare: tensor set reader pid %s is gone; its slots are free again", reader.pid)
        self.slots.wake()

    def unpublished(self, slot: int, epoch: int) -> None:
        """Finalizer of a draft that was neither published nor released: its slot is free again."""
        self.slots.abandon_later(slot, epoch)

    # -- the trainer's side -------------------------------------------------------------
    def _pick(self) -> int | None:
        """A slot no reader holds and nobody writes, not the latest if another is free. Under _lock."""
        self.slots.apply_deferred()
        for reader in tuple(self._readers.values()):
            self._collect(reader)
        free = [s for s in range(self.n) if self.slots.unheld(s)]
        others = [s for s in free if s != self._latest]
        if others:
            return min(others, key=self._slot_version.__getitem__)  # the oldest
        return free[0] if free else None

    def acquire(self, timeout: float | None, wait_stream: int | None) -> tuple[int, int]:
        """A slot to write: ``(slot, epoch)``. Waits while every slot is held or written; on
        CUDA ``wait_stream`` is made to wait for the reads of the slot's last readers."""
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
                        epoch = self.slots.begin_write(slot)
                        if slot == self._latest:
                            self._latest = -1  # readers that ask now wait for the new one
                        # The writes (on wait_stream) wait for the reads of its last readers.
                        self.slots.order_write(slot, wait_stream)
                        return slot, epoch
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeoutError(self._busy_message(timeout))
                for fd, _ in self._poller.poll(poll_ms(remaining)):
                    self.slots.soak(fd)
        finally:
            io.release()

    def give_back(self, slot: int, epoch: int) -> None:
        """A slot acquired and not published (a draft released, a copy that failed): free again."""
        with self._lock:
            self.slots.abandon(slot, epoch)
        self.slots.wake()

    def still_writing(self, slot: int, epoch: int) -> bool:
        return self.slots.writing(slot, epoch)

    def publish(self, slot: int, epoch: int, recorded: bool) -> int:
        """The write of ``slot`` is the latest version; wake the readers waiting for one."""
        with self._lock:
            if self.closed is not None:
                raise self._closed_error()
            if not self.still_writing(slot, epoch):
                raise ValueError(f"slot {slot} is not being written by this draft any more")
            version = self.version = self.version + 1
            self._slot_version[slot] = version
            self._recorded[slot] = recorded
            self.slots.state[slot] = FREE
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
            drafts = self.slots.state.count(WRITING)
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
                "free": sum(1 for s in range(self.n) if self.slots.unheld(s)),
                "writing": self.slots.state.count(WRITING),
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
        self.slots.wake()  # a trainer thread waiting for a free slot raises
        self._registry.close()
        # Drafts and readers hold counts of their own on the memory (their views).
        for b in self.buffers:
            b.release()

    def reader_count(self) -> int:
        with self._lock:
            return len(self._readers)
