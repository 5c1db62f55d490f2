"""Queue and JoinableQueue over a shared-memory ring; SimpleQueue on a pipe.

- ``put()`` pickles the item (a Buffer's wire form, or :func:`gpushare._process.dumps`'s
  bytes) and writes it into the queue's region (:mod:`gpushare._shmring`) under the producers' lock.
  What finds no room waits in this process's backlog (:class:`_Backlog`), whose thread
  writes it as room frees: the queue is unbounded, as multiprocessing's.
- ``get()`` takes the oldest message, sleeping on a futex word while there is none, reads a
  Buffer's descriptor straight from its bytes and unpickles the rest.
- ``get()`` raises OwnerGoneError once the creator is gone and everything it put is received,
  and MainGuardError when a child of this process stopped at ``MAIN_GUARD_EXIT``.
- SimpleQueue stays multiprocessing's pipe: Pool and ProcessPoolExecutor read its connection.
Why, and the end-of-queue protocol: docs/design.md, "Queues".
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import threading
import time
import types
import weakref
from multiprocessing import context, queues, util
from multiprocessing.reduction import DupFd, ForkingPickler

from ._buffer import QUEUE_HEAD, Buffer, from_queue_pickle, queue_pickle
from ._errors import OwnerGoneError
from ._process import dumps, main_guard_error, stopped_by_main_guard
from ._shmring import FULL, KIND_DATA, KIND_SPILL, NO_ROOM, Region, spill_read, spill_write

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]

HIGHEST = pickle.HIGHEST_PROTOCOL
_dumps, _loads = pickle.dumps, pickle.loads  # ForkingPickler.loads is pickle.loads
_BUFFER_HEAD = QUEUE_HEAD

_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _settled(obj: Any, depth: int = 0) -> bool:
    """True for a plain value, which ForkingPickler and pickle write alike."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    return kind is tuple and depth < 2 and len(obj) <= 16 and all(_settled(item, depth + 1) for item in obj)


def _pickle(obj: Any) -> bytes:
    """What put() writes for ``obj``: its pickle, as a Process's arguments are pickled."""
    kind = type(obj)
    if kind is Buffer:  # first: the item a gpushare queue is for
        return queue_pickle(obj)
    if kind in _ATOMS or _settled(obj):
        return _dumps(obj, HIGHEST)
    return dumps(obj, None)


def _restore(data: bytes) -> Any:
    """get(): the item ``data`` is the pickle of."""
    if data.endswith(b"\x85R.") and data.startswith(_BUFFER_HEAD):  # maybe a Buffer's wire form
        buf = from_queue_pickle(data)
        if buf is not None:
            return buf
    return _loads(data)


def _process_alive(pid: int) -> bool:
    from ._service import process_alive

    return process_alive(pid)


WATCH_INTERVAL = 0.5  # seconds a blocking get() waits between checks that the creator lives
EXIT_GRACE = 0.5  # after the end-of-queue marker, seconds get() waits for items other processes put
# The end-of-queue marker goes out at exit after the Manager's shutdown (priority 12) and
# before the backlog's close (CLOSE_PRIORITY), whose thread then writes it behind the rest.
EXIT_PRIORITY = 10
CLOSE_PRIORITY = 9
SPIN = 50  # looks at the ring, without the lock and yielding the CPU, before a get() sleeps


def _no_yield() -> None:
    time.sleep(0)


class _CreatorExited:
    """The end-of-queue marker: the creating process exited after putting what came before."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_CreatorExited, (self.pid,))


class _Backlog:
    """One process's messages that found no room in the ring, oldest first, and the thread
    that writes them as room frees (multiprocessing's feeder, for the overflow only).

    Holds no reference to its queue: a queue collected with a backlog still delivers it.
    """

    __slots__ = ("__weakref__", "closing", "cond", "items", "region", "thread")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.items: collections.deque[tuple[bytes, int]] = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.closing = False
        self.thread: threading.Thread | None = None

    def push(self, data: bytes, kind: int) -> bool:
        """Append; True when this started the thread."""
        started = False
        with self.cond:
            self.items.append((data, kind))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._feed, name="QueueFeederThread", daemon=True)
                self.thread.start()
                started = True
            self.cond.notify()
        return started

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()

    def join(self) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _feed(self) -> None:
        region, items = self.region, self.items
        while True:
            with self.cond:
                while not items and not self.closing:
                    self.cond.wait()
                if not items:
                    return
            data, kind = items[0]
            if kind == KIND_DATA and len(data) > region.spill_over:
                data, kind = items[0] = (spill_write(data), KIND_SPILL)  # at most one file waits here
            while True:
                seen = region.cseq.value  # before the try: a get after it wakes the wait below
                if not region.try_put(data, kind, 0, 0, 0):
                    items.popleft()
                    break
                region.count_waiter("p", region.put_waiters, 1)
                region.wait_for_get(seen, WATCH_INTERVAL)
                region.count_waiter("p", region.put_waiters, -1)


def _finalize_close(backlog: _Backlog) -> None:
    backlog.close()


def _finalize_join(ref: Any) -> None:
    backlog = ref()
    if backlog is not None:
        backlog.join()


def _announce_exit(region: Region, backlog: _Backlog, maxsize: int, pid: int) -> None:
    """The creator exits, or drops the queue: the marker goes behind everything it put.

    A full bounded queue gets no marker (this must not block); its consumers
    notice the creator's death by watching it instead. Nor does a queue collected while
    this thread is inside its own put() (the lock is not reentrant).
    """
    if region.plock.holder == threading.get_ident():
        return
    _send(region, backlog, maxsize, pickle.dumps(_CreatorExited(pid), HIGHEST), False, None, 0)


def _send(region: Region, backlog: _Backlog, maxsize: int, data: bytes, block: bool, timeout: float | None,
          task: int) -> bool:  # fmt: skip
    """Write one message, behind this process's backlog; False when a bounded queue stayed full.

    A payload too large for the ring goes to a spill file only when it is written: a
    process killed with a backlog leaves no files behind for it.
    """
    payload, kind = data, KIND_DATA
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            seen = region.cseq.value  # before the try: a get after it wakes the wait below
            if backlog.items:
                answer = FULL if maxsize and region.count() + len(backlog.items) >= maxsize else NO_ROOM
            else:
                if kind == KIND_DATA and len(data) > region.spill_over:
                    payload, kind = spill_write(data), KIND_SPILL
                answer = region.try_put(payload, kind, task, maxsize, 0)
                if not answer:
                    kind = KIND_DATA  # written: the file is the consumer's now
                    return True
            if answer == NO_ROOM:  # no room in the ring now: the backlog's thread writes it later
                if task:
                    region.add_task()
                backlog.push(data, KIND_DATA)
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if not block or (left is not None and left <= 0):
                return False
            region.count_waiter("p", region.put_waiters, 1)
            region.wait_for_get(seen, WATCH_INTERVAL if left is None else min(left, WATCH_INTERVAL))
            region.count_waiter("p", region.put_waiters, -1)
    finally:
        if kind == KIND_SPILL:  # spilled, then not written
            os.unlink(payload)


class Queue:
    """``multiprocessing.Queue`` over a shared-memory ring: ``put()`` pickles the item and
    writes it into the ring itself (a thread only for what finds no room), and ``get()``
    raises OwnerGoneError instead of waiting forever for a creator that is gone."""

    _joinable = 0
    __class_getitem__: Any = classmethod(types.GenericAlias)

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        self._maxsize = max(0, int(maxsize))
        self._region = Region()
        self._opid = os.getpid()
        self._setup()

    def _setup(self) -> None:
        self._closed = False
        self._joincancelled = False
        self._exit_checked = False  # put() looked whether this process must announce its exit
        self._backlog = _Backlog(self._region)
        self._close: Any = None
        self._jointhread: Any = None
        util.register_after_fork(self, Queue._after_fork)

    def _after_fork(self) -> None:
        self._region.after_fork()
        self._setup()

    def __getstate__(self) -> tuple[Any, ...]:
        context.assert_spawning(self)
        # One fd passed per child, however often the child's pickle is made (gpushare's
        # dumps may pickle twice: its dry run, then ForkingPickler) or names the queue.
        passed = vars(context.get_spawning_popen()).setdefault("_gpushare_queue_fds", {})
        fd = self._region.fd
        if fd not in passed:
            passed[fd] = DupFd(fd)
        return (self._maxsize, passed[fd], self._opid)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._maxsize, fd, self._opid = state
        self._region = Region(fd.detach())
        self._setup()

    # -- putting

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data = _pickle(obj)
        region, backlog = self._region, self._backlog
        if backlog.items or len(data) > region.spill_over or region.try_put(data, 0, self._joinable, self._maxsize, 0):
            # Not written at once: behind this process's backlog, spilled, full, or no room.
            had_thread = backlog.thread
            if not _send(region, backlog, self._maxsize, data, block, timeout, self._joinable):
                raise queue.Full
            if backlog.thread is not had_thread:
                self._watch_backlog()
        if not self._exit_checked:
            self._exit_checked = True
            if self._opid == os.getpid():  # only the creator announces its exit
                util.Finalize(
                    self,
                    _announce_exit,
                    args=(self._region, backlog, self._maxsize, self._opid),
                    exitpriority=EXIT_PRIORITY,
                )

    def _watch_backlog(self) -> None:
        """The backlog's thread started: at exit (or when collected) this process writes
        the backlog out before it ends, as multiprocessing's feeder does."""
        if self._close is None:
            self._close = util.Finalize(self, _finalize_close, [self._backlog], exitpriority=CLOSE_PRIORITY)
        if not self._joincancelled and self._jointhread is None:
            self._jointhread = util.Finalize(
                self._backlog, _finalize_join, [weakref.ref(self._backlog)], exitpriority=-5
            )

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    # -- getting

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        got = self._region.try_get()  # the fast path: a message is there
        if got is not None:
            kind, payload = got
            item = _restore(spill_read(payload) if kind == KIND_SPILL else payload)
        else:
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

    def get_nowait(self) -> Any:
        return self.get(False)

    def _pass_on(self, marker: _CreatorExited) -> None:
        """Leave the marker in the queue for the next consumer."""
        _send(self._region, self._backlog, self._maxsize, pickle.dumps(marker, HIGHEST), False, None, 0)

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
        """One message's bytes (unpickled by ``_restore`` outside the lock); raises queue.Empty."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        region = self._region
        got = region.try_get()
        if got is None and block:
            got = self._wait(region, time.monotonic() + (timeout or 0.0))
        if got is None:
            raise queue.Empty
        kind, payload = got
        return spill_read(payload) if kind == KIND_SPILL else payload

    @staticmethod
    def _wait(region: Region, deadline: float) -> tuple[int, bytes] | None:
        """Spin a moment (a reply is often that near), then sleep on the producers' word."""
        pseq = region.pseq
        seen = pseq.value
        got = region.try_get()  # a put may have come between the caller's try and ``seen``
        if got is not None:
            return got
        yield_ = getattr(os, "sched_yield", _no_yield)
        for _ in range(SPIN):
            if pseq.value != seen:  # a commit: one word, on a line of its own
                break
            yield_()  # a producer waiting for this CPU runs first
        while True:
            seen = region.pseq.value  # before the try: a put after it wakes the wait below
            got = region.try_get()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            region.count_waiter("c", region.get_waiters, 1)
            region.wait_for_put(seen, left)
            region.count_waiter("c", region.get_waiters, -1)

    # -- the rest of multiprocessing.Queue's interface

    def qsize(self) -> int:
        return self._region.count() + len(self._backlog.items)

    def empty(self) -> bool:
        return self._region.empty()

    def full(self) -> bool:
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def close(self) -> None:
        self._closed = True
        close = self._close
        if close:
            self._close = None
            close()

    def join_thread(self) -> None:
        assert self._closed, f"Queue {self!r} not closed"
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        self._joincancelled = True
        try:
            self._jointhread.cancel()
        except AttributeError:
            pass


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``, with the same changes as :class:`Queue`; the count
    of unfinished tasks lives in the region, committed with the message that adds one."""

    _joinable = 1

    def task_done(self) -> None:
        self._region.task_done()

    def join(self) -> None:
        region = self._region
        while True:
            seen = region.cseq.value
            if region.unfinished() <= 0:
                return
            region.count_waiter("c", region.join_waiters, 1)
            region.wait_for_get(seen, WATCH_INTERVAL)
            region.count_waiter("c", region.join_waiters, -1)


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
