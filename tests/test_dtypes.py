"""bfloat16 and the float8 kinds, in every constructor and across processes, through ml_dtypes.

NumPy lacks the dtypes torch and JAX share for weights; ml_dtypes (the package JAX uses) gives
them to it. A Manager makes buffers of them by name or by type, a descriptor carries them by
name, DLPack exports them with their own type codes, and without ml_dtypes each constructor
refuses them with one message that names the fix.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import start, subprocess_env

import gpushare as mp
from gpushare._memory import EXTENSION_DTYPES

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install ml_dtypes)")

NAMES = sorted(EXTENSION_DTYPES)


def read_back(q, out) -> None:
    buf = q.get(timeout=30)
    out.put((buf.dtype.name, buf.numpy().astype(np.float32).tolist()))
    buf.release()


@pytest.mark.parametrize("name", NAMES)
def test_every_constructor_takes_it_by_name_and_by_type(manager, name) -> None:
    kind = getattr(ml_dtypes, name)
    values = np.array([0.5, 1.0, 2.0, 4.0], dtype=np.float32).astype(kind)
    made = [
        manager.empty((4,), name, device="cpu"),
        manager.zeros((4,), kind, device="cpu"),
        manager.full((4,), 2.0, name, device="cpu"),
        manager.from_numpy(values, device="cpu"),
    ]
    for buf in made:
        assert buf.dtype == np.dtype(kind) and buf.dtype.name == name
        assert buf.nbytes == 4 * np.dtype(kind).itemsize
    assert not made[1].numpy().view(np.uint8).any()  # zeros: zero bytes (float8_e8m0fnu has no 0.0)
    assert made[2].numpy().astype(np.float32).tolist() == [2.0] * 4
    assert made[3].numpy().astype(np.float32).tolist() == values.astype(np.float32).tolist()


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_it_travels_to_another_process_by_name(manager, reap, name) -> None:
    values = np.array([0.5, 1.0, 2.0, 4.0], dtype=np.float32)
    buf = manager.from_numpy(values.astype(getattr(ml_dtypes, name)), device="cpu")
    q, out = mp.Queue(), mp.Queue()
    start(reap, read_back, q, out)
    q.put(buf)
    assert out.get(timeout=60) == (name, values.tolist())


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_dlpack_gives_torch_its_own_dtype(manager, name) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not hasattr(torch, name):
        pytest.skip(f"this torch has no {name}")
    values = np.array([0.5, 1.0, 2.0, 4.0], dtype=np.float32)
    buf = manager.from_numpy(values.astype(getattr(ml_dtypes, name)), device="cpu")
    tensor = torch.from_dlpack(buf)
    assert tensor.dtype == getattr(torch, name)
    assert tensor.float().tolist() == values.tolist()


WITHOUT = """
import sys
sys.modules["ml_dtypes"] = None  # as where it is not installed
import gpushare as mp
with mp.Manager() as manager:
    for make in (lambda: manager.empty((4,), "bfloat16", device="cpu"),
                 lambda: manager.zeros((4,), "float8_e4m3fn", device="cpu"),
                 lambda: manager.full((4,), 1.0, "bfloat16", device="cpu")):
        try:
            make()
            print("made")
        except ValueError as exc:
            print(exc)
"""


def test_without_ml_dtypes_every_constructor_says_what_to_install() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT], env=subprocess_env(), capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        assert "needs the ml_dtypes package" in line and "pip install ml_dtypes" in line, line
