"""The benchmark package: its scenario registry, and a short real run of the CLI on the host.

The run spawns real consumers (the floors and the host backend run on any machine) and
checks the three report files' shape, not the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from bench import cli
from bench.scenarios import MODULES, scenario_modules

ROOT = Path(__file__).resolve().parent.parent
CELL = ("median_us", "p90_us", "mean_us", "min_us", "n")


def test_every_registered_scenario_module_has_keys_and_plan() -> None:
    modules = scenario_modules()
    assert [m.__name__.rsplit(".", 1)[1] for m in modules] == list(MODULES)
    keys = [key for m in modules for key in m.KEYS]
    assert len(keys) == len(set(keys)), f"a scenario key is registered twice: {keys}"
    for module in modules:
        assert callable(module.plan), module.__name__
        assert isinstance(getattr(module, "HOW", ""), str), module.__name__
    assert cli.SCENARIO_KEYS == tuple(keys)


def test_only_rejects_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli._parse(["--only", "nosuch"])
    assert "unknown scenario(s) nosuch; valid: floors" in capsys.readouterr().err


def test_cli_host_run_writes_the_reports(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--backend",
        "host",
        "--quick",
        "--iters",
        "3",
        "--consumers",
        "1",
        "--only",
        "host",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings == [
        "## How measured",
        "## Handoff floors: a small tuple to N consumers, wait for every ack",
        "## 64 MiB float32 array to N consumers on the host: gpushare host backend vs a pickled array",
        "## Plot",
    ]
    # Every registered scenario's paragraph is in "How measured", whichever scenarios ran.
    for module in scenario_modules():
        if getattr(module, "HOW", ""):
            assert module.HOW in markdown, module.__name__
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert list(report["scenarios"]) == ["floors", "host"]
    host = report["scenarios"]["host"]
    assert "gpushare (in place)" in json.dumps(host)
    assert ": ERROR" not in done.stderr, done.stderr

    # --render writes the same Markdown from the JSON alone, measuring nothing.
    again = tmp_path / "again"
    assert cli.main(["--render", str(tmp_path / "report.json"), "--out", str(again)]) == 0
    rendered = (again / "report.md").read_text(encoding="utf-8")
    assert rendered.split("## Plot")[0] == markdown.split("## Plot")[0]
    assert cli.main(["--render", str(tmp_path / "missing.json"), "--out", str(again)]) == 2

    # Several runs' JSONs join into one report, with a table of which run measured which scenario.
    later = json.loads(json.dumps(report))
    later["meta"]["date"] = "2099-01-01 00:00 UTC"
    later["scenarios"] = {"extra": dict(report["scenarios"]["host"], title="An extra table", floor=None)}
    (tmp_path / "later.json").write_text(json.dumps(later), encoding="utf-8")
    joined = tmp_path / "joined"
    args = ["--render", str(tmp_path / "report.json"), "--render", str(tmp_path / "later.json")]
    assert cli.main([*args, "--out", str(joined)]) == 0
    merged = (joined / "report.md").read_text(encoding="utf-8")
    assert "## An extra table" in merged and "## Handoff floors" in merged and "This report joins 2 runs" in merged
    assert "| 2099-01-01 00:00 UTC, --quick |" in merged
    runs = json.loads((joined / "report.json").read_text(encoding="utf-8"))["meta"]["runs"]
    first, second = report["meta"]["date"], "2099-01-01 00:00 UTC"
    assert [(r["date"], r["scenarios"]) for r in runs] == [(first, ["floors", "host"]), (second, ["extra"])]
    # Joining the joined report again keeps its table of runs.
    assert cli.main(["--render", str(joined / "report.json"), "--render", str(tmp_path / "later.json"),
                     "--out", str(tmp_path / "twice")]) == 0  # fmt: skip
    again_runs = json.loads((tmp_path / "twice" / "report.json").read_text(encoding="utf-8"))["meta"]["runs"]
    assert again_runs == runs
    # A later run's scenario measured against its own run's floors, which an earlier scenario (`host`)
    # still uses: refused, rather than divided by another run's floor.
    later["scenarios"] = {"floors": report["scenarios"]["floors"], "b": report["scenarios"]["host"]}
    (tmp_path / "later.json").write_text(json.dumps(later), encoding="utf-8")
    assert cli.main([*args, "--out", str(tmp_path / "refused")]) == 2


def test_a_table_that_fails_to_render_costs_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import report_json, report_md

    report = {
        "meta": {"date": "today", "iters": 1, "warmup": 0, "heavy_iters": 1, "quick": True},
        "scenarios": {
            key: {
                "title": f"Table {key}",
                "row_label": "consumers",
                "rows": ["1"],
                "kind": "latency",
                "floor": None,
                "systems": {"s": {"skipped": None, "errors": {}, "cells": {"1": dict.fromkeys(CELL, 1.0)}}},
            }
            for key in ("good", "bad")
        },
    }
    scenarios = report_json.scenarios_from_json(report)
    real = report_md._render_scenario

    def fails_on_bad(all_scenarios: dict, scenario: Any) -> list[str]:
        if scenario.key == "bad":
            raise KeyError("used_mib")
        return real(all_scenarios, scenario)

    monkeypatch.setattr(report_md, "_render_scenario", fails_on_bad)
    markdown = report_md.render_markdown(scenarios, report["meta"], "")
    assert "## Table good" in markdown and "| 1 | 1.0 (1.0) |" in markdown
    assert "`bad`: this table failed to render (KeyError: 'used_mib')" in markdown


def test_per_queue_fan_out_and_ring_round_trip_run_on_the_host(tmp_path: Path) -> None:
    """The one-Queue-per-consumer pattern (its own floor, the host backend, 2 consumers) and
    the ring's round trip to 1 and 2 consumers (plain and spin columns)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "bench", "--backend", "host", "--quick", "--iters", "3"]
    cmd += ["--consumers", "1,2", "--only", "handoff_per_queue,ring_roundtrip", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr
    assert ": ERROR" not in done.stderr, done.stderr
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    scenario = json.dumps(report["scenarios"]["handoff_per_queue"])
    assert "mp.Queue per consumer" in scenario and "gpushare host" in scenario
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## 1 MiB buffer to N consumers through one Queue per consumer" in markdown
    assert "| consumers | floor (mp.Queue per consumer) | gpushare host | gpushare host / floor |" in markdown
    roundtrip = report["scenarios"]["ring_roundtrip"]
    assert roundtrip["rows"] == ["1", "2"] and "## Ring round trip" in markdown
    for name in ("gpushare host", "gpushare host spin"):  # a 1-slot ring to each N, acked by its releases
        assert sorted(roundtrip["systems"][name]["cells"]) == ["1", "2"], roundtrip["systems"][name]


def test_queue_fan_out_rows_carry_a_buffer_and_a_tuple_on_the_host(tmp_path: Path) -> None:
    """The queue scenario's fan-out cells (spawned consumers, one Queue each, acks on one Queue): the
    buffer rows through gpushare's Queue and mp.Queue, and the tuple rows the same pattern; every cell
    times its iterations and leaves no lease behind."""
    from bench.runner import Bench
    from bench.scenarios import queue as qs

    cfg = cli._parse(["--backend", "host", "--quick", "--iters", "3", "--out", str(tmp_path)])
    bench = Bench(cfg)
    with bench.stack:
        for system in (qs.GS, qs.MP):
            for n in (1, 2):
                for cell in (qs.buffer_fanout, qs.tuple_fanout):
                    samples = cell(bench, system, n)
                    assert len(samples) == 3 and min(samples) > 0, (system, n, cell.__name__)
        assert bench.manager().stats()["leases"] == 0
    rows = qs._rows()
    assert rows[-3:] == ["small tuple, 1 consumer", "small tuple, 4 consumers", "small tuple, 8 consumers"]


def test_throughput_judges_the_ring_and_the_queue_on_their_own_targets(tmp_path: Path) -> None:
    """Issue 9's pipelined targets differ: the ring >= 100,000 items/s, gpushare's Queue >= 30,000."""
    done = _bench(tmp_path, "--consumers", "1", "--only", "throughput")
    assert done.returncode == 0 and ": ERROR" not in done.stderr, done.stderr
    throughput = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))["scenarios"]["throughput"]
    goal = throughput["targets"]["1 MiB"]
    assert goal["limit"] == 30_000 and goal["system_limits"] == {"gpushare host ring": 100_000}
    rates = throughput["table"]["1 MiB"]
    for name, limit in (("gpushare host ring", 100_000), ("gpushare host Queue", 30_000)):
        assert goal["met"][name] == (rates[name]["items_per_s"] >= limit), (name, rates[name])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in (tmp_path / "report.md").read_text().splitlines()}
    assert ">= 100,000/s: " in rows["gpushare host ring"] and ">= 30,000/s: " in rows["gpushare host Queue"]


def _bench(tmp_path: Path, *args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "bench", "--backend", "host", "--quick", "--out", str(tmp_path), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_copy_kernels_status_is_asked_of_a_child_process() -> None:
    """The report names whether gpushare's copy kernel runs on device 0, asked of a child so the
    benchmark's own process makes no CUDA context; without a GPU it says why it is off."""
    from bench.runner import _copy_kernel_status
    from gpushare import _cuda

    status = _copy_kernel_status()
    if _cuda.available():
        assert status == "ready", status
    else:
        assert status.startswith("off: building it failed (NoDeviceError"), status


def test_a_run_killed_half_way_leaves_the_cells_it_measured(tmp_path: Path) -> None:
    """The reports are written after every cell of the first round, marked as cut short, so a
    run stopped by a time limit keeps what it measured."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "bench", "--backend", "host", "--quick", "--iters", "3"]
    cmd += ["--consumers", "1", "--only", "host", "--out", str(tmp_path)]
    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True) as proc:
        try:
            deadline = time.monotonic() + 90
            assert proc.stderr is not None
            for line in proc.stderr:  # progress lines: "[ 2/N] floors | ..."
                if "] floors | mp.Queue | 1: median" in line or time.monotonic() > deadline:
                    break
        finally:
            proc.kill()
            proc.wait(timeout=30)
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["meta"]["partial"].startswith("2 of ")
    floors = report["scenarios"]["floors"]["systems"]
    assert {"mp.Pipe", "mp.Queue"} <= set(floors)
    assert "cut short | written after 2 of" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_rounds_pool_every_cell_and_rewrite_the_reports(tmp_path: Path) -> None:
    """--rounds runs every cell once per round, in order, and each cell's figures are over
    the samples of all its rounds."""
    done = _bench(tmp_path, "--iters", "4", "--rounds", "3", "--consumers", "1", "--only", "ring_roundtrip")
    assert done.returncode == 0, done.stderr
    assert ": ERROR" not in done.stderr, done.stderr
    # The floors and the ring's cells, interleaved: round 2 starts after round 1's last cell.
    lines = [line for line in done.stderr.splitlines() if " | " in line and "skipped" not in line]
    rounds = [line.split(" ", 1)[0] for line in lines]
    assert rounds == ["r1"] * 4 + ["r2"] * 4 + ["r3"] * 4, lines
    assert "round 1 of 3 done; reports written" in done.stderr
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["meta"]["rounds"] == 3 and report["meta"]["rounds_run"] == 3
    cells = report["scenarios"]["ring_roundtrip"]["systems"]["gpushare host spin"]["cells"]
    assert cells["1"]["n"] == 12, cells  # 4 iterations in each of 3 rounds
    floors = report["scenarios"]["floors"]["systems"]["mp.Pipe"]["cells"]
    assert floors["1"]["n"] == 12, floors
    assert "| rounds | 3 of 3 run:" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_max_seconds_starts_no_round_that_would_overrun(tmp_path: Path) -> None:
    done = _bench(
        tmp_path, "--iters", "3", "--rounds", "4", "--max-seconds", "0.01", "--consumers", "1", "--only", "floors"
    )
    assert done.returncode == 0, done.stderr
    assert "round 2 of 4 not started" in done.stderr, done.stderr
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["meta"]["rounds_run"] == 1
    assert report["scenarios"]["floors"]["systems"]["mp.Queue"]["cells"]["1"]["n"] == 3
    assert "| rounds | 1 of 4 run:" in (tmp_path / "report.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("args", [["--rounds", "0"], ["--max-seconds", "0"]])
def test_rounds_and_max_seconds_reject_nonsense(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli._parse(args)
    assert "must be" in capsys.readouterr().err


def test_reports_go_to_dev_and_the_plot_to_the_docs_by_default(tmp_path: Path) -> None:
    """Without --out: the reports in dev/benchmarks and the plot in docs/assets, both of the
    checkout wherever the bench is started; with --out, the plot goes next to the reports
    (a run folder never replaces the docs' plot) unless --plot names it."""
    cfg = cli._parse(["--backend", "host"])
    assert Path(cfg.out) == ROOT / "dev" / "benchmarks"
    assert cfg.plot is not None and Path(cfg.plot) == ROOT / "docs" / "assets" / "benchmarks.png"
    assert cli._link(cfg.out, cfg.plot) == "../../docs/assets/benchmarks.png"
    run = tmp_path / "runs" / "a-run"
    cfg = cli._parse(["--backend", "host", "--out", str(run)])
    assert cfg.plot is not None and Path(cfg.plot) == run / "benchmarks.png"
    assert cli._link(cfg.out, cfg.plot) == "benchmarks.png"
    cfg = cli._parse(["--backend", "host", "--out", str(run), "--plot", str(tmp_path / "p.png")])
    assert cfg.plot == str(tmp_path / "p.png")


def test_first_share_lists_each_mechanisms_own_reference(tmp_path: Path) -> None:
    """Without a GPU the references are listed as skipped with the reason, and their
    ratio columns are in the table; on a GPU they run (the device suite's bench run)."""
    done = _bench(tmp_path, "--iters", "2", "--only", "first_share")
    assert done.returncode == 0, done.stderr
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "gpushare cuda_vmm / raw driver, VMM fd" in markdown
    assert "gpushare cuda_pool / raw driver, IPC pool" in markdown
    for raw in ("raw driver, VMM fd", "raw driver, IPC pool"):
        assert f"- {raw}: skipped: run with the host backend" in markdown, markdown


class _FakeDriver:
    """Stands in for ``gpushare._cuda`` in the raw references' own logic: allocations are
    ids, exported fds are real (memfds), and every open must be closed and every
    allocation freed."""

    def __init__(self) -> None:
        self.ids = iter(range(1, 1_000_000))
        self.live: set[int] = set()  # the producer's allocations
        self.mapped: set[int] = set()  # the consumer's opens
        self.events: list[str] = []

    def _new(self) -> int:
        ptr = next(self.ids)
        self.live.add(ptr)
        return ptr

    def _fd(self) -> int:
        return os.memfd_create("fake-export", os.MFD_CLOEXEC)

    # legacy IPC
    def mem_alloc(self, nbytes: int, ordinal: int) -> int:
        return self._new()

    def ipc_get_handle(self, ptr: int, ordinal: int) -> bytes:
        return ptr.to_bytes(64, "little")

    def mem_free(self, ptr: int, ordinal: int) -> None:
        self.live.remove(ptr)

    def ipc_open(self, handle: bytes, device: int) -> int:
        ptr = int.from_bytes(handle, "little")
        assert ptr in self.live, "opened memory the producer does not hold"
        self.mapped.add(ptr)
        return ptr

    def ipc_close(self, ptr: int, device: int) -> None:
        self.mapped.remove(ptr)

    # VMM
    def vmm_alloc(self, nbytes: int, ordinal: int) -> tuple[int, str]:
        ptr = self._new()
        return ptr, f"handle-{ptr}"

    def vmm_export(self, handle: str, ordinal: int) -> int:
        fd = self._fd()
        os.write(fd, handle.encode())
        return fd

    def vmm_import(self, fd: int, nbytes: int, ordinals: list[int]) -> tuple[int, str]:
        os.lseek(fd, 0, os.SEEK_SET)
        handle = os.read(fd, 64).decode()  # the fd that arrived is the one exported
        ptr = int(handle.split("-")[1])
        assert ptr in self.live and nbytes == 2 * 1024 * 1024
        self.mapped.add(ptr)
        return ptr, handle

    def vmm_free(self, ptr: int, handle: str, nbytes: int, ordinal: int) -> None:
        (self.mapped if ptr in self.mapped else self.live).remove(ptr)

    # IPC pools
    def pool_create(self, ordinal: int) -> tuple[str, int]:
        self.events.append("pool_create")
        return "pool", self._fd()

    def pool_import(self, fd: int, ordinals: list[int], home: int | None) -> str:
        os.fstat(fd)
        self.events.append("pool_import")
        return "imported-pool"

    def pool_alloc(self, pool: str, nbytes: int, ordinal: int) -> tuple[int, bytes]:
        ptr = self._new()
        return ptr, ptr.to_bytes(64, "little")

    def pool_import_pointer(self, pool: str, data: bytes, device: int) -> int:
        assert pool == "imported-pool", "a pointer was imported before its pool"
        ptr = int.from_bytes(data, "little")
        self.mapped.add(ptr)
        return -ptr  # the consumer's own address for it

    def pool_free(self, ptr: int, ordinal: int) -> None:
        (self.mapped if ptr < 0 and -ptr in self.mapped else self.live).remove(abs(ptr))

    def pool_trim(self, pool: str, ordinal: int) -> None:
        self.events.append("trim")

    def pool_destroy(self, pool: str, ordinal: int) -> None:
        self.events.append("pool_destroy")


@pytest.mark.parametrize("mechanism", ["_RawIpc", "_RawVmm", "_RawPool"])
def test_raw_references_open_close_and_free_everything(mechanism: str) -> None:
    """Each first-share reference's producer and consumer halves, with a stand-in for the
    driver (the real calls run in the GPU suite's benchmark): what the producer shares
    reaches the consumer intact, fds travel and are closed on both sides, and every
    allocation and mapping is given back."""
    import multiprocessing

    from bench import consumers
    from bench.scenarios import first_share

    ctx = multiprocessing.get_context("spawn")
    ctx.Queue().close()  # the first Queue of a process starts the resource tracker (one fd for good)
    fds_before = len(os.listdir("/proc/self/fd"))
    driver = _FakeDriver()
    raw = getattr(first_share, mechanism)(ctx, driver)
    take, open_, close = consumers._RAW_KINDS[raw.kind](driver, raw.consumer_work(), raw.sock, 0)
    for _ in range(3):
        held = raw.share(2 * 1024 * 1024)
        mapped = open_(take())
        assert driver.mapped, "the consumer's open mapped nothing"
        close(mapped)
        assert not driver.mapped
        raw.free(held, 2 * 1024 * 1024)
        raw.settled()
    assert not driver.live
    raw.work.put(None)  # what settled_loop sends to stop the consumer
    assert take() is None
    raw.close()
    if hasattr(raw.work, "close"):
        raw.work.close()
        raw.work.join_thread()
    assert len(os.listdir("/proc/self/fd")) == fds_before, "an fd was left open"
    if raw.kind == "pool":
        assert driver.events == ["pool_create", "pool_import", "trim", "trim", "trim", "pool_destroy"]


# -- startup: fresh interpreters against the stdlib ------------------------------------------------


def _startup_bench(tmp_path: Path) -> Any:
    """A Bench planned with the startup scenario alone, on the host backend (the floors are
    not planned: the startup rows are their own floors)."""
    from bench.runner import Bench

    cfg = dataclasses.replace(
        cli._parse(["--backend", "host", "--quick", "--out", str(tmp_path)]), only=frozenset({"startup"})
    )
    bench = Bench(cfg)
    bench.probe()
    bench.plan()
    return bench


def _leftover_scripts(tmp: Path) -> list[str]:
    return [p.name for p in tmp.iterdir() if p.name.startswith("gpushare-bench-startup-")]


def test_startup_times_fresh_interpreters_and_reports_rows_and_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole scenario on the host with tiny counts: every CPU row has gpushare and its
    stdlib floor from real interpreters, the GPU rows are skipped with the reason, the
    targets are judged in both reports, and no script is left behind."""
    from bench.scenarios import startup

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the scripts' directories go
    monkeypatch.setattr(startup, "QUICK", startup.Counts(imports=2, interpreters=1, starts=3, firsts=1, warmup=0))
    bench = _startup_bench(tmp_path)
    assert [t.row for t in bench.tasks] == list(startup.ROWS)
    bench.run()
    cli.write_reports(bench, str(tmp_path))
    assert _leftover_scripts(scratch) == []

    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert list(report["scenarios"]) == ["startup"]
    scenario = report["scenarios"]["startup"]
    assert scenario["rows"] == list(startup.ROWS)
    assert scenario["row_errors"] == {}, scenario["row_errors"]
    cells = {name: series["cells"] for name, series in scenario["systems"].items()}
    # How many samples each row has: 2 imports each; 1 script of 3 pairs = 2 steady + 1 first; 1 first buffer.
    expected = {
        startup.IMPORT: 2,
        startup.PROCESS: 2,
        startup.PROCESS_FIRST: 1,
        startup.MANAGER: 2,
        startup.MANAGER_FIRST: 1,
        startup.FIRST_HOST: 1,
    }
    for row, n in expected.items():
        for name in (startup.GPUSHARE, startup.FLOOR):
            assert cells[name][row]["n"] == n, (name, row, cells[name])
            assert cells[name][row]["median_us"] > 0
    assert sorted(cells[startup.BARE]) == [startup.IMPORT]
    assert startup.CUDA_ALONE not in cells  # no column for a reference that cannot run here
    for row in (startup.GPU_PROCESS, startup.FIRST_DEVICE):
        assert "host backend" in scenario["row_skips"][row], scenario["row_skips"]
        assert all(row not in by_row for by_row in cells.values())
    targets = scenario["targets"]
    assert {row: t["limit"] for row, t in targets.items()} == {
        startup.IMPORT: 1.5,
        startup.PROCESS: 1.25,
        startup.MANAGER: 1.5,
    }
    for row, target in targets.items():
        ratio = cells[startup.GPUSHARE][row]["median_us"] / cells[startup.FLOOR][row]["median_us"]
        assert target["met"] == {startup.GPUSHARE: ratio <= target["limit"]}, (row, ratio, target)

    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert startup.HOW in markdown
    lines = {line.split(" | ")[0].lstrip("| "): line for line in markdown.splitlines() if line.startswith("| ")}
    assert lines["timed"].startswith(
        "| timed | floor (multiprocessing) | gpushare | bare interpreter (pass) | gpushare / floor | target |"
    )
    assert lines["timed"].endswith("| gpushare: target |")
    for row in (startup.IMPORT, startup.PROCESS, startup.MANAGER):
        goal = f"<= {targets[row]['limit']:g}x floor"
        verdict = "met" if targets[row]["met"][startup.GPUSHARE] else "not met"
        assert lines[row].endswith(f"| {goal} | {verdict} |"), lines[row]
    for row in (startup.PROCESS_FIRST, startup.MANAGER_FIRST, startup.FIRST_HOST):
        assert lines[row].endswith("| - | - |"), lines[row]  # reported, not judged
    assert "- Targets (median): timed import: <= 1.5x the multiprocessing floor;" in markdown
    assert f"- timed {startup.GPU_PROCESS}: skipped: run with the host backend" in markdown
    assert f"- timed {startup.FIRST_DEVICE}: skipped: run with the host backend" in markdown


def test_startup_row_whose_scripts_fail_records_the_error_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.scenarios import startup

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(startup, "QUICK", startup.Counts(imports=1, interpreters=1, starts=2, firsts=1, warmup=0))
    broken = dict(startup._HEADERS, gpushare="import gpushare_no_such_module as mp\n")
    monkeypatch.setattr(startup, "_HEADERS", broken)
    bench = _startup_bench(tmp_path)
    bench.run()
    assert _leftover_scripts(scratch) == []
    scenario = bench.scenarios["startup"]
    for row in (startup.PROCESS, startup.MANAGER, startup.FIRST_HOST):
        error = scenario.row_errors[row]
        assert "exited with code 1" in error and "gpushare_no_such_module" in error, error
    for row, source in ((startup.PROCESS_FIRST, startup.PROCESS), (startup.MANAGER_FIRST, startup.MANAGER)):
        assert f"the row {source!r}, which did not run or failed" in scenario.row_errors[row]
    assert scenario.systems[startup.GPUSHARE].cells[startup.IMPORT].n == 1  # the import row ran
    assert not any(startup.PROCESS in s.cells for s in scenario.systems.values())  # no half row


def test_startup_script_that_overruns_is_killed_with_its_children(tmp_path: Path) -> None:
    """A script past its timeout is killed with the process it started; a failing script's
    error names its cause; output that is not samples is refused."""
    from bench.scenarios import startup
    from bench.settings import BenchError

    env = startup.checkout_env()
    pidfile = tmp_path / "child.pid"
    hangs = tmp_path / "hangs.py"
    hangs.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n",
        encoding="utf-8",
    )
    started = time.monotonic()
    with pytest.raises(BenchError, match="did not finish within 3 s"):
        startup.run_script(hangs, {}, env, timeout=3)
    assert time.monotonic() - started < 30
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    try:
        while _running(child):
            assert time.monotonic() < deadline, f"the script's child {child} outlived it"
            time.sleep(0.05)
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)  # a survivor must not outlive the test

    fails = tmp_path / "fails.py"
    fails.write_text("raise SystemExit('boom: the consumer failed')\n", encoding="utf-8")
    with pytest.raises(BenchError, match=r"fails.py exited with code 1: boom: the consumer failed"):
        startup.run_script(fails, {}, env)
    silent = tmp_path / "silent.py"
    silent.write_text("print('no samples here')\n", encoding="utf-8")
    with pytest.raises(BenchError, match="printed no samples"):
        startup.run_script(silent, {}, env)
    negative = tmp_path / "negative.py"
    negative.write_text("print('[5, -1]')\n", encoding="utf-8")
    with pytest.raises(BenchError, match="not a list of positive ints"):
        startup.run_script(negative, {}, env)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_startup_scripts_are_what_the_report_says() -> None:
    """The scripts compile; gpushare's import it as mp, the floor's take the stdlib's spawn
    context; targets live in the script (a spawned child re-imports it); the CUDA reference
    uses cuda.bindings directly and gpushare's scripts never do."""
    from bench.scenarios import startup

    for system in (startup.GPUSHARE, startup.FLOOR):
        for source in (
            startup.starts_script(system),
            startup.manager_script(system),
            startup.first_buffer_script(system),
        ):
            compile(source, f"<{system}>", "exec")
            assert "cuda.bindings" not in source
            assert ("import gpushare as mp\n" in source) == (system == startup.GPUSHARE)
            assert ('mp = multiprocessing.get_context("spawn")\n' in source) == (system == startup.FLOOR)
            assert 'if __name__ == "__main__":\n    main(json.loads(sys.argv[1]))' in source
        assert "\ndef target():\n    pass\n" in startup.starts_script(system)
    cuda = startup.starts_script(startup.FLOOR, cuda_target=True)
    alone = startup.context_alone_script()
    for source in (cuda, alone):
        compile(source, "<cuda>", "exec")
        assert "gpushare" not in source
        for call in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"):
            assert f"driver.{call}(" in source
    assert "\ndef target(ordinal):\n    make_cuda_context(ordinal)\n" in cuda
    with pytest.raises(ValueError, match="starts=1"):
        startup.Counts(imports=1, interpreters=1, starts=1, firsts=1)


@pytest.mark.gpu
def test_startup_gpu_rows_run_on_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two GPU rows with tiny counts: every system gives positive samples."""
    from bench.scenarios import startup

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    counts = startup.Counts(imports=1, interpreters=1, starts=2, firsts=1, warmup=0)
    processes = startup.time_gpu_processes(counts)
    assert sorted(processes) == sorted([startup.GPUSHARE, startup.CUDA_ALONE, startup.FLOOR])
    first = startup.time_first_device_buffer(counts)
    assert sorted(first) == sorted([startup.GPUSHARE, startup.CUDA_ALONE])
    for samples in (*processes.values(), *first.values()):
        assert len(samples) == 1 and samples[0] > 0
    assert _leftover_scripts(scratch) == []


# -- weight_sync (issue 24) ------------------------------------------------------------------------


def test_weight_sync_layouts_are_the_models_and_cells_that_cannot_fit_are_skipped() -> None:
    from bench.scenarios import weight_sync as ws

    small = ws.llama_shapes(**ws.MODELS["weight_sync"][1])
    large = ws.llama_shapes(**ws.MODELS["weight_sync_8b"][1])
    assert (len(small), len(large)) == (201, 291)
    assert 2.1e9 < ws.layout_bytes(small) < 2.3e9 and 15.5e9 < ws.layout_bytes(large) < 16.5e9
    assert small["model.layers.0.self_attn.k_proj.weight"] == (256, 2048)  # 4 kv heads of 64
    free = 79 * ws.GiB  # an H100's free memory
    nbytes = ws.layout_bytes(large)
    assert ws.fit_reason(ws.GS_COPY, 1, nbytes, free, 0) is None  # trainer + 2 versions + 1 engine: 64 GB
    reason = ws.fit_reason(ws.GS_COPY, 2, nbytes, free, 0)
    assert reason is not None and "x 5 copies" in reason and "79.0 GiB free on cuda:0" in reason
    assert ws.fit_reason(ws.GS_ZERO, 8, nbytes, free, 0) is None  # zero-copy engines make no copies
    # trained in the set: the trainer's weights are the one version (3 copies for 2 engines, not 5)
    assert ws.fit_reason(ws.GS_IN_SET, 2, nbytes, free, 0) is None
    assert "x 5 copies" in (ws.fit_reason(ws.GS_IN_SET, 4, nbytes, free, 0) or "")
    assert ws.fit_reason(ws.LOCAL, 8, ws.layout_bytes(small), free, 0) is None
    # torch's flattened bucket keeps last sync's bucket until the engines let go: three trainer copies
    flat = ws.fit_reason(ws.TORCH_FLAT, 2, nbytes, free, 0)
    assert flat is not None and "x 5 copies" in flat


def test_weight_sync_goals_are_judged_against_the_floor_and_the_best_torch_pattern() -> None:
    from bench.fmt import _goal_status
    from bench.results import Scenario, Series
    from bench.scenarios import weight_sync as ws
    from bench.stats import Cell

    scenario = Scenario("weight_sync", "t", "engines", ["1"], floor=("weight_sync", ws.LOCAL), goals=ws.goals(["1"]))
    for system, us in ((ws.LOCAL, 4200), (ws.TORCH_TENSOR, 29400), (ws.TORCH_FLAT, 8300), (ws.TORCH_KEPT, 7000)):
        scenario.systems[system] = Series(cells={"1": Cell.of([us * 1000])})
    scenario.systems[ws.GS_COPY] = Series(cells={"1": Cell.of([4600 * 1000])})
    scenario.systems[ws.GS_IN_SET] = Series(cells={"1": Cell.of([4400 * 1000])})
    scenario.systems[ws.GS_INPLACE] = Series(cells={"1": Cell.of([150 * 1000])})
    status = {goal.text: _goal_status({"weight_sync": scenario}, scenario, goal) for goal in scenario.goals}
    assert status[f"{ws.GS_COPY} <= 1.2x {ws.LOCAL}"] == (True, "1.10x")
    assert status[f"{ws.GS_COPY} >= 4x faster than {ws.TORCH_TENSOR}"] == (True, "0.16x, 6.39x faster")
    best = status[f"{ws.GS_COPY} >= 1.1x faster than the best torch pattern"]
    assert best == (True, "0.66x, 1.52x faster")  # against the kept bucket
    assert status[f"{ws.GS_IN_SET} <= 1.2x {ws.LOCAL}"] == (True, "1.05x")
    assert status[f"{ws.GS_IN_SET} >= 4x faster than {ws.TORCH_TENSOR}"] == (True, "0.15x, 6.68x faster")
    assert status[f"{ws.GS_IN_SET} >= 1.1x faster than the best torch pattern"] == (True, "0.63x, 1.59x faster")
    assert status[f"{ws.GS_INPLACE} <= 100 us"] == (False, "150 us")
    assert status[f"{ws.GS_ZERO} <= the {ws.LOCAL} floor"] == (None, "-")  # not measured

    # Both reports carry them, with the memory table and a cell skipped for memory.
    from bench.report_json import _scenario_json
    from bench.report_md import _render_scenario

    scenario.details["memory"] = {"1": {ws.GS_COPY: {"used_mib": 9000, "growth_mib": 0}}}
    scenario.systems[ws.GS_ZERO] = Series(skips={"1": "needs about 90 GiB"})
    markdown = "\n".join(_render_scenario({"weight_sync": scenario}, scenario))
    assert f"- Target, engines 1: {ws.GS_COPY} <= 1.2x {ws.LOCAL}: met (1.10x)." in markdown
    assert f"- Target, engines 1: {ws.GS_INPLACE} <= 100 us: not met (150 us)." in markdown
    assert "| 1 | 9,000 (+0) |" in markdown and f"- {ws.GS_ZERO}, engines 1: skipped: needs about 90 GiB" in markdown
    report = _scenario_json({"weight_sync": scenario}, scenario)
    # copy's three, trained-in-the-set's three, the in-place publish, zero-copy's two (unmeasured)
    assert [g["met"] for g in report["goals"]] == [True, True, True, True, True, True, False, None, None]
    assert report["details"]["memory"]["1"][ws.GS_COPY]["used_mib"] == 9000
    assert report["systems"][ws.GS_ZERO]["skips"] == {"1": "needs about 90 GiB"}


def test_weight_sync_cells_run_on_the_host_with_a_small_layout() -> None:
    """The scenario's trainer and engines (spawned), with a small Llama layout on the CPU: the floor and
    the gpushare systems sync, ack and end with the trainer's weights; torch's IPC needs CUDA."""
    pytest.importorskip("torch")
    import gpushare as mp
    from bench.scenarios import weight_sync as ws
    from bench.settings import BenchError

    shapes = ws.llama_shapes(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=128)
    with mp.Manager() as manager:
        for system in (ws.LOCAL, ws.GS_COPY, ws.GS_IN_SET, ws.GS_ZERO, ws.GS_BOUND, ws.GS_INPLACE):
            samples, memory = ws.run_cell(manager, shapes, system, 2, "cpu", iters=3, warmup=1)
            assert len(samples) == 3 and min(samples) > 0 and memory is None, system
        with pytest.raises(BenchError, match="needs CUDA"):
            ws.run_cell(manager, shapes, ws.TORCH_TENSOR, 1, "cpu", iters=1, warmup=1)
        assert manager.stats()["leases"] == 0


def test_weight_sync_cells_that_leak_by_design_run_in_a_trainer_of_their_own() -> None:
    """torch's IPC cells run in a spawned trainer process (what torch keeps goes with it): its samples come
    back, and its failure comes back as a BenchError with the trainer's traceback."""
    pytest.importorskip("torch")
    from bench.scenarios import weight_sync as ws
    from bench.settings import BenchError

    assert set(ws.OWN_TRAINER) == {ws.TORCH_TENSOR, ws.TORCH_FLAT}
    shapes = ws.llama_shapes(layers=1, hidden=32, intermediate=48, heads=4, kv_heads=2, vocab=64)
    samples, memory = ws.in_own_trainer(shapes, ws.LOCAL, 1, "cpu", 2, 1)
    assert len(samples) == 2 and min(samples) > 0 and memory is None
    with pytest.raises(BenchError, match=r"(?s)the trainer process failed.*needs CUDA"):
        ws.in_own_trainer(shapes, ws.TORCH_TENSOR, 1, "cpu", 1, 1)


def test_weight_sync_is_skipped_cleanly_without_a_gpu(tmp_path: Path) -> None:
    done = _bench(tmp_path, "--iters", "2", "--consumers", "1", "--only", "weight_sync,weight_sync_8b")
    assert done.returncode == 0 and ": ERROR" not in done.stderr, done.stderr
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "`weight_sync`: skipped: run with the host backend" in markdown
    assert "`weight_sync_8b`: skipped: run with the host backend" in markdown
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert report["scenarios"]["weight_sync"]["skipped"].startswith("run with the host backend")


# -- dataloader_gpu_samples and dataloader_cpu_samples ---------------------------------------------


def _loader_bench(tmp_path: Path, *keys: str) -> Any:
    """A Bench planned with the named scenarios alone, on the host backend."""
    from bench.runner import Bench

    cfg = dataclasses.replace(
        cli._parse(["--backend", "host", "--quick", "--out", str(tmp_path)]), only=frozenset(keys)
    )
    bench = Bench(cfg)
    bench.probe()
    bench.plan()
    return bench


@pytest.mark.timeout(150)
def test_dataloader_gpu_samples_runs_its_grid_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenario's plumbing with samples made on the CPU (DEVICE="cpu") and tiny counts: both loaders,
    a new loader per epoch and a persistent one, real spawned workers; the time-per-batch and first-batch
    tables, their targets and the batches/s table in both reports."""
    pytest.importorskip("torch")
    from bench.scenarios import dataloader_gpu as dg

    monkeypatch.setattr(dg, "DEVICE", "cpu")
    monkeypatch.setattr(dg, "WORKERS", (1,))
    monkeypatch.setattr(dg, "SIZES", (dg.MiB,))
    monkeypatch.setattr(dg, "BATCH", 4)
    monkeypatch.setattr(dg, "CHUNK", 2)
    monkeypatch.setattr(dg, "CHUNKS", 2)
    monkeypatch.setattr(dg, "PACED", 2)
    monkeypatch.setattr(dg, "STEP_S", 0.001)
    monkeypatch.setattr(dg, "TAIL", 3)
    monkeypatch.setattr(dg, "FLAT_CELL", (1, dg.MiB))
    monkeypatch.setattr(dg, "QUICK", dg.Counts(per_epoch=1, flat=3, persistent=2))
    bench = _loader_bench(tmp_path, dg.KEY)
    per_epoch, persistent = dg.row_label(1, dg.MiB, dg.PER_EPOCH), dg.row_label(1, dg.MiB, dg.PERSISTENT)
    assert per_epoch == "1 workers, 1 MiB, new loader per epoch"
    assert [(t.system, t.row) for t in bench.tasks] == [
        (system, row) for row in (per_epoch, persistent) for system in dg.SYSTEMS
    ]
    bench.run()
    cli.write_reports(bench, str(tmp_path))

    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert list(report["scenarios"]) == [dg.KEY, dg.FIRST_KEY]
    main, first = report["scenarios"][dg.KEY], report["scenarios"][dg.FIRST_KEY]
    assert main["rows"] == [per_epoch, persistent] and main["floor"] == [dg.KEY, dg.TORCH_LOADER]
    first_rows = [
        f"{per_epoch}: first loader",
        f"{per_epoch}: later loaders",
        f"{persistent}: epoch 0",
        f"{persistent}: later epochs",
    ]
    assert first["rows"] == first_rows
    for name in dg.SYSTEMS:
        series = main["systems"][name]
        assert series["errors"] == {} and series["skipped"] is None, series
        # chunks per epoch x epochs: 3 new loaders, 2 persistent epochs
        assert {row: cell["n"] for row, cell in series["cells"].items()} == {per_epoch: 6, persistent: 4}
        assert {row: cell["n"] for row, cell in first["systems"][name]["cells"].items()} == dict(
            zip(first_rows, (1, 2, 1, 1), strict=True)
        )
    for scenario in (main, first):
        for row, target in scenario["targets"].items():
            cells = scenario["systems"]
            ratio = cells[dg.GS_LOADER]["cells"][row]["median_us"] / cells[dg.TORCH_LOADER]["cells"][row]["median_us"]
            assert target["limit"] == 1.0 and target["met"] == {dg.GS_LOADER: ratio <= 1.0}, (row, target)
    assert "checks" not in main  # no device memory on the CPU
    (rates,) = main["tables"]
    assert [r[0] for r in rates["rows"]] == [per_epoch, persistent] and all(r[1] != "-" for r in rates["rows"])
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert dg.HOW in markdown and f"`{dg.KEY}` batches per second" in markdown
    assert f"| {persistent}: later epochs |" in markdown
    # gpushare's first batch, step by step, from its loader's stats (worker 0 starting to the trainer)
    steps = [n for n in first["notes"] if n.startswith(f"{dg.GS_LOADER}, ")]
    assert [n.split(", first batch")[0] for n in steps] == [f"{dg.GS_LOADER}, {r}" for r in first_rows[::2]]
    assert all("spawned 0." in n and "ring_received" in n and n.rstrip(".").split()[-2] == "returned" for n in steps)
    assert steps[0] in markdown


def test_dataloader_gpu_samples_judges_device_memory_and_its_flatness(tmp_path: Path) -> None:
    """The memory targets from the figures a GPU run records: gpushare's <= torch's, and flat over the
    new-loader epochs; a cell with one system only cannot be judged."""
    from bench.report_md import _render_scenario
    from bench.scenarios import dataloader_gpu as dg

    bench = _loader_bench(tmp_path, dg.KEY)
    bench.scenarios[dg.KEY].skipped = None  # planned on the host: figures as a GPU run records them
    rows = bench.scenarios[dg.KEY].rows
    per_epoch, persistent = rows[0], rows[1]

    def figures(first: float, last: float, epochs: int, paced: float | None = None) -> dict[str, Any]:
        return {
            "epochs": epochs,
            "first_epoch_mib": first,
            "last_epoch_mib": last,
            "growth_mib": last - first,
            "max_mib": max(first, last),
            "trainer_allocated_mib": 0.0,
            "paced_first_epoch_mib": paced,
        }

    bench.scenarios[dg.KEY].details["device_memory"] = {
        per_epoch: {dg.TORCH_LOADER: figures(2600, 2600, 20, 2700), dg.GS_LOADER: figures(2100, 2140, 20, 2800)},
        persistent: {dg.GS_LOADER: figures(2100, 2100, 3)},
    }
    dg.refresh(bench, (dg.GS_LOADER, per_epoch, [1_000_000]))
    main = bench.scenarios[dg.KEY]
    verdicts = {(c.row, c.text.split(" device memory ")[1]): (c.met, c.measured) for c in main.checks}
    assert verdicts == {
        (per_epoch, f"<= {dg.TORCH_LOADER}'s"): (True, "2,100 MiB vs 2,600 MiB"),
        (per_epoch, f"<= {dg.TORCH_LOADER}'s, the trainer taking 5 ms a batch"): (False, "2,800 MiB vs 2,700 MiB"),
        (per_epoch, f"flat over 20 epochs, a new loader each (growth <= {dg.FLAT_MIB} MiB)"): (
            False,
            "2,100 -> 2,140 MiB, +40.0 MiB",
        ),
        (persistent, f"<= {dg.TORCH_LOADER}'s"): (None, "-"),
    }
    markdown = "\n".join(_render_scenario(bench.scenarios, main))
    assert f"- Target, cell {per_epoch}: {dg.GS_LOADER} device memory <= {dg.TORCH_LOADER}'s: met" in markdown
    assert "flat over 20 epochs, a new loader each (growth <= 8 MiB): not met (2,100 -> 2,140 MiB" in markdown
    torch_cells = "2,600 | 2,600 (+0 over 20 epochs) | 0 | 2,700"
    gs_cells = "2,100 | 2,140 (+40 over 20 epochs) | 0 | 2,800"
    assert f"| {per_epoch} | {torch_cells} | {gs_cells} |" in markdown
    assert f"| {per_epoch} | - | 1,000 | - |" in markdown  # batches/s: the pending cell's 1 ms per batch


def test_stop_loader_notes_torch_workers_killed_by_a_signal_and_keeps_the_cells_own_failure() -> None:
    """A cell's loader is stopped whole even when a step raises. torch's workers that a signal killed
    as they were stopped (torch's own worker, stopped with batches queued, aborts at exit now and then:
    see stop_loader) are notes, whether torch raised their death or not; any other raise is the error
    of a cell that went well, and a note on the failure of one that did not."""
    from types import SimpleNamespace

    from bench.scenarios.dataloader_gpu import stop_loader
    from bench.settings import BenchError

    stopped: list[str] = []
    aborted = "DataLoader worker (pid 7) is killed by signal: Aborted. "

    class TorchIterator:  # torch's shape: no close(), _shutdown_workers(), _workers with exit codes
        def __init__(self, raises: Exception | None, *codes: int) -> None:
            self.raises = raises
            self._workers = [SimpleNamespace(pid=7 + i, exitcode=code) for i, code in enumerate(codes)]

        def _shutdown_workers(self) -> None:
            stopped.append("iterator")
            if self.raises is not None:
                raise self.raises

    class Loader:  # gpushare's shape: close()
        def close(self) -> None:
            stopped.append("loader")

    died = "torch's DataLoader worker (pid 7) died of SIGABRT as its loader was stopped"
    # raised from torch's SIGCHLD handler, or unseen: a note either way, and the loader still closed
    assert stop_loader(TorchIterator(RuntimeError(aborted), -6, 0), Loader(), None) == [died]
    assert stop_loader(TorchIterator(None, -6, 0), Loader(), None) == [died]
    assert stop_loader(TorchIterator(None, 0, -15), None, None) == [
        "torch's DataLoader worker (pid 8) died of SIGTERM as its loader was stopped"
    ]
    assert stopped == ["iterator", "loader", "iterator", "loader", "iterator"]
    # a raise no dead worker explains is the cell's error; the loader is closed all the same
    stopped.clear()
    with pytest.raises(RuntimeError, match="killed by signal: Aborted"):
        stop_loader(TorchIterator(RuntimeError(aborted), 0), Loader(), None)
    with pytest.raises(OSError, match="broken"):
        stop_loader(TorchIterator(OSError("broken"), -6), Loader(), None)
    assert stopped == ["iterator", "loader", "iterator", "loader"]
    # a persistent torch loader: its kept iterator, once even when it is also the cell's
    stopped.clear()
    kept = TorchIterator(None, -6)
    assert stop_loader(kept, SimpleNamespace(_iterator=kept), None) == [died]
    assert stop_loader(None, SimpleNamespace(_iterator=None), None) == []
    assert stopped == ["iterator"]
    # a failing cell: its failure stays its error, with what stopping raised and the deaths as notes
    stopped.clear()
    failure = BenchError("torch delivered a wrong batch: batch 0 differs from the dataset's")
    assert stop_loader(TorchIterator(RuntimeError(aborted), -6), Loader(), failure) == [died]
    stop_loader(TorchIterator(OSError("broken")), Loader(), failure)
    assert stopped == ["iterator", "loader", "iterator", "loader"]
    assert failure.__notes__ == [f"then {died}", "then stopping its loader raised OSError: broken"]
    # gpushare's iterator (with a close()) has its own workers: their faults are errors, not notes
    gs_iterator = SimpleNamespace(close=Loader().close, _workers=[SimpleNamespace(pid=9, exitcode=-6)])
    assert stop_loader(gs_iterator, None, None) == []


def test_a_cells_error_keeps_the_notes_added_to_it(tmp_path: Path) -> None:
    """What a failing cell records is its exception and the notes added on its way out (a loader's
    stop after a wrong batch adds what it raised there)."""
    from bench.results import Scenario
    from bench.settings import BenchError

    bench = _loader_bench(tmp_path, "floors")
    bench.tasks.clear()
    bench.scenarios["noted"] = Scenario("noted", "a scenario", "row", ["r"])

    def fails() -> list[int]:
        error = BenchError("torch delivered a wrong batch: batch 0 differs from the dataset's")
        error.add_note("then torch's DataLoader worker (pid 7) died of SIGABRT as its loader was stopped")
        raise error

    bench.task("noted", "torch", "r", fails, None)
    bench.run()
    assert bench.scenarios["noted"].systems["torch"].errors == {
        "r": "BenchError: torch delivered a wrong batch: batch 0 differs from the dataset's; "
        "then torch's DataLoader worker (pid 7) died of SIGABRT as its loader was stopped"
    }


@pytest.mark.timeout(150)
def test_dataloader_cpu_samples_runs_on_the_cpu_and_a_wrong_batch_fails_the_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario's plumbing with small images and no GPU (no pinning, no copies): both loaders over
    uint8 and float32 samples, their tables and targets; then a trainer that expects other values than
    the workers make (its MODULUS changed: workers import the module afresh) fails the cell."""
    pytest.importorskip("torch")
    from bench.scenarios import dataloader_cpu as dc

    monkeypatch.setattr(dc, "DEVICE", "cpu")
    monkeypatch.setattr(dc, "SHAPE", (3, 8, 8))
    monkeypatch.setattr(dc, "BATCH", 4)
    monkeypatch.setattr(dc, "WORKERS", (1,))
    monkeypatch.setattr(dc, "QUICK", dc.Counts(count=3, repeats=2, warmup=2))
    monkeypatch.setattr(dc, "PREPARE_HEAD", 0.5)
    rows = ["uint8, 1 workers", "float32, 1 workers"]
    firsts = [r for row in rows for r in (row, f"{row}: another loader")]  # the cell's loader, then a second
    prepared = [f"{row}: first loader after prepare_loaders()" for row in rows]  # gpushare's only
    out = tmp_path / "report"
    bench = _loader_bench(out, dc.KEY)
    assert [(t.system, t.row) for t in bench.tasks] == [(system, row) for row in rows for system in dc.SYSTEMS]
    bench.run()
    cli.write_reports(bench, str(out))
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert list(report["scenarios"]) == [dc.KEY, dc.FIRST_KEY]
    main, first = report["scenarios"][dc.KEY], report["scenarios"][dc.FIRST_KEY]
    for name in dc.SYSTEMS:
        assert main["systems"][name]["errors"] == {}, main["systems"][name]
        assert {row: cell["n"] for row, cell in main["systems"][name]["cells"].items()} == dict.fromkeys(rows, 2)
        mine = firsts + prepared if name == dc.GS_LOADER else firsts
        assert {row: cell["n"] for row, cell in first["systems"][name]["cells"].items()} == dict.fromkeys(mine, 1)
    deaths = [n for n in main["notes"] if " died of " in n]  # torch's workers only, and the cell kept
    assert all(n.startswith(f"{dc.TORCH_LOADER}, ") and n.endswith("(the cell is kept).") for n in deaths), deaths
    assert {row: t["limit"] for row, t in main["targets"].items()} == dict.fromkeys(rows, 0.833)
    assert {row: t["limit"] for row, t in first["targets"].items()} == dict.fromkeys(firsts, 1.0)
    for row, target in main["targets"].items():
        ratio = (
            main["systems"][dc.GS_LOADER]["cells"][row]["median_us"]
            / main["systems"][dc.TORCH_LOADER]["cells"][row]["median_us"]
        )
        assert target["met"] == {dc.GS_LOADER: ratio <= 0.833}
    assert [table["caption"].split(" ", 1)[1] for table in main["tables"]] == [
        "batches per second (1e6 / median us per batch)"
    ]
    assert dc.HOW in (out / "report.md").read_text(encoding="utf-8")
    steps = [n for n in first["notes"] if n.startswith(f"{dc.GS_LOADER}, ")]
    assert len(steps) == 2 and all("started" in n and "collated" in n and "returned" in n for n in steps), steps

    monkeypatch.setattr(dc, "MODULUS", 2)  # samples 0 and 1 of batch 0 still match
    for system in dc.SYSTEMS:
        with pytest.raises(dc.BenchError, match="delivered a wrong batch: batch 0 differs"):
            dc.run_cell(system, "uint8", 1, dc.Counts(count=2, repeats=1, warmup=1))
    monkeypatch.setattr(dc, "VERIFY", 0)  # no batch compared whole: the trainer's count on every batch
    for system in dc.SYSTEMS:
        # 12 in the cell's two batches, 4 in the first batch of the loader made after it, and for
        # gpushare 4 more in that of the loader made after prepare_loaders()
        wrong = 20 if system == dc.GS_LOADER else 16
        with pytest.raises(dc.BenchError, match=f"delivered wrong batches: {wrong} values or labels differ"):
            dc.run_cell(system, "uint8", 1, dc.Counts(count=1, repeats=1, warmup=1))


@pytest.mark.timeout(120)
def test_dataloader_sample_scenarios_are_skipped_cleanly_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the host backend (a real run of the CLI) and where torch sees no CUDA device, both scenarios
    and their first-batch tables are skipped with the reason, and nothing runs."""
    done = _bench(tmp_path, "--only", "dataloader_gpu_samples,dataloader_cpu_samples", timeout=100)
    assert done.returncode == 0 and ": ERROR" not in done.stderr, done.stderr
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    keys = ["dataloader_gpu_samples", "dataloader_gpu_samples_first", "dataloader_cpu_samples"]
    keys.append("dataloader_cpu_samples_first")
    assert [key for key in report["scenarios"] if key != "floors"] == keys
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    for key in keys:
        assert report["scenarios"][key]["skipped"].startswith("run with the host backend"), key
        assert f"`{key}`: skipped: run with the host backend" in markdown

    torch = pytest.importorskip("torch")
    from bench.runner import Bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = dataclasses.replace(
        cli._parse(["--quick", "--out", str(tmp_path)]),
        only=frozenset(["dataloader_gpu_samples", "dataloader_cpu_samples"]),
    )
    bench = Bench(cfg)
    bench.probe()
    bench.gpu_reason = None  # as on a machine with a GPU whose torch has no CUDA
    bench.plan()
    assert bench.tasks == []
    for key in keys:
        assert bench.scenarios[key].skipped == f"torch {torch.__version__} sees no CUDA device", key


# -- torch_mp ----------------------------------------------------------------------------------


def _torch_mp_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """``torch_mp`` planned on the CPU (CPU tensors: the plumbing, not the figures), small counts."""
    from bench.runner import Bench
    from bench.scenarios import torch_mp as tm

    monkeypatch.setattr(tm, "DEVICE", "cpu")
    monkeypatch.setattr(tm, "SIZES", (64 * 1024,))
    monkeypatch.setattr(tm, "MEMORY_SENDS", 12)
    parsed = cli._parse(["--backend", "host", "--quick", "--iters", "4", "--out", str(tmp_path), *args])
    bench = Bench(dataclasses.replace(parsed, only=frozenset([tm.KEY])))
    bench.probe()
    bench.plan()
    return bench


def test_torch_mp_is_registered_and_skipped_cleanly_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run of the CLI on the host: every table of the scenario is listed as skipped with the
    reason and nothing runs; where torch sees no CUDA device, that is the reason."""
    from bench.scenarios import torch_mp as tm

    assert "torch_mp" in MODULES and cli.SCENARIO_KEYS.count(tm.KEY) == 1
    keys = [tm.case_key(n, fresh) for n, fresh in tm.cases()] + [tm.MEMORY_KEY]
    assert keys == [
        "torch_mp_1mib_recycled",
        "torch_mp_1mib_fresh",
        "torch_mp_64mib_recycled",
        "torch_mp_64mib_fresh",
        "torch_mp_memory",
    ]
    done = _bench(tmp_path, "--only", "torch_mp", timeout=100)
    assert done.returncode == 0 and ": ERROR" not in done.stderr, done.stderr
    assert "] torch_mp_" not in done.stderr  # no cell was attempted
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert [key for key in report["scenarios"] if key != "floors"] == keys
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert tm.HOW in markdown
    for key in keys:
        assert report["scenarios"][key]["skipped"].startswith("run with the host backend"), key
        assert f"`{key}`: skipped: run with the host backend" in markdown
    assert report["scenarios"]["torch_mp_1mib_recycled"]["rows"] == ["1", "4", "8"]  # the default counts

    torch = pytest.importorskip("torch")
    from bench.runner import Bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench = Bench(dataclasses.replace(cli._parse(["--quick", "--consumers", "2,3"]), only=frozenset([tm.KEY])))
    bench.probe()
    bench.gpu_reason = None  # as on a machine with a GPU whose torch has no CUDA
    bench.plan()
    assert bench.tasks == []
    for key in keys:
        assert bench.scenarios[key].skipped == f"torch {torch.__version__} sees no CUDA device", key
    assert bench.scenarios["torch_mp_64mib_fresh"].rows == ["2", "3"]  # --consumers given


def test_torch_mp_processes_import_only_their_own_systems_module() -> None:
    """What keeps the two systems apart: the bench's modules import neither system's reducer into
    play, a torch.multiprocessing process never imports gpushare.torch.multiprocessing, and a process
    that imported it cannot pass for torch's (the check every producer and consumer makes first)."""
    pytest.importorskip("torch")
    script = """
import sys
import bench.cli  # every scenario module, as every spawned child of the bench imports them
from bench.scenarios import torch_mp as tm
from bench.settings import BenchError
assert tm.MODULES[tm.GS_MP] not in sys.modules
tm.system_module(tm.TORCH_MP)  # imports torch.multiprocessing alone and checks the reducer
assert tm.MODULES[tm.GS_MP] not in sys.modules
try:
    tm.check_system(tm.GS_MP)
except BenchError as exc:
    print("gpushare refused:", exc)
tm.system_module(tm.GS_MP)
tm.check_system(tm.GS_MANAGER)  # the Manager-buffer column runs the same drop-in
try:
    tm.check_system(tm.TORCH_MP)
except BenchError as exc:
    print("torch refused:", exc)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpushare refused: gpushare.torch.multiprocessing: torch.Tensor is pickled by "
                               "torch.multiprocessing.reductions.reduce_tensor"), lines  # fmt: skip
    assert lines[1].startswith("torch refused: torch.multiprocessing: torch.Tensor is pickled by "
                               "gpushare.torch._sharing.reduce_tensor"), lines  # fmt: skip
    assert len(lines) == 2, lines


@pytest.mark.timeout(150)
def test_torch_mp_cases_run_each_system_in_a_producer_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plumbing on the CPU: both systems, recycled and fresh (and the fresh cases' Manager-buffer
    column), to 2 consumers with a Queue each, each cell in its own producer process (whose consumers
    check their imports: a mix fails the cell); the tables render with torch's column as the floor and
    the targets on gpushare's."""
    pytest.importorskip("torch")
    from bench.scenarios import torch_mp as tm

    bench = _torch_mp_bench(tmp_path, monkeypatch, "--consumers", "2")
    recycled, fresh = "torch_mp_64kib_recycled", "torch_mp_64kib_fresh"
    assert [(t.scenario, t.system, t.row) for t in bench.tasks] == [
        *((recycled, system, "2") for system in tm.SYSTEMS),
        *((fresh, system, "2") for system in tm.FRESH_SYSTEMS),
        *((tm.MEMORY_KEY, system, "1") for system in tm.SYSTEMS),
    ]
    bench.tasks = [t for t in bench.tasks if t.scenario != tm.MEMORY_KEY]  # the next test runs those
    bench.run()
    cli.write_reports(bench, str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    for key, limit, systems in (
        (recycled, tm.RECYCLED_TARGET, tm.SYSTEMS),
        (fresh, tm.FRESH_TARGET, tm.FRESH_SYSTEMS),
    ):
        scenario = report["scenarios"][key]
        assert scenario["floor"] == [key, tm.TORCH_MP] and scenario["target_systems"] == list(systems[1:])
        assert list(scenario["systems"]) == list(systems)
        for system in systems:
            series = scenario["systems"][system]
            assert series["errors"] == {} and series["skipped"] is None, series
            assert series["cells"]["2"]["n"] == 4, series
        assert scenario["targets"]["2"]["limit"] == limit
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## 64 KiB CPU tensor to N consumers, one Queue each, the same tensor every iteration" in markdown
    header = f"| consumers | floor ({tm.TORCH_MP}) | {tm.GS_MP} | {tm.GS_MP} / floor | target | {tm.GS_MP}: target |"
    assert markdown.count(header) == 1, markdown
    gs, gm = tm.GS_MP, tm.GS_MANAGER
    header = (f"| consumers | floor ({tm.TORCH_MP}) | {gs} | {gm} | {gs} / floor | {gm} / floor | target "
              f"| {gs}: target | {gm}: target |")  # fmt: skip
    assert markdown.count(header) == 1, markdown


@pytest.mark.timeout(150)
def test_torch_mp_memory_cells_run_and_their_figures_render(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory cells on the CPU (per-send samples, no device memory: a note); then the table and
    gpushare's flatness check from figures as a GPU run records them, in both reports."""
    pytest.importorskip("torch")
    from bench import report_json, report_md
    from bench.scenarios import torch_mp as tm

    bench = _torch_mp_bench(tmp_path, monkeypatch, "--consumers", "2")
    bench.tasks = [t for t in bench.tasks if t.scenario == tm.MEMORY_KEY]
    bench.run()
    memory = bench.scenarios[tm.MEMORY_KEY]
    for system in tm.SYSTEMS:
        series = memory.systems[system]
        assert series.errors == {} and series.cells["1"].n == 12, series
        assert f"{system}: no device memory to read (CPU tensors)." in memory.notes
    assert memory.tables == [] and memory.checks == []

    def figures(before: float, peak: float, settled: float) -> dict[str, float]:
        return {"sends": 1000.0, "before_mib": before, "peak_mib": peak, "last_ack_mib": settled,
                "settled_mib": settled}  # fmt: skip

    memory.details["producer_memory"] = {tm.GS_MP: figures(0.0, 3.0, 0.0)}
    tm.refresh_memory(memory)
    (check,) = memory.checks
    assert (check.met, check.measured) == (True, "+3.0 MiB")
    memory.details["producer_memory"][tm.TORCH_MP] = figures(0.0, 1000.0, 1.0)
    tm.refresh_memory(memory)
    (check,) = memory.checks
    assert (check.met, check.measured) == (True, f"+3.0 MiB; {tm.TORCH_MP}: +1,000.0 MiB")
    (table,) = memory.tables
    assert [row[0] for row in table.rows] == list(tm.SYSTEMS)
    assert table.rows[0][1:] == ["0.0", "1,000.0", "+1,000.0", "1.0", "1.0"]
    memory.details["producer_memory"][tm.GS_MP] = figures(2.0, 30.0, 2.0)
    tm.refresh_memory(memory)
    assert memory.checks[0].met is False

    markdown = "\n".join(report_md._render_scenario(bench.scenarios, memory))
    assert f"- Target, consumers 1: {check.text}: not met (+28.0 MiB; {tm.TORCH_MP}: +1,000.0 MiB)." in markdown
    assert f"| {tm.TORCH_MP} | 0.0 | 1,000.0 | +1,000.0 | 1.0 | 1.0 |" in markdown
    assert f"| {tm.GS_MP} | 2.0 | 30.0 | +28.0 | 2.0 | 2.0 |" in markdown
    # --render draws the same from the JSON alone
    again = report_json.scenarios_from_json(report_json.render_json(bench.scenarios, bench.meta))
    assert "\n".join(report_md._render_scenario(again, again[tm.MEMORY_KEY])) == markdown
