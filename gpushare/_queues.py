"""Queues that pickle at ``put()`` time.

:class:`multiprocessing.Queue` pickles items later, in a feeder thread.
For buffers that is a trap: ``q.put(buf); buf.release()`` would release
the buffer before it was ever described, and the feeder thread would fail
with nobody to see the error. gpushare's queues pickle in ``put()``
itself, so the item is captured (and a buffer's lease taken) before
``put()`` returns, and an unpicklable item raises in the caller. The
feeder thread then only moves bytes; ``get()`` only turns a buffer's
captured form back into a Buffer (below).

Capturing costs as little as it can: an immutable plain value (None, a
number, a string, bytes, or a small tuple of those) cannot change before
the feeder pickles it, so it is put as it is; anything else is pickled in
``put()`` and unpickled by the receiver in one extra step. A Buffer is
shared now (its lease taken, its descriptor filled in) and travels as the
plain pair ``(BUFFER_TAG, descriptor bytes)``, which ``get()`` rebuilds:
a pair of a string and bytes unpickles without looking up a global, where
a pickled Buffer costs the receiver ``find_class`` (an import by name, on
every load: more than the rest of unpickling it). A user's own tuple that
begins with the tag is sent pickled inside ``(BUFFER_TAG, pickle, None)``,
so that no item comes out of ``get()`` other than it went in.

``get()`` also ends when the process that created the queue is gone.
With :mod:`multiprocessing`, a consumer waiting on a queue whose producer
died waits forever (the consumer itself holds a write end of the pipe, so
it never sees EOF), and a producer that returns waits forever at exit to
join that consumer. Here, either way, the consumer's ``get()`` raises
:class:`~gpushare._errors.OwnerGoneError` once it has received everything
put before, and never before:

* a creator that put items and exits normally puts an end-of-queue marker
  behind them in its exit handlers (``EXIT_PRIORITY``, after the Manager's
  shutdown told workers its buffers are gone). A consumer that reads it
  waits ``EXIT_GRACE`` seconds more: items other processes still put are
  delivered as usual (the marker goes back behind them); only when none
  comes does ``get()`` raise. Either way the marker stays in the queue for
  the next consumer;
* a creator that is killed is noticed by a blocking ``get()``, which checks
  every ``WATCH_INTERVAL`` seconds, once the queue is empty.

A queue still fed by other living processes keeps working while items keep
coming.

Watching makes every blocking ``get()`` one with a timeout, which in the
stdlib polls the pipe through a new selector per call (about as much CPU
as the rest of a small get). The queue polls its pipe with one
``select.poll`` object instead (:class:`_ReaderPoll`): the same wait,
without building it each time.
"""

from __future__ import annotations

import math
import os
import queue
import select
import time
from multiprocessing import queues, util
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._buffer import Buffer
from ._errors import OwnerGoneError
from ._reduction import rebuild_buffer, share_bytes
from ._service import process_alive

__all__ = ["JoinableQueue", "Queue"]


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _settled(obj: Any, depth: int = 0) -> bool:
    """True for a value whose pickle cannot change between put() and the feeder."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    return kind is tuple and depth < 2 and len(obj) <= 16 and all(_settled(item, depth + 1) for item in obj)


BUFFER_TAG = "gpushare.Buffer\x00"  # first of the pair a Buffer travels as (see the module docstring)


def _tagged(obj: Any) -> bool:
    """Whether ``obj`` is a tuple that begins with BUFFER_TAG."""
    return type(obj) is tuple and len(obj) > 1 and type(obj[0]) is str and obj[0] == BUFFER_TAG


def _capture(obj: Any) -> Any:
    """What put() hands to the feeder thread in place of ``obj``."""
    kind = type(obj)
    if kind is Buffer:  # first: the item a gpushare queue is for
        return (BUFFER_TAG, share_bytes(obj))
    if kind is tuple and _tagged(obj):  # a user's tuple that would read as a buffer
        return (BUFFER_TAG, bytes(ForkingPickler.dumps(obj)), None)
    if _settled(obj):
        return obj
    return _Pickled(bytes(ForkingPickler.dumps(obj)))


def _restore(item: tuple[Any, ...]) -> Any:
    """get(): the item a tagged tuple stands for (a Buffer, or a user's tuple)."""
    if len(item) == 2:
        return rebuild_buffer(item[1])
    return ForkingPickler.loads(item[1])


class _Pickled:
    """An item already pickled by ``put()``; unpickles to the item itself."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (ForkingPickler.loads, (self.data,))


WATCH_INTERVAL = 0.5  # seconds a blocking get() waits between checks that the creator lives
EXIT_GRACE = 0.5  # after the end-of-queue marker, seconds get() waits for items other processes put
# The end-of-queue marker goes out at exit after the Manager's shutdown (priority 12) and
# just before the queue's own close (stdlib, priority 10, registered earlier).
EXIT_PRIORITY = 10


class _CreatorExited:
    """The end-of-queue marker: the creating process exited after putting what came before."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_CreatorExited, (self.pid,))


def _announce_exit(buffer: Any, notempty: Any, sem: Any) -> None:
    """The creator exits, or drops the queue: the marker goes behind everything it put.

    Runs before the stdlib's own close of the queue (both at exit and when the
    queue is collected), whose feeder thread then sends it like any item. A
    full bounded queue gets no marker (this must not block); its consumers
    notice the creator's death by watching it instead.
    """
    if not sem.acquire(False):  # the slot get() gives back when it takes the marker
        return
    with notempty:
        buffer.append(_CreatorExited(os.getpid()))
        notempty.notify()


class _ReaderPoll:
    """``Connection.poll`` for a queue's reader, with one ``select.poll`` object.

    The stdlib's builds a selector on every call, and a watching ``get()``
    polls on every call. Same answers: True when there is data or the
    writers are gone (the read then raises EOFError); a closed reader raises
    OSError (from ``fileno()``). A poll object is plain user memory, so it
    stays valid in a forked child (which makes its own anyway: ``_reset``).
    """

    __slots__ = ("_poller", "_reader")

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self._poller: Any = None

    def __call__(self, timeout: float | None = 0.0) -> bool:
        fd = self._reader.fileno()
        poller = self._poller
        if poller is None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self._poller = poller
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        try:
            return bool(poller.poll(ms))
        except RuntimeError:  # "concurrent poll() invocation": another thread of this process
            # polls the same object (a get() waits while this is empty()): the stdlib's way.
            return bool(self._reader.poll(timeout))


class _CaptureAndWatch:
    """put() captures the item now; get() ends when the creator is gone."""

    _opid: int  # multiprocessing's: the pid of the process that made the queue
    _closed: bool

    _buffer: Any
    _notempty: Any
    _sem: Any
    _reader: Any
    _poll: Any
    _exit_checked = False  # put() looked whether this process must announce its exit

    def _reset(self, after_fork: bool = False) -> None:
        # multiprocessing's (at creation, unpickling and fork): it sets the
        # reader's poll, which get() with a timeout calls; use the cheap one.
        super()._reset(after_fork)  # type: ignore[misc]
        if hasattr(select, "poll"):
            self._poll = _ReaderPoll(self._reader)

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(_capture(obj), block, timeout)  # type: ignore[misc]
        if not self._exit_checked:
            # Once per queue object, after the first put started the feeder and registered
            # the stdlib's close, so that this runs first (later registrations run first, at
            # exit and on collection). Only the creator announces its exit.
            self._exit_checked = True
            if self._opid == os.getpid():
                util.Finalize(
                    self, _announce_exit, args=(self._buffer, self._notempty, self._sem), exitpriority=EXIT_PRIORITY
                )

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = self._get(block, timeout)
        kind = type(item)
        if kind is tuple:
            return _restore(item) if _tagged(item) else item
        if kind is not _CreatorExited:
            return item
        # The creator exited. Other processes may still be putting: go on while items
        # keep coming, and leave the marker behind them for the next consumer.
        try:
            after = self._get(True, EXIT_GRACE)
        except queue.Empty:
            after = item
        self._pass_on(item)
        if _tagged(after):
            return _restore(after)
        if type(after) is not _CreatorExited:
            return after
        raise OwnerGoneError(
            f"the process that created this queue (pid {item.pid}) exited, and nothing more came "
            f"within {EXIT_GRACE:g} s; its buffers' memory is gone with it. End this worker, or use "
            "Manager(owner='server') for buffers that outlive their producer"
        )

    def _pass_on(self, marker: _CreatorExited) -> None:
        """Leave the marker in the queue for the next consumer."""
        if hasattr(self, "task_done"):
            try:
                self.task_done()
            except ValueError:  # the marker was not counted (put at exit, past JoinableQueue.put)
                pass
        try:
            super().put(marker)  # type: ignore[misc]
        except (ValueError, OSError, AssertionError):
            pass

    def _get(self, block: bool, timeout: float | None) -> Any:
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
            if self._opid != os.getpid() and not process_alive(self._opid):
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
    raises OwnerGoneError instead of waiting forever for a creator that is gone."""


class JoinableQueue(_CaptureAndWatch, queues.JoinableQueue):  # type: ignore[type-arg]
    """``multiprocessing.JoinableQueue``, with the same two changes as :class:`Queue`."""
