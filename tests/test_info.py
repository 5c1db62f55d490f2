"""``python -m gpushare info``: runs in a fresh interpreter, with or without a GPU.

The command is run in a subprocess (as a user would), so these tests never
initialise CUDA in the test process. They check what holds on any machine,
and the consistency of what the command reports with a GPU.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import gpushare
from gpushare import _backends

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 60


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def info_json() -> dict:
    proc = _run("info", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_info_text_exits_zero_and_names_everything() -> None:
    proc = _run("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in ("gpushare", "python", "cuda-bindings", "driver", "start method", "SCM_RIGHTS", "backends"):
        assert label in out, f"{label!r} missing from:\n{out}"
    assert gpushare.__version__ in out
    assert platform.python_version() in out
    assert "host" in out and "cuda_ipc" in out
    assert "devices" in out and "peer access" in out
    assert "Traceback" not in proc.stderr


def test_info_json_versions_and_start_method(info_json: dict) -> None:
    assert info_json["gpushare"] == gpushare.__version__
    assert info_json["python"] == platform.python_version()
    assert isinstance(info_json["cuda_bindings"], str) and info_json["cuda_bindings"]
    assert info_json["start_method"] == "spawn"


def test_info_json_scm_rights_works_on_linux(info_json: dict) -> None:
    scm = info_json["scm_rights"]
    assert set(scm) == {"works", "error"}
    if sys.platform.startswith("linux"):
        assert scm["works"] is True, scm["error"]


def test_info_json_backends(info_json: dict) -> None:
    backends = info_json["backends"]
    assert list(backends) == list(_backends.BACKENDS)
    assert backends["host"]["available"] is True
    assert backends["host"]["cuda"] is False
    assert backends["cuda_ipc"]["cuda"] is True
    # cuda_ipc is offered exactly when a GPU is there.
    assert backends["cuda_ipc"]["available"] is bool(info_json["devices"])


def test_info_json_driver_devices_and_peers_agree(info_json: dict) -> None:
    driver = info_json["driver"]
    devices = info_json["devices"]
    if not driver["available"]:
        # No driver: the NoDeviceError message explains it, and nothing else is claimed.
        assert driver["error"]
        assert devices == []
        assert info_json["peer_access"] == []
        return
    assert isinstance(driver["version"], int) and driver["version"] > 0
    assert driver["version_string"].count(".") == 1
    assert [d["ordinal"] for d in devices] == list(range(len(devices)))
    for d in devices:
        assert "error" not in d, d
        assert d["uuid"].startswith("GPU-") and len(d["uuid"]) == 40
        assert d["name"]
        assert d["total_memory"] > 0
        assert "cuda_ipc" in d["backends"]
        # gpushare's copy kernel: built here (NVRTC), or off with the reason
        assert d["copy_kernel"] == "ready" or d["copy_kernel"].startswith("off: "), d["copy_kernel"]
    assert len({d["uuid"] for d in devices}) == len(devices)
    matrix = info_json["peer_access"]
    assert len(matrix) == len(devices)
    for i, row in enumerate(matrix):
        assert len(row) == len(devices)
        assert row[i] is None
        assert all(isinstance(c, bool) for j, c in enumerate(row) if j != i)


def test_unknown_subcommand_prints_usage_and_exits_2() -> None:
    proc = _run("bogus")
    assert proc.returncode == 2
    assert "usage" in proc.stderr.lower()
    assert "info" in proc.stderr


def test_no_subcommand_prints_usage_and_exits_2() -> None:
    proc = _run()
    assert proc.returncode == 2
    assert "usage" in proc.stderr.lower()
