"""Pool and ProcessPoolExecutor: work pickled as a Process's arguments are.

- :class:`Pool` sends tasks through a :class:`_TaskQueue` whose ``send`` pickles with
  :func:`gpushare._process.dumps`; workers return results on gpushare's SimpleQueue.
- An executor's call items get a reducer of their own (:func:`carry_executor_calls`),
  registered with ForkingPickler when a gpushare context first makes an executor's result queue.
- A worker that exits with ``MAIN_GUARD_EXIT`` stops the Pool starting workers: every task,
  given before or after, fails with MainGuardError (done in ``Pool.Process``).
Why: dev/design-notes.md, "Pool and executors".
"""

from __future__ import annotations

import threading
import time
import weakref
from multiprocessing import pool as _mp_pool

from . import _seams
from ._process import MAIN_GUARD_EXIT, dumps, main_guard_error
from ._queues import SimpleQueue

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["Pool", "carry_executor_calls"]


class _TaskQueue(SimpleQueue):
    """A Pool's task pipe. ``send`` is the Pool's ``_quick_put``, called by its task
    handler thread only: it pickles with ``dumps`` and refuses every task once the Pool
    broke (``failure``); :meth:`take_back` empties the pipe of tasks no worker read."""

    failure: BaseException | None = None  # set once, by the worker handler thread
    _sending = False

    def send(self, task: Any) -> None:
        self._sending = True  # before reading failure: take_back() waits while this is set
        try:
            failure = self.failure
            if failure is not None and task is not None:  # None: the workers' stop sentinel
                raise type(failure)(str(failure))
            self._writer.send_bytes(dumps(task, None))  # type: ignore[attr-defined]
        finally:
            self._sending = False

    def take_back(self) -> list[Any]:
        """Every task in the pipe, once ``failure`` is set: the task handler may be in
        ``send()`` (blocked on a full pipe, even), so read until it is out of it and the
        pipe is empty. Nothing when a live worker holds the read lock (it reads them)."""
        tasks: list[Any] = []
        reader = self._reader  # type: ignore[attr-defined]
        if not self._rlock.acquire(timeout=1.0):  # type: ignore[attr-defined]
            return tasks
        try:
            while True:
                while reader.poll(0):
                    tasks.append(reader.recv())
                if not self._sending and not reader.poll(0):
                    return tasks
                time.sleep(0.01)
        finally:
            self._rlock.release()  # type: ignore[attr-defined]


class _BrokenWorker:
    """Stands for a worker a broken Pool does not start: it exited already."""

    name = "unstarted"
    daemon = True
    exitcode = MAIN_GUARD_EXIT
    pid = None

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def terminate(self) -> None:
        pass


class _WorkerStarter:
    """``Pool.Process`` of one Pool: starts its workers, and breaks the Pool instead once one
    of them exited with MAIN_GUARD_EXIT (see the module docstring)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = weakref.ref(pool)  # the Pool holds this: no cycle
        self._started: list[Any] = []  # workers started and not yet seen exited
        self._broken = False

    def __call__(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._broken:
            for worker in self._started:
                if worker.exitcode == MAIN_GUARD_EXIT:
                    self._break(worker)
                    break
            self._started = [w for w in self._started if w.exitcode is None]
        if self._broken:
            return _BrokenWorker()
        worker = ctx.Process(*args, **kwargs)
        self._started.append(worker)
        return worker

    def _break(self, worker: Any) -> None:
        """Fail every task: those still to be sent (``send`` refuses them: the stdlib's task
        handler fails each, as it fails one that does not pickle) and those in the pipe."""
        self._broken = True
        pool = self._pool()
        if pool is None:
            return
        error = main_guard_error("a worker process of this Pool", worker.pid)
        inqueue = pool._inqueue  # type: ignore[attr-defined]
        inqueue.failure = error
        for task in inqueue.take_back():
            if task is not None:
                job, index = task[:2]
                try:
                    pool._cache[job]._set(index, (False, error))  # type: ignore[attr-defined]
                except KeyError:
                    pass


class Pool(_mp_pool.Pool):
    """``multiprocessing.pool.Pool`` whose tasks and results are pickled as a Process's
    arguments are, so lambdas and closures work as functions, arguments and results.

    Without ``context`` it uses gpushare's default context (spawn, gpushare's
    processes). A Pool whose workers exit at once because the main module starts
    processes at its top level fails its tasks with MainGuardError instead of starting
    new workers forever."""

    def __init__(
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: Any = (),
        maxtasksperchild: int | None = None,
        context: Any = None,
    ) -> None:
        super().__init__(processes, initializer, initargs, maxtasksperchild, context or _seams.default_context())

    def _setup_queues(self) -> None:
        # The stdlib's __init__ calls this first, before it reads self.Process for its
        # worker handler thread.
        self.Process = _WorkerStarter(self)  # type: ignore[method-assign,assignment]
        self._inqueue = _TaskQueue(ctx=self._ctx)  # type: ignore[attr-defined]
        self._outqueue = SimpleQueue(ctx=self._ctx)  # type: ignore[attr-defined]
        self._quick_put = self._inqueue.send
        self._quick_get = self._outqueue._reader.recv  # type: ignore[attr-defined]


# -- concurrent.futures.ProcessPoolExecutor ------------------------------------------------

_carry_lock = threading.Lock()
_carrying = False


def carry_executor_calls() -> None:
    """Register the reducer of ProcessPoolExecutor's call items with ForkingPickler (once)."""
    global _carrying
    with _carry_lock:
        if _carrying:
            return
        from concurrent.futures import process as _executor
        from multiprocessing.reduction import ForkingPickler

        ForkingPickler.register(_executor._CallItem, _reduce_call_item)  # type: ignore[attr-defined]
        _carrying = True


def _reduce_call_item(item: Any) -> Any:
    """A call item, pickled by :func:`dumps` (byte for byte multiprocessing's pickle
    when that carries it)."""
    return (_rebuild_call_item, (dumps((item.work_id, item.fn, item.args, item.kwargs), None),))


def _rebuild_call_item(data: bytes) -> Any:
    """In an executor's worker: the call item :func:`_reduce_call_item` pickled by value."""
    import pickle
    from concurrent.futures import process as _executor

    return _executor._CallItem(*pickle.loads(data))  # type: ignore[attr-defined]
