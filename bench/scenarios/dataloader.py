"""``dataloader``: batches/s and trainer-side latency, gpushare.torch.DataLoader against torch's DataLoader.

Both loaders read the same dataset in the same run: 4 workers, each sample made on the
GPU in the worker (``torch.full`` on CUDA: the stand-in for GPU decoding or augmenting),
16 samples per batch, batches of 1, 4 and 16 MiB. torch's DataLoader (its defaults,
spawn workers) returns each batch as a CUDA tensor through torch's CUDA IPC;
gpushare's workers stack each batch into a pre-shared slot and the trainer views it.
The trainer queues the same small reduction on every batch (no host sync) and
synchronizes at the end of each timed repeat.

Two tables from the same iterations: ``dataloader`` (time per batch over a timed
repeat, so batches/s = 1e6 / median us; target: gpushare at most 1/1.5 of torch's time,
i.e. >= 1.5x its batches/s) and ``dataloader_latency`` (the time of each ``next()`` call
in the trainer).
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

from ..fmt import _size_label
from ..peers import torch_skip
from ..results import Scenario, Series, _bind
from ..settings import MiB
from ..stats import Cell, Target

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("dataloader", "dataloader_latency")

SIZES = (1 * MiB, 4 * MiB, 16 * MiB)
WORKERS = 4
BATCH = 16  # samples per batch
SLOTS = 4
TORCH_LOADER = "torch DataLoader (CUDA tensors)"
GS_LOADER = "gpushare.torch.DataLoader"
DEVICE = "cuda"  # where samples are made and the slots live (a smoke test may set "cpu")
SPEEDUP = 1.5  # target: gpushare's batches/s over torch's
COUNT, COUNT_QUICK = 300, 100  # batches per timed repeat
REPEATS, REPEATS_QUICK = 5, 3
WARMUP, WARMUP_QUICK = 50, 20

HOW = (
    f"`dataloader` runs gpushare.torch.DataLoader and torch's DataLoader over the same dataset in the same "
    f"run: {WORKERS} workers, {BATCH} samples per batch, each sample made on the GPU in the worker "
    f"(`torch.full(..., device='cuda')`), batches of {', '.join(_size_label(s) for s in SIZES)}. torch's "
    "DataLoader uses its defaults (spawn workers, prefetch_factor 2) and returns CUDA tensors through torch's "
    f"CUDA IPC; gpushare's stacks each batch into one of {SLOTS} pre-shared slots per worker and the trainer "
    "views it. The trainer queues one small reduction per batch (no host sync) and synchronizes the device "
    f"at the end of each repeat. After {WARMUP} warm-up batches, {REPEATS} repeats of {COUNT} batches "
    f"({WARMUP_QUICK}, {REPEATS_QUICK}, {COUNT_QUICK} with --quick) are timed whole: the table shows the "
    "median time per batch (1e6 / it = batches/s), torch's as the floor, and the target: gpushare's time "
    f"per batch <= 1/{SPEEDUP:g} of torch's (>= {SPEEDUP:g}x its batches/s). `dataloader_latency` shows the "
    "time of each `next()` call in the trainer over the same timed batches."
)


class GpuSamples:
    """Sample i: ``floats`` float32 values all equal to i, made on the GPU in the worker, and i."""

    def __init__(self, n: int, floats: int, device: str) -> None:
        self.n, self.floats, self.device = n, floats, device

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        return torch.full((self.floats,), float(i), device=self.device), i


def plan(bench: Bench) -> None:
    rows = [_size_label(size) for size in SIZES]
    added = [
        bench.add(
            Scenario(
                "dataloader",
                f"DataLoader with GPU workers: time per batch ({WORKERS} workers, {BATCH} samples per batch)",
                "batch",
                rows,
                floor=("dataloader", TORCH_LOADER),
                targets={row: Target("ratio_max", round(1 / SPEEDUP, 3)) for row in rows},
                target_systems=[GS_LOADER],
                plot=False,
            )
        ),
        bench.add(
            Scenario(
                "dataloader_latency",
                "DataLoader with GPU workers: trainer-side latency of next()",
                "batch",
                rows,
                floor=("dataloader_latency", TORCH_LOADER),
                plot=False,
            )
        ),
    ]
    if not any(added):
        return
    key = "dataloader" if added[0] else "dataloader_latency"
    bench.scenarios[key].notes.append(
        f"batches/s = 1e6 / median us. {GS_LOADER}: {SLOTS} slots per worker, batches stacked into them by "
        f"`torch.stack(..., out=slot)`; {TORCH_LOADER}: torch's defaults with multiprocessing_context='spawn'."
    )
    skip = torch_skip(bench)
    for size in SIZES:
        row = _size_label(size)
        for system in (TORCH_LOADER, GS_LOADER):
            bench.task(key, system, row, _bind(measure, bench, key, system, size, row), skip)


def _make_loader(system: str, dataset: GpuSamples) -> Any:
    import torch

    if system == TORCH_LOADER:
        return torch.utils.data.DataLoader(
            dataset,  # type: ignore[arg-type,unused-ignore]  # map-style: __getitem__ and __len__
            batch_size=BATCH,
            num_workers=WORKERS,
            multiprocessing_context="spawn",
            timeout=120,
        )
    from gpushare import torch as gs_torch

    device = 0 if DEVICE == "cuda" else DEVICE
    return gs_torch.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, slots=SLOTS, device=device, timeout=120)


def measure(bench: Bench, key: str, system: str, nbytes: int, row: str) -> list[int]:
    """Iterate one loader: ns per batch for each timed repeat (the ``dataloader`` cell) and the time of
    each timed next() (the ``dataloader_latency`` cell, filled here when both tables are planned)."""
    import torch

    quick = bench.cfg.quick
    count, repeats, warmup = (COUNT_QUICK, REPEATS_QUICK, WARMUP_QUICK) if quick else (COUNT, REPEATS, WARMUP)
    dataset = GpuSamples(BATCH * (warmup + repeats * count), nbytes // BATCH // 4, DEVICE)
    loader = _make_loader(system, dataset)
    total = torch.zeros((), dtype=torch.float64, device=DEVICE)  # exact for these sums
    per_batch: list[int] = []
    latencies: list[int] = []
    clock = time.perf_counter_ns
    it = iter(loader)
    try:
        for _ in range(warmup):
            values, _labels = next(it)
            total += values[0, 0]
        _synchronize()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(repeats):
                start = clock()
                for _ in range(count):
                    t0 = clock()
                    values, _labels = next(it)
                    latencies.append(clock() - t0)
                    total += values[0, 0]
                del values, _labels
                _synchronize()
                per_batch.append(max(1, (clock() - start) // count))
        finally:
            if gc_was_enabled:
                gc.enable()
    finally:
        close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
        if close is not None:
            close()
        del it
    expected = sum(range(0, BATCH * (warmup + repeats * count), BATCH))
    if int(total.item()) != expected:
        raise RuntimeError(f"{system} delivered wrong batches: sum of first values {int(total.item())} != {expected}")
    if key == "dataloader_latency":
        return latencies
    latency = bench.scenarios.get("dataloader_latency")
    if latency is not None:
        latency.systems.setdefault(system, Series()).cells[row] = Cell.of(latencies)
    return per_batch


def _synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
