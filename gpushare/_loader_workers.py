"""A loader's worker processes: how they start, what each one runs, and how they stop.

- Start (:func:`worker_context`): forks of multiprocessing's forkserver, preloaded once
  (:func:`start_forkserver`, :func:`prepare_loaders`); GPU workers spawn while none runs.
- Run (:func:`_worker_main`): link to the trainer's allocator, make the ring from the first
  batch, build each task's batch into a free slot of it.
- Stop (:func:`stop_workers`): the stop event, a ``None`` task each, a bounded join, then
  terminate and kill; only then are their rings left.
- Messages: a :class:`Task` each way in, an :class:`Answer` per batch (a slot's ``meta``, or on
  the control queue before the worker has a ring), :class:`RingReady` and :class:`StartFailed`
  on the control queue.
Why: dev/design-notes.md, "The loader".
"""

from __future__ import annotations

import os
import queue
import time
import weakref
from collections import deque
from typing import Any, NamedTuple

from ._batch import SlotWriter, Staging, align, exception_payload
from ._buffer import Buffer
from ._errors import OwnerGoneError, RingClosedError, WaitTimeoutError
from ._service import process_alive

__all__ = [
    "JOIN_TIMEOUT",
    "POLL",
    "Answer",
    "RingReady",
    "StartFailed",
    "Task",
    "Workers",
    "current_dataset",
    "prepare_loaders",
    "start_forkserver",
    "stop_workers",
    "worker_context",
]

POLL = 0.5  # seconds between liveness checks while waiting
JOIN_TIMEOUT = 5.0  # seconds a finishing epoch waits for each worker before terminating it


# -- the messages between the trainer and its workers -------------------------------------------
class Task(NamedTuple):
    """Trainer -> worker (its task queue): build batch ``seq`` of epoch ``epoch`` from ``indices``."""

    epoch: int
    seq: int
    indices: list[Any]


class Answer(NamedTuple):
    """Worker -> trainer, about batch ``seq`` of epoch ``epoch``: ``kind`` ``"batch"`` (``payload``:
    its layout in the slot), ``"skip"`` (its epoch was left early; no payload) or ``"error"``
    (``payload``: the exception, :func:`~gpushare._batch.exception_payload`). It is the slot's
    ``meta``; a worker that has no ring yet sends it on the control queue instead."""

    worker: int
    kind: str
    epoch: int
    seq: int
    payload: Any


class RingReady(NamedTuple):
    """Worker -> trainer (control queue): its ring, made for its first batch, and its start-up marks."""

    worker: int
    ring: Any
    marks: dict[str, float]


class StartFailed(NamedTuple):
    """Worker -> trainer (control queue): it could not start; ``payload`` is the exception."""

    worker: int
    payload: tuple[Any, str]


# ---------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------


_current: list[Any] = [None]  # in a worker: its dataset (for adapters' worker info)


def current_dataset() -> Any:
    """In a loader worker, the worker's copy of the dataset; None elsewhere."""
    return _current[0]


def _fetch(dataset: Any, indices: list[Any]) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(indices))
    return [dataset[i] for i in indices]


def _worker_main(worker: int, allocator: Any, dataset: Any, collate: Any, tasks: Any, control: Any, stop: Any,
                 epoch_now: Any, options: dict[str, Any]) -> None:  # fmt: skip
    """A loader worker: build each task's batch into a slot of its ring (see the module docstring)."""
    from ._fanout import create_ring

    parent = options["parent"]
    device, backend, slots = options["device"], options["backend"], options["slots"]
    marks = {"started": time.time()}  # this worker's first-batch timeline, sent with its ring

    def going() -> bool:
        return not stop.is_set() and process_alive(parent)

    def mark(name: str) -> None:
        marks[name] = time.time()

    def ring_for(slot_bytes: int) -> Any:
        if isinstance(device, int):
            from . import _cuda

            _cuda.make_current(device)  # the context the slots need (started before unpickling)
            mark("context")
        made = create_ring(allocator, (slot_bytes,), "uint8", device, slots, 1, backend, "auto")
        mark("ring")
        control.put(RingReady(worker, made, dict(marks)))
        return made

    try:
        allocator.link()  # connect to the trainer's Owner now, not with the first slot
        mark("linked")
        _current[0] = dataset
        if options["worker_init"] is not None:
            options["worker_init"](worker)
        ring = None
        if options["slot_bytes"]:
            ring = ring_for(options["slot_bytes"])
    except BaseException as exc:
        control.put(StartFailed(worker, exception_payload(exc, worker, -1)))
        return
    staging = Staging(device) if isinstance(device, int) else None

    def acquire() -> Buffer | None:
        assert ring is not None
        while going():
            try:
                return ring.acquire(timeout=POLL)
            except WaitTimeoutError:
                continue
        return None

    while going():
        try:
            task = tasks.get(timeout=POLL)
        except queue.Empty:
            continue
        except (OwnerGoneError, EOFError, OSError):
            break
        if task is None:
            break
        epoch, seq = task.epoch, task.seq
        slot = writer = None
        meta: Any
        try:
            if epoch < epoch_now.value:  # an epoch left early: the trainer drops it anyway
                meta = Answer(worker, "skip", epoch, seq, None)
                if ring is None:
                    control.put(meta)
                    continue
                slot = acquire()
                if slot is None:
                    break
            else:
                samples = _fetch(dataset, task.indices)
                if ring is None:  # first batch: lay it out in scratch buffers, size the slots from it
                    mark("fetched")
                    writer = SlotWriter(allocator, None, device, backend)
                    meta = Answer(worker, "batch", epoch, seq, writer._layout(collate(samples, writer)))
                    writer._finish()
                    mark("collated")
                    ring = ring_for(max(1, align(writer.used)))
                    slot = acquire()
                    if slot is None:
                        break
                    writer._move_into(slot)
                    allocator.released_transient()  # the scratch memory is freed now, not pooled
                else:
                    slot = acquire()
                    if slot is None:
                        break
                    writer = SlotWriter(allocator, slot, device, backend, staging)
                    meta = Answer(worker, "batch", epoch, seq, writer._layout(collate(samples, writer)))
                    writer._finish()
        except Exception as exc:
            payload = exception_payload(exc, worker, seq)
            if writer is not None:
                writer.clear()
                writer = None
            meta = Answer(worker, "error", epoch, seq, payload)
            if ring is None:
                control.put(meta)
                continue
            if slot is None:
                slot = acquire()
                if slot is None:
                    break
        if writer is not None:
            writer.clear()
        while going():
            try:
                ring.publish(slot, meta=meta, timeout=POLL)
                break
            except WaitTimeoutError:  # the trainer has not registered yet
                continue
            except RingClosedError:
                return
        slot = None
    if ring is not None:
        ring.close()
    if staging is not None:
        staging.close()


# ---------------------------------------------------------------------------
# Starting and stopping them
# ---------------------------------------------------------------------------


def stop_workers(procs: list[Any], tasks: list[Any], control: Any, stop: Any, rings: list[Any],
                  stash: list[Any]) -> None:  # fmt: skip
    """Stop a set of workers: stop them, join them (terminating stragglers), then leave their rings."""
    stop.set()
    for q in tasks:
        try:
            q.put(None)
        except (ValueError, OSError, AssertionError):
            pass
    # Workers first, rings after: leaving a ring frees the slots this process holds, and a
    # worker still running could then rewrite a batch the trainer keeps. A worker waiting
    # for a slot polls the stop event, so it needs no wake-up.
    for proc in procs:
        proc.join(JOIN_TIMEOUT)
        if proc.is_alive():
            proc.terminate()
            proc.join(JOIN_TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join(JOIN_TIMEOUT)
    stashed = [message.ring for messages in stash for message in messages if type(message) is RingReady]
    for ring in (*rings, *stashed):  # a ring read ahead of its turn is registered too
        if ring is not None:
            ring.close()
    for q in (*tasks, control):
        q.cancel_join_thread()
        q.close()


# What a forkserver imports once, before it forks any worker: the worker's own module and,
# when the trainer has them, the heavy imports of datasets and of a worker bound to a GPU.
# None of them initialises CUDA on import (cuInit runs on first use), so the forked
# workers can still make their own contexts.
_PRELOAD = ("torch", "numpy", "gpushare.torch", "cuda.bindings.driver", "gpushare._cuda")


def worker_context(choice: Any, gpu: bool = False) -> tuple[Any, bool]:
    """The gpushare context that starts a loader's workers (``multiprocessing_context``), and
    whether to start multiprocessing's forkserver once they are started.

    ``None``: the forkserver where the platform has one, else gpushare's default context;
    spawn once the forkserver failed to start in this process (:func:`start_forkserver`).
    While no forkserver runs, GPU workers (``gpu``) are spawned, and the forkserver starts
    once their first batch is in. A name (``"spawn"``, ``"forkserver"``) or a context
    (gpushare's or multiprocessing's) picks the start method itself. Why: dev/design-notes.md,
    "The loader".
    """
    import multiprocessing

    from ._context import get_context

    if choice is None:
        if "forkserver" not in multiprocessing.get_all_start_methods():
            return get_context(), False
        if gpu and not _forkserver_failed and not _forkserver_running():
            _preload_forkserver(get_context("forkserver"))  # named now; it starts after the first batch
            return get_context("spawn"), True
        return (get_context("forkserver"), False) if _ensure_forkserver() else (get_context("spawn"), False)
    if isinstance(choice, str):
        method = choice
    else:
        get_method = getattr(choice, "get_start_method", None)
        if get_method is None:
            raise ValueError(
                f"multiprocessing_context={choice!r} is neither a start method's name nor a multiprocessing context"
            )
        method = get_method()
    ctx = get_context(method)
    if ctx.get_start_method() == "forkserver":
        _preload_forkserver(ctx)
    return ctx, False


def _forkserver_running() -> bool:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return server is not None and getattr(server, "_forkserver_pid", None) is not None


_forkserver_failed: list[str] = []  # why the forkserver could not start, once it failed: not tried again


def start_forkserver() -> bool:
    """Start multiprocessing's forkserver now (quick here: it imports in its own process);
    False, with a warning, where it cannot start: loaders left to their default then spawn their
    workers, and it is not tried again in this process."""
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except Exception as e:  # the workers still start by spawn: slower, not wrong
        import logging

        _forkserver_failed.append(f"{type(e).__name__}: {e}")
        logging.getLogger("gpushare").warning(
            "gpushare: could not start multiprocessing's forkserver (%s); loader workers will spawn", e
        )
        return False
    return True


def prepare_loaders() -> bool:
    """Start the process that loaders fork their workers from now, so the first loader's
    workers are forks too.

    Returns
    -------
    bool
        True once it runs; False where the platform has none or it could not start
        (a warning says why; loaders then spawn their workers).

    Notes
    -----
    That process is multiprocessing's forkserver, started with gpushare's worker
    module and whatever of torch, numpy and cuda.bindings this process has
    imported, never the main script; it imports them in its own process while
    this one goes on (the call takes milliseconds). Left to itself, a loader
    whose workers are bound to a GPU spawns its first workers, each an
    interpreter importing torch (seconds), and starts the forkserver after its
    first batch. Call this early in a script, after importing what the dataset
    needs and before building the model: by the first ``iter()`` the workers
    are forks (each still makes its own CUDA context). The forkserver keeps the
    environment it started with (``CUDA_VISIBLE_DEVICES`` among it) and runs
    for the process's life, shared by every loader; a loader given
    ``multiprocessing_context="spawn"`` does not use it.
    """
    return _ensure_forkserver()


prepare_loaders.__module__ = "gpushare"  # its public name


def _ensure_forkserver() -> bool:
    """The forkserver running, started now with its preload if need be; False where the platform
    has none or it failed to start (:func:`start_forkserver`)."""
    import multiprocessing

    from ._context import get_context

    if "forkserver" not in multiprocessing.get_all_start_methods() or _forkserver_failed:
        return False
    if _forkserver_running():
        return True
    _preload_forkserver(get_context("forkserver"))
    return start_forkserver()


def _preload_forkserver(ctx: Any) -> None:
    """Before the forkserver starts, name what it imports once for every worker it forks."""
    import sys
    from multiprocessing import forkserver

    if _forkserver_running():
        return  # its imports are the ones it was started with
    server = getattr(forkserver, "_forkserver", None)
    if server is None:
        return
    wanted = [__name__] + [name for name in _PRELOAD if name in sys.modules]
    have = list(getattr(server, "_preload_modules", ()) or ())
    if have == ["__main__"]:
        # multiprocessing's default: run the main script in the forkserver. Not here: a script
        # that touches CUDA at module level would leave every forked worker without CUDA; each
        # worker imports it after the fork instead, as a spawned one does.
        have = []
    ctx.set_forkserver_preload(have + [name for name in wanted if name not in have])


class Workers:
    """``num_workers`` worker processes, their queues, and the trainer's ends of their rings.

    For one epoch, or (``persistent_workers=True``) for the loader's life. ``sent``
    and ``taken`` count tasks and answers per worker over every epoch, so that an
    epoch can drop what an earlier one left in flight. ``loader`` is the
    :class:`~gpushare._loader.SlotLoader` (not imported here: it imports this module).
    """

    def __init__(self, loader: Any, allocator: Any) -> None:
        ctx, then_forkserver = worker_context(loader.multiprocessing_context, isinstance(loader.device, int))
        # Spawned while no forkserver runs: start one once this epoch's first batch is in (not
        # beside the workers' own imports, which it would slow), for the next epochs' workers.
        self.then_forkserver = then_forkserver
        n = loader.num_workers
        self.n = n
        self.tasks = [ctx.Queue() for _ in range(n)]
        self.control = ctx.Queue()
        self.stop = ctx.Event()
        self.epoch_now = ctx.Value("q", 0, lock=False)  # the epoch workers build batches for
        self.rings: list[Any] = [None] * n
        self.stash: list[deque[tuple[Any, ...]]] = [deque() for _ in range(n)]
        self.procs: list[Any] = []
        self.sent = [0] * n
        self.taken = [0] * n
        self.broken = False  # a worker died: a persistent loader starts new workers next epoch
        self.timelines: list[dict[str, float]] = [{} for _ in range(n)]  # per worker: its start-up marks
        self._finalizer = weakref.finalize(
            self, stop_workers, self.procs, self.tasks, self.control, self.stop, self.rings, self.stash
        )
        options = {
            "parent": os.getpid(),
            "device": loader.device,
            "backend": loader.backend,
            "slots": loader.slots,
            "slot_bytes": loader.slot_bytes,
            "worker_init": loader.worker_init,
        }
        for k in range(n):
            proc = ctx.Process(
                target=_worker_main,
                args=(k, allocator, loader.dataset, loader.collate, self.tasks[k], self.control, self.stop,
                      self.epoch_now, options),
                device=loader.device,
                daemon=True,
                name=f"gpushare-loader-{k}",
            )  # fmt: skip
            self.timelines[k]["spawned"] = time.time()
            proc.start()
            self.procs.append(proc)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and not self.broken

    def close(self) -> None:
        self._finalizer()
