"""Benchmarks: gpushare's buffer handoff against its floors and its peers.

``python -m gpushare.bench`` (``--quick`` for a short run, ``--help`` for
the options) measures everything below in one run and writes three files
to ``--out`` (default ``docs``): ``benchmarks.md`` (machine, versions and
one table per scenario: medians, p90 and ratios to the floor),
``benchmarks.json`` (every median, p90, mean and minimum, plus skip
reasons and errors) and ``benchmarks.png`` (latency against the number of
consumers, one line per system; skipped with a note when matplotlib does
not import).

What one iteration is, per scenario (one producer, N consumer processes):

``floors``
    A small tuple sent down one ``multiprocessing.Pipe`` per consumer, or
    put N times on one ``multiprocessing.Queue`` read by N consumers; each
    consumer acks (on its pipe, or on one ack queue) and the producer
    waits for every ack. No handoff can cost less than this notification,
    so every other table is read as a ratio to the Queue floor.
``handoff_recycled`` / ``handoff_fresh``
    The Queue-floor pattern carrying a 1 MiB buffer instead of the tuple:
    the producer puts the buffer once per consumer; a consumer gets it,
    touches its device pointer, lets it go and acks. Systems: gpushare
    (``Manager.empty`` on the chosen backend; consumers ``buf.ptr`` then
    ``buf.release()``), ``torch.multiprocessing`` (a CUDA tensor;
    ``t.data_ptr()`` then ``del t``) and cuda.core (a buffer of an
    IPC-enabled ``DeviceMemoryResource``, which cuda.core pickles itself;
    the memory resource is handed to each consumer at spawn). *recycled*
    puts the same buffer every iteration; *fresh* allocates one per
    iteration and drops it after the acks (each library's pool or caching
    allocator recycles the memory, as it would in a pipeline).
``first_share``
    Time from ``m.empty()`` of a fresh allocation through one consumer
    mapping it and acking. Between iterations (not timed) the producer
    waits for the consumer's lease to come back and calls ``m.trim()``,
    so every iteration allocates, exports and maps new memory.
``host``
    A 64 MiB float32 array on the host backend (always runs, GPU or not):
    a gpushare host buffer written in place, the same buffer refilled with
    ``copy_from`` every iteration, and a plain ``multiprocessing.Queue``
    carrying the NumPy array itself (a pickled copy per consumer).
    Consumers touch the first element.

How: everything uses the spawn start method. Consumers are module-level
functions, started once per (scenario, system, N), reused across
iterations, told to stop with a sentinel and always joined with a timeout
(then terminated, then killed). After a warm-up, each iteration is timed
with ``time.perf_counter_ns`` around "produce, put N times, collect N
acks", with the garbage collector off in the producer while timing.
Large transfers (64 MiB and up) run fewer iterations. A peer that cannot
run here (not importable, no GPU) is recorded as skipped with the reason;
an error in one cell is recorded as that cell's error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["main"]

MiB = 1 << 20
GiB = 1 << 30
HANDOFF_BYTES = 1 * MiB
HANDOFF_SHAPE = (HANDOFF_BYTES // 4,)  # float32
HOST_BYTES = 64 * MiB
HOST_SHAPE = (HOST_BYTES // 4,)
CONSUMERS = (1, 2, 4, 8)
HOST_CONSUMERS = (1, 2, 4)
READY_TIMEOUT = 180.0  # seconds for N spawned consumers to import and set up (torch is slow)
ACK_TIMEOUT = 60.0  # seconds for one ack; only a stuck or dead consumer takes this long
JOIN_TIMEOUT = 10.0
SETTLE_TIMEOUT = 10.0

FLOOR_SCENARIO = "floors"
FLOOR_SYSTEM = "mp.Queue"
GPUSHARE = "gpushare"
TORCH = "torch.multiprocessing"
CUDA_CORE = "cuda.core IPC pool"


class BenchError(RuntimeError):
    """A consumer failed, died or did not answer in time."""


# ---------------------------------------------------------------------------
# Consumer side (module level: spawn imports this module in every worker)
# ---------------------------------------------------------------------------


def _touch_plain(item: Any) -> None:
    pass


def _touch_gpushare(buf: Any) -> None:
    _ = buf.ptr  # the mapping is real: ptr is this process's address of the memory
    buf.release()


def _touch_gpushare_host(buf: Any) -> None:
    _ = buf.numpy()[0]
    buf.release()


def _touch_numpy(array: Any) -> None:
    _ = array[0]


def _touch_torch(tensor: Any) -> None:
    _ = tensor.data_ptr()


def _touch_cuda_core(buf: Any) -> None:
    _ = int(buf.handle)
    buf.close()


_TOUCH: dict[str, Callable[[Any], None]] = {
    "plain": _touch_plain,
    "gpushare": _touch_gpushare,
    "gpushare_host": _touch_gpushare_host,
    "numpy": _touch_numpy,
    "torch": _touch_torch,
    "cuda_core": _touch_cuda_core,
}


def _consumer_setup(kind: str, device: int | None) -> None:
    if kind == "torch":
        import torch

        torch.cuda.set_device(device or 0)
        torch.cuda.init()
    elif kind == "cuda_core":
        _cuda_core().Device(device or 0).set_current()


def _queue_consumer(kind: str, work: Any, acks: Any, device: int | None, extra: Any = None) -> None:
    """Get items from ``work`` until None; touch each one, then ack on ``acks``.

    ``extra`` is carried only so that it is unpickled at spawn (cuda.core maps
    its memory resource there, which its buffers need on arrival).
    """
    try:
        _consumer_setup(kind, device)
        touch = _TOUCH[kind]
    except BaseException as exc:
        acks.put(("error", f"consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    acks.put(("ready", os.getpid()))
    while True:
        item = work.get()
        if item is None:
            return
        try:
            touch(item)
        except BaseException as exc:
            acks.put(("error", f"consumer failed: {type(exc).__name__}: {exc}"))
            return
        del item
        acks.put(1)


def _pipe_consumer(conn: Any) -> None:
    conn.send(("ready", os.getpid()))
    while True:
        if conn.recv() is None:
            return
        conn.send(1)


# ---------------------------------------------------------------------------
# Optional peers
# ---------------------------------------------------------------------------


def _cuda_core() -> Any:
    """cuda.core's memory-IPC names: top level (1.x) or ``experimental`` (0.x)."""
    names = ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions")
    errors = []
    for module_name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = importlib.import_module(module_name)
            return SimpleNamespace(**{name: getattr(module, name) for name in names}, module=module)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
    raise ImportError("; ".join(errors))


def _gpushare() -> Any:
    """The public facade (its multiprocessing names are set at import, which mypy cannot see)."""
    return importlib.import_module("gpushare")


def _version_of(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "not installed"


# ---------------------------------------------------------------------------
# Statistics and results
# ---------------------------------------------------------------------------


@dataclass
class Cell:
    median_us: float
    p90_us: float
    mean_us: float
    min_us: float
    n: int

    @classmethod
    def of(cls, samples_ns: list[int]) -> Cell:
        us = np.asarray(samples_ns, dtype=np.float64) / 1000.0
        return cls(
            median_us=round(float(np.median(us)), 2),
            p90_us=round(float(np.percentile(us, 90)), 2),
            mean_us=round(float(us.mean()), 2),
            min_us=round(float(us.min()), 2),
            n=len(samples_ns),
        )


@dataclass
class Series:
    """One system's results in one scenario, per row."""

    cells: dict[str, Cell] = field(default_factory=dict)
    skipped: str | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Scenario:
    key: str
    title: str
    row_label: str
    rows: list[str]
    systems: dict[str, Series] = field(default_factory=dict)
    floor: tuple[str, str] | None = (FLOOR_SCENARIO, FLOOR_SYSTEM)
    floor_row: str | None = None  # None: the same row of the floor scenario
    ratio_systems: list[str] | None = None  # systems with a "/ floor" column; None: all of them
    extra_ratios: list[tuple[str, str]] = field(default_factory=list)  # (numerator, denominator) systems
    notes: list[str] = field(default_factory=list)
    plot: bool = True


@dataclass
class Task:
    scenario: str
    system: str
    row: str
    run: Callable[[], list[int]] | None
    skip: str | None = None


# ---------------------------------------------------------------------------
# Timing and worker management
# ---------------------------------------------------------------------------


def _time_loop(
    step: Callable[[int], None], warmup: int, iters: int, between: Callable[[], None] | None = None
) -> list[int]:
    """Run ``step`` ``warmup`` times, then time it ``iters`` times (``between`` runs untimed before each)."""
    for i in range(warmup):
        if between is not None:
            between()
        step(i)
    samples: list[int] = []
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(iters):
            if between is not None:
                between()
            t0 = clock()
            step(i)
            samples.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _check_ack(ack: Any) -> None:
    if ack != 1:
        raise BenchError(f"a consumer sent {ack!r} instead of an ack")


def _check_alive(procs: list[Any]) -> None:
    dead = [p for p in procs if p.exitcode is not None]
    if dead:
        raise BenchError(f"a consumer (pid {dead[0].pid}) exited with code {dead[0].exitcode}")


def _get_ack(acks: Any, procs: list[Any]) -> Any:
    """The next ack; a consumer that died or hangs fails the cell instead of the run."""
    deadline = time.monotonic() + ACK_TIMEOUT
    while True:
        try:
            return acks.get(timeout=1.0)  # the fast path pays no more for a timeout than without one
        except queue.Empty:
            _check_alive(procs)
            if time.monotonic() > deadline:
                raise BenchError(f"no ack from a consumer within {ACK_TIMEOUT:g} s") from None


def _wait_pipe(conn: Any, procs: list[Any]) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT
    while not conn.poll(1.0):
        _check_alive(procs)
        if time.monotonic() > deadline:
            raise BenchError(f"no ack from a consumer within {ACK_TIMEOUT:g} s")


def _await_ready(poll: Callable[[float], Any], procs: list[Any], n: int) -> None:
    """Wait for ``n`` ("ready", pid) messages, failing fast when a consumer dies."""
    deadline = time.monotonic() + READY_TIMEOUT
    ready = 0
    while ready < n:
        if time.monotonic() > deadline:
            raise BenchError(f"only {ready} of {n} consumers were ready after {READY_TIMEOUT:g} s")
        message = poll(0.25)
        if message is None:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise BenchError(
                    f"a consumer (pid {dead[0].pid}) exited with code {dead[0].exitcode} before it was ready"
                )
            continue
        if isinstance(message, tuple) and message[:1] == ("ready",):
            ready += 1
        else:
            raise BenchError(f"a consumer did not start: {message[1] if isinstance(message, tuple) else message!r}")


def _queue_poll(q: Any) -> Callable[[float], Any]:
    def poll(timeout: float) -> Any:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            return None

    return poll


def _stop(procs: list[Any], send_stop: Callable[[], None], queues: Sequence[Any] = ()) -> None:
    """Tell consumers to stop, join with a timeout, then terminate and kill survivors."""
    try:
        send_stop()
    except Exception:
        pass
    deadline = time.monotonic() + JOIN_TIMEOUT
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    for q in queues:
        # Whatever is left unread must not keep this process waiting at exit.
        with contextlib.suppress(Exception):
            q.cancel_join_thread()
            q.close()


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------


@dataclass
class Config:
    out: str
    quick: bool
    backend: str  # "cuda" or "host"
    iters: int
    warmup: int
    heavy_iters: int
    heavy_warmup: int
    consumers: tuple[int, ...]
    host_consumers: tuple[int, ...]
    only: frozenset[str] | None


class Bench:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stack = contextlib.ExitStack()
        self._manager: Any = None
        self.scenarios: dict[str, Scenario] = {}
        self.tasks: list[Task] = []
        self.meta: dict[str, Any] = {}
        self.gpu_reason: str | None = None  # why CUDA scenarios cannot run; None when they can
        self.device: int | None = None

    # -- environment -----------------------------------------------------------------
    def probe(self) -> None:
        from . import __version__, _cuda

        cfg = self.cfg
        gpu_ok = False
        try:
            gpu_ok = _cuda.available()
        except Exception:
            gpu_ok = False
        if cfg.backend == "host":
            self.gpu_reason = "run with the host backend (--backend host)"
        elif not gpu_ok:
            self.gpu_reason = "no usable GPU or CUDA driver on this machine"
        else:
            self.device = 0
        meta: dict[str, Any] = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "backend": cfg.backend,
            "device": "none (host backend)" if cfg.backend == "host" else "none usable",
            "driver": "none",
            "cuda_driver_api": "none",
            "cuda_bindings": _cuda.bindings_version(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpushare": __version__,
            "numpy": np.__version__,
            "torch": "not used (host backend)" if cfg.backend == "host" else _version_of("torch"),
            "cuda_core": "not used (host backend)" if cfg.backend == "host" else _version_of("cuda-core"),
            "iters": cfg.iters,
            "warmup": cfg.warmup,
            "heavy_iters": cfg.heavy_iters,
            "quick": cfg.quick,
        }
        if gpu_ok:
            with contextlib.suppress(Exception):
                version = _cuda.driver_version()
                meta["cuda_driver_api"] = f"CUDA {version // 1000}.{version % 1000 // 10}"
            with contextlib.suppress(Exception):
                meta["device"] = f"{_cuda.device_name(0)} (cuda:0)"
                if cfg.backend == "host":
                    meta["device"] += ", unused: host backend"
            meta["driver"] = _nvidia_driver() or meta["cuda_driver_api"]
        self.meta = meta

    def manager(self) -> Any:
        if self._manager is None:
            gpushare = _gpushare()

            self._manager = self.stack.enter_context(gpushare.Manager())
        return self._manager

    @property
    def gs_device(self) -> int | str:
        return "cpu" if self.cfg.backend == "host" else (self.device or 0)

    # -- plan ----------------------------------------------------------------------
    def plan(self) -> None:
        cfg = self.cfg
        rows = [str(n) for n in cfg.consumers]
        gs_label = f"gpushare ({'host' if cfg.backend == 'host' else 'cuda_ipc'} backend)"

        def add(scenario: Scenario) -> bool:
            if cfg.only is not None and scenario.key not in cfg.only:
                return False
            self.scenarios[scenario.key] = scenario
            return True

        def task(scenario: str, system: str, row: str, run: Callable[[], list[int]] | None, skip: str | None) -> None:
            self.scenarios[scenario].systems.setdefault(system, Series())
            self.tasks.append(Task(scenario, system, row, run, skip))

        if add(
            Scenario(
                FLOOR_SCENARIO,
                "Handoff floors: a small tuple to N consumers, wait for every ack",
                "consumers",
                rows,
                floor=None,
                extra_ratios=[("mp.Queue", "mp.Pipe")],
            )
        ):
            for n in cfg.consumers:
                task(FLOOR_SCENARIO, "mp.Pipe", str(n), _bind(self.pipe_floor, n), None)
                task(FLOOR_SCENARIO, "mp.Queue", str(n), _bind(self.queue_floor, n), None)

        torch_skip = self.torch_skip()
        core_skip = self.cuda_core_skip()
        gs_skip = self.gpu_reason if cfg.backend == "cuda" else None
        for fresh in (False, True):
            key = "handoff_fresh" if fresh else "handoff_recycled"
            how = "a new buffer every iteration" if fresh else "the same buffer every iteration"
            if not add(Scenario(key, f"1 MiB buffer to N consumers through a Queue, {how}", "consumers", rows)):
                continue
            self.scenarios[key].notes.append(f"gpushare column: {gs_label}.")
            for n in cfg.consumers:
                task(key, GPUSHARE, str(n), _bind(self.gpushare_handoff, n, fresh), gs_skip)
                task(key, TORCH, str(n), _bind(self.torch_handoff, n, fresh), torch_skip)
                task(key, CUDA_CORE, str(n), _bind(self.cuda_core_handoff, n, fresh), core_skip)

        sizes = [2 * MiB, 64 * MiB] + ([GiB] if cfg.backend == "cuda" else [])
        if add(
            Scenario(
                "first_share",
                "First share of a fresh allocation: m.empty() -> one consumer maps it -> ack",
                "size",
                [_size_label(s) for s in sizes],
                floor_row="1",
            )
        ):
            self.scenarios["first_share"].notes.append(
                f"gpushare column: {gs_label}. The Manager's pool is trimmed between iterations (untimed)."
            )
            for size in sizes:
                task("first_share", GPUSHARE, _size_label(size), _bind(self.first_share, size), gs_skip)

        host_rows = [str(n) for n in cfg.host_consumers]
        if add(
            Scenario(
                "host",
                "64 MiB float32 array to N consumers on the host: gpushare host backend vs a pickled array",
                "consumers",
                host_rows,
                ratio_systems=["gpushare (in place)"],
                extra_ratios=[("mp.Queue (pickled array)", "gpushare (in place)")],
            )
        ):
            for n in cfg.host_consumers:
                task("host", "gpushare (in place)", str(n), _bind(self.host_gpushare, n, False), None)
                task("host", "gpushare (copy_from)", str(n), _bind(self.host_gpushare, n, True), None)
                task("host", "mp.Queue (pickled array)", str(n), _bind(self.host_pickled, n), None)

    def torch_skip(self) -> str | None:
        if self.gpu_reason is not None:
            return self.gpu_reason
        try:
            import torch
        except Exception as exc:
            return f"torch is not importable ({type(exc).__name__}: {exc})"
        try:
            if not torch.cuda.is_available():
                return f"torch {torch.__version__} sees no CUDA device"
        except Exception as exc:
            return f"torch.cuda failed: {type(exc).__name__}: {exc}"
        return None

    def cuda_core_skip(self) -> str | None:
        if self.gpu_reason is not None:
            return self.gpu_reason
        try:
            _cuda_core()
        except Exception as exc:
            return f"cuda.core is not importable with memory IPC ({exc})"
        return None

    # -- run -----------------------------------------------------------------------
    def run(self) -> None:
        total = len(self.tasks)
        width = len(str(total))
        with self.stack:
            for index, t in enumerate(self.tasks, 1):
                series = self.scenarios[t.scenario].systems[t.system]
                head = f"[{index:>{width}}/{total}] {t.scenario} | {t.system} | {t.row}"
                if t.skip is not None or t.run is None:
                    series.skipped = t.skip or "not run"
                    _progress(f"{head}: skipped ({series.skipped})")
                    continue
                started = time.monotonic()
                try:
                    samples = t.run()
                except Exception as exc:
                    series.errors[t.row] = f"{type(exc).__name__}: {exc}"
                    _progress(f"{head}: ERROR {series.errors[t.row]}")
                    continue
                cell = Cell.of(samples)
                series.cells[t.row] = cell
                _progress(
                    f"{head}: median {cell.median_us:.1f} us, p90 {cell.p90_us:.1f} us "
                    f"({cell.n} iters, {time.monotonic() - started:.1f} s)"
                )

    # -- floors ---------------------------------------------------------------------
    def pipe_floor(self, n: int) -> list[int]:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(n)]
        mine = [a for a, _ in pairs]
        procs = [ctx.Process(target=_pipe_consumer, args=(b,), daemon=True) for _, b in pairs]

        def send_stop() -> None:
            for conn in mine:
                with contextlib.suppress(Exception):
                    conn.send(None)

        try:
            for p in procs:
                p.start()
            for _, b in pairs:
                b.close()  # the children hold their ends now
            pending = list(mine)

            def poll(timeout: float) -> Any:
                for conn in list(pending):
                    if conn.poll(timeout / max(1, len(pending))):
                        pending.remove(conn)
                        return conn.recv()
                return None

            _await_ready(poll, procs, n)
            message = ("job", 0, b"x" * 16)

            def step(i: int) -> None:
                for conn in mine:
                    conn.send(message)
                for conn in mine:
                    _wait_pipe(conn, procs)
                    _check_ack(conn.recv())

            return _time_loop(step, self.cfg.warmup, self.cfg.iters)
        finally:
            _stop(procs, send_stop)
            for conn in mine:
                conn.close()

    def queue_floor(self, n: int) -> list[int]:
        import multiprocessing

        message = ("job", 0, b"x" * 16)
        return self.queue_fanout(multiprocessing.get_context("spawn"), n, "plain", lambda i: message)

    # -- the shared fan-out pattern -------------------------------------------------------
    def queue_fanout(
        self,
        ctx: Any,
        n: int,
        kind: str,
        produce: Callable[[int], Any],
        *,
        drop: Callable[[Any], None] | None = None,
        device: int | None = None,
        extra: Any = None,
        process_kwargs: dict[str, Any] | None = None,
        heavy: bool = False,
    ) -> list[int]:
        """One iteration: ``item = produce(i)``, put it N times, collect N acks, ``drop(item)``."""
        work = ctx.Queue()
        acks = ctx.Queue()
        procs = [
            ctx.Process(
                target=_queue_consumer,
                args=(kind, work, acks, device, extra),
                daemon=True,
                **(process_kwargs or {}),
            )
            for _ in range(n)
        ]

        def send_stop() -> None:
            for _ in procs:
                work.put(None)

        try:
            for p in procs:
                p.start()
            _await_ready(_queue_poll(acks), procs, n)

            def step(i: int) -> None:
                item = produce(i)
                for _ in range(n):
                    work.put(item)
                for _ in range(n):
                    _check_ack(_get_ack(acks, procs))
                if drop is not None:
                    drop(item)

            cfg = self.cfg
            if heavy:
                return _time_loop(step, cfg.heavy_warmup, cfg.heavy_iters)
            return _time_loop(step, cfg.warmup, cfg.iters)
        finally:
            _stop(procs, send_stop, [work, acks])

    # -- gpushare ----------------------------------------------------------------------
    def gpushare_handoff(self, n: int, fresh: bool) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        device = self.gs_device
        kind = "gpushare_host" if device == "cpu" else "gpushare"
        before = m.stats()["reused"]
        if fresh:

            def produce(i: int) -> Any:
                return m.empty(HANDOFF_SHAPE, "float32", device=device)

            samples = self.queue_fanout(
                gpushare.get_context("spawn"),
                n,
                kind,
                produce,
                drop=lambda buf: buf.release(),
                process_kwargs={"device": device},
            )
            reused = m.stats()["reused"] - before
            total = self.cfg.warmup + self.cfg.iters
            self.scenarios["handoff_fresh"].notes.append(
                f"gpushare, {n} consumer(s): {reused} of {total} allocations came from the pool."
            )
            return samples
        buf = m.zeros(HANDOFF_SHAPE, "float32", device=device)
        try:
            return self.queue_fanout(
                gpushare.get_context("spawn"), n, kind, lambda i: buf, process_kwargs={"device": device}
            )
        finally:
            buf.release()

    def first_share(self, nbytes: int) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        device = self.gs_device
        kind = "gpushare_host" if device == "cpu" else "gpushare"
        ctx = gpushare.get_context("spawn")
        work = ctx.Queue()
        acks = ctx.Queue()
        proc = ctx.Process(target=_queue_consumer, args=(kind, work, acks, None, None), daemon=True, device=device)
        reused: list[int] = []
        heavy = nbytes >= 64 * MiB

        def settle() -> None:
            # Wait until the consumer's lease is back, then free the pool: the next
            # allocation is new memory the consumer has never mapped.
            deadline = time.monotonic() + SETTLE_TIMEOUT
            while m.stats()["leases"]:
                if time.monotonic() > deadline:
                    raise BenchError(f"the consumer's lease did not come back within {SETTLE_TIMEOUT:g} s")
                time.sleep(0.0002)
            m.trim()
            stats = m.stats()
            if stats["bytes_pooled"]:
                reused.append(stats["bytes_pooled"])

        def step(i: int) -> None:
            buf = m.empty((nbytes // 4,), "float32", device=device)
            work.put(buf)
            _check_ack(_get_ack(acks, [proc]))
            buf.release()

        try:
            proc.start()
            _await_ready(_queue_poll(acks), [proc], 1)
            cfg = self.cfg
            warmup, iters = (cfg.heavy_warmup, cfg.heavy_iters) if heavy else (cfg.warmup, cfg.iters)
            samples = _time_loop(step, warmup, iters, between=settle)
            settle()
        finally:
            _stop([proc], lambda: work.put(None), [work, acks])
        if reused:
            self.scenarios["first_share"].notes.append(
                f"{_size_label(nbytes)}: the pool still held memory after trim() in {len(reused)} iteration(s)."
            )
        return samples

    def host_gpushare(self, n: int, copy: bool) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        src = np.arange(HOST_SHAPE[0], dtype=np.float32)
        buf = m.from_numpy(src, device="cpu")
        view = buf.numpy()  # zero-copy on the host backend

        def produce(i: int) -> Any:
            if copy:
                buf.copy_from(src)
            else:
                view[0] = i  # the producer writes in place
            return buf

        try:
            return self.queue_fanout(
                gpushare.get_context("spawn"),
                n,
                "gpushare_host",
                produce,
                process_kwargs={"device": "cpu"},
                heavy=True,
            )
        finally:
            buf.release()

    def host_pickled(self, n: int) -> list[int]:
        import multiprocessing

        src = np.arange(HOST_SHAPE[0], dtype=np.float32)

        def produce(i: int) -> Any:
            src[0] = i
            return src

        return self.queue_fanout(multiprocessing.get_context("spawn"), n, "numpy", produce, heavy=True)

    # -- peers ---------------------------------------------------------------------------
    def torch_handoff(self, n: int, fresh: bool) -> list[int]:
        import torch
        import torch.multiprocessing as tmp

        device = self.device or 0
        cuda = torch.device("cuda", device)
        keep = torch.zeros(HANDOFF_SHAPE, dtype=torch.float32, device=cuda)
        torch.cuda.synchronize(cuda)

        def produce(i: int) -> Any:
            if fresh:
                return torch.empty(HANDOFF_SHAPE, dtype=torch.float32, device=cuda)
            return keep

        try:
            return self.queue_fanout(tmp.get_context("spawn"), n, "torch", produce, device=device)
        finally:
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()

    def cuda_core_handoff(self, n: int, fresh: bool) -> list[int]:
        import multiprocessing

        cc = _cuda_core()
        device = self.device or 0
        dev = cc.Device(device)
        dev.set_current()
        stream = dev.default_stream
        options = cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=64 * MiB)
        with warnings.catch_warnings():
            # cuda.core warns when multiprocessing's *global* start method is fork; every
            # process here is started from an explicit spawn context.
            warnings.filterwarnings("ignore", message="multiprocessing start method is 'fork'")
            mr = cc.DeviceMemoryResource(dev, options=options)
        kept: Any = None
        try:
            if not fresh:
                kept = mr.allocate(HANDOFF_BYTES, stream=stream)
                stream.sync()

            def produce(i: int) -> Any:
                if not fresh:
                    return kept
                buf = mr.allocate(HANDOFF_BYTES, stream=stream)
                stream.sync()
                return buf

            return self.queue_fanout(
                multiprocessing.get_context("spawn"),
                n,
                "cuda_core",
                produce,
                drop=(lambda buf: buf.close()) if fresh else None,
                device=device,
                extra=mr,
            )
        finally:
            if kept is not None:
                with contextlib.suppress(Exception):
                    kept.close()
            with contextlib.suppress(Exception):
                stream.sync()
            with contextlib.suppress(Exception):
                mr.close()


def _bind(fn: Callable[..., list[int]], *args: Any) -> Callable[[], list[int]]:
    return lambda: fn(*args)


def _size_label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except Exception:
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------


def _fmt_us(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _fmt_cell(cell: Cell | None) -> str:
    return "-" if cell is None else f"{_fmt_us(cell.median_us)} ({_fmt_us(cell.p90_us)})"


def _ratio(num: Cell | None, den: Cell | None) -> str:
    if num is None or den is None or den.median_us <= 0:
        return "-"
    ratio = num.median_us / den.median_us
    return f"{ratio:.0f}" if ratio >= 100 else f"{ratio:.1f}" if ratio >= 10 else f"{ratio:.2f}"


def _floor_cell(bench_scenarios: dict[str, Scenario], scenario: Scenario, row: str) -> Cell | None:
    if scenario.floor is None:
        return None
    floor_scenario = bench_scenarios.get(scenario.floor[0])
    if floor_scenario is None:
        return None
    series = floor_scenario.systems.get(scenario.floor[1])
    return None if series is None else series.cells.get(scenario.floor_row or row)


def render_markdown(scenarios: dict[str, Scenario], meta: dict[str, Any], plot_note: str) -> str:
    lines = [
        "# gpushare benchmarks",
        "",
        f"Written by `python -m gpushare.bench` on {meta['date']}; run it again rather than editing this file.",
        "",
        "| | |",
        "|---|---|",
    ]
    for label, key in (
        ("device", "device"),
        ("driver", "driver"),
        ("CUDA (driver API)", "cuda_driver_api"),
        ("cuda-bindings", "cuda_bindings"),
        ("python", "python"),
        ("gpushare", "gpushare"),
        ("torch", "torch"),
        ("cuda-core", "cuda_core"),
        ("numpy", "numpy"),
        ("gpushare backend", "backend"),
        ("CPUs", "cpus"),
        ("platform", "platform"),
    ):
        lines.append(f"| {label} | {meta.get(key)} |")
    lines.append(
        f"| iterations | {meta['iters']} timed after {meta['warmup']} warm-up "
        f"({meta['heavy_iters']} for 64 MiB and larger){'; --quick' if meta['quick'] else ''} |"
    )
    lines += [
        "",
        "## How measured",
        "",
        "One producer process and N consumer processes, all started with spawn. Consumers are started once "
        "per cell (scenario, system, N), warmed up, then reused for every timed iteration. One iteration is: "
        "produce the item (or reuse it), put it on the transport once per consumer, and wait until every "
        "consumer has acknowledged it; each consumer gets the item, touches it (device pointer, first "
        "element) and lets it go before acking. The iteration is timed with `time.perf_counter_ns` with the "
        "producer's garbage collector off. Cells show the median and, in parentheses, the 90th percentile, "
        "in microseconds; ratio columns divide medians by the floor: the same pattern carrying a small "
        "tuple through `multiprocessing.Queue` (the first table), which no handoff can beat.",
        "",
        "**Absolute times mean something only on a GPU machine** (and only on one like the one named above): "
        "CPU count, scheduler noise and the host-only backend change them a lot. Compare ratios to the floor, "
        "which were measured in the same run and the same pattern.",
        "",
    ]
    for scenario in scenarios.values():
        lines += _render_scenario(scenarios, scenario)
    lines += ["## Plot", "", plot_note, ""]
    return "\n".join(lines)


def _render_scenario(scenarios: dict[str, Scenario], scenario: Scenario) -> list[str]:
    systems = [name for name, s in scenario.systems.items() if s.skipped is None]
    wanted = scenario.ratio_systems
    ratio_systems = [n for n in systems if scenario.floor is not None and (wanted is None or n in wanted)]
    header = [scenario.row_label]
    if scenario.floor is not None:
        header.append("floor (mp.Queue)")
    header += systems
    header += [f"{name} / floor" for name in ratio_systems]
    header += [f"{a} / {b}" for a, b in scenario.extra_ratios]
    out = [f"## {scenario.title}", "", f"`{scenario.key}`: median us (p90 us)", ""]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for row in scenario.rows:
        floor = _floor_cell(scenarios, scenario, row)
        cells = [row]
        if scenario.floor is not None:
            cells.append(_fmt_cell(floor))
        cells += [_fmt_cell(scenario.systems[name].cells.get(row)) for name in systems]
        cells += [_ratio(scenario.systems[name].cells.get(row), floor) for name in ratio_systems]
        for a, b in scenario.extra_ratios:
            sa, sb = scenario.systems.get(a), scenario.systems.get(b)
            cells.append(_ratio(sa.cells.get(row) if sa else None, sb.cells.get(row) if sb else None))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for name, series in scenario.systems.items():
        if series.skipped is not None:
            out.append(f"- {name}: skipped: {series.skipped}")
        for row, error in series.errors.items():
            out.append(f"- {name}, {scenario.row_label} {row}: error: {error}")
    for note in scenario.notes:
        out.append(f"- {note}")
    if out[-1] != "":
        out.append("")
    return out


def render_json(scenarios: dict[str, Scenario], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "scenarios": {
            key: {
                "title": s.title,
                "row_label": s.row_label,
                "rows": s.rows,
                "floor": list(s.floor) if s.floor else None,
                "floor_row": s.floor_row,
                "notes": s.notes,
                "systems": {
                    name: {
                        "skipped": series.skipped,
                        "errors": series.errors,
                        "cells": {row: asdict(cell) for row, cell in series.cells.items()},
                    }
                    for name, series in s.systems.items()
                },
            }
            for key, s in scenarios.items()
        },
    }


def render_plot(scenarios: dict[str, Scenario], meta: dict[str, Any], path: str) -> str:
    """Latency against consumers, one panel per fan-out scenario; returns a line for the report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"No plot: matplotlib does not import here ({type(exc).__name__}: {exc})."
    panels = [s for s in scenarios.values() if s.plot and s.row_label == "consumers"]
    if not panels:
        return "No plot: no scenario with a consumer axis was run."
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax, scenario in zip(axes.flat, panels, strict=False):
        if scenario.floor is not None:
            xs = [int(r) for r in scenario.rows if _floor_cell(scenarios, scenario, r) is not None]
            ys = [c.median_us for r in scenario.rows if (c := _floor_cell(scenarios, scenario, r)) is not None]
            if xs:
                ax.plot(xs, ys, "k--", marker="o", label="floor (mp.Queue, small tuple)")
        for name, series in scenario.systems.items():
            points = [(int(r), series.cells[r].median_us) for r in scenario.rows if r in series.cells]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        ax.set_title(scenario.title, fontsize=9)
        ax.set_xlabel("consumers")
        ax.set_ylabel("median latency per iteration (us)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([int(r) for r in scenario.rows])
        ax.set_xticklabels(scenario.rows)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"gpushare benchmarks: {meta['device']}, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"![median latency against the number of consumers]({os.path.basename(path)})"


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

SCENARIO_KEYS = ("floors", "handoff_recycled", "handoff_fresh", "first_share", "host")


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: consumer counts are ints >= 1")
    return values


def _parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m gpushare.bench",
        description="Measure gpushare's buffer handoff against multiprocessing floors, torch.multiprocessing "
        "and cuda.core; write benchmarks.md, benchmarks.json and benchmarks.png.",
    )
    parser.add_argument("--out", default="docs", help="directory for the reports (default: docs)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, for smoke and CI runs")
    parser.add_argument(
        "--backend",
        choices=("host", "cuda"),
        default=None,
        help="gpushare backend for the handoff scenarios (default: cuda when a GPU is usable, else host)",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per cell (default 300; 100 quick)")
    parser.add_argument(
        "--consumers", type=_counts, default=CONSUMERS, help="consumer counts, comma-separated (default 1,2,4,8)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=f"run only these scenarios, comma-separated: {', '.join(SCENARIO_KEYS)} "
        "(the floors always run: every ratio is taken to them)",
    )
    args = parser.parse_args(argv)
    backend = args.backend
    if backend is None:
        from . import _cuda

        backend = "cuda" if _cuda.available() else "host"
    iters = args.iters if args.iters is not None else (100 if args.quick else 300)
    if iters < 1:
        parser.error("--iters must be at least 1")
    only = None
    if args.only:
        only = frozenset(k.strip() for k in args.only.split(",") if k.strip())
        unknown = sorted(only - set(SCENARIO_KEYS))
        if unknown:
            parser.error(f"unknown scenario(s) {', '.join(unknown)}; valid: {', '.join(SCENARIO_KEYS)}")
        only |= {FLOOR_SCENARIO}
    host_consumers = tuple(n for n in args.consumers if n <= max(HOST_CONSUMERS)) or (1,)
    return Config(
        out=args.out,
        quick=args.quick,
        backend=backend,
        iters=iters,
        warmup=10 if args.quick else 20,
        heavy_iters=max(20, iters // 5),
        heavy_warmup=2 if args.quick else 3,
        consumers=args.consumers,
        host_consumers=host_consumers,
        only=only,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = _parse(argv)
    bench = Bench(cfg)
    bench.probe()
    bench.plan()
    _progress(
        f"gpushare.bench: backend {cfg.backend}, {len(bench.tasks)} cells, {cfg.iters} iterations each "
        f"({cfg.heavy_iters} for 64 MiB and larger); reports go to {cfg.out}/"
    )
    started = time.monotonic()
    bench.run()
    os.makedirs(cfg.out, exist_ok=True)
    plot_note = render_plot(bench.scenarios, bench.meta, os.path.join(cfg.out, "benchmarks.png"))
    bench.meta["elapsed_s"] = round(time.monotonic() - started, 1)
    with open(os.path.join(cfg.out, "benchmarks.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(bench.scenarios, bench.meta, plot_note))
    with open(os.path.join(cfg.out, "benchmarks.json"), "w", encoding="utf-8") as f:
        json.dump(render_json(bench.scenarios, bench.meta), f, indent=2)
        f.write("\n")
    _progress(f"gpushare.bench: done in {bench.meta['elapsed_s']} s; wrote {cfg.out}/benchmarks.md, .json")
    _progress(plot_note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
