"""``dataloader_gpu_samples``: DataLoaders whose workers make samples on the GPU, per cell of a grid.

gpushare.torch.DataLoader against torch's DataLoader in the same run, over the same
dataset: each sample is made on the GPU in the worker (``torch.full`` on CUDA, as in
``dataloader``), 64 samples per batch. The grid: 4 and 8 workers, batches of 4 and 16
MiB, and two ways to run epochs: a new loader per epoch (its workers start with it and
stop at its end), or one loader with ``persistent_workers=True`` for every epoch.

One task per cell and system. An epoch is 1 + ``CHUNKS`` x ``CHUNK`` + ``PACED`` +
``TAIL`` batches: the first
batch is timed from the loader's construction (a new loader, and a persistent loader's
epoch 0) or from ``iter()`` (a persistent loader's later epochs) until ``next()`` returns
it; then ``CHUNKS`` chunks of ``CHUNK`` batches are timed whole, the device synchronized
at the end of each, one sample each (ns per batch). The trainer queues the same small
reduction on every batch (no host sync) and checks the sums at the end of the cell: a
wrong batch fails the cell.

Three tables: ``dataloader_gpu_samples`` (time per batch; target: gpushare's <= torch's,
i.e. batches/s >= torch's), its companion ``dataloader_gpu_samples_first`` (time to the
first batch; for persistent loaders, of epoch 0 and the median of the later epochs;
target <= torch's) and, under the first, batches/s and device memory per cell: the
device's used memory (``torch.cuda.mem_get_info`` in the trainer: the trainer's and every
worker's allocations and contexts) at the end of each epoch, less what was used before
the cell, and the trainer's ``torch.cuda.memory_allocated`` at the same moment. Targets on it:
gpushare's at most torch's, and flat (growth over the epochs <= ``FLAT_MIB``) with a new
loader each epoch, judged over ``Counts.flat`` epochs in the cell ``FLAT_CELL``.

That trainer takes a batch as soon as it can (hundreds to thousands a second), so torch's
workers rarely have more than one batch alive each, while gpushare's slots are allocated
up front. A trainer whose step takes time lets every worker fill its prefetch, as in
training: after the timed chunks each epoch goes on with ``PACED`` batches held
``STEP_S`` each (a host sleep standing for the step), then reads the used memory again
(``paced``, judged the same way), with ``TAIL`` batches still to come so that no worker has
run out of tasks; the tail is then taken untimed.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..fmt import _size_label
from ..peers import torch_skip
from ..results import Check, Scenario, Table, _bind
from ..settings import BenchError, MiB
from ..stats import Cell, Target
from .dataloader import GpuSamples

if TYPE_CHECKING:
    from ..runner import Bench


KEY = "dataloader_gpu_samples"
FIRST_KEY = f"{KEY}_first"  # the time-to-first-batch table, added with KEY
KEYS = (KEY,)

WORKERS = (4, 8)
SIZES = (4 * MiB, 16 * MiB)
BATCH = 64  # samples per batch
PREFETCH = 2  # both loaders' prefetch_factor (torch's default); gpushare's slots: its default, PREFETCH + 1
PER_EPOCH = "new loader per epoch"
PERSISTENT = "persistent"
MODES = (PER_EPOCH, PERSISTENT)
TORCH_LOADER = "torch DataLoader"
GS_LOADER = "gpushare.torch.DataLoader"
SYSTEMS = (TORCH_LOADER, GS_LOADER)
DEVICE = "cuda"  # where samples are made and the slots live (the plumbing test sets "cpu")
CHUNK = 10  # batches timed whole, one sample
CHUNKS = 3  # timed chunks per epoch, after its first batch
PACED = 8  # then this many batches, each held STEP_S by the trainer, before the second memory reading
STEP_S = 0.005  # the paced trainer's step per batch
TAIL = 2 * PREFETCH * max(WORKERS)  # batches after the second reading: every worker still has tasks
FLAT_CELL = (4, 4 * MiB)  # (workers, batch bytes): the cell whose new-loader epochs judge flatness
FLAT_MIB = 8  # growth over the epochs at most this: flat (less than one 4 MiB ring of 4 slots)
TIMEOUT = 120  # seconds: any one batch, a loader's workers starting included


@dataclass(frozen=True)
class Counts:
    """Epochs per cell."""

    per_epoch: int  # new-loader-per-epoch cells (each epoch starts a loader and its workers)
    flat: int  # the FLAT_CELL's new-loader cell: the memory-flatness check
    persistent: int  # persistent cells: one loader, this many epochs


FULL = Counts(per_epoch=3, flat=20, persistent=6)
QUICK = Counts(per_epoch=2, flat=5, persistent=3)

HOW = (
    f"`{KEY}` (a GPU and torch only) runs {GS_LOADER} and torch's DataLoader over the same dataset in the same "
    f"run: each sample made on the GPU in the worker (`torch.full(..., device='cuda')`), {BATCH} samples per "
    f"batch; {' and '.join(map(str, WORKERS))} workers, batches of {' and '.join(map(_size_label, SIZES))}, "
    f"a new loader per epoch (a new torch DataLoader too) or one loader with `persistent_workers=True`. torch's: "
    f"spawn workers, its defaults otherwise (prefetch_factor 2), CUDA tensors through its CUDA IPC; gpushare's: "
    f"its defaults too (prefetch_factor {PREFETCH}, {PREFETCH + 1} slots per worker: the batches built ahead and "
    "the one the trainer holds), each batch stacked into a slot, viewed in place by the trainer, its workers forked "
    "from multiprocessing's forkserver (its default), which is stopped before each of its cells: a cell's first "
    "loader spawns its workers and starts the forkserver after its first batch, as a script's first loader does. "
    "An epoch is "
    f"{1 + CHUNKS * CHUNK + PACED + TAIL} batches: its first, then {CHUNKS} chunks of {CHUNK} timed whole, the "
    f"device synchronized after each, then {PACED} batches each held {STEP_S * 1e3:g} ms by the trainer (a paced "
    f"trainer, as in training) and {TAIL} more untimed; the trainer queues one small reduction per batch (no "
    "host sync) and checks the sums at the end of the cell (a wrong batch fails it). "
    f"Epochs per cell: {FULL.per_epoch} with a new loader "
    f"each ({FULL.flat} in the {FLAT_CELL[0]} workers, {_size_label(FLAT_CELL[1])} cell), {FULL.persistent} "
    f"persistent ({QUICK.per_epoch}, {QUICK.flat} and {QUICK.persistent} with --quick). `{KEY}`: median time per "
    f"chunk / {CHUNK} (1e6 / it = batches/s), torch's as the floor; target: gpushare's <= torch's. "
    f"`{FIRST_KEY}`: from a new loader's construction (a persistent loader's later epochs: from `iter()`) until "
    "`next()` returns the first batch, the first loader of a cell apart from the later ones (their median); "
    "target <= torch's; a note per cell gives gpushare's first batch step by "
    "step (`loader.stats()['first_batch_s']`: worker 0 spawned, started, linked, its slots allocated, the "
    "trainer's receipt). Device memory: the device's used memory "
    "(`torch.cuda.mem_get_info` in the trainer: trainer and workers, contexts included) after each epoch's timed "
    "chunks, workers still running, less the used memory before the cell; and the trainer's "
    "`torch.cuda.memory_allocated`; then again after the paced batches, every worker still with tasks: a trainer "
    "that takes its batches as fast as this one leaves torch's workers about one batch alive each, a paced one "
    "lets them fill their prefetch, while gpushare's slots are allocated up front. Targets: gpushare's <= "
    f"torch's (first epoch, both readings), and growth from the first to the last epoch <= {FLAT_MIB} MiB with a "
    f"new loader each epoch (judged in the {FULL.flat}-epoch cell; {QUICK.flat} epochs with --quick). "
    "A torch worker that a signal kills as its loader is stopped (its own abort at exit when stopped with "
    "batches queued) is a note; the cell, its batches all taken and checked by then, is kept."
)


def row_label(workers: int, nbytes: int, mode: str) -> str:
    return f"{workers} workers, {_size_label(nbytes)}, {mode}"


def grid() -> list[tuple[int, int, str]]:
    """(workers, batch bytes, mode) of every cell, in row order."""
    return [(w, size, mode) for w in WORKERS for size in SIZES for mode in MODES]


def first_rows(workers: int, nbytes: int, mode: str) -> list[str]:
    """The time-to-first-batch rows of one cell."""
    row = row_label(workers, nbytes, mode)
    if mode == PERSISTENT:
        return [f"{row}: epoch 0", f"{row}: later epochs"]
    return [f"{row}: first loader", f"{row}: later loaders"]


def cold_start() -> None:
    """Stop multiprocessing's forkserver, if one runs: the next gpushare loader starts it again.

    gpushare's loaders fork their workers from the forkserver, which imports torch once
    and stays for the process's life. Each gpushare cell starts from none, so that its
    first loader pays what a script's first loader pays; torch's spawned workers start
    from nothing every time."""
    from multiprocessing import forkserver

    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


def epochs_of(counts: Counts, workers: int, nbytes: int, mode: str) -> int:
    if mode == PERSISTENT:
        return counts.persistent
    return counts.flat if (workers, nbytes) == FLAT_CELL else counts.per_epoch


# -- planning, shared with dataloader_cpu ------------------------------------------------------


def loader_skip(bench: Bench, device: str) -> str | None:
    """Why a loader scenario cannot run: torch_skip on a GPU; with ``device="cpu"`` (the plumbing
    test), only a missing torch."""
    if device != "cpu":
        return torch_skip(bench)
    try:
        import torch  # noqa: F401
    except Exception as exc:
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    return None


def add_pair(bench: Bench, main: Scenario, first: Scenario) -> bool:
    """Add a scenario and its time-to-first-batch companion (with it, whatever ``--only`` names)."""
    if not bench.add(main):
        return False
    bench.scenarios[first.key] = first
    return True


def close_iterator(it: Any) -> None:
    """Stop an iterator's workers now: gpushare's ``close()``, torch's ``_shutdown_workers()``."""
    close = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if close is not None:
        close()


def stop_loader(it: Any, loader: Any, failure: BaseException | None) -> list[str]:
    """Stop a cell's loader at the cell's end: its iterator's workers, then the loader (gpushare's
    ``close()``, or a persistent torch loader's kept iterator), each step even when one before it
    raised; return notes on torch workers a signal killed meanwhile.

    torch's own spawned workers now and then die of SIGABRT ("terminate called without an active
    exception") as they exit after being stopped with batches still queued: the queue's feeder thread
    is pickling one, inside torch's ``THPStorage_shareFd`` with the GIL let go, when the interpreter
    finalizes; CPython (3.12 and before) ends such a thread with ``pthread_exit``, whose unwinding
    cannot cross that C++ frame. torch raises the death from its SIGCHLD handler when the signal lands
    during its join and lets it pass unseen otherwise. The cell's batches were all taken and checked
    by then, so such a death is a note (read from the workers' exit codes: each one is told, raised or
    not) and the cell is kept. Anything else that stopping raises is the cell's error. Where the cell
    is already failing (``failure``), what stopping raised and the notes are added to that failure
    instead: a wrong batch is reported as one, not as a worker that died being shut down after it."""
    notes: list[str] = []
    errors: list[Exception] = []
    close = None if loader is None else getattr(loader, "close", None)
    iterators = [it]
    if loader is not None and close is None:
        kept = getattr(loader, "_iterator", None)  # a persistent torch loader's
        if kept is not it:
            iterators.append(kept)
    for each in (i for i in iterators if i is not None):
        try:
            close_iterator(each)
            error: Exception | None = None
        except Exception as exc:
            error = exc
        deaths = signal_deaths(each)
        notes.extend(deaths)
        explained = deaths and isinstance(error, RuntimeError) and "killed by signal" in str(error)
        if error is not None and not explained:
            errors.append(error)
    if close is not None:
        try:
            close()
        except Exception as exc:
            errors.append(exc)
    if failure is not None:
        for error in errors:
            failure.add_note(f"then stopping its loader raised {type(error).__name__}: {error}")
        for note in notes:
            failure.add_note(f"then {note}")
    elif errors:
        raise errors[0]
    return notes


def signal_deaths(it: Any) -> list[str]:
    """One line for each worker of torch's iterator ``it`` that a signal killed (gpushare's iterator,
    with a ``close()``, is not looked at: its workers are gpushare's, and their faults are errors)."""
    if hasattr(it, "close"):
        return []
    lines = []
    for worker in getattr(it, "_workers", ()):
        code = worker.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            lines.append(f"torch's DataLoader worker (pid {worker.pid}) died of {name} as its loader was stopped")
    return lines


def device_used(device: str) -> int | None:
    """Bytes in use on the device (every process's), or None off CUDA."""
    if device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def settled_used(device: str, timeout: float = 3.0) -> int | None:
    """The device's used bytes once three reads 0.1 s apart agree (what an earlier cell freed on a
    thread, processes exiting), or the last read after ``timeout``."""
    if device != "cuda":
        return None
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with contextlib.suppress(Exception):
        torch.cuda.ipc_collect()
    reads = [device_used(device)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (len(reads) >= 3 and len(set(reads[-3:])) == 1):
        time.sleep(0.1)
        reads.append(device_used(device))
    return reads[-1]


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.0f}"


# -- the scenario --------------------------------------------------------------------------------


def plan(bench: Bench) -> None:
    cells = grid()
    rows = [row_label(*cell) for cell in cells]
    firsts = [r for cell in cells for r in first_rows(*cell)]
    main = Scenario(
        KEY,
        f"DataLoader, samples made on the GPU in the workers: time per batch ({BATCH} samples per batch)",
        "cell",
        rows,
        floor=(KEY, TORCH_LOADER),
        targets={row: Target("ratio_max", 1.0) for row in rows},
        target_systems=[GS_LOADER],
        plot=False,
    )
    first = Scenario(
        FIRST_KEY,
        "DataLoader, samples made on the GPU in the workers: time to the first batch",
        "cell",
        firsts,
        floor=(FIRST_KEY, TORCH_LOADER),
        targets={row: Target("ratio_max", 1.0) for row in firsts},
        target_systems=[GS_LOADER],
        plot=False,
    )
    if not add_pair(bench, main, first):
        return
    main.notes.append(
        f"batches/s = 1e6 / median us (listed in the table below). {GS_LOADER}: its defaults ({PREFETCH + 1} slots "
        f"per worker, prefetch_factor {PREFETCH}); {TORCH_LOADER}: multiprocessing_context='spawn', its defaults "
        "otherwise. Targets: {GS_LOADER}'s "
        "time per batch <= torch's (batches/s >= torch's)."
    )
    first.notes.append(
        "New loader per epoch: from the loader's construction to its first batch, the cell's first loader (for "
        "gpushare: spawned workers, the forkserver started after its first batch) and the later ones (forked; their "
        "median); persistent: epoch 0 from the construction, later epochs from `iter()` (their median)."
    )
    skip = loader_skip(bench, DEVICE)
    if skip is not None:
        main.skipped = first.skipped = skip
        return
    counts = QUICK if bench.cfg.quick else FULL
    for workers, nbytes, mode in cells:
        epochs = epochs_of(counts, workers, nbytes, mode)
        row = row_label(workers, nbytes, mode)
        for system in SYSTEMS:
            bench.task(KEY, system, row, _bind(measure, bench, system, workers, nbytes, mode, epochs), None)


def _make_loader(system: str, dataset: GpuSamples, workers: int, persistent: bool) -> Any:
    import torch

    if system == TORCH_LOADER:
        return torch.utils.data.DataLoader(
            dataset,  # type: ignore[arg-type,unused-ignore]  # map-style: __getitem__ and __len__
            batch_size=BATCH,
            num_workers=workers,
            multiprocessing_context="spawn",
            persistent_workers=persistent,
            timeout=TIMEOUT,
        )
    from gpushare import torch as gs_torch

    return gs_torch.DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=workers,
        device=0 if DEVICE == "cuda" else DEVICE,
        persistent_workers=persistent,
        timeout=TIMEOUT,
    )


@dataclass
class CellRun:
    """What one cell measured."""

    per_batch: list[int]  # ns per batch, one per timed chunk
    firsts: list[int]  # ns to the first batch, one per epoch
    used: list[int]  # device bytes in use after each epoch's timed chunks, less the baseline (CUDA only)
    trainer: list[int]  # the trainer's torch.cuda.memory_allocated at the same moments, less its baseline
    paced: list[int]  # device bytes in use after each epoch's paced batches, less the baseline
    steps: dict[str, float] | None = None  # gpushare's: where its first epoch's first batch went
    notes: list[str] = field(default_factory=list)  # torch workers a signal killed (stop_loader)


def first_steps(loader: Any) -> dict[str, float] | None:
    """gpushare's ``loader.stats()["first_batch_s"]`` (torch's loader has none)."""
    stats = getattr(loader, "stats", None)
    return None if stats is None else stats().get("first_batch_s")


def note_steps(scenario: Scenario, system: str, row: str, steps: dict[str, float] | None) -> None:
    """A note on ``scenario``: where ``system``'s first batch of ``row`` spent its time."""
    if steps:
        marks = ", ".join(f"{name} {seconds:.3f}" for name, seconds in steps.items())
        scenario.notes.append(f"{system}, {row}, first batch, s since `iter()` (`loader.stats()`): {marks}.")


def note_deaths(scenario: Scenario, system: str, row: str, notes: list[str]) -> None:
    """Notes on ``scenario``: torch workers that a signal killed as ``system``'s loader of ``row`` was stopped."""
    for note in notes:
        scenario.notes.append(f"{system}, {row}: {note}, after the cell's batches (the cell is kept).")


def run_cell(system: str, workers: int, nbytes: int, mode: str, epochs: int) -> CellRun:
    """Run ``epochs`` epochs of one loader kind (see the module docstring); raises on a wrong batch."""
    import torch

    cuda = DEVICE == "cuda"
    per_epoch = 1 + CHUNKS * CHUNK + PACED + TAIL
    dataset = GpuSamples(BATCH * per_epoch, nbytes // BATCH // 4, DEVICE)
    persistent = mode == PERSISTENT
    if system == GS_LOADER:
        cold_start()
    base_used = settled_used(DEVICE)
    base_trainer = torch.cuda.memory_allocated() if cuda else 0
    total = torch.zeros((), dtype=torch.float64, device=DEVICE)  # exact for these sums
    run = CellRun([], [], [], [], [])
    clock = time.perf_counter_ns
    loader: Any = None
    it: Any = None
    values: Any = None
    failure: BaseException | None = None
    try:
        for _ in range(epochs):
            t0 = clock()
            if loader is None:
                loader = _make_loader(system, dataset, workers, persistent)
            it = iter(loader)
            values, _labels = next(it)
            run.firsts.append(clock() - t0)
            if run.steps is None:
                run.steps = first_steps(loader)
            total += values[0, 0] + values[-1, -1]
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                for _ in range(CHUNKS):
                    start = clock()
                    for _ in range(CHUNK):
                        values, _labels = next(it)
                        total += values[0, 0] + values[-1, -1]
                    _synchronize()
                    run.per_batch.append(max(1, (clock() - start) // CHUNK))
            finally:
                if gc_was_enabled:
                    gc.enable()
            used = device_used(DEVICE)  # the epoch's workers still running, its last batch held
            if used is not None and base_used is not None:
                run.used.append(used - base_used)
                run.trainer.append(torch.cuda.memory_allocated() - base_trainer)
            for _ in range(PACED):  # a trainer whose step takes time: every worker fills its prefetch
                values, _labels = next(it)
                total += values[0, 0] + values[-1, -1]
                time.sleep(STEP_S)
            used = device_used(DEVICE)
            if used is not None and base_used is not None:
                run.paced.append(used - base_used)
            for _ in range(TAIL):
                values, _labels = next(it)
                total += values[0, 0] + values[-1, -1]
            values = _labels = None
            try:
                next(it)
            except StopIteration:
                pass
            else:
                raise BenchError(f"{system} gave more than the {per_epoch} batches of an epoch")
            run.notes.extend(signal_deaths(it))  # torch stopped its workers at StopIteration
            it = None
            if not persistent:
                close = getattr(loader, "close", None)  # gpushare's; torch's stopped at StopIteration
                if close is not None:
                    close()
                loader = None
                gc.collect()
    except BaseException as exc:
        failure = exc
        raise
    finally:
        values = None
        run.notes.extend(stop_loader(it, loader, failure))
        it = loader = None
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()
    # batch k holds samples kB .. kB+B-1: its first and last values are kB and kB+B-1
    expected = epochs * sum(2 * k * BATCH + BATCH - 1 for k in range(per_epoch))
    got = int(total.item())
    if got != expected:
        raise BenchError(f"{system} delivered wrong batches: checksum {got} != {expected}")
    return run


def measure(bench: Bench, system: str, workers: int, nbytes: int, mode: str, epochs: int) -> list[int]:
    """One cell: its time per batch (returned), its first batches and memory (recorded on the side)."""
    run = run_cell(system, workers, nbytes, mode, epochs)
    rows = first_rows(workers, nbytes, mode)
    first = bench.scenarios[FIRST_KEY]
    note_steps(first, system, rows[0], run.steps)
    bench._pool(first, system, rows[0], run.firsts[:1])
    if run.firsts[1:]:
        bench._pool(first, system, rows[1], run.firsts[1:])
    if run.used:
        memory = bench.scenarios[KEY].details.setdefault("device_memory", {})
        memory.setdefault(row_label(workers, nbytes, mode), {})[system] = {
            "epochs": len(run.used),
            "first_epoch_mib": round(run.used[0] / MiB, 1),
            "last_epoch_mib": round(run.used[-1] / MiB, 1),
            "growth_mib": round((run.used[-1] - run.used[0]) / MiB, 1),
            "max_mib": round(max(run.used) / MiB, 1),
            "trainer_allocated_mib": round(run.trainer[0] / MiB, 1),
            "paced_first_epoch_mib": round(run.paced[0] / MiB, 1) if run.paced else None,
        }
    note_deaths(bench.scenarios[KEY], system, row_label(workers, nbytes, mode), run.notes)
    refresh(bench, (system, row_label(workers, nbytes, mode), run.per_batch))
    return run.per_batch


def refresh(bench: Bench, pending: tuple[str, str, list[int]]) -> None:
    """Rebuild the memory and batches/s tables and the memory targets from what has run so far and
    ``pending`` (system, row, samples: the cell about to be recorded)."""
    main = bench.scenarios[KEY]
    memory: dict[str, dict[str, dict[str, Any]]] = main.details.get("device_memory", {})
    tables = [rate_table(bench, main, SYSTEMS, pending)]
    checks: list[Check] = []
    memory_rows = []
    for row in main.rows:
        figures = memory.get(row, {})
        if not figures:
            continue
        cells = [row]
        for system in SYSTEMS:
            f = figures.get(system)
            if f is None:
                cells += ["-", "-", "-", "-"]
            else:
                paced = f.get("paced_first_epoch_mib")
                cells += [
                    f"{f['first_epoch_mib']:,.0f}",
                    f"{f['last_epoch_mib']:,.0f} ({f['growth_mib']:+,.0f} over {f['epochs']} epochs)",
                    f"{f['trainer_allocated_mib']:,.0f}",
                    "-" if paced is None else f"{paced:,.0f}",
                ]
        memory_rows.append(cells)
        torch_f, gs_f = figures.get(TORCH_LOADER), figures.get(GS_LOADER)
        if torch_f is None or gs_f is None:
            checks.append(Check(row, f"{GS_LOADER} device memory <= {TORCH_LOADER}'s", None, "-"))
        else:
            checks.append(
                Check(
                    row,
                    f"{GS_LOADER} device memory <= {TORCH_LOADER}'s",
                    gs_f["first_epoch_mib"] <= torch_f["first_epoch_mib"],
                    f"{gs_f['first_epoch_mib']:,.0f} MiB vs {torch_f['first_epoch_mib']:,.0f} MiB",
                )
            )
            gs_p, torch_p = gs_f.get("paced_first_epoch_mib"), torch_f.get("paced_first_epoch_mib")
            if gs_p is not None and torch_p is not None:
                checks.append(
                    Check(
                        row,
                        f"{GS_LOADER} device memory <= {TORCH_LOADER}'s, the trainer taking {STEP_S * 1e3:g} ms "
                        "a batch",
                        gs_p <= torch_p,
                        f"{gs_p:,.0f} MiB vs {torch_p:,.0f} MiB",
                    )
                )
        if row == row_label(*FLAT_CELL, PER_EPOCH) and gs_f is not None and gs_f["epochs"] >= 2:
            checks.append(
                Check(
                    row,
                    f"{GS_LOADER} device memory flat over {gs_f['epochs']} epochs, a new loader each "
                    f"(growth <= {FLAT_MIB} MiB)",
                    abs(gs_f["growth_mib"]) <= FLAT_MIB,
                    f"{gs_f['first_epoch_mib']:,.0f} -> {gs_f['last_epoch_mib']:,.0f} MiB, "
                    f"{gs_f['growth_mib']:+,.1f} MiB",
                )
            )
    main.checks = checks
    if memory_rows:
        header = ["cell"]
        for system in SYSTEMS:
            header += [
                f"{system}: first epoch",
                f"{system}: last epoch (growth)",
                f"{system}: trainer allocated",
                f"{system}: first epoch, paced trainer",
            ]
        tables.append(
            Table(
                f"`{KEY}` device memory, MiB: the device's used memory after an epoch's timed chunks (trainer and "
                "workers, contexts included) less the used memory before the cell; the trainer's "
                f"`torch.cuda.memory_allocated` (first epoch); the used memory after {PACED} more batches that the "
                f"trainer held {STEP_S * 1e3:g} ms each (first epoch), every worker still with tasks",
                header,
                memory_rows,
            )
        )
    main.tables = tables


def rate_table(
    bench: Bench, scenario: Scenario, systems: tuple[str, str], pending: tuple[str, str, list[int]]
) -> Table:
    """Batches per second per row, from the time-per-batch cells (and ``pending``: the samples of the cell
    being recorded), and the second system's over the first's."""

    def cell(system: str, row: str) -> Cell | None:
        if (system, row) == pending[:2]:
            return Cell.of(bench._pooled.get((scenario.key, system, row), []) + pending[2])
        return _cell(scenario, system, row)

    rows = []
    for row in scenario.rows:
        cells = [cell(system, row) for system in systems]
        rates = ["-" if cell is None else f"{1e6 / cell.median_us:,.0f}" for cell in cells]
        ratio = "-" if None in cells else f"{cells[0].median_us / cells[1].median_us:.2f}"  # type: ignore[union-attr]
        rows.append([row, *rates, ratio])
    return Table(
        f"`{scenario.key}` batches per second (1e6 / median us per batch)",
        [scenario.row_label, *(f"{s} (batches/s)" for s in systems), f"{systems[1]} / {systems[0]}"],
        rows,
    )


def _cell(scenario: Scenario, system: str, row: str) -> Cell | None:
    series = scenario.systems.get(system)
    return None if series is None else series.cells.get(row)


def _synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
