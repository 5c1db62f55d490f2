"""One contract, every backend: the same tests against host, cuda_ipc, cuda_vmm and cuda_pool.

The host backend runs everywhere (CI included); the CUDA backends are
marked ``gpu`` and run on a GPU machine (``--require-gpu``). Multi-GPU
cases (a consumer on another GPU, or seeing the GPUs in another order) are
marked ``multigpu`` too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import BACKENDS, CUDA_BACKENDS, device_for, guarded, recv, wait_until

import gpushare as mp
from gpushare import _backends

TIMEOUT = 60

# -- workers ---------------------------------------------------------------------------


def w_negate(out, jobs, backend) -> None:
    buf = jobs.get(timeout=TIMEOUT)
    seen = buf.numpy().copy()  # numpy() is a view on the host backend
    buf.copy_from(-seen)
    out.put(("done", seen, buf.backend, buf.device, buf.device_uuid, _backends.get(backend).opens))
    buf.release()


def w_hold_many(out, jobs, backend, n) -> None:
    held = [jobs.get(timeout=TIMEOUT) for _ in range(n)]
    out.put(("held", len({b.ptr for b in held}), _backends.get(backend).opens))
    for b in held:
        b.release()
    again = jobs.get(timeout=TIMEOUT)  # the recycled allocation
    out.put(("again", float(again.numpy().ravel()[0]), _backends.get(backend).opens))
    again.release()
    jobs.get(timeout=TIMEOUT)  # stay alive (mapping retained) until told to go


def w_sum(out, jobs) -> None:
    buf = jobs.get(timeout=TIMEOUT)
    out.put(("sum", float(buf.numpy().astype(np.float64).sum())))
    buf.release()


# -- helpers ---------------------------------------------------------------------------


def start(reap, fn, out, *args, device=None, env=None):
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


# -- the contract ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_operations(manager, backend) -> None:
    dev = device_for(backend)
    buf = manager.full((3, 5), 1.5, "float32", device=dev, backend=backend)
    assert buf.backend == backend
    np.testing.assert_array_equal(buf.numpy(), np.full((3, 5), 1.5, np.float32))
    buf.copy_from(np.arange(15).reshape(3, 5))
    np.testing.assert_array_equal(buf.numpy(), np.arange(15).reshape(3, 5))
    kept = []
    for dtype, value in (("float16", 2.5), ("float64", -1.25), ("int8", 7), ("complex64", 1 - 2j)):
        kept.append(manager.full((9,), value, dtype, device=dev, backend=backend))
        np.testing.assert_array_equal(kept[-1].numpy(), np.full(9, value, dtype))
    assert manager.stats()["backends"] == {backend: 5}


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_cross_both_ways(manager, reap, backend) -> None:
    src = np.arange(1000, dtype=np.float32)
    buf = manager.from_numpy(src, device=device_for(backend), backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    start(reap, w_negate, out, jobs, backend)
    jobs.put(buf)
    _, seen, name, device, uuid, opens = recv(out)
    np.testing.assert_array_equal(seen, src)
    assert name == backend and opens == 1
    assert device == buf.device and uuid == buf.device_uuid
    np.testing.assert_array_equal(buf.numpy(), -src)
    wait_until(lambda: manager.stats()["leases"] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_open_once_and_recycled_allocation_costs_no_open(manager, reap, backend) -> None:
    dev = device_for(backend)
    buf = manager.full((64,), 3.0, device=dev, backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    start(reap, w_hold_many, out, jobs, backend, 5)
    for _ in range(5):
        jobs.put(buf)
    assert recv(out)[1:] == (1, 1)  # one pointer, one open
    wait_until(lambda: manager.stats()["leases"] == 0)
    buf.release()
    recycled = manager.full((64,), 4.0, device=dev, backend=backend)
    assert manager.stats()["reused"] == 1
    jobs.put(recycled)
    assert recv(out)[1:] == (4.0, 1)
    jobs.put("go")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fan_out_and_trim_unmaps_everywhere(manager, reap, backend) -> None:
    buf = manager.full((256, 256), 2.0, device=device_for(backend), backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    procs = [start(reap, w_sum, out, jobs) for _ in range(4)]
    for _ in procs:
        jobs.put(buf)
    assert [recv(out)[1] for _ in procs] == [2.0 * 256 * 256] * 4
    for proc in procs:
        proc.join(timeout=TIMEOUT)
        assert proc.exitcode == 0
    wait_until(lambda: manager.stats()["leases"] == 0)
    buf.release()
    assert manager.trim() == mp.GRANULARITY  # freed, no LeakWarning (filterwarnings=error)
    assert manager.stats()["bytes_allocated"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_trim_while_a_live_worker_retains_the_mapping(manager, reap, backend) -> None:
    buf = manager.full((64,), 5.0, device=device_for(backend), backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    start(reap, w_hold_many, out, jobs, backend, 1)
    jobs.put(buf)
    recv(out)
    wait_until(lambda: manager.stats()["leases"] == 0)
    buf.release()
    # The worker still has the allocation mapped (retained for reuse): trim asks it to unmap first.
    assert manager.trim() == mp.GRANULARITY
    jobs.put(manager.full((64,), 6.0, device=device_for(backend), backend=backend))
    assert recv(out)[1:] == (6.0, 2)  # a new allocation: a second open
    jobs.put("go")


@pytest.mark.parametrize("backend", ["cuda_ipc", "cuda_vmm", "cuda_pool"])
def test_cuda_backend_with_a_host_device_is_refused(manager, backend) -> None:
    with pytest.raises(mp.BackendUnavailableError, match="device='cpu'"):
        manager.empty((4,), device="cpu", backend=backend)


def test_manager_default_backend_and_per_allocation_override() -> None:
    with mp.Manager(backend="host") as m:
        assert m.empty((2,), device="cpu").backend == "host"
        with pytest.raises(mp.BackendUnavailableError, match="shares host memory"):
            m.empty((2,), device=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_ipc", "cuda_vmm", "cuda_pool"])
def test_manager_backend_option_picks_cuda_backend(backend) -> None:
    with mp.Manager(backend=backend) as m:
        default = m.empty((2,), device=0)
        override = m.empty((2,), device=0, backend="cuda_ipc")
        assert default.backend == backend and override.backend == "cuda_ipc"
        assert m.stats()["backends"] == ({backend: 2} if backend == "cuda_ipc" else {backend: 1, "cuda_ipc": 1})


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_consumer_on_the_other_gpu_reads_and_writes(manager, reap, backend) -> None:
    src = np.arange(4096, dtype=np.float32)
    buf = manager.from_numpy(src, device=0, backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    start(reap, w_negate, out, jobs, backend, device=1)
    jobs.put(buf)
    _, seen, _, device, uuid, _ = recv(out)
    np.testing.assert_array_equal(seen, src)
    assert device == 0 and uuid == buf.device_uuid
    np.testing.assert_array_equal(buf.numpy(), -src)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize(("visible", "expect_device"), [("1,0", 1), ("1", 0)])
def test_device_identity_travels_by_uuid(manager, reap, backend, visible, expect_device) -> None:
    # With CUDA_VISIBLE_DEVICES="1,0" the buffer's GPU is ordinal 1 in the consumer; with "1" it
    # is hidden and the consumer (bound to its ordinal 0, the other GPU) maps it as a peer.
    src = np.arange(2048, dtype=np.float32)
    buf = manager.from_numpy(src, device=0, backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    start(reap, w_negate, out, jobs, backend, device=0, env={"CUDA_VISIBLE_DEVICES": visible})
    jobs.put(buf)
    _, seen, _, device, uuid, _ = recv(out)
    np.testing.assert_array_equal(seen, src)
    assert device == expect_device
    assert uuid == buf.device_uuid
    np.testing.assert_array_equal(buf.numpy(), -src)
