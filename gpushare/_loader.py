"""SlotLoader: dataset batches built by worker processes straight into pre-shared slots.

- The trainer owns the memory: an Owner in its process (or ``manager=``); workers allocate
  their rings' slots from it by ``Alloc`` requests (:class:`~gpushare._manager.RemoteAllocator`).
- Per epoch: workers start (:mod:`gpushare._loader_workers`); batch ``s``'s task goes to worker
  ``s % num_workers``, at most ``prefetch`` ahead; each worker builds it into a free slot of its
  ring and publishes it with its layout (:mod:`gpushare._batch`); the trainer reads in order.
- A worker's exception is raised at its batch; a dead worker is OwnerGoneError.
- Stop: workers first, then their rings; memory goes with the loader and its last batch.
Data flow, errors and stopping: dev/design-notes.md, "The loader".
"""

from __future__ import annotations

import atexit
import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _backends
from ._batch import SlotArray, SlotWriter, Staging, build, default_collate, rebuild_exception
from ._buffer import Buffer
from ._errors import LoaderError, OwnerGoneError, RingClosedError, WaitTimeoutError
from ._loader_workers import (
    POLL,
    Answer,
    RingReady,
    StartFailed,
    Task,
    Workers,
    current_dataset,
    start_forkserver,
    worker_context,
)

if TYPE_CHECKING:
    from ._types import Device

__all__ = ["SlotLoader", "current_dataset"]

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


def _release(owner: Any, workers: list[Any], pinned: list[tuple[int, int]]) -> None:
    """The loader and every batch it handed out are gone: stop what still runs, unpin, free."""
    for w in workers:
        w.close()
    workers.clear()
    if pinned:
        from . import _cuda

        for ptr, device in pinned:
            try:
                _cuda.host_unregister(ptr, device)
            except Exception:  # the driver already gone at exit
                pass
        pinned.clear()
    if owner is not None:
        # Leases come back as their last holders go, maybe just after this runs (inside the
        # garbage collector, say): a thread waits for them. At interpreter exit there is
        # nothing left to wait for, and a thread would not be waited for.
        if _exiting:
            owner.shutdown(0.0)
        else:
            stopping = threading.Thread(target=owner.shutdown, name="gpushare-loader-shutdown", daemon=True)
            _stopping.add(stopping)
            stopping.start()


_exiting = False
_stopping: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # loader Owners shutting down on a thread
EXIT_JOIN = 5.0  # at exit, how long the Owners already shutting down get to finish (all together)


def _at_exit() -> None:
    """Interpreter exit: later releases shut their Owners down at once, and the shutdowns
    already running on a thread (a loader closed just before the script ended) get to
    free what they hold, within ``EXIT_JOIN`` seconds: a daemon thread killed half-way
    would leave host segments to the resource tracker, which warns of them as leaked."""
    global _exiting
    _exiting = True
    deadline = time.monotonic() + EXIT_JOIN
    for stopping in list(_stopping):
        stopping.join(max(0.0, deadline - time.monotonic()))


atexit.register(_at_exit)  # registered after weakref's own exit hook, so it runs before it


class _Resources:
    """What a loader owns: its Owner (unless ``manager=`` allocates), its persistent
    workers and the host memory it pinned. Held by the loader, by each epoch and by each
    batch it handed out; released (:func:`_release`) when the last of them goes, and at
    interpreter exit."""

    def __init__(self, loader: SlotLoader) -> None:
        from multiprocessing import current_process

        self.owner: Any = None
        if loader.manager is None:
            from ._lifetime._owner import Owner
            from ._manager import RemoteAllocator

            self.owner = Owner(authkey=bytes(current_process().authkey))
            self.allocator = RemoteAllocator(self.owner.address, self.owner.token, loader.backend)
        else:
            self.allocator = loader.manager.allocator()
        self.workers: list[Workers] = []  # the persistent ones (none for per-epoch workers)
        self.pinned: list[tuple[int, int]] = []  # host slots registered for pin_memory: (pointer, device)
        self._pinned_ptrs: set[int] = set()
        self._finalizer = weakref.finalize(self, _release, self.owner, self.workers, self.pinned)

    def pin(self, item: Buffer) -> None:
        """pin_memory: page-lock a host slot once (torch then sees its tensors as pinned)."""
        ptr = item.ptr
        if ptr in self._pinned_ptrs:
            return
        self._pinned_ptrs.add(ptr)
        from . import _cuda

        try:
            _cuda.host_register(ptr, item.nbytes, 0)
        except Exception as exc:  # no GPU or driver: pinning means nothing there (torch warns too)
            import warnings

            warnings.warn(
                f"pin_memory=True, but host memory cannot be pinned here ({exc}); batches stay pageable",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        self.pinned.append((ptr, 0))

    def release(self) -> None:
        self._finalizer()


def _warm_cuda(device: int) -> None:
    """Ready this process's CUDA context on ``device`` (the first slot a worker asks for needs it)."""
    try:
        from . import _cuda

        _cuda.make_current(device)  # cuInit and the device's primary context: the slow part
    except Exception:  # a real problem shows again, with its message, at the first allocation
        pass


class SlotLoader:
    """Batches of a dataset, built by worker processes straight into pre-shared slots.

    ::

        loader = gpushare.SlotLoader(dataset, batch_size=64, num_workers=4, device=0)
        for batch in loader:           # the dataset's structure, with SlotArrays for arrays
            use(batch)                 # views of the worker's slot: no copy on this side
                                       # the slot goes back when the batch is dropped

    Parameters
    ----------
    dataset : map-style dataset
        ``dataset[i]``, and ``len()`` unless ``batch_sampler`` is given; picklable:
        each worker gets a copy.
    batch_size, shuffle, drop_last, seed
        Make the batches' index lists when ``batch_sampler`` is not given (1, False,
        False, None: a seed drawn at random).
    batch_sampler : iterable of lists of int, optional
        Any re-iterable of index lists.
    num_workers : int
        Worker processes, 1 or more (2).
    slots : int
        Slots per worker (4), which bound the memory: ``num_workers * slots`` slots
        of ``slot_bytes``.
    slot_bytes : int, optional
        Default: the first batch's size, rounded up to 256 bytes (a worker's slots
        are one allocation, a slot every 64 KiB).
    prefetch : int, optional
        Batches asked of each worker ahead of the one being read (default: ``slots``);
        a worker builds them as its slots come free.
    device : int, "cuda:N", torch.device or "cpu", optional
        Where the slots live (a CUDA device, or ``"cpu"`` for host shared memory);
        workers are bound to it. None: as for :meth:`BufferManager.zeros`.
    backend : str, optional
        The CUDA sharing mechanism, as for :meth:`BufferManager.zeros`.
    collate : callable, optional
        ``collate(samples, writer)`` builds a batch into the slot
        (:func:`default_collate` stacks arrays; see :class:`SlotWriter`).
    worker_init : callable, optional
        ``worker_init(worker_id)`` runs first in each worker.
    timeout : float, optional
        Seconds to wait for one batch (None: no bound).
    persistent_workers : bool
        Keep the workers, their rings and their slots from one epoch to the next
        (the next epoch's first batch then comes as fast as a batch is built).
    pin_memory : bool
        With ``device="cpu"``, page-lock the slots, so host-to-device copies of the
        batches are asynchronous (torch's ``pin_memory``).
    manager : BufferManager, optional
        A started Manager to allocate the slots from (either owner mode); by
        default the loader owns them itself, in this process.
    multiprocessing_context : context or str, optional
        What starts the workers. By default they are forked from multiprocessing's
        forkserver (it imports torch and numpy once and never sees CUDA, so a
        loader's workers start in a fraction of a second; while none runs, GPU
        workers are spawned and it starts after their first batch); ``"spawn"``
        starts a fresh interpreter per worker (environment changes made after the
        forkserver started reach spawned workers only).

    Raises
    ------
    ValueError, TypeError
        If an argument is out of range or of the wrong kind (the message names it).
    WaitTimeoutError
        While iterating: no batch within ``timeout`` (a ``TimeoutError``).
    OwnerGoneError
        While iterating: a worker died.
    LoaderError
        While iterating: a worker could not start, or a batch outgrew its slot.

    Notes
    -----
    Close the loader (``close()``, or ``with SlotLoader(...) as loader:``)
    to stop persistent workers at once; dropping it does the same. Its
    memory goes when the loader and every batch it handed out are gone.
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

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
        device: Device = None,
        backend: str | None = None,
        collate: Callable[[list[Any], SlotWriter], Any] | None = None,
        worker_init: Callable[[int], Any] | None = None,
        timeout: float | None = None,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        manager: Any = None,
        multiprocessing_context: Any = None,
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
        if manager is not None and not callable(getattr(manager, "allocator", None)):
            raise ValueError(f"manager={manager!r} is not a gpushare Manager; pass a started gpushare.Manager()")
        _, ordinal = _backends.resolve(device, backend)
        self.device: int | str = "cpu" if ordinal is None else ordinal
        self.backend = backend
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.collate = collate or default_collate
        self.worker_init = worker_init
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self.persistent_workers = bool(persistent_workers)
        self.pin_memory = bool(pin_memory) and self.device == "cpu"
        self.manager = manager
        self.multiprocessing_context = multiprocessing_context
        if multiprocessing_context is not None:
            worker_context(multiprocessing_context)  # a wrong name fails here, not in the first epoch
        self._resources: _Resources | None = None
        self._epochs: weakref.WeakSet[_Epoch] = weakref.WeakSet()
        self._first_batch: dict[str, float] | None = None  # the latest epoch's (see stats())
        self._closed = False

    def _house(self) -> _Resources:
        """The loader's resources, made with its first epoch."""
        if self._closed:
            raise LoaderError("this loader was closed; make a new one to iterate again")
        if self._resources is None:
            self._resources = _Resources(self)
            # Closing (or collecting) the loader stops persistent workers at once; the
            # memory waits for the batches (they hold the resources too).
            weakref.finalize(self, _stop_all, self._resources.workers)
        return self._resources

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        epoch = _Epoch(self, self._house())
        self._epochs.add(epoch)
        return epoch

    def _convert(self, array: SlotArray) -> Any:
        """What the trainer gets for each array of a batch (adapters turn it into their tensors)."""
        return array

    def stats(self) -> dict[str, Any]:
        """The memory the loader holds, and where its latest first batch spent its time.

        Returns
        -------
        dict
            ``workers``, ``persistent_workers``, ``slots``, ``slot_bytes``,
            ``device_bytes``, ``host_bytes``, ``staging_bytes_per_worker`` (page-locked
            memory for CPU samples bound for CUDA slots), ``pinned`` and
            ``first_batch_s``.

        Notes
        -----
        ``first_batch_s`` (None before a first batch) maps step names to seconds since
        ``iter()`` began that epoch, in order. ``returned``: ``next()`` gave the batch.
        With workers started for that epoch, worker 0's start-up too: ``spawned`` (the
        trainer started it), ``started`` (it had unpickled its target: the imports a
        dataset needs), ``linked`` (connected to the trainer's allocator), ``fetched``
        (the first batch's samples, without ``slot_bytes``), ``collated`` (laid out in
        scratch memory), ``context`` (its CUDA context current, on a GPU), ``ring`` (its
        slots allocated and mapped), ``ring_received`` (the trainer had them)."""
        house = self._resources
        rings = []
        if house is not None:
            for workers in house.workers:
                rings += [r for r in workers.rings if r is not None]
        for epoch in list(self._epochs):
            if epoch.workers is not None and not self.persistent_workers:
                rings += [r for r in epoch.workers.rings if r is not None]
        slot_bytes = max((int(np.prod(r.shape)) * r.dtype.itemsize for r in rings), default=self.slot_bytes or 0)
        return {
            "workers": self.num_workers,
            "persistent_workers": self.persistent_workers,
            "slots": len(rings) * self.slots,
            "slot_bytes": slot_bytes,
            "device_bytes": len(rings) * self.slots * slot_bytes if isinstance(self.device, int) else 0,
            "host_bytes": len(rings) * self.slots * slot_bytes if self.device == "cpu" else 0,
            # CPU samples into CUDA slots: at most this much page-locked staging per worker
            "staging_bytes_per_worker": Staging.bytes_for(slot_bytes) if isinstance(self.device, int) else 0,
            "pinned": bool(house and house.pinned),
            "first_batch_s": None if self._first_batch is None else dict(self._first_batch),
        }

    def close(self) -> None:
        """Stop the workers now; the loader's memory goes once no batch of it is alive. Idempotent."""
        self._closed = True
        for epoch in list(self._epochs):
            epoch.close()
        house, self._resources = self._resources, None
        if house is not None:
            _stop_all(house.workers)

    def __enter__(self) -> SlotLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<gpushare.SlotLoader workers={self.num_workers} slots={self.slots} device={self.device!r} "
            f"dataset={type(self.dataset).__name__}{' persistent' if self.persistent_workers else ''}>"
        )


def _stop_all(workers: list[Workers]) -> None:
    for w in workers:
        w.close()


class _Epoch:
    """One pass over the batches: its workers (new, or the loader's persistent ones) and what is in flight."""

    def __init__(self, loader: SlotLoader, house: _Resources) -> None:
        self._loader = loader
        self._house = house
        n = loader.num_workers
        self._batches = iter(loader.batch_sampler)
        self._started = time.time()
        self._sent = self._next = 0
        self._exhausted = False
        if isinstance(loader.device, int):
            threading.Thread(target=_warm_cuda, args=(loader.device,), daemon=True).start()
        if loader.persistent_workers:
            pool = [w for w in house.workers if w.alive]
            for w in house.workers:
                if not w.alive:
                    w.close()
            house.workers[:] = pool
            self._fresh = not pool  # workers started for this epoch: their start-up is its first batch's
            if not pool:
                house.workers.append(Workers(loader, house.allocator))
            self.workers = house.workers[0]
            self.workers.epoch_now.value += 1
        else:
            self._fresh = True
            self.workers = Workers(loader, house.allocator)
        self._number = self.workers.epoch_now.value
        self._first: list[int] = list(self.workers.sent)  # per worker, the first task of this epoch
        self._closed = False
        self._dispatch()
        assert n == self.workers.n

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers.procs]

    @property
    def _rings(self) -> list[Any]:
        return self.workers.rings

    def _dispatch(self) -> None:
        w = self.workers
        window = self._next + self._loader.num_workers * self._loader.prefetch
        while not self._exhausted and self._sent < window:
            try:
                indices = next(self._batches)
            except StopIteration:
                self._exhausted = True
                break
            k = self._sent % w.n
            w.tasks[k].put(Task(self._number, self._sent, list(indices)))
            w.sent[k] += 1
            self._sent += 1

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        if self._next >= self._sent or self._closed:  # done, or ended by close() or an error
            self.close()
            raise StopIteration
        seq = self._next
        worker = seq % self.workers.n
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
        if self._loader.pin_memory:
            self._house.pin(item)
        # (house, item): a tuple drops its last item first, so the slot goes back before
        # the loader's resources can be released.
        batch = build(payload, item, (self._house, item), self._loader._convert)
        if seq == 0:
            self._loader._first_batch = self._timeline(time.time())
            if self.workers.then_forkserver:
                self.workers.then_forkserver = False
                start_forkserver()
        return batch

    def _timeline(self, returned: float) -> dict[str, float]:
        """Worker 0's start-up marks and the trainer's, in seconds since this epoch began."""
        marks = dict(self.workers.timelines[0]) if self._fresh else {}
        marks["returned"] = returned
        return {name: round(t - self._started, 4) for name, t in sorted(marks.items(), key=lambda kv: kv[1])}

    def close(self) -> None:
        """End this epoch now: its workers stop (unless persistent); batches already received stay valid."""
        if self._closed:
            return
        self._closed = True
        if not self._loader.persistent_workers:
            self.workers.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # -- waiting ----------------------------------------------------------------------
    def _gone(self, worker: int, during: str) -> OwnerGoneError:
        proc = self.workers.procs[worker]
        proc.join(1.0)
        self.workers.broken = True
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
        """Batch ``seq``'s answer from ``worker``: what an earlier epoch left in flight is dropped first."""
        w = self.workers
        deadline = self._deadline()
        while True:
            kind, epoch, got, payload, item = self._answer(worker, seq, deadline)
            w.taken[worker] += 1
            if epoch == self._number:
                break
            if item is not None:  # an earlier epoch's: its slot goes back at once
                item.release()
        if got != seq:
            raise LoaderError(f"internal: worker {worker} sent batch {got}, expected {seq}")
        if kind == "skip":
            raise LoaderError(f"internal: worker {worker} skipped batch {seq} of the current epoch")
        return kind, payload, item

    def _answer(self, worker: int, seq: int, deadline: float | None) -> tuple[str, int, int, Any, Any]:
        """The next answer of ``worker``: (kind, epoch, sequence, payload, ring item or None)."""
        w = self.workers
        while w.rings[worker] is None:
            message = w.stash[worker].popleft() if w.stash[worker] else self._control_message(worker, deadline, seq)
            if type(message) is RingReady:
                w.rings[worker] = message.ring
                w.timelines[worker].update(message.marks, ring_received=time.time())
            elif type(message) is Answer:  # an error, or a skip, before the worker had a ring
                return message.kind, message.epoch, message.seq, message.payload, None
            elif type(message) is StartFailed:
                raise LoaderError(f"loader worker {worker} could not start: {message.payload[1]}")
            else:
                raise LoaderError(f"internal: loader worker {worker} sent {message!r}")
        ring = w.rings[worker]
        self._check_held(worker, ring)
        while True:
            try:
                item = ring.get(timeout=POLL)
                break
            except WaitTimeoutError:
                if not w.procs[worker].is_alive():
                    raise self._gone(worker, f"while batch {seq} was awaited") from None
                self._expired(deadline, worker, seq)
            except OwnerGoneError:
                raise self._gone(worker, f"while batch {seq} was awaited") from None
            except RingClosedError:
                raise LoaderError(f"loader worker {worker} closed its ring before batch {seq}") from None
        answer: Answer = item.meta
        return answer.kind, answer.epoch, answer.seq, answer.payload, item

    def _control_message(self, worker: int, deadline: float | None, seq: int) -> RingReady | StartFailed | Answer:
        w = self.workers
        while True:
            try:
                message = w.control.get(timeout=POLL)
            except queue.Empty:
                if not w.procs[worker].is_alive():
                    raise self._gone(worker, "before it sent its first batch") from None
                self._expired(deadline, worker, seq)
                continue
            if message.worker == worker:
                return message  # type: ignore[no-any-return]
            w.stash[message.worker].append(message)

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
