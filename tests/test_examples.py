"""The examples run end to end (host backend here; the GPU run covers CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

EXAMPLES = [
    "fanout.py",
    "producer_consumer.py",
    "pool_map.py",
    "ring_pipeline.py",
    "dataloader_gpu.py",
    "weight_sync.py",
    "train_in_set.py",
]


# examples on a GPU: name -> (what its output says of the device, its "[ok]" lines, whether it needs torch)
GPU_EXAMPLES = {
    "fanout.py": ("backend: cuda_ipc on 0", 4, False),
    "dataloader_gpu.py": ("slots on cuda:0", 3, True),
    "weight_sync.py": ("on GPU 0 (torch", 4, True),
    "train_in_set.py": ("on cuda:0", 2, True),
}


def _run_example(name: str, *args: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**env),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_on_host_backend(name: str) -> None:
    if name == "train_in_set.py":
        pytest.importorskip("torch")  # torch's CPU build is enough
    out = _run_example(name, timeout=120, GPUSHARE_BACKEND="host")
    assert "Traceback" not in out.stderr
    if name == "fanout.py":
        assert "backend: host" in out.stdout
        assert out.stdout.count("[ok]") == 4
        assert "leases outstanding after the workers exited: 0" in out.stdout
    if name == "dataloader_gpu.py":
        assert out.stdout.count("[ok]") >= 2, out.stdout
    if name == "weight_sync.py":
        assert "backend: host (NumPy)" in out.stdout
        assert out.stdout.count("[ok]") == 4, out.stdout  # two copy-mode and two zero-copy engines
        assert "leases outstanding after the engines exited: 0" in out.stdout
    if name == "train_in_set.py":
        assert "backend: host on cpu" in out.stdout
        assert out.stdout.count("(last 20), 0 checksum mismatch(es) [ok]") == 2, out.stdout  # a slow engine skips some
        assert "leases outstanding after the engines exited: 0" in out.stdout


def test_ray_pipeline_example_runs_on_host_backend() -> None:
    pytest.importorskip("ray")
    out = _run_example("ray_pipeline.py", "--batches", "2", timeout=240, GPUSHARE_BACKEND="host")
    assert out.stdout.count("returned as Buffer, same memory: True [ok]") == 2
    assert out.stdout.count("received as ['Buffer']") == 2
    assert "LeakWarning" not in out.stderr and "leaked" not in out.stderr


def test_ray_pipeline_example_without_ray_says_what_to_install() -> None:
    code = (
        "import runpy, sys; sys.modules['ray'] = None; sys.argv = [sys.argv[1]]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "examples", "ray_pipeline.py")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "needs Ray" in out.stderr and "pip install '.[ray]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_EXAMPLES))
def test_example_runs_on_gpu(name: str) -> None:
    device_line, oks, needs_torch = GPU_EXAMPLES[name]
    if needs_torch:
        pytest.importorskip("torch")
    out = _run_example(name, timeout=240)
    assert device_line in out.stdout and out.stdout.count("[ok]") == oks, out.stdout
