"""gpushare.torch.DataLoader: :class:`gpushare.SlotLoader` with torch's conventions, its batches as
tensors over the workers' slots (re-exported by :mod:`gpushare.torch`; the package docstring shows
it in use). torch is imported with this module."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import _loader
from .._batch import SlotArray, SlotWriter
from .._loader import SlotLoader
from ._weights import _layout_dtype

if TYPE_CHECKING:
    from .._types import Device

__all__ = ["DataLoader"]


def _as_tensor(buf: Any, tag: str | None) -> torch.Tensor:
    """A tensor viewing a gpushare Buffer (no copy), in the torch dtype ``tag`` names if any."""
    if buf.device == "cpu":
        tensor = torch.from_numpy(buf.numpy())
    else:
        tensor = torch.from_dlpack(buf)
    return tensor.view(getattr(torch, tag)) if tag else tensor


def _slot_tensor(writer: SlotWriter, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    layout, tag = _layout_dtype(dtype)
    buf = writer.empty(shape, layout, tag=tag)
    return buf, _as_tensor(buf, tag)


def _put_tensor(writer: SlotWriter, tensor: torch.Tensor) -> Any:
    if tensor.device.type == "cpu":  # through staging for a CUDA slot, like stacked samples
        layout, tag = _layout_dtype(tensor.dtype)
        return writer.stacked(tuple(tensor.shape), layout, _parts([tensor.contiguous()]), tag=tag)
    buf, out = _slot_tensor(writer, tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return buf


def _parts(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """``(address, length)`` of each contiguous CPU tensor's bytes, for ``SlotWriter.stacked``."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]


def _stack(samples: list[Any], writer: SlotWriter) -> Any:
    """torch's default_collate, written into the slot."""
    first = samples[0]
    if isinstance(first, np.ndarray) and first.dtype.kind in "biufc":
        samples = [torch.as_tensor(s) for s in samples]
        first = samples[0]
    if isinstance(first, torch.Tensor):
        shape = tuple(first.shape)
        for i, sample in enumerate(samples):
            if tuple(sample.shape) != shape:
                raise ValueError(
                    f"sample {i} has shape {tuple(sample.shape)}, sample 0 has {shape}: samples of a batch must "
                    "have one shape to be stacked; pad them in the dataset, or pass collate_fn="
                )
        if first.device.type == "cpu":
            # Stacked on the CPU, each sample copied once: into a host slot, or into page-locked
            # staging that asynchronous copies take to a CUDA slot (see gpushare._batch).
            layout, tag = _layout_dtype(first.dtype)
            if all(s.device.type == "cpu" and s.dtype == first.dtype for s in samples):
                dense = [s.contiguous() for s in samples]  # kept alive until the bytes are copied
                return writer.stacked((len(samples), *shape), layout, _parts(dense), tag=tag)
            host, buf = writer.staged_empty((len(samples), *shape), layout, tag=tag)  # dtypes to promote
            out = torch.from_numpy(host)
            torch.stack(samples, out=out.view(first.dtype) if tag else out)
            return buf
        buf, out = _slot_tensor(writer, (len(samples), *shape), first.dtype)
        if first.device == out.device:
            torch.stack(samples, out=out)
        else:
            out.copy_(torch.stack(samples))
        return buf
    if isinstance(first, bool):
        return _put_tensor(writer, torch.tensor(samples, dtype=torch.bool))
    if isinstance(first, int):
        return _put_tensor(writer, torch.tensor(samples, dtype=torch.int64))
    if isinstance(first, float):
        return _put_tensor(writer, torch.tensor(samples, dtype=torch.float64))
    if isinstance(first, np.generic):
        return _put_tensor(writer, torch.as_tensor(np.asarray(samples)))
    if isinstance(first, dict):
        return {key: _stack([s[key] for s in samples], writer) for key in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_stack(list(field), writer) for field in zip(*samples, strict=True)))
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise ValueError("samples have different lengths; every sample of a batch must have the same structure")
        return [_stack(list(field), writer) for field in zip(*samples, strict=True)]
    return list(samples)


def _into_slot(tree: Any, writer: SlotWriter) -> Any:
    """A collate_fn's result with every tensor copied into the slot."""
    if isinstance(tree, torch.Tensor):
        return _put_tensor(writer, tree.contiguous())
    if isinstance(tree, dict):
        return {key: _into_slot(value, writer) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_into_slot(value, writer) for value in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_into_slot(value, writer) for value in tree)
    return tree


class _Collate:
    """The worker-side collate: torch's default stacking into the slot, or a collate_fn then a copy."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any], writer: SlotWriter) -> Any:
        if self.collate_fn is None:
            return _stack(samples, writer)
        return _into_slot(self.collate_fn(samples), writer)


class _WorkerInit:
    """One torch thread per worker, seeds torch and random per worker, sets get_worker_info(),
    then runs worker_init_fn (as torch's own worker loop does)."""

    def __init__(self, base_seed: int, num_workers: int, worker_init_fn: Any) -> None:
        self.base_seed, self.num_workers, self.worker_init_fn = base_seed, num_workers, worker_init_fn

    def __call__(self, worker: int) -> None:
        seed = self.base_seed + worker
        torch.set_num_threads(1)  # as torch's own workers: N workers must not each take every core
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            from torch.utils.data._utils import worker as torch_worker

            # torch has no public way to set what get_worker_info() returns: its own workers set
            # this module global, so ours do the same (a torch that changes it: the except below).
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=worker, num_workers=self.num_workers, seed=seed, dataset=_loader.current_dataset()
            )
        except (ImportError, AttributeError, TypeError):  # a torch without it: get_worker_info() stays None
            pass
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker)


def _default_device() -> Any:
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


class DataLoader(SlotLoader):
    """A PyTorch DataLoader whose workers build batches in pre-shared slots (see the module docstring).

    Batches are tensors on ``device`` viewing the slots; keep a copy
    (``tensor.clone()``) of what must outlive the batch, or raise ``slots``.

    Parameters
    ----------
    dataset, batch_size, shuffle, sampler, batch_sampler, collate_fn, drop_last, worker_init_fn, generator
        As for ``torch.utils.data.DataLoader``, with map-style datasets.
    num_workers : int
        Worker processes, 1 or more (2).
    timeout : float
        Seconds to wait for one batch; 0 (default) waits forever.
    prefetch_factor : int, optional
        As torch's: the batches a worker builds ahead (2).
    persistent_workers : bool
        Keep the workers between epochs.
    pin_memory : bool
        With a CPU ``device``, page-lock the slots, so
        ``batch.cuda(non_blocking=True)`` is asynchronous. With a CUDA ``device``
        batches are already on the GPU, and CPU samples reach it through
        page-locked staging in the workers.
    slots : int, optional
        Slots per worker (default ``prefetch_factor + 1``: the batches a worker
        builds ahead and the one the trainer holds).
    slot_bytes, backend, manager
        As for :class:`gpushare.SlotLoader`.
    device : int, "cuda:N", torch.device or "cpu", optional
        Where batches live (default: torch's current CUDA device when CUDA is
        available, else the CPU).
    multiprocessing_context : context or str, optional
        As for :class:`gpushare.SlotLoader` (default: workers forked from
        multiprocessing's forkserver, which imported torch once).

    Raises
    ------
    ValueError, TypeError
        If an argument is out of range, of the wrong kind, or a combination torch's
        loader refuses too, or ``batch_size=None``; the message names it.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 2,
        collate_fn: Any = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        slots: int | None = None,
        slot_bytes: int | None = None,
        device: Device = None,
        backend: str | None = None,
        manager: Any = None,
        multiprocessing_context: Any = None,
    ) -> None:
        from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler= is mutually exclusive with batch_size, shuffle, sampler and drop_last")
        else:
            if batch_size is None:
                raise ValueError("batch_size=None (unbatched samples) is not supported: slots hold whole batches")
            if sampler is not None and shuffle:
                raise ValueError("sampler= is mutually exclusive with shuffle=True")
            if sampler is None:
                sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        if timeout < 0:
            raise ValueError(f"timeout={timeout!r} must be >= 0 (0 waits forever)")
        # torch's default with workers; checked here, before slots are counted from it
        prefetch_factor = 2 if prefetch_factor is None else _loader._positive("prefetch_factor", prefetch_factor)
        if slots is None:
            slots = prefetch_factor + 1
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            slots=slots,
            slot_bytes=slot_bytes,
            prefetch=prefetch_factor,
            device=_default_device() if device is None else device,
            backend=backend,
            collate=_Collate(collate_fn),
            timeout=timeout or None,
            persistent_workers=persistent_workers,
            pin_memory=pin_memory,
            manager=manager,
            multiprocessing_context=multiprocessing_context,
        )
        self.generator = generator
        self.worker_init_fn = worker_init_fn

    def __iter__(self) -> Any:
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        self.worker_init = _WorkerInit(base_seed, self.num_workers, self.worker_init_fn)
        return super().__iter__()

    def _convert(self, array: SlotArray) -> torch.Tensor:
        return _as_tensor(array, array.tag)
