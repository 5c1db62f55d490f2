"""Buffer on the host backend, in one process: attributes, views, copies, interop, errors."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

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


def test_sizes_over_2mib_round_up(manager: mp.BufferManager) -> None:
    manager.empty((3 << 20,), "uint8", device="cpu")
    assert manager.stats()["bytes_allocated"] == 4 << 20


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


def test_garbage_collection_recycles(manager: mp.BufferManager) -> None:
    buf = manager.empty((10,), device="cpu")
    del buf
    gc.collect()
    stats = manager.stats()
    assert stats["live_buffers"] == 0 and stats["pooled_buffers"] == 1
    again = manager.empty((20,), device="cpu")  # same size class: reused
    assert manager.stats()["reused"] == 1
    assert again.shape == (20,)


def test_trim_frees_pool(manager: mp.BufferManager) -> None:
    for _ in range(3):
        manager.empty((3 << 20,), "uint8", device="cpu").release()
    assert manager.stats()["bytes_pooled"] == 4 << 20
    assert manager.trim() == 4 << 20
    assert manager.stats()["bytes_allocated"] == 0


def test_pool_limit_is_enforced(tmp_path) -> None:
    with mp.Manager(pool_limit=2 << 20) as m:
        bufs = [m.empty((1,), "uint8", device="cpu") for _ in range(4)]
        del bufs
        gc.collect()
        from conftest import wait_until

        wait_until(lambda: m.stats()["bytes_pooled"] <= 2 << 20, timeout=5)
        assert m.stats()["bytes_allocated"] == 2 << 20


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


def test_unknown_backend(manager: mp.BufferManager) -> None:
    with pytest.raises(mp.BackendUnavailableError, match="valid backends"):
        manager.empty((2,), device="cpu", backend="carrier-pigeon")
    with pytest.raises(mp.BackendUnavailableError, match="valid backends"):
        mp.BufferManager(backend="carrier-pigeon")


def test_host_backend_cannot_take_a_gpu_device(manager: mp.BufferManager) -> None:
    with pytest.raises(mp.BackendUnavailableError, match="host"):
        manager.empty((2,), device=0, backend="host")


def test_shutdown_keeps_owner_buffers_valid_until_dropped() -> None:
    m = mp.Manager()
    buf = m.full((4,), 2, "int32", device="cpu")
    pooled = m.zeros((4,), device="cpu")
    pooled.release()
    m.shutdown()
    with pytest.raises(mp.ManagerClosedError):
        m.empty((2,), device="cpu")
    with pytest.raises(mp.ManagerClosedError, match="shutting down"):
        pickle.dumps(buf)
    # Still this process's memory: libraries holding views of it stay valid.
    np.testing.assert_array_equal(buf.numpy(), [2, 2, 2, 2])
    stats = m.stats()
    assert stats["closed"] is True and stats["bytes_allocated"] == mp.GRANULARITY  # the pooled one is freed
    buf.release()
    assert m.stats()["bytes_allocated"] == 0


def test_unstarted_manager() -> None:
    with pytest.raises(mp.ManagerClosedError, match="not started"):
        mp.BufferManager().empty((2,), device="cpu")


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
