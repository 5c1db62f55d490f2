"""The owner's size-class pool: unreferenced allocations wait here to be handed out again.

An allocation with no owner reference and no lease goes back to the pool,
keyed by (backend, device, size); the next allocation of that key takes it
with its generation bumped, so descriptors of its previous life are refused.
Over ``limit`` bytes, the oldest pooled allocations are taken out to be freed
(by the unmap protocol, :mod:`._unmapper`). A *transient* allocation (asked
for as such: a loader worker's scratch for its first batch, a size no later
request asks for) is never pooled: once unused it is freed the same way,
by a housekeeping round that ``kick`` starts at once. Every method runs under the
owner's lock.
"""

from __future__ import annotations

from collections.abc import Callable

from ._records import AllocRecord, OwnerState

__all__ = ["AllocationPool"]


class AllocationPool:
    """Pooled allocations by size class; ``reused`` counts the allocations served from it."""

    def __init__(self, state: OwnerState, limit: int | None) -> None:
        self._state = state
        self.limit = limit
        self._free: dict[tuple[str, int | None, int], list[AllocRecord]] = {}
        self._unused_transient: list[AllocRecord] = []  # to be freed by housekeeping, started by kick()
        self.kick: Callable[[], object] = lambda: None  # the request loop's: housekeep now
        self.reused = 0
        self._closed = False  # the owner is shutting down: nothing is pooled any more

    def take(self, key: tuple[str, int | None, int]) -> AllocRecord | None:
        """A pooled allocation of ``key`` for a new life, or None."""
        free = self._free.get(key)
        if not free:
            return None
        record = free.pop()
        record.pooled = False
        record.generation += 1
        self.reused += 1
        return record

    def offer(self, record: AllocRecord) -> None:
        """Pool ``record`` if nothing references it any more (and the owner is not shutting down);
        a transient one is set aside to be freed instead."""
        if record.owner_ref or record.leases or record.pooled or record.dead or self._closed:
            return
        if record.transient:
            if record not in self._unused_transient:
                self._unused_transient.append(record)
                self.kick()
            return
        record.pooled = True
        self._free.setdefault(record.pool_key, []).append(record)
        self._state.cond.notify_all()

    def close(self) -> None:
        """The owner is shutting down: nothing is pooled any more."""
        self._closed = True

    def remove(self, record: AllocRecord) -> None:
        """Take a pooled ``record`` out (to be freed)."""
        self._free[record.pool_key].remove(record)
        record.pooled = False

    def select(self, which: Callable[[AllocRecord], bool]) -> list[AllocRecord]:
        """Take out and return every pooled allocation ``which`` accepts."""
        victims = [r for records in self._free.values() for r in records if which(r)]
        for record in victims:
            self.remove(record)
        return victims

    def to_free(self) -> list[AllocRecord]:
        """What housekeeping frees: the unused transient allocations, then the oldest pooled
        allocations until the pool holds at most ``limit`` bytes."""
        unused, self._unused_transient = self._unused_transient, []
        unused = [r for r in unused if not (r.owner_ref or r.leases or r.dead)]
        if self.limit is None:
            return unused
        pooled = sorted((r for records in self._free.values() for r in records), key=lambda r: r.alloc_id)
        total = sum(r.allocation.nbytes for r in pooled)
        victims = unused
        while pooled and total > self.limit:
            record = pooled.pop(0)
            total -= record.allocation.nbytes
            self.remove(record)
            victims.append(record)
        return victims
