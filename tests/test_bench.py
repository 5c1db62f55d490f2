"""The benchmark package: its scenario registry, and a short real run of the CLI on the host.

The run spawns real consumers (the floors and the host backend run on any machine) and
checks the three report files' shape, not the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.bench import cli
from gpushare.bench.scenarios import MODULES, scenario_modules

ROOT = Path(__file__).resolve().parent.parent


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
        "gpushare.bench",
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
    markdown = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
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
    report = json.loads((tmp_path / "benchmarks.json").read_text(encoding="utf-8"))
    assert list(report["scenarios"]) == ["floors", "host"]
    host = report["scenarios"]["host"]
    assert "gpushare (in place)" in json.dumps(host)
    assert ": ERROR" not in done.stderr, done.stderr
