"""Test configuration: GPU marker, --require-gpu, and process hygiene.

* ``@pytest.mark.gpu`` tests skip with a reason when no GPU is usable; with
  ``--require-gpu`` that skip becomes a failure, so a GPU run cannot pass by
  skipping.
* Every test that starts processes uses the ``reap`` fixture (or the
  helpers here), which kills whatever a test left running, so a stuck child
  cannot wedge the suite; pytest-timeout bounds each test.
* The helpers more than one test file uses live here, and only here
  (``test_layers.py`` checks that no two test files define the same one);
  worker targets more than one file starts are in ``workers.py``.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from workers import w_unpickle_and_sum

import gpushare as mp
from gpushare import _cuda, _service


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


def recv(
    out: object,
    *procs: multiprocessing.process.BaseProcess,
    timeout: float = 60.0,
    waiting_for: str = "a worker's answer",
) -> tuple[object, ...]:
    """The next message a ``guarded`` worker sent; its traceback fails the test. A
    timeout names the exit codes of ``procs``, the workers that should have answered."""
    try:
        msg = out.get(timeout=timeout)  # type: ignore[attr-defined]
    except queue.Empty:
        codes = f" (exit codes {[p.exitcode for p in procs]})" if procs else ""
        pytest.fail(f"no answer within {timeout} s while waiting for {waiting_for}{codes}")
    if msg[0] == "error":
        pytest.fail(f"worker failed:\n{msg[1]}")
    return msg  # type: ignore[no-any-return]


#: Seconds a child Python takes to start and exit on an unloaded machine (about 0.05 on the
#: 2-core development machine, 0.1 on the GPU machines): what :func:`assert_prompt` scales by.
IDLE_START = 0.1


def assert_prompt(elapsed: float, bound: float, what: str, cap: float | None = None) -> None:
    """Assert that ``elapsed`` seconds met ``bound``, a bound for an unloaded machine.

    Past it, the bound is scaled by how much slower than IDLE_START a child Python starts right
    now (a few times on a loaded 2-core machine), never above ``cap``: the time of what the test
    tells the prompt path from (a timeout waited out, a slow close waited behind). A loaded
    machine passes; a hang, or a wait for that other thing, still fails."""
    if elapsed < bound:
        return
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=False, timeout=120)
    start_now = time.monotonic() - started
    scaled = bound * max(1.0, start_now / IDLE_START)
    if cap is not None:
        scaled = min(scaled, cap)
    assert elapsed < scaled, (
        f"{what} took {elapsed:.2f} s: over {bound:g} s, and over {scaled:.2f} s for this machine's load "
        f"now (a child Python started in {start_now:.2f} s)"
    )


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.02) -> None:
    """Poll until ``predicate()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


# -- starting and joining workers --------------------------------------------------------


def start(
    reap: list[multiprocessing.process.BaseProcess], target: Callable[..., object], *args: object, **kwargs: object
) -> multiprocessing.process.BaseProcess:
    """Start ``mp.Process(target=target, args=args, **kwargs)``; ``reap`` kills it if it outlives the test."""
    proc = mp.Process(target=target, args=args, **kwargs)  # type: ignore[arg-type]
    proc.start()
    reap.append(proc)
    return proc


def start_guarded(
    reap: list[multiprocessing.process.BaseProcess],
    fn: Callable[..., object],
    out: object,
    *args: object,
    device: int | str | None = None,
    env: dict[str, str] | None = None,
) -> multiprocessing.process.BaseProcess:
    """Start ``fn(out, *args)`` under :func:`guarded` on ``device``, with ``env`` set
    in the environment it starts with; ``reap`` kills it if it outlives the test."""
    saved = {}
    for key, value in (env or {}).items():  # a spawned child inherits the environment at start()
        saved[key] = os.environ.get(key)
        os.environ[key] = value
    try:
        proc = mp.Process(target=guarded, args=(fn, out, *args), device=device)
        proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    reap.append(proc)
    return proc


def run_guarded(
    reap: list[multiprocessing.process.BaseProcess],
    fn: Callable[..., object],
    *args: object,
    device: int | str | None = None,
) -> object:
    """Start ``fn(out, *args)`` under :func:`guarded` with a new queue ``out``; return the queue."""
    out = mp.Queue()
    start_guarded(reap, fn, out, *args, device=device)
    return out


def join_ok(*procs: multiprocessing.process.BaseProcess, timeout: float = 60.0) -> None:
    """Each worker exits, with exit code 0, within ``timeout`` seconds."""
    for proc in procs:
        proc.join(timeout)
        assert not proc.is_alive(), f"worker {proc.pid} did not exit within {timeout:g} s"
        assert proc.exitcode == 0, f"worker {proc.pid} exited with {proc.exitcode}"


def kill_quietly(pid: int) -> None:
    """SIGKILL ``pid`` if it is still there (what a test leaves that ``reap`` does not know)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def clean_up_after(pid: int, server_pid: int, dirs: list[str]) -> None:
    """Remove what a SIGKILLed producer leaves: its manager server, socket dirs, shared memory."""
    import glob
    import shutil
    from multiprocessing import resource_tracker

    try:  # the server process has nobody left to stop it
        os.kill(server_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(f"/dev/shm/gpushare-{pid}-*"):  # so the resource tracker has nothing to report
        os.unlink(path)
        resource_tracker.unregister("/" + os.path.basename(path), "shared_memory")


def all_gone(pids: list[int]) -> bool:
    """None of ``pids`` is alive (workers, a Manager's server)."""
    return not any(_service.process_alive(pid, sentinel=False) for pid in pids)


# -- Managers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[mp.BufferManager]:
    """One ``owner="server"`` Manager for a whole test module (the loaders' tests)."""
    with mp.Manager(owner="server", release_timeout=2.0) as m:
        yield m


def no_leases(manager: mp.BufferManager) -> bool:
    """No lease of ``manager`` is out, once this process's garbage is collected."""
    gc.collect()
    return manager.stats()["leases"] == 0


def _settled_stats(m: mp.BufferManager) -> dict[str, Any]:
    """``m.stats()`` once its lease count has held still for 0.1 s: a worker that has just
    answered may still be exiting, and the owner drops its leases when its connection closes."""
    stats = m.stats()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = m.stats()
        if now["leases"] == stats["leases"]:
            return now
        stats = now
    return stats


def assert_intact(
    m: mp.BufferManager,
    reap: list[multiprocessing.process.BaseProcess],
    device: int | str = "cpu",
    backend: str | None = None,
) -> None:
    """The Manager still allocates, shares with a worker and recycles, and its counts add up."""
    before = _settled_stats(m)
    buf = m.full((256,), 2.0, "float32", device=device, backend=backend)
    out = run_guarded(reap, w_unpickle_and_sum, pickle.dumps(buf), device=device)
    assert recv(out) == ("ok", 512.0)
    wait_until(lambda: m.stats()["leases"] == before["leases"])
    buf.release()
    after = m.stats()
    assert after["live_buffers"] == before["live_buffers"]
    assert after["leaked_buffers"] == 0 and not after["closed"]


# -- GPU tests ---------------------------------------------------------------------------

GPU_TIMEOUT = 30.0  # seconds, a GPU test's wait for one worker message or exit
MiB = 1 << 20


def require(name: str) -> Any:
    """pytest.importorskip, without letting an import-time warning become an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(name)


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


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A local two-node Ray cluster for one test module (test_ray.py, test_ray_transport.py):
    node "a" (the driver's) with the resource ``node_a``, node "b" with ``node_b`` and
    ``GPUSHARE_NODE_ID`` set, so its workers believe they are on another machine. Workers
    inherit their raylet's environment, which is this process's when the node is added."""
    import ray
    from ray.cluster_utils import Cluster

    from gpushare import ray as gray

    os.environ.pop(gray.NODE_ID_ENV, None)
    env = {"GPUSHARE_BACKEND": "host", "RAY_DEDUP_LOGS": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    os.environ[gray.NODE_ID_ENV] = "simulated-node-b"
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1})
    finally:
        del os.environ[gray.NODE_ID_ENV]
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
