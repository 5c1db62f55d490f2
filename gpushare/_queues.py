"""Queue, JoinableQueue and SimpleQueue that pickle in ``put()``.

- ``put()`` captures the item: a Buffer's wire form, or :func:`gpushare._process.dumps`'s
  bytes (:class:`_Pickled`); this queue's feeder (:func:`_feed`) writes them as they are.
- ``get()`` reads a Buffer's descriptor straight from its bytes and unpickles the rest.
- ``get()`` raises OwnerGoneError once the creator is gone and everything it put is received,
  and MainGuardError when a child of this process stopped at ``MAIN_GUARD_EXIT``.
- A blocking ``get()`` polls its pipe with one ``select.poll`` object (:class:`_ReaderPoll`).
Why, and the end-of-queue protocol: docs/design.md, "Queues".
"""

from __future__ import annotations

import errno
import math
import os
import queue
import select
import threading
import time
import weakref
from multiprocessing import queues, util
from multiprocessing.reduction import ForkingPickler

from ._buffer import Buffer, queue_pickle
from ._errors import OwnerGoneError
from ._process import dumps, main_guard_error, stopped_by_main_guard

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _settled(obj: Any, depth: int = 0) -> bool:
    """True for a value whose pickle cannot change between put() and the feeder."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    return kind is tuple and depth < 2 and len(obj) <= 16 and all(_settled(item, depth + 1) for item in obj)


class _Pickled:
    """An item already pickled by ``put()``: the feeder writes ``data`` as it is."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _capture(obj: Any) -> Any:
    """What put() hands to the feeder thread in place of ``obj``."""
    kind = type(obj)
    if kind is Buffer:  # first: the item a gpushare queue is for
        return _Pickled(queue_pickle(obj))
    if _settled(obj):
        return obj
    return _Pickled(dumps(obj, None))


def _restore(data: bytes) -> Any:
    """get(): the item ``data`` is the pickle of."""
    if data[:2] == b"\x80\x05" and data[-3:] == b"\x85R.":  # maybe a Buffer's wire form
        from ._buffer import from_queue_pickle

        buf = from_queue_pickle(data)
        if buf is not None:
            return buf
    return ForkingPickler.loads(data)


def _process_alive(pid: int) -> bool:
    from ._service import process_alive

    return process_alive(pid)


def _feed(buffer: Any, notempty: Any, send_bytes: Any, writelock: Any, reader_close: Any, writer_close: Any,
          ignore_epipe: bool, onerror: Any, queue_sem: Any) -> None:  # fmt: skip
    """The feeder thread: what multiprocessing's does, but an item ``put()`` already
    pickled is written as it is (see the module docstring).

    It takes items from ``buffer`` as they come, pickles the ones still to be
    pickled outside the write lock, and writes each under it. The stdlib's close
    (``Queue._finalize_close``) puts multiprocessing's own end marker in the buffer:
    then it closes the pipe's ends and returns. An error writing an item gives its
    place in the queue back and reports it (``onerror``), unless the process is
    exiting (its pipes may already be closed) or the reader went away and the
    queue ignores that.
    """
    end = queues._sentinel  # type: ignore[attr-defined]  # what Queue._finalize_close appends
    while True:
        with notempty:
            if not buffer:
                notempty.wait()
        try:
            while buffer:
                item = buffer.popleft()
                if item is end:
                    reader_close()
                    writer_close()
                    return
                data = item.data if type(item) is _Pickled else ForkingPickler.dumps(item)
                if writelock is None:
                    send_bytes(data)
                else:
                    with writelock:
                        send_bytes(data)
        except Exception as exc:
            if ignore_epipe and getattr(exc, "errno", 0) == errno.EPIPE:
                return
            if util.is_exiting():
                util.info("error in queue thread: %s", exc)
                return
            queue_sem.release()
            onerror(exc, item)


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
    """put() captures the item now; get() ends when the creator is gone. Over a
    ``multiprocessing.queues`` class, whose attributes these are."""

    _opid: int
    _closed: bool
    _buffer: Any
    _notempty: Any
    _sem: Any
    _rlock: Any
    _wlock: Any
    _reader: Any
    _writer: Any
    _poll: Any
    _recv_bytes: Any
    _send_bytes: Any
    _ignore_epipe: bool
    _thread: Any
    _jointhread: Any
    _joincancelled: bool
    _close: Any
    _on_queue_feeder_error: Any
    _exit_checked = False  # put() looked whether this process must announce its exit

    def _reset(self, after_fork: bool = False) -> None:
        # multiprocessing's (at creation, unpickling and fork): it sets the
        # reader's poll, which get() with a timeout calls; use the cheap one.
        super()._reset(after_fork)  # type: ignore[misc]
        if hasattr(select, "poll"):
            self._poll = _ReaderPoll(self._reader)

    def _start_thread(self) -> None:
        """Start this queue's feeder (:func:`_feed`), as multiprocessing starts its own:
        the same exit-time join of the thread and the same close when collected."""
        self._buffer.clear()
        self._thread = threading.Thread(
            target=_feed,
            args=(self._buffer, self._notempty, self._send_bytes, self._wlock, self._reader.close,
                  self._writer.close, self._ignore_epipe, self._on_queue_feeder_error, self._sem),
            name="QueueFeederThread",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        stdlib: Any = queues.Queue  # its finalizers, which typeshed does not list
        if not self._joincancelled:
            self._jointhread = util.Finalize(
                self._thread, stdlib._finalize_join, [weakref.ref(self._thread)], exitpriority=-5
            )
        self._close = util.Finalize(self, stdlib._finalize_close, [self._buffer, self._notempty], exitpriority=10)

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
        if type(item) is not _CreatorExited:
            return item
        # The creator exited. Other processes may still be putting: go on while items
        # keep coming, and leave the marker behind them for the next consumer.
        try:
            after = self._get(True, EXIT_GRACE)
        except queue.Empty:
            after = item
        self._pass_on(item)
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
        """The next item; a blocking wait checks every WATCH_INTERVAL that the creator lives."""
        if not block:
            return _restore(self._receive(False, None))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = WATCH_INTERVAL if deadline is None else min(WATCH_INTERVAL, max(0.0, deadline - time.monotonic()))
            try:
                return _restore(self._receive(True, wait))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            if self._opid != os.getpid() and not _process_alive(self._opid):
                try:
                    return _restore(self._receive(False, None))  # what it put before it died comes first
                except queue.Empty:
                    raise OwnerGoneError(
                        f"the process that created this queue (pid {self._opid}) is gone and the queue is "
                        "empty; nothing more will come from it. Its buffers' memory may be gone too; "
                        "end this worker, or use Manager(owner='server') for buffers that outlive it"
                    ) from None
            child = stopped_by_main_guard()
            if child is not None:  # nothing it was to put will come, nor from any child started alike
                raise main_guard_error(f"child process {child.name}", child.pid)

    def _receive(self, block: bool, timeout: float | None) -> bytes:
        """One item's bytes from the pipe (multiprocessing's get, less the unpickling, which
        ``_restore`` does outside the read lock); raises queue.Empty like it."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if block and timeout is None:
            with self._rlock:
                data: bytes = self._recv_bytes()
            self._sem.release()
            return data
        deadline = time.monotonic() + timeout if block and timeout is not None else 0.0
        if not self._rlock.acquire(block, timeout):
            raise queue.Empty
        try:
            if not self._poll(max(0.0, deadline - time.monotonic()) if block else 0.0):
                raise queue.Empty
            data = self._recv_bytes()
            self._sem.release()
        finally:
            self._rlock.release()
        return data


class Queue(_CaptureAndWatch, queues.Queue):  # type: ignore[type-arg]
    """``multiprocessing.Queue`` that pickles each item in ``put()`` and whose ``get()``
    raises OwnerGoneError instead of waiting forever for a creator that is gone."""


class JoinableQueue(_CaptureAndWatch, queues.JoinableQueue):  # type: ignore[type-arg]
    """``multiprocessing.JoinableQueue``, with the same two changes as :class:`Queue`."""


class SimpleQueue(queues.SimpleQueue):
    """``multiprocessing.SimpleQueue`` whose ``put()`` pickles as a Process's arguments are
    (lambdas and closures by value): Pool's and ProcessPoolExecutor's tasks and results."""

    def put(self, obj: Any) -> None:
        # Pickled before taking the lock, as the stdlib's does; a plain value (a Pool's None
        # sentinel, put even at interpreter exit) by ForkingPickler alone, the same bytes.
        data = ForkingPickler.dumps(obj) if _settled(obj) else dumps(obj, None)
        if self._wlock is None:  # type: ignore[attr-defined]
            self._writer.send_bytes(data)  # type: ignore[attr-defined]
        else:
            with self._wlock:  # type: ignore[attr-defined]
                self._writer.send_bytes(data)  # type: ignore[attr-defined]
