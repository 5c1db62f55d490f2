"""Queues that pickle at ``put()`` time.

:class:`multiprocessing.Queue` pickles items later, in a feeder thread.
For buffers that is a trap: ``q.put(buf); buf.release()`` would release
the buffer before it was ever described, and the feeder thread would fail
with nobody to see the error. gpushare's queues pickle in ``put()``
itself, so the item is captured (and a buffer's lease taken) before
``put()`` returns, and an unpicklable item raises in the caller. The
feeder thread then only moves bytes; ``get()`` is unchanged.
"""

from __future__ import annotations

from multiprocessing import queues
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["JoinableQueue", "Queue"]


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
        super().put(_Pickled(bytes(ForkingPickler.dumps(obj))), block, timeout)


class JoinableQueue(queues.JoinableQueue):  # type: ignore[type-arg]
    """``multiprocessing.JoinableQueue`` that pickles each item in ``put()``."""

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(_Pickled(bytes(ForkingPickler.dumps(obj))), block, timeout)
