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

A blocking ``get()`` also watches the process that created the queue.
With :mod:`multiprocessing`, a consumer waiting on a queue whose producer
was killed waits forever (the consumer itself holds a write end of the
pipe, so it never sees EOF). Here, once the creating process is gone and
the queue is empty, ``get()`` raises
:class:`~gpushare._errors.OwnerGoneError` within about
``WATCH_INTERVAL`` seconds; items put before it died are still delivered
first, and a queue still fed by other living processes keeps working
while items keep coming.
"""

from __future__ import annotations

import os
import queue
import time
from multiprocessing import parent_process, queues
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._buffer import Buffer
from ._errors import OwnerGoneError
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


WATCH_INTERVAL = 0.5  # seconds a blocking get() waits between checks that the creator lives


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie counts as gone)."""
    parent = parent_process()
    if parent is not None and parent.pid == pid:
        return parent.is_alive()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class _CaptureAndWatch:
    """put() captures the item now; a blocking get() notices a dead creator."""

    _opid: int  # multiprocessing's: the pid of the process that made the queue

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(_capture(obj), block, timeout)  # type: ignore[misc]

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        get = super().get  # type: ignore[misc]
        if not block:
            return get(False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = WATCH_INTERVAL if deadline is None else min(WATCH_INTERVAL, max(0.0, deadline - time.monotonic()))
            try:
                return get(True, wait)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            if self._opid != os.getpid() and not _alive(self._opid):
                try:
                    return get(False)  # what it put before it died comes first
                except queue.Empty:
                    raise OwnerGoneError(
                        f"the process that created this queue (pid {self._opid}) is gone and the queue is "
                        "empty; nothing more will come from it. Its buffers' memory may be gone too; "
                        "end this worker, or use Manager(owner='server') for buffers that outlive it"
                    ) from None


class Queue(_CaptureAndWatch, queues.Queue):  # type: ignore[type-arg]
    """``multiprocessing.Queue`` that pickles each item in ``put()`` and whose ``get()``
    raises OwnerGoneError instead of waiting forever for a dead creator."""


class JoinableQueue(_CaptureAndWatch, queues.JoinableQueue):  # type: ignore[type-arg]
    """``multiprocessing.JoinableQueue``, with the same two changes as :class:`Queue`."""
