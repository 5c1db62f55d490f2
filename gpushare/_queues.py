"""Queues that pickle at ``put()`` time.

:class:`multiprocessing.Queue` pickles items later, in a feeder thread.
For buffers that is a trap: ``q.put(buf); buf.release()`` would release
the buffer before it was ever described, and the feeder thread would fail
with nobody to see the error. gpushare's queues pickle in ``put()``
itself, so the item is captured (and a buffer's lease taken) before
``put()`` returns, and an unpicklable item raises in the caller. The
feeder thread then only moves bytes; ``get()`` is unchanged.

Capturing costs as little as it can: an immutable plain value (None, a
number, a string, bytes, or a small tuple of those) cannot change before
the feeder pickles it, so it is put as it is; a Buffer is replaced by its
reduction (the lease is taken now, and it pickles once, exactly as the
buffer would); anything else is pickled in ``put()`` and unpickled by the
receiver in one extra step.
"""

from __future__ import annotations

from multiprocessing import queues
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._buffer import Buffer
from ._reduction import reduce_buffer

__all__ = ["JoinableQueue", "Queue"]


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _settled(obj: Any, depth: int = 0) -> bool:
    """True for a value whose pickle cannot change between put() and the feeder."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    return kind is tuple and depth < 2 and len(obj) <= 16 and all(_settled(item, depth + 1) for item in obj)


def _capture(obj: Any) -> Any:
    """What put() hands to the feeder thread in place of ``obj``."""
    if _settled(obj):
        return obj
    if type(obj) is Buffer:
        return _Reduced(reduce_buffer(obj))
    return _Pickled(bytes(ForkingPickler.dumps(obj)))


class _Reduced:
    """A buffer's reduction, taken by ``put()``: pickles exactly as the buffer would."""

    __slots__ = ("reduction",)

    def __init__(self, reduction: tuple[Any, ...]) -> None:
        self.reduction = reduction

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduction


class _Pickled:
    """An item already pickled by ``put()``; unpickles to the item itself."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (ForkingPickler.loads, (self.data,))


class Queue(queues.Queue):  # type: ignore[type-arg]
    """``multiprocessing.Queue`` that pickles each item in ``put()``."""

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(_capture(obj), block, timeout)


class JoinableQueue(queues.JoinableQueue):  # type: ignore[type-arg]
    """``multiprocessing.JoinableQueue`` that pickles each item in ``put()``."""

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(_capture(obj), block, timeout)
