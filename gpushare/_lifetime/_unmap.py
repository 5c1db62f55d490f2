"""Freeing memory: only after every process that mapped it says it unmapped it.

The owner sends ``("unmap", alloc)`` to each mapper and waits up to ``unmap_timeout`` for
``("unmapped", alloc, ok)`` (answered by the service loop, :mod:`._serve`). A mapper that
refuses (a buffer of its still uses the memory) or does not answer makes the owner leak
the slot with a :class:`~gpushare.LeakWarning` rather than free memory someone may reach.
``trim()`` frees the whole pool this way; an out-of-memory retry frees one device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .. import _backends
from .._errors import LeakWarning
from ._common import _warn
from ._leases import _LeaseTable
from ._records import _Slot


class _Unmapper(_LeaseTable):
    """The unmap protocol and the freeing it guards."""

    def _unmap_everywhere(self, slot: _Slot) -> bool:
        """Ask every process that mapped ``slot`` to unmap it; True once all have.

        A process that refuses (it still uses the memory) or does not answer
        within ``unmap_timeout`` makes the slot leak: it is never freed.
        """
        with self._lock:
            waits: dict[int, bool | None] = {c: (None if c in self._peers else True) for c in slot.mappers}
            self._unmap_waits[slot.alloc_id] = waits
            peers = [self._peers[c] for c in slot.mappers if c in self._peers]
        for peer in peers:
            if not peer.send(("unmap", slot.alloc_id)):
                with self._lock:
                    waits[peer.conn_id] = True
        deadline = time.monotonic() + self.unmap_timeout
        with self._lock:
            while any(v is None for v in waits.values()) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            del self._unmap_waits[slot.alloc_id]
            refused = [c for c, ok in waits.items() if not ok]
            if not refused:
                return True
            self._leaked.append(slot)
            pids = [self._peers[c].pid for c in refused if c in self._peers]
        _warn(
            f"gpushare: allocation {slot.alloc_id} ({slot.label}) is still mapped by process(es) "
            f"{pids or refused}, which did not unmap it within {self.unmap_timeout:g} s; it is leaked "
            "rather than freed under them",
            LeakWarning,
        )
        return False

    def _free_locked(self, slot: _Slot) -> None:
        """Give a slot's memory back to its backend. Nobody maps it any more."""
        if slot.dead:
            return
        slot.dead = True
        self._slots.pop(slot.alloc_id, None)
        slot.backend.free(slot.allocation)

    def _destroy(self, slot: _Slot) -> bool:
        if not self._unmap_everywhere(slot):
            return False
        with self._lock:
            self._free_locked(slot)
        return True

    def trim(self) -> int:
        """Free every pooled allocation; return the bytes given back."""
        return self._trim(lambda slot: True)

    def _trim_device(self, backend: _backends.Backend, device: int | None) -> int:
        """Free the pooled allocations that share ``device``'s memory (out-of-memory retry)."""
        return self._trim(lambda slot: slot.backend.is_cuda == backend.is_cuda and slot.allocation.device == device)

    def _trim(self, which: Callable[[_Slot], bool]) -> int:
        with self._lock:
            self._drain_locked()
            victims = [s for lst in self._pool.values() for s in lst if which(s)]
            for slot in victims:
                self._unpool_locked(slot)
        return sum(slot.allocation.nbytes for slot in victims if self._destroy(slot))
