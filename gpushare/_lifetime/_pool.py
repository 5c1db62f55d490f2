"""The owner's size-class pool: unreferenced allocations wait here to be handed out again.

A slot with no owner reference and no lease goes back to the pool, keyed by (backend,
device, size), and the next allocation of that key takes it with its generation bumped
(so descriptors of its previous life are refused). Over ``pool_limit`` the oldest pooled
slots are taken out to be freed (by the unmap protocol, :mod:`._unmap`).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from .._errors import ManagerClosedError
from .._memory import Memory
from ._common import _ReadyEvents
from ._records import _Lease, _Peer, _Slot


class _OwnerState:
    """The state an :class:`~gpushare._lifetime.Owner` keeps, shared by its parts.

    Each part below (pool, lease table, unmapper, service) is one concern of the
    protocol with its own methods; all of them read and change this state under
    ``_lock`` (``_cond`` waits on it). :meth:`Owner.__init__` sets it.
    """

    token: bytes
    address: str
    lease_timeout: float
    unmap_timeout: float
    pool_limit: int | None
    authkey: bytes
    _lock: threading.Lock
    _cond: threading.Condition
    _pending: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]]
    _refusals: queue.SimpleQueue[tuple[_Peer, int, str]]
    _slots: dict[int, _Slot]
    _pool: dict[tuple[str, int | None, int], list[_Slot]]
    _leases: dict[int, _Lease]
    _peers: dict[int, _Peer]
    _unmap_waits: dict[int, dict[int, bool | None]]
    _leaked: list[_Slot]
    _ready: _ReadyEvents
    _lease_ids: itertools.count[int]
    _conn_ids: itertools.count[int]
    _closed: bool
    _stop: threading.Event


class _Pool(_OwnerState):
    """Recycling: a slot's way back into the pool, and out of it when the pool is too big."""

    def _memory(self, slot: _Slot, source: Any) -> Memory:
        a = slot.allocation
        return Memory(
            backend=slot.backend,
            base=a.ptr,
            alloc_nbytes=a.nbytes,
            device=a.device,
            device_uuid=a.device_uuid,
            owner_token=self.token,
            address=self.address,
            alloc_id=slot.alloc_id,
            generation=slot.generation,
            handle=a.handle,
            native=a.native,
            source=source,
        )

    def _check_slot(self, slot: _Slot) -> None:
        if slot.dead:
            raise ManagerClosedError(
                "the memory of this buffer was freed (its Manager was shut down); "
                "keep the Manager open while buffers are in use"
            )

    def _maybe_recycle(self, slot: _Slot) -> None:
        """Lock held. Put an unreferenced slot back in the pool."""
        if slot.owner_ref or slot.leases or slot.pooled or slot.dead or self._closed:
            return
        slot.pooled = True
        self._pool.setdefault(slot.pool_key, []).append(slot)
        self._cond.notify_all()

    def _over_limit_locked(self) -> list[_Slot]:
        if self.pool_limit is None:
            return []
        pooled = sorted((s for lst in self._pool.values() for s in lst), key=lambda s: s.alloc_id)
        total = sum(s.allocation.nbytes for s in pooled)
        victims = []
        while pooled and total > self.pool_limit:
            slot = pooled.pop(0)
            total -= slot.allocation.nbytes
            self._unpool_locked(slot)
            victims.append(slot)
        return victims

    def _unpool_locked(self, slot: _Slot) -> None:
        self._pool[slot.pool_key].remove(slot)
        slot.pooled = False
