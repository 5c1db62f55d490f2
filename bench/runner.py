"""The run: probe the machine, plan every registered scenario into tasks, run them in order.

``Bench.plan`` asks each module of ``scenarios.MODULES`` to add its scenario(s) and their
tasks (``Bench.add``, ``Bench.task``); ``Bench.run`` runs the tasks one by one, recording
each cell's samples, skip reason or error, so one failing cell never costs the run.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .fmt import _fmt_gbps, _fmt_rate, _gbps, _gs_label, _rate
from .results import Samples, Scenario, Series, Task, _unavailable
from .scenarios import scenario_modules
from .settings import HOST_BACKEND, BenchError, Config, _gpushare, _progress, _version_of
from .stats import Cell


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
        self.gpu_count = 0
        self._pooled: dict[tuple[str, str, str], list[int]] = {}  # every round's samples, per cell

    # -- environment -----------------------------------------------------------------
    def probe(self) -> None:
        from gpushare import __version__, _cuda

        cfg = self.cfg
        gpu_ok = False
        try:
            gpu_ok = _cuda.available()
        except Exception:
            gpu_ok = False
        if gpu_ok:
            with contextlib.suppress(Exception):
                self.gpu_count = int(_cuda.device_count())
        if cfg.backend == "host":
            self.gpu_reason = "run with the host backend (--backend host)" + (
                "" if gpu_ok else "; no usable GPU or CUDA driver on this machine"
            )
        elif not gpu_ok:
            self.gpu_reason = "no usable GPU or CUDA driver on this machine"
        else:
            self.device = 0
        meta: dict[str, Any] = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "backend": cfg.backend,
            "backends": ", ".join(cfg.backends) + (" (not run: host backend)" if cfg.backend == "host" else ""),
            "gpus": self.gpu_count,
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
            "rounds": cfg.rounds,
            "rounds_run": 0,
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
            if cfg.backend != "host":
                meta["copy_kernel"] = _copy_kernel_status()
        self.meta = meta

    def manager(self) -> Any:
        if self._manager is None:
            gpushare = _gpushare()

            self._manager = self.stack.enter_context(gpushare.Manager())
        return self._manager

    def gs_columns(self) -> list[tuple[str, str, int | str, str | None]]:
        """gpushare's columns: (label, backend, device, skip reason), one per backend.

        With the host backend, the host column runs and the CUDA columns are listed as skipped.
        """
        columns: list[tuple[str, str, int | str, str | None]] = []
        if self.cfg.backend == "host":
            columns.append((_gs_label(HOST_BACKEND), HOST_BACKEND, "cpu", None))
        for name in self.cfg.backends:
            columns.append((_gs_label(name), name, self.device or 0, self.gpu_reason))
        return columns

    def rows(self) -> list[str]:
        """The consumer-count rows of the fan-out scenarios."""
        return [str(n) for n in self.cfg.consumers]

    # -- plan ----------------------------------------------------------------------
    def plan(self) -> None:
        """Every registered scenario adds itself and its tasks, in the registry's order."""
        for module in scenario_modules():
            module.plan(self)

    def add(self, scenario: Scenario) -> bool:
        """Add ``scenario`` to the report unless ``--only`` leaves it out; True when added."""
        if self.cfg.only is not None and scenario.key not in self.cfg.only:
            return False
        self.scenarios[scenario.key] = scenario
        return True

    def task(
        self,
        scenario: str,
        system: str | None,
        row: str,
        run: Callable[[], Samples] | None,
        skip: str | None,
        *,
        cell: bool = False,
    ) -> None:
        """One cell to run (``run``) or to list as skipped (``skip``); ``system`` None fills a whole row.
        ``cell``: a skip concerns this cell only (the column's other rows still run)."""
        if system is not None:
            self.scenarios[scenario].systems.setdefault(system, Series())
        self.tasks.append(Task(scenario, system, row, run, skip, cell))

    # -- run -----------------------------------------------------------------------
    def run(
        self,
        after_round: Callable[[int], None] | None = None,
        after_cell: Callable[[int, int], None] | None = None,
    ) -> None:
        """Run every task once per round, in the planned order; ``after_round(r)`` after each,
        and ``after_cell(done, total)`` after each cell of the first round that ran.

        With several rounds, a cell's samples are pooled over the rounds it ran in: each
        round measures every system and its floor minutes apart at most, so a slow drift
        of the machine moves both sides of a ratio alike, instead of one of them. A round
        is not started when ``cfg.max_seconds`` would be exceeded at the pace of the rounds
        so far (the first always runs). A cell that fails or is skipped is not retried.
        """
        cfg = self.cfg
        started = time.monotonic()
        with self.stack:
            for r in range(1, cfg.rounds + 1):
                if r > 1 and cfg.max_seconds is not None:
                    elapsed = time.monotonic() - started
                    if elapsed / (r - 1) * r > cfg.max_seconds:
                        _progress(
                            f"bench: round {r} of {cfg.rounds} not started: at {elapsed / (r - 1):.0f} s "
                            f"per round it would end past --max-seconds {cfg.max_seconds:g}"
                        )
                        break
                self._run_round(r, after_cell if r == 1 else None)
                self.meta["rounds_run"] = r
                if after_round is not None:
                    after_round(r)

    def _run_round(self, r: int, after_cell: Callable[[int, int], None] | None = None) -> None:
        total = len(self.tasks)
        width = len(str(total))
        tag = f"r{r} " if self.cfg.rounds > 1 else ""
        for index, t in enumerate(self.tasks, 1):
            scenario = self.scenarios[t.scenario]
            series = None if t.system is None else scenario.systems[t.system]
            head = f"{tag}[{index:>{width}}/{total}] {t.scenario} | {t.system or 'all'} | {t.row}"
            if t.skip is not None or t.run is None:
                reason = t.skip or "not run"
                if series is not None and t.cell:
                    series.skips[t.row] = reason
                elif series is not None:
                    series.skipped = reason
                else:
                    scenario.row_skips[t.row] = reason
                if r == 1:
                    _progress(f"{head}: skipped ({reason})")
                continue
            if series is not None and series.skipped is not None:
                # An earlier row (or round) found this column's backend unavailable.
                if r == 1:
                    _progress(f"{head}: skipped ({series.skipped})")
                continue
            if (series.errors if series is not None else scenario.row_errors).get(t.row) is not None or (
                series is None and t.row in scenario.row_skips
            ):
                continue  # failed or skipped in an earlier round: its message stands
            started = time.monotonic()
            try:
                samples = t.run()
            except Exception as exc:
                # with the notes added to it on its way (a loader's stop after a wrong batch, say)
                message = "; ".join([f"{type(exc).__name__}: {exc}", *map(str, getattr(exc, "__notes__", ()))])
                unavailable = _unavailable(exc)
                if series is None:
                    (scenario.row_skips if unavailable else scenario.row_errors)[t.row] = message
                    self._drop_row(scenario, t.row)
                elif unavailable and not series.cells and not series.errors:
                    series.skipped = message  # the whole column: its backend cannot run here
                else:
                    series.errors[t.row] = message
                    series.cells.pop(t.row, None)  # an error stands over earlier rounds' samples
                    self._pooled.pop((t.scenario, t.system or "", t.row), None)
                _progress(f"{head}: skipped ({message})" if unavailable else f"{head}: ERROR {message}")
                continue
            try:
                summary = self._record(scenario, t.system, t.row, samples, time.monotonic() - started)
            except Exception as exc:  # malformed samples: that cell's error, not the run's
                message = f"could not record the samples: {type(exc).__name__}: {exc}"
                (scenario.row_errors if series is None else series.errors)[t.row] = message
                _progress(f"{head}: ERROR {message}")
                continue
            if after_cell is not None:  # before the line: a cell reported is a cell saved
                after_cell(index, total)
            _progress(f"{head}: {summary}")

    def _drop_row(self, scenario: Scenario, row: str) -> None:
        for name, series in scenario.systems.items():
            if series.cells.pop(row, None) is not None:
                self._pooled.pop((scenario.key, name, row), None)

    def _record(self, scenario: Scenario, system: str | None, row: str, samples: Samples, took: float) -> str:
        """Pool one run's samples into its cell(s); return the progress line (this run's own figures)."""
        if isinstance(samples, dict):
            for values in samples.values():
                _check_samples(values)  # all of them before any is pooled: a row is recorded whole or not at all
            parts = []
            for name, values in samples.items():
                self._pool(scenario, name, row, values)
                cell = Cell.of(values)
                if scenario.kind in ("throughput", "kernel"):
                    parts.append(f"{name} {_fmt_gbps(_gbps(scenario, cell))} GB/s")
                else:
                    parts.append(f"{name} median {cell.median_us:.1f} us")
            return f"{'; '.join(parts)} ({took:.1f} s)"
        if system is None:
            raise BenchError("a task that fills several systems must return samples per system")
        _check_samples(samples)
        self._pool(scenario, system, row, samples)
        cell = Cell.of(samples)
        if scenario.kind == "rate":
            return (
                f"{_fmt_rate(_rate(cell))} items/s ({cell.median_us:.1f} us per item; median of {cell.n} repeats, "
                f"{took:.1f} s)"
            )
        return f"median {cell.median_us:.1f} us, p90 {cell.p90_us:.1f} us ({cell.n} iters, {took:.1f} s)"

    def _pool(self, scenario: Scenario, system: str, row: str, samples: list[int]) -> None:
        pooled = self._pooled.setdefault((scenario.key, system, row), [])
        pooled.extend(samples)
        scenario.systems.setdefault(system, Series()).cells[row] = Cell.of(pooled)


def _check_samples(samples: Any) -> None:
    if not isinstance(samples, list) or not samples:
        raise BenchError(f"expected a non-empty list of samples, got {type(samples).__name__}")


def _copy_kernel_status() -> str:
    """Whether gpushare's copy kernel runs on device 0 (what the weight-sync copies run on), asked
    of a child process: building it here would give this process a CUDA context (about 500 MiB
    of the device) that the scenarios' memory readings and fit estimates would then count."""
    script = "from gpushare._cuda import copy_kernel_status as s; print(s(0, build=True))"
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return f"unknown (the probe exited {done.returncode}: {done.stderr.strip()[-200:]})"
    return lines[-1]


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
