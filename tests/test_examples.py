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


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_on_host_backend(name: str) -> None:
    if name == "train_in_set.py":
        pytest.importorskip("torch")  # torch's CPU build is enough
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name)],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(GPUSHARE_BACKEND="host"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
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


@pytest.mark.gpu
def test_fanout_example_runs_on_gpu() -> None:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "fanout.py")],
        capture_output=True,
        text=True,
        timeout=180,
        env=subprocess_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "backend: cuda_ipc on 0" in out.stdout
    assert out.stdout.count("[ok]") == 4


def test_ray_pipeline_example_runs_on_host_backend() -> None:
    pytest.importorskip("ray")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ray_pipeline.py"), "--batches", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(GPUSHARE_BACKEND="host"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("returned as Buffer, same memory: True [ok]") == 2
    assert out.stdout.count("received as ['Buffer']") == 2
    assert "LeakWarning" not in out.stderr and "leaked" not in out.stderr


@pytest.mark.gpu
def test_dataloader_example_runs_on_gpu() -> None:
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "dataloader_gpu.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "slots on cuda:0" in out.stdout
    assert "on cuda:0" in out.stdout and out.stdout.count("[ok]") == 3


@pytest.mark.gpu
def test_weight_sync_example_runs_on_gpu() -> None:
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "weight_sync.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "on GPU 0 (torch" in out.stdout and out.stdout.count("[ok]") == 4, out.stdout


@pytest.mark.gpu
def test_train_in_set_example_runs_on_gpu() -> None:
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_in_set.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=subprocess_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "on cuda:0" in out.stdout and out.stdout.count("0 checksum mismatch(es) [ok]") == 2, out.stdout
