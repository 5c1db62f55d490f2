"""The backends: one contract, every backend; then what each backend does of its own.

The contract: the same tests against host, cuda_ipc, cuda_vmm and cuda_pool.
The host backend runs everywhere (CI included); the CUDA backends are
marked ``gpu`` and run on a GPU machine (``--require-gpu``). Multi-GPU
cases (a consumer on another GPU, or seeing the GPUs in another order) are
marked ``multigpu`` too.

Then, backend by backend: the host backend's open count; the cuda_ipc path
end to end on a real GPU (values both ways, fan-out, one open per
allocation per process, a buffer on the other GPU, and the GIL-keeping
driver queries the CUDA backends use); and cuda_vmm's export of an
allocation's fd ahead of the first request for it. The export promises are
about threads and locks, not about the driver: the first lease starts the
export on a background thread and never waits for one in progress (the
caller holds the owner's lock), each allocation is exported once however
many ask, and a freed allocation is never exported. The two driver calls
involved (``vmm_export``, ``vmm_free``) are replaced there by stand-ins that
record what they were asked; the GPU suite runs the real ones (the contract
and test_faults.py on cuda_vmm).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import (
    BACKENDS,
    CUDA_BACKENDS,
    GPU_TIMEOUT,
    MiB,
    assert_prompt,
    device_for,
    fill_behind_a_running_kernel,
    join_ok,
    recv,
    require,
    start,
    start_guarded,
    wait_until,
)
from workers import w_sum_each

import gpushare as mp
from gpushare import _backends, _cuda
from gpushare._backends import _base, cuda_vmm

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


def w_slow_unmap_then_ask(out, jobs) -> None:
    """Release a buffer, then, while the owner's ``Unmap`` of it is being closed here (for
    1 s: this process's host close is slowed), time a request to the owner."""
    from gpushare import _lifetime
    from gpushare._lifetime._protocol import Stats

    backend = _backends.get("host")
    real, closing = backend.close, threading.Event()

    def slow_close(mapping: Any) -> None:
        closing.set()
        time.sleep(1.0)
        real(mapping)

    backend.close = slow_close  # type: ignore[method-assign]
    buf = jobs.get(timeout=TIMEOUT)
    buf.release()
    out.put(("released",))
    assert closing.wait(TIMEOUT), "the owner never asked this process to unmap"
    (link,) = _lifetime.links()
    start = time.monotonic()
    link.request(Stats)
    out.put(("answered", time.monotonic() - start))
    jobs.get(timeout=TIMEOUT)  # stay alive until told to go


def count_opens(jobs, results, n) -> None:
    held = [jobs.get(timeout=30) for _ in range(n)]
    same = len({b.ptr for b in held}) == 1
    results.put((_backends.get("host").opens, same))
    for b in held:
        b.release()
    again = jobs.get(timeout=30)  # same allocation, recycled or re-sent
    results.put((_backends.get("host").opens, float(again.numpy()[0])))
    again.release()


def _w_roundtrip(out: Any, q: Any, cmd: Any) -> None:
    buf, expected = q.get(timeout=GPU_TIMEOUT)
    seen = bool(np.array_equal(buf.numpy(), expected))
    buf.copy_from(-expected)
    out.put(("written", seen, buf.device, buf.device_uuid, buf.shape, str(buf.dtype)))
    expected2 = cmd.get(timeout=GPU_TIMEOUT)  # the parent wrote again while we hold the buffer
    out.put(("reread", bool(np.array_equal(buf.numpy(), expected2))))
    buf.release()


def _w_fanout(out: Any, q: Any, barrier: Any) -> None:
    buf = q.get(timeout=GPU_TIMEOUT)
    base, size = _cuda.address_range(buf.ptr, buf.device)
    ptr_ok = base == buf.ptr and size >= buf.nbytes
    out.put(("sum", os.getpid(), int(buf.numpy().sum(dtype=np.int64)), ptr_ok))
    barrier.wait(timeout=GPU_TIMEOUT)  # every worker holds its lease until all have mapped
    buf.release()


def _w_opens(out: Any, q: Any) -> None:
    backend = _backends.get("cuda_ipc")
    bufs = [q.get(timeout=GPU_TIMEOUT) for _ in range(10)]
    first_ptr = bufs[0].ptr
    values_ok = all(np.array_equal(b.numpy(), np.full(1024, 3, np.int32)) for b in bufs)
    out.put(("held", backend.opens, len({b.ptr for b in bufs}), values_ok))
    for b in bufs:
        b.release()
    out.put(("released",))
    again = q.get(timeout=GPU_TIMEOUT)  # the same allocation, same generation
    out.put(("again", backend.opens, again.ptr == first_ptr))
    again.release()
    recycled = q.get(timeout=GPU_TIMEOUT)  # a new buffer in the recycled allocation
    ok = recycled.ptr == first_ptr and np.array_equal(recycled.numpy(), np.full(1024, 5, np.int32))
    out.put(("recycled", backend.opens, bool(ok)))
    recycled.release()


def _w_other_gpu(out: Any, q: Any) -> None:
    buf, expected = q.get(timeout=GPU_TIMEOUT)
    base, size = _cuda.address_range(buf.ptr, buf.device)
    seen = bool(np.array_equal(buf.numpy(), expected))
    buf.copy_from(expected + 1)
    out.put(("other", buf.device, buf.device_uuid, seen, base == buf.ptr, size))
    buf.release()


# -- the contract ----------------------------------------------------------------------


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
    start_guarded(reap, w_negate, out, jobs, backend)
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
    start_guarded(reap, w_hold_many, out, jobs, backend, 5)
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
    procs = [start_guarded(reap, w_sum_each, out, jobs, 1) for _ in range(4)]
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
    start_guarded(reap, w_hold_many, out, jobs, backend, 1)
    jobs.put(buf)
    recv(out)
    wait_until(lambda: manager.stats()["leases"] == 0)
    buf.release()
    # The worker still has the allocation mapped (retained for reuse): trim asks it to unmap first.
    assert manager.trim() == mp.GRANULARITY
    jobs.put(manager.full((64,), 6.0, device=device_for(backend), backend=backend))
    assert recv(out)[1:] == (6.0, 2)  # a new allocation: a second open
    jobs.put("go")


def test_a_slow_unmap_holds_back_no_reply_to_that_process(manager, reap) -> None:
    """The consumer closes what the owner asks to unmap on its writer thread: its reader goes
    on delivering replies (a CUDA close takes 100-200 us, and a first arrival's claim answer
    used to wait behind it)."""
    buf = manager.full((64,), 5.0, device="cpu", backend="host")
    jobs, out = mp.Queue(), mp.Queue()
    start_guarded(reap, w_slow_unmap_then_ask, out, jobs)
    jobs.put(buf)
    assert recv(out) == ("released",)
    wait_until(lambda: manager.stats()["leases"] == 0)
    buf.release()
    freed: list[int] = []
    trimmer = threading.Thread(target=lambda: freed.append(manager.trim()))
    trimmer.start()  # asks the worker to unmap, and waits for its answer (1 s)
    answered, seconds = recv(out)
    trimmer.join(TIMEOUT)
    assert answered == "answered"
    assert freed == [mp.GRANULARITY]  # freed once the slow close was done and answered
    assert_prompt(seconds, 0.5, "the owner's reply, a 1 s close under way", cap=0.9)
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
    start_guarded(reap, w_negate, out, jobs, backend, device=1)
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
    start_guarded(reap, w_negate, out, jobs, backend, device=0, env={"CUDA_VISIBLE_DEVICES": visible})
    jobs.put(buf)
    _, seen, _, device, uuid, _ = recv(out)
    np.testing.assert_array_equal(seen, src)
    assert device == expect_device
    assert uuid == buf.device_uuid
    np.testing.assert_array_equal(buf.numpy(), -src)


# -- host: one open per allocation per process -----------------------------------------


def test_one_open_per_allocation_and_recycled_reuse(manager, reap) -> None:
    buf = manager.full((16,), 7, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    start(reap, count_opens, jobs, results, 10)
    for _ in range(10):
        jobs.put(buf)
    opens, same = results.get(timeout=30)
    assert opens == 1 and same
    wait_until(lambda: manager.stats()["leases"] == 0)
    del buf
    gc.collect()
    recycled = manager.full((16,), 9, device="cpu")  # same size class: the same allocation
    assert manager.stats()["reused"] == 1
    jobs.put(recycled)
    opens, first = results.get(timeout=30)
    assert opens == 1  # the worker's retained mapping served the recycled allocation
    assert first == 9


# -- cuda_ipc end to end, on a real GPU ------------------------------------------------


@pytest.mark.gpu
def test_values_travel_both_ways(manager: mp.BufferManager, reap: list[Any]) -> None:
    q, out, cmd = mp.Queue(), mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_roundtrip, out, q, cmd, device=0)
    arr = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    buf = manager.from_numpy(arr, device=0)
    assert buf.backend == "cuda_ipc" and buf.device == 0
    q.put((buf, arr))
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("written", True, 0, buf.device_uuid, (64, 1024), "float32")
    np.testing.assert_array_equal(buf.numpy(), -arr)  # the worker's write, seen here
    arr2 = arr + 0.5
    buf.copy_from(arr2)  # and ours, seen there while it still holds the buffer
    cmd.put(arr2)
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("reread", True)
    join_ok(proc, timeout=GPU_TIMEOUT)


@pytest.mark.gpu
def test_fan_out_to_four_workers(manager: mp.BufferManager, reap: list[Any]) -> None:
    n = 4
    q, out = mp.Queue(), mp.Queue()
    barrier = mp.Barrier(n + 1)
    procs = [start_guarded(reap, _w_fanout, out, q, barrier, device=0) for _ in range(n)]
    arr = np.arange(1 << 16, dtype=np.int64)
    buf = manager.from_numpy(arr, device=0)
    for _ in range(n):
        q.put(buf)
    results = [recv(out, *procs, timeout=GPU_TIMEOUT) for _ in range(n)]
    assert {r[1] for r in results} == {p.pid for p in procs}
    for _, pid, total, ptr_ok in results:
        assert total == int(arr.sum()), f"worker {pid} summed {total}"
        assert ptr_ok, f"worker {pid} got a pointer that is not the base of its mapping"
    stats = manager.stats()
    assert stats["leases"] == n and stats["unclaimed_leases"] == 0
    assert stats["consumers"] == n
    barrier.wait(timeout=GPU_TIMEOUT)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    join_ok(*procs, timeout=GPU_TIMEOUT)
    wait_until(lambda: manager.stats()["consumers"] == 0, timeout=10)
    np.testing.assert_array_equal(buf.numpy(), arr)


@pytest.mark.gpu
def test_one_open_per_allocation_per_process(manager: mp.BufferManager, reap: list[Any]) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_opens, out, q, device=0)
    buf = manager.full((1024,), 3, dtype="int32", device=0)
    for _ in range(10):
        q.put(buf)
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("held", 1, 1, True)
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("released",)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    q.put(buf)
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("again", 1, True)

    # Recycle the allocation: drop ours once the worker has released its lease.
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    reused = manager.stats()["reused"]
    buf.release()
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1, timeout=10)
    buf2 = manager.full((1024,), 5, dtype="int32", device=0)
    assert manager.stats()["reused"] == reused + 1
    q.put(buf2)
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("recycled", 1, True)
    join_ok(proc, timeout=GPU_TIMEOUT)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_buffer_on_second_gpu_used_by_worker_on_first(manager: mp.BufferManager, reap: list[Any]) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_other_gpu, out, q, device=0)
    arr = np.arange(3 * 1000, dtype=np.float64).reshape(3, 1000)
    buf = manager.from_numpy(arr, device=1)
    assert buf.device == 1
    assert buf.device_uuid == _cuda.format_uuid(_cuda.device_uuid(1))
    assert buf.device_uuid != _cuda.format_uuid(_cuda.device_uuid(0))
    q.put((buf, arr))
    tag, device, uuid, seen, base_ok, size = recv(out, proc, timeout=GPU_TIMEOUT)
    assert tag == "other"
    assert device == 1, "the worker should map the memory on the GPU it lives on"
    assert uuid == buf.device_uuid
    assert seen and base_ok
    assert size == 2 * MiB
    np.testing.assert_array_equal(buf.numpy(), arr + 1)
    join_ok(proc, timeout=GPU_TIMEOUT)


@pytest.mark.gpu
def test_queries_keep_the_gil_and_agree_with_the_bindings() -> None:
    """``stream_idle`` and ``event_done`` answer through the GIL-keeping queries on the
    driver cuda-bindings loaded (the C extension's where it builds), and give cuda-bindings'
    own answers, busy and idle, as do the ctypes ones; an event recorded through either
    GIL-keeping ``cuEventRecord`` orders like one recorded through cuda-bindings."""
    from gpushare import _native
    from gpushare._cuda import _driver, _streams
    from gpushare._cuda._queries import _Queries

    torch = require("torch")
    t = torch.zeros(1 << 20, device="cuda:0")
    event, _ = _cuda.event_create_ipc(0)  # loads the driver here, if no test did before
    queries, driver = _driver._queries, _driver._bindings
    assert queries is not None, "libcuda.so.1 was not found for the GIL-keeping queries"
    if _native.queries_type() is not None:
        assert not isinstance(queries, _Queries), "the C queries build here, but the ctypes ones are in use"
    by_ctypes = _Queries.load()
    assert by_ctypes is not None
    try:
        for busy in (True, False):
            if busy:
                fill_behind_a_running_kernel(torch, t, 1.0)
            _cuda.event_record(event, 0)  # behind the kernel when busy
            key = _driver._primary_ints[0]
            # The record itself went through the GIL-keeping call (it answers True only
            # when the driver recorded); recorded again, behind the same kernel when busy.
            assert queries.record(key, int(event), 0), "the GIL-keeping cuEventRecord did not record"
            assert by_ctypes.record(key, int(event), 0), "the ctypes cuEventRecord did not record"
            if not busy:
                torch.cuda.synchronize()  # the records themselves done too
            answers = {
                "stream, kept": queries.stream_done(key, 0),
                "event, kept": queries.event_done(key, int(event)),
                "stream, ctypes": by_ctypes.stream_done(key, 0),
                "event, ctypes": by_ctypes.event_done(key, int(event)),
                "stream, bindings": _streams._finished(
                    driver, 0, "cuStreamQuery", driver.cuStreamQuery, _driver._stream(driver, 0)
                ),
                "event, bindings": _streams._finished(driver, 0, "cuEventQuery", driver.cuEventQuery, event),
                "stream_idle": _cuda.stream_idle(0),
                "event_done": _cuda.event_done(event, 0),
            }
            assert answers == dict.fromkeys(answers, not busy), f"busy={busy}: {answers}"
            torch.cuda.synchronize()
    finally:
        _cuda.event_destroy(event, 0)
    assert float(t[0]) == 1.0


# -- cuda_vmm: the fd is exported ahead of the first request (driver stand-ins) --------


class Driver:
    """Stand-ins for the driver calls: an export blocks until ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.exported: list[object] = []
        self.freed: list[object] = []
        self.started = threading.Event()

    def vmm_export(self, handle: object, ordinal: int) -> int:
        self.started.set()
        assert self.go.wait(10), "the test never let the export finish"
        self.exported.append(handle)
        return os.open(os.devnull, os.O_RDONLY)  # a real fd: free() closes it

    def vmm_free(self, ptr: int, handle: object, size: int, ordinal: int) -> None:
        self.freed.append(handle)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Driver:
    fake = Driver()
    monkeypatch.setattr(cuda_vmm._cuda, "vmm_export", fake.vmm_export)
    monkeypatch.setattr(cuda_vmm._cuda, "vmm_free", fake.vmm_free)
    return fake


def allocation(name: str) -> _base.Allocation:
    # The layout allocate() makes: [generic handle, fd, mapped size, export queued].
    return _base.Allocation("cuda_vmm", 0x1000, 2 << 20, 0, b"\0" * 16, b"", [name, None, 2 << 20, False])


@pytest.mark.timeout(30)
def test_the_first_lease_starts_the_export_and_never_waits_for_one(driver: Driver) -> None:
    backend = cuda_vmm.CudaVmmBackend()
    first, second = allocation("first"), allocation("second")
    assert backend.export(first) == b""
    assert driver.started.wait(10)  # the exporter thread is inside first's export
    began = time.monotonic()
    backend.export(second)  # queued behind it, without waiting for it
    backend.export(second)  # a second lease queues nothing more
    assert_prompt(time.monotonic() - began, 0.5, "two exports queued behind a running one")
    assert driver.exported == []
    driver.go.set()
    wait_until(lambda: driver.exported == ["first", "second"], timeout=10.0, interval=0.005)
    assert backend.export_fd(first) == first.native[1]  # the fd made ahead, no new export
    assert driver.exported == ["first", "second"]
    backend.free(first)
    backend.free(second)


@pytest.mark.timeout(30)
def test_requests_wait_for_the_export_in_progress_and_share_it(driver: Driver) -> None:
    backend = cuda_vmm.CudaVmmBackend()
    alloc = allocation("only")
    backend.export(alloc)
    assert driver.started.wait(10)
    fds: list[int] = []
    askers = [threading.Thread(target=lambda: fds.append(backend.export_fd(alloc))) for _ in range(3)]
    for t in askers:
        t.start()
    time.sleep(0.05)
    assert fds == []  # they wait for the export in progress
    driver.go.set()
    for t in askers:
        t.join(10)
    assert driver.exported == ["only"] and len(set(fds)) == 1 and fds[0] == alloc.native[1]
    backend.free(alloc)


@pytest.mark.timeout(30)
def test_an_allocation_freed_before_its_export_is_never_exported(driver: Driver) -> None:
    backend = cuda_vmm.CudaVmmBackend()
    driver.go.set()
    freed, after = allocation("freed"), allocation("after")
    backend.free(freed)  # e.g. trimmed while its export waited in the queue
    backend.export(freed)
    backend.export(after)  # the queue is in order: once this one is exported, freed's turn went by
    wait_until(lambda: driver.exported == ["after"], timeout=10.0, interval=0.005)
    assert driver.freed == ["freed"]
    with pytest.raises(ValueError, match="freed"):
        backend.export_fd(freed)
    backend.free(after)
    assert driver.freed == ["freed", "after"]
