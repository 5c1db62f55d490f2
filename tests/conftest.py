"""Test configuration: GPU marker, --require-gpu, and process hygiene.

* ``@pytest.mark.gpu`` tests skip with a reason when no GPU is usable; with
  ``--require-gpu`` that skip becomes a failure, so a GPU run cannot pass by
  skipping.
* Every test that starts processes uses the ``reap`` fixture (or the
  helpers here), which kills whatever a test left running, so a stuck child
  cannot wedge the suite; pytest-timeout bounds each test.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator

import pytest

import gpushare as mp
from gpushare import _cuda


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=False,
        help="fail, instead of skipping, GPU tests when no GPU is usable",
    )
    parser.addoption(
        "--soak",
        type=int,
        default=2000,
        metavar="N",
        help="handoffs per backend in the soak test (default 2000; the GPU run uses 100000)",
    )
    parser.addoption(
        "--soak-report",
        default=None,
        metavar="PATH",
        help="append the soak test's figures to this file, one JSON object per backend",
    )
    parser.addoption(
        "--require-multigpu",
        action="store_true",
        default=False,
        help="fail, instead of skipping, two-GPU tests when fewer than two GPUs are usable",
    )


def _gpu_count() -> int:
    try:
        return _cuda.device_count()
    except mp.NoDeviceError:
        return 0


_GPUS: int | None = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _GPUS
    need = 2 if "multigpu" in item.keywords else 1 if "gpu" in item.keywords else 0
    if not need:
        return
    if _GPUS is None:
        _GPUS = _gpu_count()
    if _GPUS < need:
        reason = f"needs {need} GPU(s); this machine has {_GPUS}"
        option = "--require-multigpu" if need == 2 else "--require-gpu"
        if item.config.getoption(option):
            pytest.fail(f"{option}: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def reap() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """A list to put started processes in; survivors are killed after the test."""
    procs: list[multiprocessing.process.BaseProcess] = []
    yield procs
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


@pytest.fixture
def manager() -> Iterator[mp.BufferManager]:
    with mp.Manager(release_timeout=2.0) as m:
        yield m


#: The backends every contract and fault test runs on: host everywhere, CUDA ones on a GPU.
BACKENDS = [
    pytest.param("host", id="host"),
    pytest.param("cuda_ipc", id="cuda_ipc", marks=pytest.mark.gpu),
    pytest.param("cuda_vmm", id="cuda_vmm", marks=pytest.mark.gpu),
    pytest.param("cuda_pool", id="cuda_pool", marks=pytest.mark.gpu),
]
CUDA_BACKENDS = [p for p in BACKENDS if p.id != "host"]


def device_for(backend: str) -> int | str:
    return "cpu" if backend == "host" else 0


def guarded(fn: Callable[..., object], out: object, *args: object) -> None:
    """A worker's target: run ``fn(out, *args)``; a failure goes to ``out`` as
    ``("error", traceback)`` (and is raised), so the test can show it."""
    try:
        fn(out, *args)
    except BaseException:
        out.put(("error", traceback.format_exc()))  # type: ignore[attr-defined]
        raise


def recv(out: object, timeout: float = 60.0, waiting_for: str = "a worker's answer") -> tuple[object, ...]:
    """The next message a ``guarded`` worker sent; its traceback fails the test."""
    try:
        msg = out.get(timeout=timeout)  # type: ignore[attr-defined]
    except queue.Empty:
        pytest.fail(f"no answer within {timeout} s while waiting for {waiting_for}")
    if msg[0] == "error":
        pytest.fail(f"worker failed:\n{msg[1]}")
    return msg  # type: ignore[no-any-return]


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.02) -> None:
    """Poll until ``predicate()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


@pytest.fixture(autouse=True)
def _no_inherited_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests say which device they want; a developer's environment must not change that.
    for var in ("GPUSHARE_BACKEND", "GPUSHARE_DEVICE"):
        if var in os.environ:
            monkeypatch.delenv(var)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fill_behind_a_running_kernel(torch: object, tensor: object, value: float) -> None:
    """Queue ``tensor.fill_(value)`` behind a long kernel on the default stream, still
    running on return: what an ordering test must see its receiver wait for. Sleeps
    longer each try; fails the test if the GPU outruns every try."""
    for attempt in range(4):
        torch.cuda._sleep(3_000_000_000 << attempt)  # type: ignore[attr-defined]
        tensor.fill_(value)  # type: ignore[attr-defined]
        if not torch.cuda.current_stream().query():  # type: ignore[attr-defined]
            return
        tensor.zero_()  # type: ignore[attr-defined]
        torch.cuda.synchronize()  # type: ignore[attr-defined]
    pytest.fail("could not keep a producer kernel running long enough to test anything")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: gpushare importable from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env
