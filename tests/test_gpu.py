"""The cuda_ipc path end to end, on a real GPU.

Every test is marked ``gpu`` (skipped without one, a failure under
``--require-gpu``). Workers are module-level functions started with the
spawn start method through ``mp.Process(..., device=0)``; each runs under
:func:`_guarded`, which sends any exception back as a traceback so a
failure in a worker fails the test with the worker's own message. Every
``get`` and ``join`` has a timeout, and the ``reap`` fixture kills what a
failing test leaves behind (it is listed after ``manager`` so workers are
reaped before the Manager shuts down).

Third-party libraries (torch, CuPy, Numba) are imported inside the workers;
the parent only checks they are installed and skips otherwise.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
import warnings
from typing import Any

import numpy as np
import pytest
from conftest import fill_behind_a_running_kernel, wait_until

import gpushare as mp
from gpushare import _backends, _cuda

pytestmark = pytest.mark.gpu

TIMEOUT = 30.0
MiB = 1 << 20


# ---------------------------------------------------------------------------
# helpers (parent side)
# ---------------------------------------------------------------------------


def _require(name: str) -> Any:
    """pytest.importorskip, without letting an import-time warning become an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(name)


def _start(reap: list[Any], fn: Any, *args: Any, device: Any = 0) -> Any:
    proc = mp.Process(target=_guarded, args=(fn, *args), device=device)
    proc.start()
    reap.append(proc)
    return proc


def _recv(out: Any, *procs: Any, timeout: float = TIMEOUT) -> tuple[Any, ...]:
    """The next message from a worker; a worker's exception fails the test."""
    try:
        msg = out.get(timeout=timeout)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        pytest.fail(f"no message from the worker(s) within {timeout:g} s (exit codes {codes})")
    if msg[0] == "error":
        pytest.fail(f"worker failed:\n{msg[1]}")
    return tuple(msg)


def _join(*procs: Any) -> None:
    for proc in procs:
        proc.join(timeout=TIMEOUT)
        assert not proc.is_alive(), f"worker {proc.pid} did not exit within {TIMEOUT:g} s"
        assert proc.exitcode == 0, f"worker {proc.pid} exited with {proc.exitcode}"


# ---------------------------------------------------------------------------
# workers (module level: spawn imports this module in the child)
# ---------------------------------------------------------------------------


def _guarded(fn: Any, out: Any, *args: Any) -> None:
    try:
        fn(out, *args)
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


def _w_roundtrip(out: Any, q: Any, cmd: Any) -> None:
    buf, expected = q.get(timeout=TIMEOUT)
    seen = bool(np.array_equal(buf.numpy(), expected))
    buf.copy_from(-expected)
    out.put(("written", seen, buf.device, buf.device_uuid, buf.shape, str(buf.dtype)))
    expected2 = cmd.get(timeout=TIMEOUT)  # the parent wrote again while we hold the buffer
    out.put(("reread", bool(np.array_equal(buf.numpy(), expected2))))
    buf.release()


def _w_fanout(out: Any, q: Any, barrier: Any) -> None:
    buf = q.get(timeout=TIMEOUT)
    base, size = _cuda.address_range(buf.ptr, buf.device)
    ptr_ok = base == buf.ptr and size >= buf.nbytes
    out.put(("sum", os.getpid(), int(buf.numpy().sum(dtype=np.int64)), ptr_ok))
    barrier.wait(timeout=TIMEOUT)  # every worker holds its lease until all have mapped
    buf.release()


def _w_interop(out: Any, q: Any, kind: str) -> None:
    buf = q.get(timeout=TIMEOUT)
    expected = np.arange(buf.size, dtype=np.float32).reshape(buf.shape)
    written = expected * 2 + 1
    if kind in ("torch", "torch_dlpack"):
        import torch

        t = torch.as_tensor(buf, device="cuda") if kind == "torch" else torch.from_dlpack(buf)
        shape, dtype, ptr = tuple(t.shape), str(t.dtype).removeprefix("torch."), t.data_ptr()
        same = bool(np.array_equal(t.cpu().numpy(), expected))
        t.mul_(2).add_(1)
        torch.cuda.synchronize()
        del t
    elif kind == "cupy":
        import cupy

        a = cupy.asarray(buf)
        shape, dtype, ptr = tuple(a.shape), str(a.dtype), a.data.ptr
        same = bool(np.array_equal(cupy.asnumpy(a), expected))
        a *= 2
        a += 1
        cupy.cuda.runtime.deviceSynchronize()
        del a
    elif kind == "numba":
        from numba import cuda

        d = cuda.as_cuda_array(buf)
        shape, dtype, ptr = tuple(d.shape), str(d.dtype), d.__cuda_array_interface__["data"][0]
        same = bool(np.array_equal(d.copy_to_host(), expected))
        d.copy_to_device(written)
        cuda.synchronize()
        del d
    elif kind == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax
        import jax.dlpack

        x = jax.dlpack.from_dlpack(buf)
        x.block_until_ready()
        shape, dtype, ptr = tuple(x.shape), str(x.dtype), x.unsafe_buffer_pointer()
        same = bool(np.array_equal(np.asarray(x), expected))
        del x
        buf.copy_from(written)  # JAX arrays are immutable: write through the buffer instead
    else:
        raise ValueError(kind)
    result = ("view", shape, dtype, int(ptr), buf.ptr, same, bool(np.array_equal(buf.numpy(), written)))
    buf.release()
    out.put(result)


def _w_address_range(out: Any, q: Any) -> None:
    for _ in range(2):
        buf = q.get(timeout=TIMEOUT)
        base, size = _cuda.address_range(buf.ptr, buf.device)
        out.put(("range", buf.nbytes, buf.ptr, base, size))
        buf.release()


def _w_opens(out: Any, q: Any) -> None:
    backend = _backends.get("cuda_ipc")
    bufs = [q.get(timeout=TIMEOUT) for _ in range(10)]
    first_ptr = bufs[0].ptr
    values_ok = all(np.array_equal(b.numpy(), np.full(1024, 3, np.int32)) for b in bufs)
    out.put(("held", backend.opens, len({b.ptr for b in bufs}), values_ok))
    for b in bufs:
        b.release()
    out.put(("released",))
    again = q.get(timeout=TIMEOUT)  # the same allocation, same generation
    out.put(("again", backend.opens, again.ptr == first_ptr))
    again.release()
    recycled = q.get(timeout=TIMEOUT)  # a new buffer in the recycled allocation
    ok = recycled.ptr == first_ptr and np.array_equal(recycled.numpy(), np.full(1024, 5, np.int32))
    out.put(("recycled", backend.opens, bool(ok)))
    recycled.release()


def _w_map_until_none(out: Any, q: Any) -> None:
    """Map each buffer sent, read its first elements, release it; stop at None."""
    while True:
        buf = q.get(timeout=TIMEOUT)
        if buf is None:
            out.put(("bye",))
            return
        _, size = _cuda.address_range(buf.ptr, buf.device)
        head = buf.view(shape=(4,))
        first = head.numpy().tolist()
        head.release()
        buf.release()
        out.put(("mapped", size, first))


def _w_device(out: Any) -> None:
    env = os.environ.get("GPUSHARE_DEVICE")
    import torch

    out.put(("device", env, torch.cuda.current_device()))


def _w_released(out: Any, q: Any) -> None:
    a16, a64 = q.get(timeout=TIMEOUT)
    copies = (a16.numpy(), a64.numpy())
    a16.release()
    a16.release()  # idempotent
    outcomes = {}
    attempts = {
        "numpy": lambda: a16.numpy(),
        "ptr": lambda: a16.ptr,
        "copy_from": lambda: a16.copy_from(copies[0]),
        "cuda_array_interface": lambda: a16.__cuda_array_interface__,
        "dlpack": lambda: a16.__dlpack__(),
        "pickle": lambda: pickle.dumps(a16),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            outcomes[name] = "no error"
        except mp.BufferReleasedError:
            outcomes[name] = "BufferReleasedError"
        except Exception as exc:
            outcomes[name] = f"{type(exc).__name__}: {exc}"
    with a64:
        pass
    out.put(("released", copies[0], copies[1], a16.released, a64.released, outcomes))


def _w_other_gpu(out: Any, q: Any) -> None:
    buf, expected = q.get(timeout=TIMEOUT)
    base, size = _cuda.address_range(buf.ptr, buf.device)
    seen = bool(np.array_equal(buf.numpy(), expected))
    buf.copy_from(expected + 1)
    out.put(("other", buf.device, buf.device_uuid, seen, base == buf.ptr, size))
    buf.release()


def _w_ordered_read(out: Any, q: Any, how: str) -> None:
    if how == "torch_dlpack":
        import torch

        torch.zeros(1, device="cuda")
    elif how == "cupy_cai":
        import cupy

        cupy.zeros(1)
    out.put(("ready",))
    buf = q.get(timeout=TIMEOUT)
    if how == "numpy":
        values = buf.numpy()
    elif how == "torch_dlpack":
        values = torch.from_dlpack(buf).cpu().numpy()  # its stream waits on the ready event
    else:
        values = cupy.asnumpy(cupy.asarray(buf))  # CAI v3: CuPy orders after the given stream
    out.put(("seen", float(values.min()), float(values.max())))
    buf.release()


def _noop() -> None:
    pass


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


def test_values_travel_both_ways(manager: mp.BufferManager, reap: list[Any]) -> None:
    q, out, cmd = mp.Queue(), mp.Queue(), mp.Queue()
    proc = _start(reap, _w_roundtrip, out, q, cmd)
    arr = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    buf = manager.from_numpy(arr, device=0)
    assert buf.backend == "cuda_ipc" and buf.device == 0
    q.put((buf, arr))
    assert _recv(out, proc) == ("written", True, 0, buf.device_uuid, (64, 1024), "float32")
    np.testing.assert_array_equal(buf.numpy(), -arr)  # the worker's write, seen here
    arr2 = arr + 0.5
    buf.copy_from(arr2)  # and ours, seen there while it still holds the buffer
    cmd.put(arr2)
    assert _recv(out, proc) == ("reread", True)
    _join(proc)


def test_fan_out_to_four_workers(manager: mp.BufferManager, reap: list[Any]) -> None:
    n = 4
    q, out = mp.Queue(), mp.Queue()
    barrier = mp.Barrier(n + 1)
    procs = [_start(reap, _w_fanout, out, q, barrier) for _ in range(n)]
    arr = np.arange(1 << 16, dtype=np.int64)
    buf = manager.from_numpy(arr, device=0)
    for _ in range(n):
        q.put(buf)
    results = [_recv(out, *procs) for _ in range(n)]
    assert {r[1] for r in results} == {p.pid for p in procs}
    for _, pid, total, ptr_ok in results:
        assert total == int(arr.sum()), f"worker {pid} summed {total}"
        assert ptr_ok, f"worker {pid} got a pointer that is not the base of its mapping"
    stats = manager.stats()
    assert stats["leases"] == n and stats["unclaimed_leases"] == 0
    assert stats["consumers"] == n
    barrier.wait(timeout=TIMEOUT)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    _join(*procs)
    wait_until(lambda: manager.stats()["consumers"] == 0, timeout=10)
    np.testing.assert_array_equal(buf.numpy(), arr)


@pytest.mark.parametrize(
    ("kind", "module"),
    [("torch", "torch"), ("torch_dlpack", "torch"), ("cupy", "cupy"), ("numba", "numba.cuda"), ("jax", "jax")],
)
def test_library_views_in_worker(manager: mp.BufferManager, reap: list[Any], kind: str, module: str) -> None:
    _require(module)
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_interop, out, q, kind)
    arr = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
    buf = manager.from_numpy(arr, device=0)
    q.put(buf)
    tag, shape, dtype, view_ptr, buf_ptr, same, written = _recv(out, proc, timeout=60)
    assert tag == "view"
    assert shape == (8, 256)
    assert dtype == "float32"
    assert view_ptr == buf_ptr, f"{kind} view copied the memory instead of aliasing it"
    assert same, f"{kind} view does not show the buffer's contents"
    assert written, f"the worker's own buffer does not show the write made through {kind}"
    np.testing.assert_array_equal(buf.numpy(), arr * 2 + 1)  # seen by the parent
    _join(proc)


def test_allocations_are_2mib_isolated(manager: mp.BufferManager, reap: list[Any]) -> None:
    assert mp.GRANULARITY == 2 * MiB
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_address_range, out, q)
    small = manager.empty((1000,), dtype="uint8", device=0)
    big = manager.empty((3 * MiB,), dtype="uint8", device=0)
    for buf, rounded in ((small, 2 * MiB), (big, 4 * MiB)):
        assert _cuda.address_range(buf.ptr, 0) == (buf.ptr, rounded)
        q.put(buf)
        tag, nbytes, ptr, base, size = _recv(out, proc)
        assert tag == "range"
        assert nbytes == buf.nbytes
        assert base == ptr, "the mapped pointer is not the base of its allocation"
        assert size == rounded, f"a worker mapped {size} bytes for a {buf.nbytes}-byte buffer"
    _join(proc)


def test_one_open_per_allocation_per_process(manager: mp.BufferManager, reap: list[Any]) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_opens, out, q)
    buf = manager.full((1024,), 3, dtype="int32", device=0)
    for _ in range(10):
        q.put(buf)
    assert _recv(out, proc) == ("held", 1, 1, True)
    assert _recv(out, proc) == ("released",)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    q.put(buf)
    assert _recv(out, proc) == ("again", 1, True)

    # Recycle the allocation: drop ours once the worker has released its lease.
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    reused = manager.stats()["reused"]
    buf.release()
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1, timeout=10)
    buf2 = manager.full((1024,), 5, dtype="int32", device=0)
    assert manager.stats()["reused"] == reused + 1
    q.put(buf2)
    assert _recv(out, proc) == ("recycled", 1, True)
    _join(proc)


def test_device_memory_back_to_baseline(manager: mp.BufferManager, reap: list[Any]) -> None:
    # The baseline is taken with the worker running and CUDA (context, IPC
    # open, copies) already initialised in both processes by a small buffer
    # that stays alive to the end, so only the 256 MiB buffer is measured.
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_map_until_none, out, q)
    warm = manager.full((16,), 1.0, dtype="float32", device=0)
    q.put(warm)
    assert _recv(out, proc, timeout=60) == ("mapped", 2 * MiB, [1.0] * 4)
    baseline = _cuda.mem_info(0)[0]

    big = manager.full((64, 1024, 1024), 2.0, dtype="float32", device=0)  # 256 MiB
    assert big.nbytes == 256 * MiB
    assert baseline - _cuda.mem_info(0)[0] >= 248 * MiB
    q.put(big)
    assert _recv(out, proc) == ("mapped", 256 * MiB, [2.0] * 4)
    big.release()
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    wait_until(lambda: manager.stats()["bytes_pooled"] == 256 * MiB, timeout=10)
    assert manager.trim() == 256 * MiB  # the worker unmapped it when asked, then it was freed
    stats = manager.stats()
    assert stats["bytes_pooled"] == 0 and stats["leaked_buffers"] == 0
    wait_until(lambda: _cuda.mem_info(0)[0] >= baseline - 8 * MiB, timeout=10)

    q.put(None)  # the worker was part of the baseline: stop it only now
    assert _recv(out, proc) == ("bye",)
    _join(proc)
    np.testing.assert_array_equal(warm.numpy(), np.ones(16, np.float32))


def test_torch_aliases_owner_buffer(manager: mp.BufferManager) -> None:
    torch = _require("torch")
    arr = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)
    buf = manager.from_numpy(arr, device=0)
    t = torch.as_tensor(buf, device="cuda")
    assert t.data_ptr() == buf.ptr
    assert tuple(t.shape) == buf.shape and t.dtype == torch.float32
    assert t.device == torch.device("cuda", 0)
    t.add_(1)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(buf.numpy(), arr + 1)
    d = torch.from_dlpack(buf)
    assert d.data_ptr() == buf.ptr and tuple(d.shape) == buf.shape
    del t, d


def test_unpickle_in_owner_process_sees_same_memory(manager: mp.BufferManager) -> None:
    arr = np.arange(512, dtype=np.int32)
    buf = manager.from_numpy(arr, device=0)
    data = pickle.dumps(buf)
    copy = pickle.loads(data)
    assert copy is not buf
    assert copy.ptr == buf.ptr and copy.device == 0 and copy.shape == buf.shape and copy.dtype == buf.dtype
    np.testing.assert_array_equal(copy.numpy(), arr)
    copy.copy_from(arr * 7)
    np.testing.assert_array_equal(buf.numpy(), arr * 7)
    assert manager.stats()["leases"] == 1
    with pytest.raises(mp.DescriptorError):
        pickle.loads(data)  # one pickling, one receiver
    copy.release()
    assert manager.stats()["leases"] == 0
    np.testing.assert_array_equal(buf.numpy(), arr * 7)  # the owner's buffer is untouched


def test_fork_refused_after_cuda_init(manager: mp.BufferManager) -> None:
    if "fork" not in mp.get_all_start_methods():
        pytest.skip("this platform has no fork start method")
    buf = manager.empty((16,), dtype="float32", device=0)
    proc = mp.get_context("fork").Process(target=_noop)
    with pytest.raises(mp.StartMethodError, match="spawn"):
        proc.start()
    assert proc.pid is None  # nothing was forked
    buf.release()


@pytest.mark.parametrize("device", [0, "cuda:0"])
def test_process_device_binds_worker(reap: list[Any], device: Any) -> None:
    _require("torch")
    out = mp.Queue()
    proc = _start(reap, _w_device, out, device=device)
    assert proc.device == 0
    assert _recv(out, proc, timeout=60) == ("device", "0", 0)
    _join(proc)


@pytest.mark.multigpu
def test_process_device_binds_second_gpu(reap: list[Any]) -> None:
    _require("torch")
    out = mp.Queue()
    proc = _start(reap, _w_device, out, device=1)
    assert _recv(out, proc, timeout=60) == ("device", "1", 1)
    _join(proc)


def test_released_buffer_raises_and_numpy_copies(manager: mp.BufferManager, reap: list[Any]) -> None:
    a16 = np.linspace(-100, 100, 999).astype(np.float16)  # 1998 bytes: not a multiple of 4
    a64 = np.array([-(2**62), 2**62, -1, 0, 1, 2**40 + 3], dtype=np.int64)
    b16 = manager.from_numpy(a16, device=0)
    b64 = manager.from_numpy(a64, device=0)

    # numpy() is a correct host copy, for both dtypes.
    c16, c64 = b16.numpy(), b64.numpy()
    assert c16.dtype == np.float16 and c64.dtype == np.int64
    np.testing.assert_array_equal(c16, a16)
    np.testing.assert_array_equal(c64, a64)
    c64[:] = 0
    np.testing.assert_array_equal(b64.numpy(), a64)  # a copy, not a view

    # Worker side.
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_released, out, q)
    q.put((b16, b64))
    tag, w16, w64, released16, released64, outcomes = _recv(out, proc)
    assert tag == "released"
    assert w16.dtype == np.float16 and w64.dtype == np.int64
    np.testing.assert_array_equal(w16, a16)
    np.testing.assert_array_equal(w64, a64)
    assert released16 and released64
    assert outcomes == dict.fromkeys(outcomes, "BufferReleasedError"), outcomes
    assert set(outcomes) == {"numpy", "ptr", "copy_from", "cuda_array_interface", "dlpack", "pickle"}
    _join(proc)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)

    # Owner side: a view taken before release keeps the memory on its own.
    view = b16.view()
    b16.release()
    b16.release()  # idempotent
    assert b16.released
    for attempt in (
        lambda: b16.numpy(),
        lambda: b16.ptr,
        lambda: b16.copy_from(a16),
        lambda: b16.fill(0),
        lambda: b16.__cuda_array_interface__,
        lambda: b16.__dlpack__(),
        lambda: pickle.dumps(b16),
    ):
        with pytest.raises(mp.BufferReleasedError):
            attempt()
    np.testing.assert_array_equal(view.numpy(), a16)
    view.release()
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1, timeout=10)


@pytest.mark.multigpu
def test_buffer_on_second_gpu_used_by_worker_on_first(manager: mp.BufferManager, reap: list[Any]) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_other_gpu, out, q, device=0)
    arr = np.arange(3 * 1000, dtype=np.float64).reshape(3, 1000)
    buf = manager.from_numpy(arr, device=1)
    assert buf.device == 1
    assert buf.device_uuid == _cuda.format_uuid(_cuda.device_uuid(1))
    assert buf.device_uuid != _cuda.format_uuid(_cuda.device_uuid(0))
    q.put((buf, arr))
    tag, device, uuid, seen, base_ok, size = _recv(out, proc)
    assert tag == "other"
    assert device == 1, "the worker should map the memory on the GPU it lives on"
    assert uuid == buf.device_uuid
    assert seen and base_ok
    assert size == 2 * MiB
    np.testing.assert_array_equal(buf.numpy(), arr + 1)
    _join(proc)


@pytest.mark.parametrize("how", ["numpy", "torch_dlpack", "cupy_cai"])
def test_consumer_waits_for_a_long_running_producer_kernel(
    manager: mp.BufferManager, reap: list[Any], how: str
) -> None:
    torch = _require("torch")
    if how == "cupy_cai":
        _require("cupy")
    q, out = mp.Queue(), mp.Queue()
    proc = _start(reap, _w_ordered_read, out, q, how)
    assert _recv(out, proc, timeout=120) == ("ready",)
    buf = manager.zeros((1 << 22,), "float32", device=0)
    t = torch.from_dlpack(buf)
    fill_behind_a_running_kernel(torch, t, 7.0)  # still running at put() time
    q.put(buf)  # no synchronize: the ready event recorded at pickling carries the ordering
    tag, low, high = _recv(out, proc, timeout=60)
    assert tag == "seen"
    assert (low, high) == (7.0, 7.0), f"consumer read before the producer's kernel finished ({how})"
    del t
    _join(proc)


def test_queries_keep_the_gil_and_agree_with_the_bindings() -> None:
    """``stream_idle`` and ``event_done`` answer through the GIL-keeping queries on the
    driver cuda-bindings loaded, and give cuda-bindings' own answers, busy and idle."""
    from gpushare._cuda import _driver, _streams

    torch = _require("torch")
    t = torch.zeros(1 << 20, device="cuda:0")
    event, _ = _cuda.event_create_ipc(0)  # loads the driver here, if no test did before
    queries, driver = _driver._queries, _driver._bindings
    assert queries is not None, "libcuda.so.1 was not found for the GIL-keeping queries"
    try:
        for busy in (True, False):
            if busy:
                fill_behind_a_running_kernel(torch, t, 1.0)
            _cuda.event_record(event, 0)  # behind the kernel when busy
            if not busy:
                torch.cuda.synchronize()  # the record itself done too
            key = _driver._primary_ints[0]
            answers = {
                "stream, kept": queries.done(key, queries.stream, 0),
                "event, kept": queries.done(key, queries.event, int(event)),
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
