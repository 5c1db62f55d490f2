"""``dataloader_cpu_samples``: DataLoaders whose workers make image samples on the CPU, for a GPU trainer.

The usual input pipeline: workers decode (here: make cheaply) 3x224x224 images on the
CPU, the trainer uses them on the GPU. torch's way: ``pin_memory=True`` (its pin thread
copies each batch into page-locked memory in the trainer) and ``.cuda(non_blocking=True)``
in the trainer; gpushare's: ``gpushare.torch.DataLoader(..., device="cuda")``, whose
workers stack each batch into page-locked staging and copy it asynchronously into a GPU
slot the trainer views. Both in the same run, over the same dataset: sample ``i`` is
``torch.full((3, 224, 224), v)`` with ``v = i % 251`` (uint8) or ``i`` (float32), and its
label ``i``; 64 samples per batch; 4 and 8 workers.

One task per cell (dtype, workers) and system: the loader is made and the time to its
first batch taken (construction to ``next()``, the trainer's copy issued for torch);
then warm-up batches, the first ``VERIFY`` of them compared whole with what the dataset
made (a host sync each, untimed); then ``repeats`` x ``count`` batches timed whole, the
device synchronized after each repeat. On every batch the trainer queues the same small
check (the first and last value of each sample and the labels, against the batch's
indices, summed into an error count on the device: no host sync); a cell whose count is
not 0 fails. Host memory: gpushare's page-locked staging as ``loader.stats()`` reports it
(``staging_bytes_per_worker`` x workers); torch's pinned buffers as its pinned-host
allocator reports them (``torch.cuda.host_memory_stats()``, peak over the cell, its cache
emptied before), or, without that, estimated (workers x prefetch_factor x batch bytes).
Device memory: the device's used memory at the end of the timed batches less before.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..results import Check, Scenario, Table, _bind
from ..settings import BenchError, MiB
from ..stats import Target
from .dataloader_gpu import (
    add_pair,
    cold_start,
    device_used,
    first_steps,
    loader_skip,
    note_deaths,
    note_steps,
    rate_table,
    settled_used,
    stop_loader,
)

if TYPE_CHECKING:
    from ..runner import Bench


KEY = "dataloader_cpu_samples"
FIRST_KEY = f"{KEY}_first"  # the time-to-first-batch table, added with KEY
KEYS = (KEY,)

SHAPE = (3, 224, 224)
DTYPES = ("uint8", "float32")
WORKERS = (4, 8)
BATCH = 64  # samples per batch
SLOTS = 3  # gpushare's slots per worker: its default, prefetch_factor + 1 (not passed)
PREFETCH = 2  # torch's prefetch_factor (its default)
MODULUS = 251  # uint8 samples hold i % MODULUS
TORCH_LOADER = "torch DataLoader (pin_memory, .cuda(non_blocking=True))"
GS_LOADER = "gpushare.torch.DataLoader (device='cuda')"
SYSTEMS = (TORCH_LOADER, GS_LOADER)
DEVICE = "cuda"  # where batches are used (the plumbing test sets "cpu": no pinning, no copies)
SPEEDUP = 1.2  # target: gpushare's batches/s over torch's
VERIFY = 2  # warm-up batches compared whole
TIMEOUT = 120  # seconds: any one batch, the workers starting included
PREPARE_HEAD = 5.0  # seconds between gpushare.prepare_loaders() and the loader (a script building its model)
PREPARED = "first loader after prepare_loaders()"  # the row's suffix (gpushare only)


@dataclass(frozen=True)
class Counts:
    count: int  # batches per timed repeat
    repeats: int
    warmup: int


FULL = Counts(count=150, repeats=3, warmup=20)
QUICK = Counts(count=40, repeats=3, warmup=10)

HOW = (
    f"`{KEY}` (a GPU and torch only): workers make {'x'.join(map(str, SHAPE))} image samples on the CPU "
    f"(`torch.full`, {' and '.join(DTYPES)}, with the sample's index as its label), {BATCH} per batch, "
    f"{' and '.join(map(str, WORKERS))} workers, for a trainer on the GPU. torch's DataLoader with "
    "`pin_memory=True` (spawn workers, prefetch_factor 2) and `.cuda(non_blocking=True)` of images and labels in "
    f"the trainer, against {GS_LOADER}: its workers stack each batch into page-locked staging and copy it "
    f"asynchronously into one of {SLOTS} GPU slots per worker (its defaults: prefetch_factor 2, slots "
    "prefetch_factor + 1), which the trainer views; its workers are forked "
    "from multiprocessing's forkserver (its default), stopped before each of its cells (a first loader spawns its "
    "workers and starts the forkserver after its first batch). Time to the first batch: "
    "from the loader's construction to `next()` (and the trainer's copy issued, for torch), with gpushare's "
    "step by step in a note per cell (`loader.stats()['first_batch_s']`): the cell's loader (gpushare's spawning "
    "its workers and starting the forkserver), and another loader made after it (gpushare's forked from the "
    "forkserver; torch's spawned again); for gpushare, also a first loader made "
    f"{PREPARE_HEAD:g} s after `gpushare.prepare_loaders()` (the forkserver stopped before it: a script that "
    "calls it, then builds its model; no target). Then "
    f"{FULL.warmup} warm-up batches, the first {VERIFY} compared whole with what the dataset made, and "
    f"{FULL.repeats} repeats of {FULL.count} batches timed whole ({QUICK.warmup}, {QUICK.repeats}, "
    f"{QUICK.count} with --quick), the device synchronized after each; on every batch the trainer queues a small "
    "check on the GPU (each sample's first and last value and the labels against the batch's indices, into an "
    "error count; no host sync), and a cell whose count is not 0 fails. Table: the median time per batch "
    f"(1e6 / it = batches/s), torch's as the floor; target: gpushare's <= 1/{SPEEDUP:g} of torch's (>= "
    f"{SPEEDUP:g}x its batches/s); time to the first batch <= torch's. Host memory: gpushare's page-locked "
    "staging from `loader.stats()` (`staging_bytes_per_worker` x workers); torch's pinned buffers from "
    "`torch.cuda.host_memory_stats()` (`allocated_bytes` peak over the cell, its cache emptied before; "
    f"estimated as workers x {PREFETCH} x batch bytes where it is missing); target: gpushare's <= torch's. "
    "Device memory (used memory on the device, all processes, at the end of the timed batches, less before the "
    "cell) is reported, not judged. "
    "A torch worker that a signal kills as its loader is stopped (its own abort at exit when stopped with "
    "batches queued) is a note; the cell, its batches all taken and checked by then, is kept."
)


def row_label(dtype: str, workers: int) -> str:
    return f"{dtype}, {workers} workers"


def plan(bench: Bench) -> None:
    cells = [(dtype, workers) for dtype in DTYPES for workers in WORKERS]
    rows = [row_label(*cell) for cell in cells]
    shape = "x".join(map(str, SHAPE))
    main = Scenario(
        KEY,
        f"DataLoader, {shape} images made on the CPU in the workers, used on the GPU: time per batch "
        f"({BATCH} samples per batch)",
        "cell",
        rows,
        floor=(KEY, TORCH_LOADER),
        targets={row: Target("ratio_max", round(1 / SPEEDUP, 3)) for row in rows},
        target_systems=[GS_LOADER],
        plot=False,
    )
    firsts = [r for row in rows for r in (row, f"{row}: another loader")]
    first = Scenario(
        FIRST_KEY,
        f"DataLoader, {shape} images made on the CPU in the workers: time to the first batch",
        "cell",
        [r for row in rows for r in (row, f"{row}: another loader", f"{row}: {PREPARED}")],
        floor=(FIRST_KEY, TORCH_LOADER),
        targets={row: Target("ratio_max", 1.0) for row in firsts},
        target_systems=[GS_LOADER],
        plot=False,
    )
    if not add_pair(bench, main, first):
        return
    main.notes.append(
        f"batches/s = 1e6 / median us (listed in the table below). Target: {GS_LOADER}'s batches/s >= {SPEEDUP:g}x "
        f"{TORCH_LOADER}'s."
    )
    first.notes.append(
        "From the loader's construction to its first batch on the GPU (one per cell and round): the cell's loader "
        "(gpushare's spawns its workers and starts multiprocessing's forkserver), then another loader made after it "
        f"(gpushare's forked from that forkserver); for gpushare, a first loader made {PREPARE_HEAD:g} s after "
        "`gpushare.prepare_loaders()` started the forkserver (none running before): what a script that calls it "
        "before building its model gets. No target on that row."
    )
    skip = loader_skip(bench, DEVICE)
    if skip is not None:
        main.skipped = first.skipped = skip
        return
    counts = QUICK if bench.cfg.quick else FULL
    for dtype, workers in cells:
        for system in SYSTEMS:
            bench.task(
                KEY, system, row_label(dtype, workers), _bind(measure, bench, system, dtype, workers, counts), None
            )


class CpuImages:
    """Sample i: an image of one value (``i % 251`` for uint8, ``i`` for float32) made on the CPU, and i."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype: str) -> None:
        self.n, self.shape, self.dtype = n, shape, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        value = i % MODULUS if self.dtype == "uint8" else float(i)
        return torch.full(self.shape, value, dtype=getattr(torch, self.dtype)), i


def batch_bytes(dtype: str) -> int:
    return BATCH * math.prod(SHAPE) * (1 if dtype == "uint8" else 4)


def _make_loader(system: str, dataset: CpuImages, workers: int) -> Any:
    import torch

    if system == TORCH_LOADER:
        return torch.utils.data.DataLoader(
            dataset,  # type: ignore[arg-type,unused-ignore]  # map-style: __getitem__ and __len__
            batch_size=BATCH,
            num_workers=workers,
            multiprocessing_context="spawn",
            prefetch_factor=PREFETCH,
            pin_memory=DEVICE == "cuda",
            timeout=TIMEOUT,
        )
    from gpushare import torch as gs_torch

    return gs_torch.DataLoader(dataset, batch_size=BATCH, num_workers=workers, device=DEVICE, timeout=TIMEOUT)


@dataclass
class CellRun:
    per_batch: list[int]  # ns per batch, one per timed repeat
    first: int  # ns from the loader's construction to its first batch
    again: int  # the same for another loader made after the first was closed
    prepared: int | None  # gpushare's: a first loader made PREPARE_HEAD s after prepare_loaders()
    host_bytes: int | None  # page-locked host bytes (None off CUDA)
    host_how: str  # how host_bytes was had
    device_bytes: int | None  # device bytes in use at the end, less before (None off CUDA)
    steps: dict[str, float] | None = None  # gpushare's: where its first batch went (loader.stats())
    notes: list[str] = field(default_factory=list)  # torch workers a signal killed (stop_loader)


def _host_stats() -> dict[str, Any] | None:
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    try:
        return dict(stats())
    except Exception:
        return None


def run_cell(system: str, dtype: str, workers: int, counts: Counts) -> CellRun:
    """Run one loader over ``warmup + repeats * count`` batches (see the module docstring)."""
    import torch

    cuda = DEVICE == "cuda"
    dev = torch.device(DEVICE)
    warm = max(1, counts.warmup)  # the first batch is a warm-up batch
    total_batches = warm + counts.repeats * counts.count
    dataset = CpuImages(BATCH * total_batches, SHAPE, dtype)
    copy = cuda and system == TORCH_LOADER
    torch_dtype = getattr(torch, dtype)
    base_used = settled_used(DEVICE)
    host_base: int | None = None
    if copy:
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty is not None:
            empty()  # what earlier cells left cached would be reused here and go uncounted
        with contextlib.suppress(Exception):
            torch.cuda.reset_peak_host_memory_stats()
        stats = _host_stats()
        host_base = None if stats is None else int(stats.get("allocated_bytes.current", 0))
    arange = torch.arange(BATCH, device=dev)
    errors = torch.zeros((), dtype=torch.int64, device=dev)
    clock = time.perf_counter_ns
    seq = 0

    def take(it: Any) -> Any:
        nonlocal seq, errors
        images, labels = next(it)
        if copy:
            images = images.cuda(non_blocking=True)
            labels = labels.cuda(non_blocking=True)
        index = arange + seq * BATCH
        want = (index % MODULUS if dtype == "uint8" else index).to(torch_dtype)
        errors += (images[:, 0, 0, 0] != want).sum() + (images[:, -1, -1, -1] != want).sum()
        errors += (labels != index).sum()
        seq += 1
        return images, want

    loader: Any = None
    it: Any = None
    per_batch: list[int] = []
    notes: list[str] = []
    failure: BaseException | None = None
    if system == GS_LOADER:
        cold_start()
    try:
        t0 = clock()
        loader = _make_loader(system, dataset, workers)
        it = iter(loader)
        images, want = take(it)
        first = clock() - t0
        steps = first_steps(loader)
        for i in range(warm):
            if i < VERIFY and bool((images.reshape(BATCH, -1) != want[:, None]).any()):
                raise BenchError(f"{system} delivered a wrong batch: batch {i} differs from the dataset's")
            if i + 1 < warm:
                images, want = take(it)
        del images, want
        _synchronize()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(counts.repeats):
                start = clock()
                for _ in range(counts.count):
                    take(it)
                _synchronize()
                per_batch.append(max(1, (clock() - start) // counts.count))
        finally:
            if gc_was_enabled:
                gc.enable()
        used = device_used(DEVICE)
        device_bytes = None if used is None or base_used is None else used - base_used
        host_bytes: int | None = None
        host_how = "-"
        if cuda and system == GS_LOADER:
            host_bytes = int(loader.stats()["staging_bytes_per_worker"]) * workers
            host_how = "loader.stats()"
        elif copy:
            stats = _host_stats()
            if stats is not None and host_base is not None and "allocated_bytes.peak" in stats:
                host_bytes = int(stats["allocated_bytes.peak"]) - host_base
                host_how = "torch.cuda.host_memory_stats()"
            else:
                host_bytes = workers * PREFETCH * batch_bytes(dtype)
                host_how = f"estimate: workers x {PREFETCH} x batch bytes"
    except BaseException as exc:
        failure = exc
        raise
    finally:
        notes.extend(stop_loader(it, loader, failure))
        it = loader = None
        gc.collect()
    if seq != total_batches:
        raise BenchError(f"{system}: {seq} batches taken, {total_batches} planned")
    seq = 0  # another loader: its first batch is batch 0 again, checked the same way
    again = _first_again(system, dataset, workers, take, notes)
    prepared = None
    if system == GS_LOADER:
        from gpushare import prepare_loaders

        cold_start()  # as a script's start: no forkserver yet
        if prepare_loaders():
            time.sleep(PREPARE_HEAD)  # the script builds its model meanwhile
            seq = 0
            prepared = _first_again(system, dataset, workers, take, notes)
    bad = int(errors.item())
    if bad:
        raise BenchError(f"{system} delivered wrong batches: {bad} values or labels differ from the dataset's")
    return CellRun(per_batch, first, again, prepared, host_bytes, host_how, device_bytes, steps, notes)


def _first_again(system: str, dataset: CpuImages, workers: int, take: Any, notes: list[str]) -> int:
    """Construction to first batch of another loader, made after the cell's (see the module docstring)."""
    clock = time.perf_counter_ns
    loader: Any = None
    it: Any = None
    failure: BaseException | None = None
    try:
        t0 = clock()
        loader = _make_loader(system, dataset, workers)
        it = iter(loader)
        images, _ = take(it)
        elapsed = clock() - t0
        del images
    except BaseException as exc:
        failure = exc
        raise
    finally:
        notes.extend(stop_loader(it, loader, failure))
        it = loader = None
        gc.collect()
    return elapsed


def measure(bench: Bench, system: str, dtype: str, workers: int, counts: Counts) -> list[int]:
    """One cell: its time per batch (returned), its first batch and memory (recorded on the side)."""
    run = run_cell(system, dtype, workers, counts)
    row = row_label(dtype, workers)
    bench._pool(bench.scenarios[FIRST_KEY], system, row, [run.first])
    bench._pool(bench.scenarios[FIRST_KEY], system, f"{row}: another loader", [run.again])
    if run.prepared is not None:
        bench._pool(bench.scenarios[FIRST_KEY], system, f"{row}: {PREPARED}", [run.prepared])
    note_steps(bench.scenarios[FIRST_KEY], system, row, run.steps)
    main = bench.scenarios[KEY]
    if run.host_bytes is not None or run.device_bytes is not None:
        main.details.setdefault("loader_memory", {}).setdefault(row, {})[system] = {
            "host_pinned_mib": None if run.host_bytes is None else round(run.host_bytes / MiB, 1),
            "host_pinned_how": run.host_how,
            "device_mib": None if run.device_bytes is None else round(run.device_bytes / MiB, 1),
        }
    note_deaths(main, system, row, run.notes)
    refresh(bench, (system, row, run.per_batch))
    return run.per_batch


def refresh(bench: Bench, pending: tuple[str, str, list[int]]) -> None:
    """Rebuild the batches/s and memory tables and the host-memory targets (see dataloader_gpu.refresh)."""
    main = bench.scenarios[KEY]
    memory: dict[str, dict[str, dict[str, Any]]] = main.details.get("loader_memory", {})
    tables = [rate_table(bench, main, SYSTEMS, pending)]
    checks: list[Check] = []
    rows = []

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    for row in main.rows:
        figures = memory.get(row)
        if not figures:
            continue
        torch_f, gs_f = figures.get(TORCH_LOADER, {}), figures.get(GS_LOADER, {})
        rows.append(
            [
                row,
                f"{fmt(torch_f.get('host_pinned_mib'))} ({torch_f.get('host_pinned_how', '-')})",
                f"{fmt(gs_f.get('host_pinned_mib'))} ({gs_f.get('host_pinned_how', '-')})",
                fmt(torch_f.get("device_mib")),
                fmt(gs_f.get("device_mib")),
            ]
        )
        mine, theirs = gs_f.get("host_pinned_mib"), torch_f.get("host_pinned_mib")
        met = None if mine is None or theirs is None else mine <= theirs
        checks.append(
            Check(
                row,
                f"{GS_LOADER} page-locked staging <= {TORCH_LOADER}'s pinned buffers",
                met,
                "-" if met is None else f"{mine:,.0f} MiB vs {theirs:,.0f} MiB",
            )
        )
    main.checks = checks
    if rows:
        tables.append(
            Table(
                f"`{KEY}` memory, MiB: page-locked host memory (how it was had), and device memory used at the end of "
                "the timed batches (all processes) less before the cell",
                [
                    "cell",
                    f"{TORCH_LOADER}: pinned host",
                    f"{GS_LOADER}: page-locked staging",
                    f"{TORCH_LOADER}: device",
                    f"{GS_LOADER}: device",
                ],
                rows,
            )
        )
    main.tables = tables


def _synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
