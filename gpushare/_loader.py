"""SlotLoader: dataset batches built by worker processes straight into pre-shared slots.

The data flow, per epoch (one ``iter(loader)``):

* The trainer (the process iterating) uses a Manager with
  ``owner="server"`` (the loader's own, or one passed in), starts
  ``num_workers`` gpushare Processes, and sends each a *task* per batch:
  ``(sequence, indices)`` on that worker's queue, round robin (batch ``s``
  goes to worker ``s % num_workers``), at most ``prefetch`` ahead per worker.
* Each worker connects to the Manager and makes its own ring
  (``manager.ring(...)``: ``slots`` buffers of ``slot_bytes`` bytes, owned
  by the Manager's server, so a worker that dies takes no memory the
  trainer still uses with it). It sends the ring to the trainer on the
  control queue once; the trainer unpickles it and so registers as its
  one consumer. For every task the worker fetches the samples, acquires a
  free slot, and the ``collate`` function writes the batch into it through
  a :class:`SlotWriter` (each array at the next 256-byte boundary). The
  worker publishes the slot with its *layout* (the batch's structure,
  each array's offset, shape and dtype, plain values as they are) as the
  ring item's ``meta``. Without ``slot_bytes`` the first batch is built in
  scratch buffers, the ring is sized from it (rounded up to 2 MiB), and
  the batch is copied into slot 0.
* The trainer reads worker ``s % num_workers``'s ring for batch ``s``, so
  batches come in sampler order, and rebuilds the structure with a
  :class:`SlotArray` per array: a Buffer viewing the slot, holding the ring
  item. The slot goes back to its worker when the last reference to the
  batch (its arrays, their views, tensors made from them) is gone; so
  memory is bounded by ``num_workers * slots`` slots.

Errors: an exception in a worker (in the dataset, ``collate``, a batch
larger than its slot) travels in order as that batch's item (or on the
control queue before the worker has a ring) and is raised in the trainer
with the worker's traceback, as its own type when that can be rebuilt;
the next ``next()`` goes on with the following batch. A worker that dies
is an :class:`~gpushare.OwnerGoneError` naming it. A trainer that holds
every slot of the worker it waits for would wait forever: that is a
:class:`~gpushare.LoaderError` saying what to do instead.

Ending: the epoch ends after the last batch, when the iterator is closed
or collected (``break`` out of the loop), or at exit: the stop event is
set, workers are joined (a worker waiting for a slot polls the event) and,
past a bound, terminated; only then does the trainer leave their rings,
because leaving frees the slots it holds and a running worker could
rewrite a batch the trainer keeps. Workers also stop when
the trainer's process is gone (their task queue says so, and they poll).
"""

from __future__ import annotations

import gc
import os
import queue
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from . import _backends
from ._authsocket import process_alive
from ._batch import SlotArray, SlotWriter, align, build, default_collate, exception_payload, rebuild_exception
from ._buffer import Buffer
from ._errors import LoaderError, OwnerGoneError, RingClosedError, WaitTimeoutError

__all__ = ["SlotLoader", "current_dataset"]

POLL = 0.5  # seconds between liveness checks while waiting
JOIN_TIMEOUT = 5.0  # seconds a finishing epoch waits for each worker before terminating it


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


def _worker_main(worker: int, address: Any, dataset: Any, collate: Any, tasks: Any, control: Any, stop: Any,
                 options: dict[str, Any]) -> None:  # fmt: skip
    """A loader worker: connect to the Manager, then build each task's batch into a slot of its ring."""
    from ._manager import BufferManager

    parent = options["parent"]
    device, backend, slots = options["device"], options["backend"], options["slots"]

    def going() -> bool:
        return not stop.is_set() and process_alive(parent)

    manager = BufferManager(address=address, owner="server")
    try:
        manager.connect()
        _current[0] = dataset
        if options["worker_init"] is not None:
            options["worker_init"](worker)
        ring = None
        if options["slot_bytes"]:
            ring = manager.ring((options["slot_bytes"],), "uint8", device, slots=slots, backend=backend)
            control.put(("ring", worker, ring))
    except BaseException as exc:
        control.put(("fatal", worker, *exception_payload(exc, worker, -1)))
        return

    def acquire() -> Buffer | None:
        assert ring is not None
        while going():
            try:
                return ring.acquire(timeout=POLL)
            except TimeoutError:
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
        seq, indices = task
        slot = writer = None
        try:
            samples = _fetch(dataset, indices)
            if ring is None:  # first batch: lay it out in scratch buffers, size the slots from it
                writer = SlotWriter(manager, None, device, backend)
                meta: Any = ("batch", seq, writer.layout(collate(samples, writer)))
                nbytes = max(1, align(writer.used))
                ring = manager.ring((nbytes,), "uint8", device, slots=slots, backend=backend)
                control.put(("ring", worker, ring))
                slot = acquire()
                if slot is None:
                    break
                writer.move_into(slot)
            else:
                slot = acquire()
                if slot is None:
                    break
                writer = SlotWriter(manager, slot, device, backend)
                meta = ("batch", seq, writer.layout(collate(samples, writer)))
        except Exception as exc:
            payload = exception_payload(exc, worker, seq)
            if writer is not None:
                writer.clear()
            if ring is None:
                control.put(("error", worker, seq, payload))
                continue
            meta = ("error", seq, payload)
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
            except TimeoutError:  # the trainer has not registered yet
                continue
            except RingClosedError:
                return
        slot = None
    if ring is not None:
        ring.close()


# ---------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------


class _Batches:
    """Index lists for ``batch_size``/``shuffle``/``drop_last`` (a new order each epoch when shuffling)."""

    def __init__(self, length: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int | None) -> None:
        self.length, self.batch_size, self.shuffle, self.drop_last = length, batch_size, shuffle, drop_last
        self._rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.batch_size
        return -(-self.length // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = self._rng.permutation(self.length) if self.shuffle else np.arange(self.length)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield [int(i) for i in order[start : start + self.batch_size]]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return value


class SlotLoader:
    """Batches of a dataset, built by worker processes straight into pre-shared slots.

    ::

        loader = gpushare.SlotLoader(dataset, batch_size=64, num_workers=4, device=0)
        for batch in loader:           # the dataset's structure, with SlotArrays for arrays
            use(batch)                 # views of the worker's slot: no copy on this side
                                       # the slot goes back when the batch is dropped

    ``dataset`` is map-style (``dataset[i]``, and ``len()`` unless
    ``batch_sampler`` is given) and picklable: each worker gets a copy.
    ``batch_sampler`` is any re-iterable of index lists; otherwise
    ``batch_size``, ``shuffle``, ``drop_last`` and ``seed`` make one.
    ``collate(samples, writer)`` builds a batch into the slot
    (:func:`default_collate` stacks arrays; see :class:`SlotWriter`).
    ``slots`` per worker bound the memory: ``num_workers * slots`` slots of
    ``slot_bytes`` (default: the first batch's size, rounded up to 2 MiB).
    ``device`` is where the slots live (a CUDA device, or ``"cpu"`` for
    host shared memory); workers are bound to it. ``worker_init(worker_id)``
    runs first in each worker. ``timeout`` bounds the wait for one batch
    (:class:`~gpushare.WaitTimeoutError`, a ``TimeoutError``). ``manager`` may be a started ``Manager(owner="server")``
    to allocate from; by default the loader starts its own.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        batch_sampler: Iterable[Any] | None = None,
        seed: int | None = None,
        num_workers: int = 2,
        slots: int = 4,
        slot_bytes: int | None = None,
        prefetch: int | None = None,
        device: Any = None,
        backend: str | None = None,
        collate: Callable[[list[Any], SlotWriter], Any] | None = None,
        worker_init: Callable[[int], Any] | None = None,
        timeout: float | None = None,
        manager: Any = None,
    ) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"dataset {type(dataset).__name__} has no __getitem__: SlotLoader needs a map-style dataset "
                "(dataset[i]); iterable datasets are not supported"
            )
        self.num_workers = _positive("num_workers", num_workers)
        self.slots = _positive("slots", slots)
        self.prefetch = self.slots if prefetch is None else _positive("prefetch", prefetch)
        if slot_bytes is not None:
            _positive("slot_bytes", slot_bytes)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, or None to wait forever")
        if batch_sampler is None:
            try:
                length = len(dataset)
            except TypeError:
                raise TypeError(
                    f"dataset {type(dataset).__name__} has no len(); give it __len__, or pass batch_sampler="
                ) from None
            batch_sampler = _Batches(length, _positive("batch_size", batch_size), shuffle, drop_last, seed)
        if manager is not None and getattr(manager, "owner", None) != "server":
            raise ValueError(
                "manager= must be a started gpushare.Manager(owner='server'): the slots must outlive the "
                "worker that fills them, so the Manager's server owns them"
            )
        _, ordinal = _backends.resolve(device, backend)
        self.device: int | str = "cpu" if ordinal is None else ordinal
        self.backend = backend
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.collate = collate or default_collate
        self.worker_init = worker_init
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self._manager = manager
        self._own_manager = manager is None

    @property
    def manager(self) -> Any:
        """The Manager that owns the slots (started on first use)."""
        if self._manager is None:
            from ._context import get_context

            self._manager = get_context().Manager(owner="server")
        return self._manager

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return _Epoch(self)

    def _convert(self, array: SlotArray) -> Any:
        """What the trainer gets for each array of a batch (adapters turn it into their tensors)."""
        return array

    def close(self) -> None:
        """Shut down the loader's own Manager once no batch of it is alive (it lives while they do)."""
        if self._own_manager:
            self._manager = None

    def __repr__(self) -> str:
        return (
            f"<gpushare.SlotLoader workers={self.num_workers} slots={self.slots} device={self.device!r} "
            f"dataset={type(self.dataset).__name__}>"
        )


def _shutdown(procs: list[Any], tasks: list[Any], control: Any, stop: Any, rings: list[Any], stash: list[Any]) -> None:
    """End an epoch: stop the workers, leave their rings, join them (terminating stragglers)."""
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
    stashed = [message[2] for messages in stash for message in messages if message[0] == "ring"]
    for ring in (*rings, *stashed):  # a ring read ahead of its turn is registered too
        if ring is not None:
            ring.close()
    for q in (*tasks, control):
        q.cancel_join_thread()
        q.close()


class _Epoch:
    """One pass over the batches: the workers, their rings, and what is in flight."""

    def __init__(self, loader: SlotLoader) -> None:
        from ._context import get_context

        self._loader = loader
        manager = loader.manager
        self._hold_manager = manager
        ctx = get_context()
        n = loader.num_workers
        self._batches = iter(loader.batch_sampler)
        self._tasks = [ctx.Queue() for _ in range(n)]
        self._control = ctx.Queue()
        self._stop = ctx.Event()
        self._rings: list[Any] = [None] * n
        self._stash: list[deque[tuple[Any, ...]]] = [deque() for _ in range(n)]
        self._procs: list[Any] = []
        self._sent = self._next = 0
        self._exhausted = False
        self._finalizer = weakref.finalize(
            self, _shutdown, self._procs, self._tasks, self._control, self._stop, self._rings, self._stash
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
                args=(k, manager.address, loader.dataset, loader.collate, self._tasks[k], self._control,
                      self._stop, options),
                device=loader.device,
                daemon=True,
                name=f"gpushare-loader-{k}",
            )  # fmt: skip
            proc.start()
            self._procs.append(proc)
        self._dispatch()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _dispatch(self) -> None:
        window = self._next + self._loader.num_workers * self._loader.prefetch
        while not self._exhausted and self._sent < window:
            try:
                indices = next(self._batches)
            except StopIteration:
                self._exhausted = True
                break
            self._tasks[self._sent % self._loader.num_workers].put((self._sent, list(indices)))
            self._sent += 1

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._next >= self._sent or not self._finalizer.alive:  # done, or ended by close() or an error
            self.close()
            raise StopIteration
        seq = self._next
        worker = seq % self._loader.num_workers
        self._next += 1
        try:
            kind, payload, item = self._receive(worker, seq)
        except BaseException:
            self.close()
            raise
        self._dispatch()
        if kind == "error":
            del item  # the slot goes back at once
            raise rebuild_exception(payload)
        return build(payload, item, (item, self._hold_manager), self._loader._convert)

    def close(self) -> None:
        """End this epoch now: workers stop and exit; batches already received stay valid."""
        self._finalizer()

    # -- waiting ----------------------------------------------------------------------
    def _gone(self, worker: int, during: str) -> OwnerGoneError:
        proc = self._procs[worker]
        proc.join(1.0)
        return OwnerGoneError(
            f"loader worker {worker} (pid {proc.pid}) exited unexpectedly (exit code {proc.exitcode}) {during}. "
            "A negative exit code is the signal that killed it (e.g. -9: killed, often by the out-of-memory "
            "killer). Batches already received stay valid; start a new epoch to go on"
        )

    def _deadline(self) -> float | None:
        timeout = self._loader.timeout
        return None if timeout is None else _now() + timeout

    def _expired(self, deadline: float | None, worker: int, seq: int) -> None:
        if deadline is not None and _now() > deadline:
            raise WaitTimeoutError(
                f"batch {seq} did not come from loader worker {worker} within timeout={self._loader.timeout:g} s; "
                "the dataset or collate is slower than that, or stuck"
            )

    def _receive(self, worker: int, seq: int) -> tuple[str, Any, Any]:
        deadline = self._deadline()
        while self._rings[worker] is None:
            message = self._stash[worker].popleft() if self._stash[worker] else self._control_message(worker, deadline)
            if message[0] == "ring":
                self._rings[worker] = message[2]
            elif message[0] == "error":
                if message[2] != seq:
                    raise LoaderError(f"internal: worker {worker} reported batch {message[2]}, expected {seq}")
                return "error", message[3], None
            else:  # "fatal"
                raise LoaderError(f"loader worker {worker} could not start: {message[3]}")
        ring = self._rings[worker]
        self._check_held(worker, ring)
        while True:
            try:
                item = ring.get(timeout=POLL)
                break
            except TimeoutError:
                if not self._procs[worker].is_alive():
                    raise self._gone(worker, f"while batch {seq} was awaited") from None
                self._expired(deadline, worker, seq)
            except OwnerGoneError:
                raise self._gone(worker, f"while batch {seq} was awaited") from None
            except RingClosedError:
                raise LoaderError(f"loader worker {worker} closed its ring before batch {seq}") from None
        kind, got, payload = item.meta
        if got != seq:
            raise LoaderError(f"internal: worker {worker} sent batch {got}, expected {seq}")
        return kind, payload, item

    def _control_message(self, worker: int, deadline: float | None) -> tuple[Any, ...]:
        while True:
            try:
                message = self._control.get(timeout=POLL)
            except queue.Empty:
                if not self._procs[worker].is_alive():
                    raise self._gone(worker, "before it sent its first batch") from None
                self._expired(deadline, worker, self._next - 1)
                continue
            if message[1] == worker:
                return message  # type: ignore[no-any-return]
            self._stash[message[1]].append(message)

    def _check_held(self, worker: int, ring: Any) -> None:
        if ring.stats()["held"] < self._loader.slots:
            return
        gc.collect()  # batches caught in reference cycles
        if ring.stats()["held"] >= self._loader.slots:
            raise LoaderError(
                f"this process holds all {self._loader.slots} slots of loader worker {worker}, so its next batch "
                "can never be built: drop batches (or copy what you keep, e.g. tensor.clone()) before asking for "
                "the next, or raise slots="
            )


def _now() -> float:
    import time

    return time.monotonic()
