"""tests/driver_repro/cuda_pool_killed_importers.py: its pure parts on the CPU, its processes with a fake driver.

The script reproduces the open cuda_pool finding (docs/reliability.md) on the
raw driver, without gpushare. On the CPU: argument parsing, the matrix plan,
the report's deltas and verdicts from made-up measurements, the summary table
and the JSON writer; then the whole script run as a subprocess against
``tests/driver_repro/fake_driver.py`` (spawned importers, the pool fd by
SCM_RIGHTS, SIGKILL, timeouts, errors reported by name, exit statuses). On a
GPU: one short run on the real driver that must measure every phase.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

FOLDER = os.path.join(ROOT, "tests", "driver_repro")
SCRIPT = os.path.join(FOLDER, "cuda_pool_killed_importers.py")
MiB = 1 << 20


def _load() -> object:
    spec = importlib.util.spec_from_file_location("cuda_pool_killed_importers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


repro = _load()


# -- pure parts ---------------------------------------------------------------------------------------


def test_the_script_imports_no_gpu_library_at_module_level() -> None:
    with open(SCRIPT) as f:
        top = [line for line in f if line.startswith(("import ", "from "))]
    assert not [line for line in top if "cuda" in line or "numpy" in line or "gpushare" in line], top


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("2MiB", 2 * MiB), ("32M", 32 * MiB), ("512KiB", 512 << 10), ("1GiB", 1 << 30), ("2097152", 2 * MiB)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert repro.parse_size(text) == nbytes
    assert repro.parse_size(repro.format_size(nbytes)) == nbytes


@pytest.mark.parametrize("text", ["", "x", "0", "-1MiB", "3x", "1.5", "MiB", "nanMiB", "2 TiB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|bytes"):
        repro.parse_size(text)


def test_format_size() -> None:
    assert repro.format_size(2 * MiB) == "2MiB"
    assert repro.format_size(3 << 10) == "3KiB"
    assert repro.format_size(1 << 30) == "1GiB"
    assert repro.format_size(1000) == "1000B"


def test_defaults_are_the_briefs() -> None:
    args = repro.parse_args([])
    assert (args.importers, args.buffers, args.size, args.mode, args.trim) == (50, 4, 2 * MiB, "kill", "every-round")
    assert (args.max_seconds, args.matrix, args.importer_frees, args.reuse, args.json) == (
        420.0,
        False,
        False,
        False,
        None,
    )
    assert args.sizes == [2 * MiB, 32 * MiB]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--importer-frees"], "needs --mode exit"),
        (["--importers", "0"], "at least 1"),
        (["--size", "3x"], "not a size"),
        (["--mode", "stop"], "invalid choice"),
        (["--trim", "sometimes"], "invalid choice"),
        (["--only", "kill/every-round/2MiB"], "needs --matrix"),
        (["--matrix", "--only", "kill/nope/2MiB"], "unknown variant"),
        (["--matrix", "--probe"], "exclude each other"),
        (["--settle", "-1"], ">= 0"),
        (["--device", "-1"], "--device"),
    ],
)
def test_bad_arguments_exit_2_with_a_reason(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        repro.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_matrix_plan_order_and_coverage() -> None:
    plan = repro.matrix_plan(repro.parse_args(["--matrix"]))
    names = [v.name for v in plan]
    assert len(names) == len(set(names))
    # gpushare's own set-up first, then its clean control, then the same buffers reused.
    assert names[:5] == [
        "kill/every-round/2MiB",
        "exit+frees/every-round/2MiB",
        "kill/every-round/2MiB/reuse",
        "exit/every-round/2MiB",
        "kill/end/2MiB",
    ]
    for mode in ("kill", "exit+frees", "exit"):
        for trim in ("every-round", "end"):
            for size in ("2MiB", "32MiB"):
                assert f"{mode}/{trim}/{size}" in names
    assert {(v.importers, v.buffers) for v in plan} == {(50, 4)}
    assert not [v for v in plan if v.mode == "kill" and v.importer_frees]


def test_matrix_plan_follows_sizes_importers_and_only() -> None:
    args = repro.parse_args(["--matrix", "--sizes", "4MiB,4MiB", "--importers", "7", "--buffers", "2"])
    plan = repro.matrix_plan(args)
    assert {v.size for v in plan} == {4 * MiB} and {v.importers for v in plan} == {7}
    only = repro.parse_args(["--matrix", "--only", "exit/end/2MiB, kill/every-round/2MiB"])
    assert [v.name for v in repro.matrix_plan(only)] == ["kill/every-round/2MiB", "exit/end/2MiB"]


def test_every_variants_argv_parses_back_to_it() -> None:
    for variant in repro.matrix_plan(repro.parse_args(["--matrix", "--sizes", "2MiB,32MiB,1000"])):
        args = repro.parse_args(variant.argv())
        again = repro.Variant(
            args.mode, args.trim, args.importer_frees, args.size, args.buffers, args.importers, args.reuse
        )
        assert again == variant


def test_estimate_is_the_slowest_so_far_else_a_guess() -> None:
    variant = repro.Variant("kill", "end", False, MiB, 4, 50)
    assert repro.estimate_seconds(variant, {}) >= 50
    assert repro.estimate_seconds(variant, {"a": 12.0, "b": 40.0}) == 40.0


def fake_report(
    trim: str = "every-round",
    phases: dict[str, float | None] | None = None,
    rounds: list[float] | None = None,
    reuse: bool = False,
    base: int = 80_000 * MiB,
) -> dict:
    """A report as the script fills it, from deltas in MiB (None: not measured)."""
    report = {
        "variant": {"name": f"kill/{trim}/2MiB", "mode": "kill", "trim": trim, "reuse": reuse, "importers": 3},
        "baseline_free": base,
        "rounds": [
            {"round": i + 1, "free_end": base + int(d * MiB), "expected_bytes": 0} for i, d in enumerate(rounds or [])
        ],
        "phases": {p: {"free": None if d is None else base + int(d * MiB)} for p, d in (phases or {}).items()},
        "pool_after_trim": {"reserved": 0},
    }
    return repro.finalize(report)


ALL = ("after_last_round", "after_trim", "after_destroy", "after_fd_close", "after_sync_sleep", "after_recreate")


def phases_of(*deltas: float | None) -> dict[str, float | None]:
    return dict(zip(ALL, deltas, strict=True))


def test_one_granule_is_never_judged() -> None:
    summary = fake_report(phases=phases_of(-2, -2, -2, -2, -2, -2), rounds=[-2, 0, -2])["summary"]
    assert summary["code"] == "none" and summary["short_rounds"] == 0


@pytest.mark.parametrize(
    ("deltas", "code"),
    [
        ((0, 0, 0, 0, 0, 0), "none"),
        ((-32, -32, 0, 0, 0, 0), "back-at-after_destroy"),
        ((-64, -64, -64, 0, 0, 0), "back-at-after_fd_close"),
        ((-32, -32, -32, -32, 0, 0), "back-at-after_sync_sleep"),
        ((-32, -32, -32, -32, -32, 0), "back-at-after_recreate"),
        ((-32, -32, -32, -32, -32, -32), "kept"),
        ((-32, -32, -32, -32, -32, None), "kept"),
        ((-4, -4, -4, -4, -4, -4), "kept"),
    ],
)
def test_verdict_names_the_phase_that_gives_memory_back(deltas: tuple, code: str) -> None:
    report = fake_report(phases=phases_of(*deltas))
    assert report["summary"]["code"] == code, report["summary"]
    assert report["phases"]["after_trim"]["delta_mib"] == deltas[1]
    if code == "kept":
        assert "owner's life" in report["summary"]["verdict"]


def test_last_round_is_not_judged_when_the_pool_is_expected_to_hold_memory() -> None:
    for trim, reuse in (("end", False), ("never", False), ("every-round", True)):
        summary = fake_report(trim, phases_of(-8, 0, 0, 0, 0, 0), reuse=reuse)["summary"]
        assert summary["code"] == "none" and "after_last_round" not in summary["judged_phases"], (trim, reuse)
    assert fake_report("every-round", phases_of(-8, 0, 0, 0, 0, 0))["summary"]["code"] == "back-at-after_trim"


def test_trim_never_skips_the_trim_phase() -> None:
    report = fake_report("never", phases_of(-8, None, -32, 0, 0, None))
    assert report["summary"]["code"] == "back-at-after_fd_close"
    assert report["phases"]["after_trim"]["delta_mib"] is None


def test_intermittent_and_gained_are_said() -> None:
    summary = fake_report(phases=phases_of(-32, 0, -32, 0, 0, 0))["summary"]
    assert summary["code"] == "back-at-after_fd_close" and "intermittent" in summary["verdict"]
    assert "note" in fake_report(phases=phases_of(0, 0, 8, 0, 0, 0))["summary"]


def test_rounds_summary_counts_expected_bytes_back() -> None:
    report = fake_report(phases=phases_of(0, 0, 0, 0, 0, 0), rounds=[0, -2, -32, -64])
    summary = report["summary"]
    assert (summary["first_short_round"], summary["short_rounds"], summary["worst_round_delta_mib"]) == (3, 2, -64)
    report["rounds"][3]["expected_bytes"] = 64 * MiB  # e.g. the pool's reserve with the trim at the end
    repro.finalize(report)
    assert report["rounds"][3]["delta_mib"] == 0 and report["rounds"][3]["raw_delta_bytes"] == -64 * MiB
    assert report["summary"]["worst_round_delta_mib"] == -32


def test_no_baseline_means_unmeasured() -> None:
    report = fake_report(phases=phases_of(0, 0, 0, 0, 0, 0))
    report["baseline_free"] = None
    assert repro.finalize(report)["summary"]["code"] == "unmeasured"


def entry(name: str, report: dict | None = None, **extra: object) -> dict:
    return {"name": name, **({"report": report} if report is not None else {}), **extra}


def test_table_has_every_phase_and_only_judged_values() -> None:
    kept = fake_report(phases=phases_of(-64, -64, -64, -64, -64, -64), rounds=[0, -64])
    clean = fake_report(phases=phases_of(-2, 0, 0, 0, 0, 0), rounds=[0, -1])
    table = repro.format_table(
        [
            entry("kill/every-round/2MiB", kept, owner_exit_delta_mib=-64.0),
            entry("exit+frees/every-round/2MiB", clean, owner_exit_delta_mib=0.0),
            entry("kill/end/32MiB", skipped="time budget (3 s left, about 60 s needed)"),
            entry("exit/end/2MiB", error="importer 12 failed:\nTraceback ..."),
        ]
    )
    lines = table.splitlines()
    assert "2 MiB granule" in lines[0]
    for title in ("rounds", "worst round", "last round", "trim", "destroy", "fd close", "sync+sleep", "recreate"):
        assert title in lines[1]
    kill_row, clean_row = lines[2].split(), lines[3].split()
    assert kill_row[:10] == ["kill/every-round/2MiB", "2/3", "-64", "-64", "-64", "-64", "-64", "-64", "-64", "-64"]
    assert clean_row[:10] == ["exit+frees/every-round/2MiB", "2/3", "0", "0", "0", "0", "0", "0", "0", "0"]
    assert "owner's life" in lines[2] and "no shortfall" in lines[3]
    assert "skipped: time budget" in lines[4] and "ERROR: importer 12 failed:" in lines[5]
    # Columns line up: every full row has the verdict at the same place.
    assert lines[2].index("kept") == lines[3].index("no shortfall")


def test_interpretation_tells_driver_from_gpushare() -> None:
    def made(mode: str, frees: bool, deltas: tuple) -> dict:
        report = fake_report(phases=phases_of(*deltas))
        report["variant"].update(mode=mode, importer_frees=frees)
        return entry(f"{mode}{'+frees' if frees else ''}", report)

    gone = (-32, -32, 0, 0, 0, 0)
    clean = (0, 0, 0, 0, 0, 0)
    lines = repro.interpret([made("kill", False, gone), made("exit", True, clean), made("exit", False, gone)])
    assert lines[0].startswith("REPRODUCED") and "driver's" in lines[0]
    assert any("destroyed" in line for line in lines) and any("exit without freeing" in line for line in lines)
    lines = repro.interpret([made("kill", False, clean), made("exit", True, clean)])
    assert lines[0].startswith("NOT reproduced") and "gpushare" in lines[0]
    lines = repro.interpret([made("kill", False, (-32,) * 6), made("exit", True, (-32,) * 6)])
    assert "even when importers free" in lines[0] and any("owner process's life" in line for line in lines)
    assert "no clean control" in repro.interpret([made("kill", False, gone)])[0]
    assert repro.interpret([made("exit", True, clean)])[0].startswith("No kill variant")
    lost = made("kill", False, clean)
    lost["owner_exit_delta_mib"] = -32.0
    assert any("after the owner process itself exited" in line for line in repro.interpret([lost]))


def test_write_json_is_atomic_and_valid(tmp_path) -> None:
    path = tmp_path / "sub" / "report.json"
    report = fake_report(phases=phases_of(0, 0, 0, 0, 0, 0), rounds=[0])
    repro.write_json(str(path), report)
    assert json.loads(path.read_text())["summary"]["code"] == "none"
    with pytest.raises(ValueError):
        repro.write_json(str(path), {"bad": float("nan")})
    assert json.loads(path.read_text())["summary"]["code"] == "none"  # the old file is untouched
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temporary file left


def test_kill_all_kills_and_reaps_what_is_left(reap: list) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]
    reap.extend(procs)
    for proc in procs:
        proc.start()
    procs[0].kill()
    procs[0].join(10)
    repro.kill_all(procs)  # one already reaped, one running
    assert [p.exitcode for p in procs] == [-9, -9]


# -- the whole script, as a subprocess with the fake driver ------------------------------------------

FAST = ["--settle", "0.05", "--end-sleep", "0", "--no-smi", "--child-timeout", "30"]


def run_script(args: list[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CUDA_", "CUDA_POOL_REPRO_"))}
    environ.update(env)
    return subprocess.run([sys.executable, SCRIPT, *args], env=environ, capture_output=True, text=True, timeout=timeout)


def run_fake(args: list[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (FOLDER, os.environ.get("PYTHONPATH", "")) if p)
    return run_script(args, timeout, CUDA_POOL_REPRO_DRIVER="fake_driver", PYTHONPATH=path, **env)


def gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_complete(report: dict, importers: int) -> None:
    assert report["error"] is None
    assert isinstance(report["baseline_free"], int)
    assert len(report["rounds"]) == importers
    for rnd in report["rounds"]:
        for key in ("free_start", "free_allocated", "free_child_ready", "free_child_gone", "free_end"):
            assert isinstance(rnd[key], int), (key, rnd)
    for phase in ALL:
        assert isinstance(report["phases"][phase]["free"], int), phase
        assert isinstance(report["phases"][phase]["delta_mib"], float), phase
    assert all(gone(pid) for pid in report["children"])


def test_kill_run_with_the_fake_driver(tmp_path) -> None:
    path = tmp_path / "kill.json"
    done = run_fake(["--importers", "3", "--recreate", "--json", str(path), *FAST])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(path.read_text())
    assert_complete(report, 3)
    assert [r["exitcode"] for r in report["rounds"]] == [-9, -9, -9]
    assert report["warmup_round"]["exitcode"] == 0 and len(report["children"]) == 4
    assert report["summary"]["code"] == "none"
    assert "round 3/3" in done.stdout and "2 MiB steps" in done.stdout and "verdict: no shortfall" in done.stdout


def test_a_simulated_driver_leak_is_a_finding_with_exit_0(tmp_path) -> None:
    leak = {"FAKE_CUDA_LEAK_PER_IMPORT": str(16 * MiB)}
    kill = run_fake(["--importers", "2", "--recreate", "--json", str(tmp_path / "k.json"), *FAST], **leak)
    assert kill.returncode == 0, kill.stdout + kill.stderr
    report = json.loads((tmp_path / "k.json").read_text())
    assert report["summary"]["code"] == "back-at-after_destroy" and report["summary"]["first_short_round"] == 1
    assert report["phases"]["after_trim"]["delta_mib"] == -128.0
    args = ["--mode", "exit", "--importer-frees", "--reuse", "--recreate", "--json", str(tmp_path / "e.json")]
    clean = run_fake(["--importers", "2", *args, *FAST], **leak)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    report = json.loads((tmp_path / "e.json").read_text())
    assert_complete(report, 2)
    assert report["summary"]["code"] == "none" and [r["exitcode"] for r in report["rounds"]] == [0, 0]


def test_an_importers_driver_error_comes_back_by_name(tmp_path) -> None:
    path = tmp_path / "r.json"
    done = run_fake(["--importers", "3", "--json", str(path), *FAST], FAKE_CUDA_FAIL="cuMemPoolImportPointer@importer")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cuMemPoolImportPointer failed with CUDA_ERROR_INVALID_VALUE" in done.stderr
    assert "Traceback" in done.stderr  # the importer's own
    report = json.loads(path.read_text())
    assert "CUDA_ERROR_INVALID_VALUE" in report["error"] and report["children"]
    assert all(gone(pid) for pid in report["children"])


def test_an_owner_driver_error_exits_1(tmp_path) -> None:
    done = run_fake(["--importers", "2", *FAST], FAKE_CUDA_FAIL="cuMemPoolTrimTo@owner")
    assert done.returncode == 1 and "cuMemPoolTrimTo failed with CUDA_ERROR_INVALID_VALUE" in done.stderr


def test_a_hung_importer_is_killed_after_its_timeout(tmp_path) -> None:
    path = tmp_path / "r.json"
    started = time.monotonic()
    args = ["--importers", "3", "--json", str(path), *FAST, "--child-timeout", "2"]
    done = run_fake(args, FAKE_CUDA_HANG="cuMemPoolImportFromShareableHandle@importer")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "timed out" in done.stderr and time.monotonic() - started < 60
    report = json.loads(path.read_text())
    assert report["children"] and all(gone(pid) for pid in report["children"])


def test_no_driver_is_a_clear_error_and_exit_3() -> None:
    started = time.monotonic()
    done = run_fake(["--importers", "2"], FAKE_CUDA_NO_DRIVER="1")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no NVIDIA driver library was found" in done.stderr and time.monotonic() - started < 30


def test_no_gpu_with_the_real_bindings_is_a_clear_error_and_exit_3() -> None:
    from gpushare import _cuda

    if _cuda.available():
        pytest.skip("this machine has a GPU")
    started = time.monotonic()
    done = run_script(["--importers", "2"])
    assert done.returncode == 3, done.stdout + done.stderr
    assert "error:" in done.stderr and ("no usable GPU" in done.stderr or "cuda-bindings" in done.stderr)
    assert time.monotonic() - started < 30


def test_help_says_what_it_measures() -> None:
    done = run_script(["--help"], timeout=30)
    assert done.returncode == 0 and "--matrix" in done.stdout and "2 MiB" in done.stdout


def test_matrix_with_the_fake_driver(tmp_path) -> None:
    path = tmp_path / "matrix.json"
    only = "kill/every-round/2MiB,exit+frees/every-round/2MiB,exit/every-round/2MiB"
    args = ["--matrix", "--importers", "2", "--sizes", "2MiB", "--only", only, "--json", str(path), *FAST]
    done = run_fake(args, timeout=120, FAKE_CUDA_LEAK_PER_IMPORT=str(8 * MiB))
    assert done.returncode == 0, done.stdout + done.stderr
    matrix = json.loads(path.read_text())
    assert [r["name"] for r in matrix["results"]] == only.split(",")
    for res in matrix["results"]:
        assert res["returncode"] == 0 and res["owner_exit_delta_mib"] == 0.0
        assert_complete(res["report"], 2)
        assert res["report"]["phases"]["after_recreate"]["free"] is not None  # the matrix always recreates
    codes = [r["report"]["summary"]["code"] for r in matrix["results"]]
    assert codes == ["back-at-after_destroy", "none", "back-at-after_destroy"]
    assert matrix["interpretation"][0].startswith("REPRODUCED")
    assert matrix["table"] in done.stdout and "* REPRODUCED" in done.stdout


def test_matrix_skips_what_does_not_fit_and_fails_when_nothing_ran(tmp_path) -> None:
    path = tmp_path / "matrix.json"
    done = run_fake(["--matrix", "--importers", "50", "--max-seconds", "20", "--json", str(path), *FAST])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no variant fit" in done.stderr
    matrix = json.loads(path.read_text())
    assert matrix["results"] and all("time budget" in r["skipped"] for r in matrix["results"])


def test_matrix_without_a_driver_exits_3() -> None:
    done = run_fake(["--matrix", "--importers", "2"], FAKE_CUDA_NO_DRIVER="1")
    assert done.returncode == 3 and "no usable GPU" in done.stderr


# -- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(400)
def test_the_repro_runs_on_the_real_driver(tmp_path) -> None:
    """Measures every phase (not any particular shortfall: that is what the script is for)."""
    path = tmp_path / "gpu.json"
    args = ["--importers", "5", "--size", "2MiB", "--mode", "kill", "--recreate", "--json", str(path)]
    done = run_script([*args, "--max-seconds", "240"], timeout=300)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(path.read_text())
    assert_complete(report, 5)
    assert [r["exitcode"] for r in report["rounds"]] == [-9] * 5
    assert report["environment"]["driver_module"] == "cuda.bindings.driver"
    assert report["summary"]["code"] not in (None, "unmeasured")
