"""A ring item: a Buffer viewing a slot, handed out by the producer's ``acquire()`` and a consumer's ``get()``.

An item takes no count on its memory. The ring's end (producer or consumer)
keeps one Buffer per slot, and a slot has at most one item out in each end,
so that end releases a slot's Buffer only once the slot's item went back
(see ``RingProducer.unpublished`` and ``ReaderEnd.release``). That saves a
count, a finalizer object and its call per item: the item's finalizer is one
of two shared marks, :data:`LIVE` or :data:`GONE`.
"""

from __future__ import annotations

from typing import Any

from .._buffer import Buffer, byte_offset, memory_of

__all__ = ["GONE", "LIVE", "RingItem", "SlotView", "slot_view"]

#: What an item of a slot is made from: (memory, byte offset, shape, dtype) of the slot's
#: Buffer, taken once per slot so that making an item costs one constructor call.
SlotView = tuple[Any, int, tuple[int, ...], Any]


def slot_view(buf: Buffer) -> SlotView:
    return (memory_of(buf), byte_offset(buf), buf.shape, buf.dtype)


class _Mark:
    """What a ring item has in place of a finalizer: only whether it is still usable."""

    __slots__ = ("alive",)

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def __call__(self) -> None:
        pass


LIVE = _Mark(True)
GONE = _Mark(False)


class RingItem(Buffer):
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
        self, view: SlotView, ring: object, slot: int, sequence: int | None, epoch: int, meta: Any, on_release: Any
    ) -> None:
        # No count on the memory (finalizer=LIVE): the ring's end keeps the slot's own
        # Buffer until this item went back.
        Buffer.__init__(self, view[0], view[1], view[2], view[3], LIVE)
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
        """Give the slot back to the ring (once); touching this item afterwards raises. Idempotent."""
        self._finalizer = GONE  # type: ignore[assignment]  # first: the slot's Buffer may go with the callback
        self._give_back()

    def _published(self) -> None:
        """The producer published this item: the slot is the consumers' now, and the item
        is spent (the slot's own Buffer stays with the ring)."""
        self._on_release = None
        self._finalizer = GONE  # type: ignore[assignment]

    def _still_acquired(self) -> bool:
        """Whether this producer item was neither published nor released yet."""
        return self._on_release is not None

    def _belongs_to(self, ring: object) -> bool:
        return self._ring is ring

    def __del__(self) -> None:
        # The callbacks only write shared memory or enqueue, and never raise.
        try:
            if self._on_release is not None:
                self._give_back()
        except Exception:  # interpreter shutdown, or __init__ did not finish
            pass

    def __repr__(self) -> str:
        state = "released" if self.released else self.backend
        return (
            f"<gpushare ring slot {self.slot} sequence={self.sequence} shape={self.shape} dtype={self.dtype} "
            f"device={self.device!r} {state}>"
        )
