"""Freeing memory: only after every process that mapped it says it unmapped it.

The owner sends ``Unmap`` to each mapper and waits up to ``timeout`` for
``Unmapped`` (the request loop hands the answers to
:meth:`Unmapper.answered_locked`). A mapper that refuses (a buffer of its
still uses the memory) or does not answer makes the owner leak the allocation
with a :class:`~gpushare.LeakWarning` rather than free memory someone may
still reach. ``trim()`` frees the whole pool this way; an out-of-memory retry
frees one device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .._errors import LeakWarning
from ._protocol import Unmap, warn
from ._records import AllocationPool, AllocRecord, Consumers, LeaseTable, OwnerState

__all__ = ["Unmapper"]


class Unmapper:
    """The unmap protocol and the freeing it guards; ``leaked`` lists what it would not free."""

    def __init__(
        self, state: OwnerState, pool: AllocationPool, leases: LeaseTable, consumers: Consumers, timeout: float
    ) -> None:
        self._state = state
        self._pool = pool
        self._leases = leases
        self._consumers = consumers  # asked who is connected, and how to reach them
        self.timeout = float(timeout)
        self._waits: dict[int, dict[int, bool | None]] = {}  # alloc id -> {conn id: answer}
        self.leaked: list[AllocRecord] = []

    def unmap_everywhere(self, record: AllocRecord) -> bool:
        """Ask every process that mapped ``record`` to unmap it; True once all have.

        A process that refuses (it still uses the memory) or does not answer
        within ``timeout`` makes the allocation leak: it is never freed.
        """
        state = self._state
        consumers = self._consumers
        with state.lock:
            waits: dict[int, bool | None] = {c: (None if c in consumers else True) for c in record.mappers}
            self._waits[record.alloc_id] = waits
            peers = [peer for c in record.mappers if (peer := consumers.get(c)) is not None]
        for peer in peers:
            if not peer.send(Unmap(record.alloc_id)):
                with state.lock:
                    waits[peer.conn_id] = True
        deadline = time.monotonic() + self.timeout
        with state.lock:
            while any(v is None for v in waits.values()) and time.monotonic() < deadline:
                state.cond.wait(max(0.0, deadline - time.monotonic()))
            del self._waits[record.alloc_id]
            refused = [c for c, ok in waits.items() if not ok]
            if not refused:
                return True
            self.leaked.append(record)
            pids = [peer.pid for c in refused if (peer := consumers.get(c)) is not None]
        warn(
            f"gpushare: allocation {record.alloc_id} ({record.label}) is still mapped by process(es) "
            f"{pids or refused}, which did not unmap it within {self.timeout:g} s; it is leaked "
            "rather than freed under them",
            LeakWarning,
        )
        return False

    def answered_locked(self, conn_id: int, alloc_id: int, ok: bool) -> None:
        """Consumer ``conn_id`` answered an unmap request for ``alloc_id``."""
        waits = self._waits.get(alloc_id)
        if waits is not None and conn_id in waits:
            waits[conn_id] = bool(ok)
        if ok:
            record = self._state.records.get(alloc_id)
            if record is not None:
                record.mappers.discard(conn_id)
        self._state.cond.notify_all()

    def peer_gone_locked(self, conn_id: int) -> None:
        """Consumer ``conn_id``'s connection closed: its mappings died with it."""
        for record in self._state.records.values():
            record.mappers.discard(conn_id)
        for waits in self._waits.values():
            if conn_id in waits:
                waits[conn_id] = True
        self._state.cond.notify_all()

    def free_locked(self, record: AllocRecord) -> None:
        """Give ``record``'s memory back to its backend. Nobody maps it any more."""
        if record.dead:
            return
        record.dead = True
        self._state.records.pop(record.alloc_id, None)
        record.backend.free(record.allocation)

    def destroy(self, record: AllocRecord) -> bool:
        """Unmap ``record`` everywhere, then free it; False if it leaked instead."""
        if not self.unmap_everywhere(record):
            return False
        with self._state.lock:
            self.free_locked(record)
        return True

    def trim(self, which: Callable[[AllocRecord], bool]) -> int:
        """Free every pooled allocation ``which`` accepts; return the bytes given back."""
        with self._state.lock:
            self._leases.catch_up_locked()
            victims = self._pool.select(which)
        return sum(record.allocation.nbytes for record in victims if self.destroy(record))
