"""Buffer: attributes, views, copies, interop, release, and the errors of asking for one.

On the host backend in one process, but for a release checked across
processes (a worker reads a view of a released buffer) and, marked ``gpu``,
a cuda_ipc buffer: its views in torch, CuPy, Numba and JAX (in a worker),
its pickling in its owner's process, and what it refuses once released.
What the Manager does with the memory (rounding, pooling, trim, limits,
shutdown) is in test_manager.py.
"""

from __future__ import annotations

import gc
import os
import pickle
from typing import Any

import numpy as np
import pytest
from conftest import GPU_TIMEOUT, assert_intact, join_ok, recv, require, run_guarded, start_guarded, wait_until
from workers import w_sum_each

import gpushare as mp


def test_empty_rounds_to_2mib_and_has_every_attribute(manager: mp.BufferManager) -> None:
    buf = manager.empty((3, 5), dtype="float16", device="cpu")
    assert buf.shape == (3, 5)
    assert buf.dtype == np.float16
    assert buf.strides == (10, 2)
    assert buf.nbytes == 30
    assert buf.device == "cpu"
    assert buf.device_uuid is None
    assert buf.backend == "host"
    assert isinstance(buf.ptr, int) and buf.ptr % 4096 == 0
    assert not buf.released
    assert manager.stats()["bytes_allocated"] == mp.GRANULARITY
    assert manager.stats()["backends"] == {"host": 1}


def test_zeros_full_from_numpy_buffer(manager: mp.BufferManager) -> None:
    np.testing.assert_array_equal(manager.zeros((4, 4), "int64", device="cpu").numpy(), np.zeros((4, 4)))
    np.testing.assert_array_equal(manager.full((7,), 2.5, "float64", device="cpu").numpy(), np.full(7, 2.5))
    np.testing.assert_array_equal(manager.full((5,), 3 + 1j, "complex64", device="cpu").numpy(), np.full(5, 3 + 1j))
    src = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    buf = manager.from_numpy(src, device="cpu")
    assert buf.shape == src.shape and buf.dtype == src.dtype
    np.testing.assert_array_equal(buf.numpy(), src)
    raw = manager.buffer(100, device="cpu")
    assert raw.dtype == np.uint8 and raw.shape == (100,)


def test_asarray_with_dtype_and_copy(manager: mp.BufferManager) -> None:
    buf = manager.full((3,), 2, "int32", device="cpu")
    as_float = np.asarray(buf, dtype=np.float64)
    assert as_float.dtype == np.float64 and as_float.tolist() == [2.0, 2.0, 2.0]
    copied = np.array(buf, copy=True)
    copied[0] = 5
    assert buf.numpy()[0] == 2


def test_numpy_is_zero_copy_on_host(manager: mp.BufferManager) -> None:
    buf = manager.zeros((10,), "float32", device="cpu")
    view = buf.numpy()
    view[3] = 7
    assert buf.numpy()[3] == 7
    assert np.asarray(buf)[3] == 7
    assert view.ctypes.data == buf.ptr


def test_copy_from_and_fill(manager: mp.BufferManager) -> None:
    buf = manager.empty((2, 3), "float32", device="cpu")
    buf.copy_from([[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(buf.numpy(), [[1, 2, 3], [4, 5, 6]])
    buf.fill(9)
    assert (buf.numpy() == 9).all()
    with pytest.raises(ValueError, match="elements"):
        buf.copy_from(np.zeros(5))


def test_view(manager: mp.BufferManager) -> None:
    buf = manager.from_numpy(np.arange(8, dtype=np.float32), device="cpu")
    as_bytes = buf.view(dtype="uint8")
    assert as_bytes.shape == (32,)
    grid = buf.view(shape=(2, -1))
    assert grid.shape == (2, 4)
    np.testing.assert_array_equal(grid.numpy(), np.arange(8).reshape(2, 4))
    assert buf.view(dtype="float64").shape == (4,)
    small = buf.view(shape=(3,))
    assert small.nbytes == 12
    with pytest.raises(ValueError, match="needs"):
        buf.view(shape=(9,))
    with pytest.raises(ValueError, match="more than one"):
        buf.view(shape=(-1, -1))


def test_view_keeps_memory_after_parent_release(manager: mp.BufferManager) -> None:
    buf = manager.full((4,), 5, "int32", device="cpu")
    view = buf.view()
    buf.release()
    assert buf.released and not view.released
    assert (view.numpy() == 5).all()
    assert manager.stats()["live_buffers"] == 1
    view.release()
    assert manager.stats()["live_buffers"] == 0
    assert manager.stats()["pooled_buffers"] == 1


@pytest.mark.parametrize("dtype", ["float32", "int8", "uint16", "bool", "complex128", "float16"])
def test_dlpack_and_array_interface_on_host(manager: mp.BufferManager, dtype: str) -> None:
    src = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
    buf = manager.from_numpy(src, device="cpu")
    assert buf.__dlpack_device__() == (1, 0)
    out = np.from_dlpack(buf)
    np.testing.assert_array_equal(out, src)
    assert out.ctypes.data == buf.ptr
    assert np.asarray(buf).ctypes.data == buf.ptr
    with pytest.raises(AttributeError):
        _ = buf.__cuda_array_interface__


def test_released_buffer_refuses_every_touch(manager: mp.BufferManager) -> None:
    buf = manager.zeros((4,), device="cpu")
    with buf:
        pass
    assert buf.released
    buf.release()  # idempotent
    for touch in (
        lambda: buf.ptr,
        buf.numpy,
        lambda: buf.copy_from([1, 2, 3, 4]),
        lambda: buf.fill(1),
        lambda: buf.view(),
        lambda: np.asarray(buf),
        lambda: buf.__dlpack__(),
        lambda: pickle.dumps(buf),
    ):
        with pytest.raises(mp.BufferReleasedError, match="released"):
            touch()
    assert buf.shape == (4,)  # metadata stays readable
    assert "released" in repr(buf)


def test_double_release_and_use_after_release_across_processes(manager, reap) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    view = buf.view()
    buf.release()
    buf.release()
    assert view.numpy().sum() == 16.0  # the view's own reference keeps the memory
    with pytest.raises(mp.BufferReleasedError, match="released"):
        pickle.dumps(buf)
    jobs = mp.Queue()
    with pytest.raises(mp.BufferReleasedError):
        jobs.put(buf)  # refused in the caller, and nothing half-sent
    out = run_guarded(reap, w_sum_each, jobs, 1)
    jobs.put(view)  # the queue still works
    assert recv(out) == ("sum", 16.0)
    wait_until(lambda: manager.stats()["leases"] == 0)
    view.release()
    view.release()
    assert manager.stats()["live_buffers"] == 0 and manager.stats()["pooled_buffers"] == 1
    assert_intact(manager, reap)


def test_host_array_keeps_its_memory_after_release(manager: mp.BufferManager) -> None:
    buf = manager.full((1000,), 3, "int64", device="cpu")
    view = buf.numpy()[10:]
    buf.release()
    assert manager.stats()["pooled_buffers"] == 0  # the array still holds the memory
    other = manager.full((1000,), 7, "int64", device="cpu")  # cannot be handed the same memory
    assert other.ptr != view.ctypes.data - 80
    assert int(view.sum()) == 3 * 990
    del view
    gc.collect()
    assert manager.stats()["pooled_buffers"] == 1  # recycled once the array is gone


@pytest.mark.parametrize(
    ("shape", "dtype", "error", "match"),
    [
        ((-1, 3), "float32", ValueError, "negative"),
        ((2,), "not-a-dtype", ValueError, "dtype"),
        ((2,), [("a", "i4"), ("b", "f4")], ValueError, "cannot be shared"),
        ((2,), "U5", ValueError, "cannot be shared"),
        ((2,), "object", ValueError, "cannot be shared"),
        ((1 << 40, 1 << 20), "float32", MemoryError, "bytes"),
        ("abc", "float32", ValueError, "shape"),
    ],
)
def test_bad_allocation_requests(manager: mp.BufferManager, shape, dtype, error, match) -> None:
    with pytest.raises(error, match=match):
        manager.empty(shape, dtype, device="cpu")
    assert manager.stats()["live_buffers"] == 0


@pytest.mark.parametrize("device", [-1, "cuda:x", "tpu", 1.5, True])
def test_bad_device_values(manager: mp.BufferManager, device: object) -> None:
    with pytest.raises(ValueError, match="device"):
        manager.empty((2,), device=device)


@pytest.mark.parametrize(
    ("device", "hint"),
    [("CPU", "'cpu'"), ("host", "'cpu'"), ("gpu", "'cuda'"), ("GPU", "'cuda'"), ("Cuda", "'cuda'"),
     ("gpu:1", "'cuda:1'"), ("cuda: 1", "'cuda:1'"), (" cpu", "'cpu'")],
)  # fmt: skip
def test_only_the_documented_device_names_are_accepted(manager, device, hint) -> None:
    # The names torch accepts, spelled as torch spells them; anything else is refused with the
    # name it was probably meant to be, before any memory is touched.
    with pytest.raises(ValueError, match=f"did you mean {hint}"):
        manager.empty((2,), device=device)
    with pytest.raises(ValueError, match="did you mean"):
        mp.Process(target=print, device=device)
    assert manager.stats()["live_buffers"] == 0


def test_the_documented_device_values_parse() -> None:
    from gpushare._backends import parse_device

    class TorchLikeDevice:  # torch.device's two attributes, for runs without torch
        def __init__(self, type: str, index: int | None) -> None:
            self.type, self.index = type, index

    assert [parse_device(d) for d in (None, 0, 3, "cuda", "cuda:2", "cpu")] == [None, 0, 3, 0, 2, "cpu"]
    assert parse_device(TorchLikeDevice("cuda", None)) == 0
    assert parse_device(TorchLikeDevice("cuda", 1)) == 1
    assert parse_device(TorchLikeDevice("cpu", None)) == "cpu"
    with pytest.raises(ValueError, match="'meta' device"):
        parse_device(TorchLikeDevice("meta", None))


@pytest.mark.parametrize("device", [64, "cuda:64"])
def test_a_device_that_does_not_exist(manager, device) -> None:
    # With GPUs: "CUDA device 64 does not exist ... ordinals 0..N-1"; without: no usable GPU.
    with pytest.raises(mp.NoDeviceError, match=r"device 64 does not exist|GPU"):
        manager.empty((4,), device=device)
    assert manager.stats()["live_buffers"] == 0


def test_unknown_backend(manager: mp.BufferManager) -> None:
    with pytest.raises(mp.BackendUnavailableError, match="valid backends"):
        manager.empty((2,), device="cpu", backend="carrier-pigeon")
    with pytest.raises(mp.BackendUnavailableError, match="valid backends"):
        mp.BufferManager(backend="carrier-pigeon")


def test_host_backend_cannot_take_a_gpu_device(manager: mp.BufferManager) -> None:
    with pytest.raises(mp.BackendUnavailableError, match="host"):
        manager.empty((2,), device=0, backend="host")


def test_unpickle_in_owner_process_shares_memory(manager: mp.BufferManager) -> None:
    buf = manager.zeros((4,), "int32", device="cpu")
    data = pickle.dumps(buf)
    assert manager.stats()["unclaimed_leases"] == 1
    twin = pickle.loads(data)
    twin.numpy()[0] = 11
    assert buf.numpy()[0] == 11
    assert manager.stats()["leases"] == 1
    with pytest.raises(mp.DescriptorError, match="already claimed"):
        pickle.loads(data)
    twin.release()
    assert manager.stats()["leases"] == 0


def test_cloudpickle_carries_buffers(manager: mp.BufferManager) -> None:
    import cloudpickle

    buf = manager.full((3,), 4, "int16", device="cpu")
    twin = pickle.loads(cloudpickle.dumps({"x": buf}))["x"]
    np.testing.assert_array_equal(twin.numpy(), [4, 4, 4])


def test_no_gpu_means_no_device_error_for_cuda() -> None:
    from gpushare import _cuda

    if _cuda.available():
        pytest.skip("this machine has a GPU")
    with mp.Manager() as m, pytest.raises(mp.NoDeviceError, match="device='cpu'"):
        m.empty((2,), device=0)


def test_device_none_without_gpu_warns_once_and_uses_host(monkeypatch) -> None:
    from gpushare import _backends, _cuda

    if _cuda.available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(_backends, "_warned_no_gpu", False)
    with mp.Manager() as m:
        with pytest.warns(RuntimeWarning, match="no usable GPU"):
            buf = m.empty((2,))
        assert buf.backend == "host"
        m.empty((2,))  # no second warning (filterwarnings=error would raise)


# -- on a GPU (cuda_ipc): library views, pickling in the owner, release --------------


def _w_interop(out: Any, q: Any, kind: str) -> None:
    buf = q.get(timeout=GPU_TIMEOUT)
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


def _w_released(out: Any, q: Any) -> None:
    a16, a64 = q.get(timeout=GPU_TIMEOUT)
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


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kind", "module"),
    [("torch", "torch"), ("torch_dlpack", "torch"), ("cupy", "cupy"), ("numba", "numba.cuda"), ("jax", "jax")],
)
def test_library_views_in_worker(manager: mp.BufferManager, reap: list[Any], kind: str, module: str) -> None:
    require(module)
    q, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_interop, out, q, kind, device=0)
    arr = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
    buf = manager.from_numpy(arr, device=0)
    q.put(buf)
    tag, shape, dtype, view_ptr, buf_ptr, same, written = recv(out, proc, timeout=60)
    assert tag == "view"
    assert shape == (8, 256)
    assert dtype == "float32"
    assert view_ptr == buf_ptr, f"{kind} view copied the memory instead of aliasing it"
    assert same, f"{kind} view does not show the buffer's contents"
    assert written, f"the worker's own buffer does not show the write made through {kind}"
    np.testing.assert_array_equal(buf.numpy(), arr * 2 + 1)  # seen by the parent
    join_ok(proc, timeout=GPU_TIMEOUT)


@pytest.mark.gpu
def test_torch_aliases_owner_buffer(manager: mp.BufferManager) -> None:
    torch = require("torch")
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    proc = start_guarded(reap, _w_released, out, q, device=0)
    q.put((b16, b64))
    tag, w16, w64, released16, released64, outcomes = recv(out, proc, timeout=GPU_TIMEOUT)
    assert tag == "released"
    assert w16.dtype == np.float16 and w64.dtype == np.int64
    np.testing.assert_array_equal(w16, a16)
    np.testing.assert_array_equal(w64, a64)
    assert released16 and released64
    assert outcomes == dict.fromkeys(outcomes, "BufferReleasedError"), outcomes
    assert set(outcomes) == {"numpy", "ptr", "copy_from", "cuda_array_interface", "dlpack", "pickle"}
    join_ok(proc, timeout=GPU_TIMEOUT)
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
