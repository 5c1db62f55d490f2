"""The driver primitives for loaders and weight sync: pinned host memory, asynchronous and
batched copies, plain events, stream destruction.

Two halves. The GPU tests (``@pytest.mark.gpu``) run the primitives on a device and
check every byte they copy (fresh random data, never zeros). The CPU tests run the same
code against a stand-in for ``cuda.bindings.driver`` (:class:`FakeDriver`), which copies
host memory with ``ctypes.memmove`` and can lack, refuse or fail the batched copy: they
check which path :func:`gpushare._cuda.memcpy_batch_async` takes and that its probe
decides once, the flags passed to the driver, and that failures name the call. One
more checks that importing the package loads no driver and nothing heavy.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import mmap
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import fill_behind_a_running_kernel

from gpushare import _cuda
from gpushare._cuda import _copies, _driver
from gpushare._errors import CUDAError

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, 256, n, dtype=np.uint8)  # never zero: an untouched byte shows


def _layout(rng: np.random.Generator, count: int, src_size: int) -> tuple[list[int], list[int], list[int]]:
    """``count`` copies of different sizes: destination offsets that never overlap (with gaps
    between them), source offsets anywhere in the source."""
    sizes = [int(n) for n in rng.integers(1, 5000, count)]
    dst_offsets, end = [], 0
    for size in sizes:
        end += int(rng.integers(0, 64))
        dst_offsets.append(end)
        end += size
    src_offsets = [int(rng.integers(0, src_size - size)) for size in sizes]
    return dst_offsets, src_offsets, sizes


# ---------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------


def _is_pinned(ptr: int) -> bool:
    """Whether the driver knows ``ptr`` as page-locked host memory."""
    with _cuda.on_device(0) as driver:
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        err, kind = driver.cuPointerGetAttribute(attr, ptr)
    return err == driver.CUresult.CUDA_SUCCESS and int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)


def _read(dev: int, n: int) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    _cuda.memcpy_dtoh(out.ctypes.data, dev, n, 0)
    return out


@pytest.mark.gpu
def test_pinned_memory_copies_to_the_device_on_a_created_stream() -> None:
    seed = random.randrange(2**32)
    n = 3 * MiB + 123
    data = _random_bytes(np.random.default_rng(seed), n)
    host = _cuda.host_alloc(n)
    dev = _cuda.mem_alloc(n, 0)
    stream = _cuda.stream_create(0)
    event = _cuda.event_create(0)
    try:
        assert _is_pinned(host)
        ctypes.memmove(host, data.ctypes.data, n)
        _cuda.memcpy_htod_async(dev, host, n, 0, stream)
        _cuda.event_record(event, 0, stream)
        _cuda.event_synchronize(event, 0)
        assert _cuda.event_done(event, 0)
        np.testing.assert_array_equal(_read(dev, n), data, err_msg=f"seed {seed}")
    finally:
        _cuda.event_destroy(event, 0)
        _cuda.stream_destroy(stream, 0)
        _cuda.mem_free(dev, 0)
        _cuda.host_free(host)


@pytest.mark.gpu
def test_a_registered_mmap_is_pinned_copies_from_it_and_unregisters() -> None:
    seed = random.randrange(2**32)
    n = 2 * MiB
    m = mmap.mmap(-1, n)
    view = np.frombuffer(m, dtype=np.uint8)
    view[:] = _random_bytes(np.random.default_rng(seed), n)
    ptr = view.ctypes.data
    dev = _cuda.mem_alloc(n, 0)
    stream = _cuda.stream_create(0)
    try:
        assert not _is_pinned(ptr)
        _cuda.host_register(ptr, n)
        try:
            assert _is_pinned(ptr)
            try:
                import torch
            except ImportError:
                pass
            else:
                torch.cuda.init()  # is_pinned() says False, whatever the range, before torch's CUDA starts
                seen = torch.frombuffer(m, dtype=torch.uint8)
                assert seen.is_pinned(), "torch does not see the range as pinned"
                del seen  # it exports the mmap: close() below refuses while it lives
            _cuda.memcpy_htod_async(dev, ptr, n, 0, stream)
            _cuda.stream_synchronize(stream, 0)
        finally:
            _cuda.host_unregister(ptr)
        assert not _is_pinned(ptr)
        np.testing.assert_array_equal(_read(dev, n), view, err_msg=f"seed {seed}")
    finally:
        _cuda.stream_destroy(stream, 0)
        _cuda.mem_free(dev, 0)
        del view
        gc.collect()  # anything else still viewing the mmap (a failed assertion's frame)
        m.close()


@pytest.mark.gpu
def test_memcpy_async_copies_device_to_device_exactly_the_range() -> None:
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    n = MiB
    src_data, dst_data = _random_bytes(rng, n), _random_bytes(rng, n)
    src, dst = _cuda.mem_alloc(n, 0), _cuda.mem_alloc(n, 0)
    stream = _cuda.stream_create(0)
    try:
        _cuda.memcpy_htod(src, src_data.ctypes.data, n, 0)
        _cuda.memcpy_htod(dst, dst_data.ctypes.data, n, 0)
        size, src_off, dst_off = n - 1000, 37, 11
        _cuda.memcpy_async(dst + dst_off, src + src_off, size, 0, stream)
        _cuda.stream_synchronize(stream, 0)
        expected = dst_data.copy()
        expected[dst_off : dst_off + size] = src_data[src_off : src_off + size]
        np.testing.assert_array_equal(_read(dst, n), expected, err_msg=f"seed {seed}")
    finally:
        _cuda.stream_destroy(stream, 0)
        _cuda.mem_free(src, 0)
        _cuda.mem_free(dst, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["device", "pinned host"])
@pytest.mark.parametrize("on", ["created stream", "legacy stream"])
def test_memcpy_batch_async_makes_fifty_copies_of_different_sizes(source: str, on: str) -> None:
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    src_size = MiB
    dst_offsets, src_offsets, sizes = _layout(rng, 50, src_size)
    dst_size = dst_offsets[-1] + sizes[-1] + 100
    src_data, dst_data = _random_bytes(rng, src_size), _random_bytes(rng, dst_size)
    src = _cuda.host_alloc(src_size) if source == "pinned host" else _cuda.mem_alloc(src_size, 0)
    dst = _cuda.mem_alloc(dst_size, 0)
    stream = _cuda.stream_create(0) if on == "created stream" else 0
    try:
        if source == "pinned host":
            ctypes.memmove(src, src_data.ctypes.data, src_size)
        else:
            _cuda.memcpy_htod(src, src_data.ctypes.data, src_size, 0)
        _cuda.memcpy_htod(dst, dst_data.ctypes.data, dst_size, 0)
        _cuda.memcpy_batch_async([dst + o for o in dst_offsets], [src + o for o in src_offsets], sizes, 0, stream)
        _cuda.stream_synchronize(stream, 0)
        expected = dst_data.copy()
        for d, s, size in zip(dst_offsets, src_offsets, sizes, strict=True):
            expected[d : d + size] = src_data[s : s + size]
        np.testing.assert_array_equal(_read(dst, dst_size), expected, err_msg=f"seed {seed}")
        driver = _driver._bindings
        if on == "created stream" and _cuda.driver_version() >= 12080 and hasattr(driver, "cuMemcpyBatchAsync"):
            assert _copies._batch is True, "cuMemcpyBatchAsync refused a batch: copies went one by one"
    finally:
        if stream:
            _cuda.stream_destroy(stream, 0)
        _cuda.mem_free(dst, 0)
        if source == "pinned host":
            _cuda.host_free(src)
        else:
            _cuda.mem_free(src, 0)


def _kernel_layout(rng: np.random.Generator) -> tuple[list[int], list[int], list[int], int, int]:
    """200 copies for the copy kernel (three launches): sizes around its chunk and word edges
    and random ones, half of them at odd addresses on one side or the other."""
    from gpushare._cuda._kernels import CHUNK

    edges = [0, 1, 15, 16, 17, 31, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, MiB + 3]
    sizes = edges + [int(n) for n in rng.integers(1, 200_000, 200 - len(edges))]
    dst_offsets, src_offsets, dst_end, src_end = [], [], 0, 0
    for i, size in enumerate(sizes):
        dst_end = (dst_end + 64 + 15) // 16 * 16 + (3 if i % 4 == 1 else 0)  # a gap before each
        src_end = (src_end + 15) // 16 * 16 + (1 if i % 4 == 2 else 0)
        dst_offsets.append(dst_end)
        src_offsets.append(src_end)
        dst_end += size
        src_end += size
    return dst_offsets, src_offsets, sizes, dst_end + 64, src_end


@pytest.mark.gpu
@pytest.mark.parametrize("on", ["created stream", "legacy stream"])
def test_the_copy_kernel_makes_two_hundred_copies_of_every_awkward_size_and_alignment(on: str) -> None:
    from gpushare._cuda import _kernels

    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    dst_offsets, src_offsets, sizes, dst_size, src_size = _kernel_layout(rng)
    src_data, dst_data = _random_bytes(rng, src_size), _random_bytes(rng, dst_size)
    src, dst = _cuda.mem_alloc(src_size, 0), _cuda.mem_alloc(dst_size, 0)
    stream = _cuda.stream_create(0) if on == "created stream" else 0
    try:
        _cuda.memcpy_htod(src, src_data.ctypes.data, src_size, 0)
        _cuda.memcpy_htod(dst, dst_data.ctypes.data, dst_size, 0)
        dsts, srcs = [dst + o for o in dst_offsets], [src + o for o in src_offsets]
        _cuda.memcpy_batch_async(dsts, srcs, sizes, 0, stream, kernel=True)
        assert _kernels.kernel_status(0) == "ready", f"the copy kernel was not used: {_kernels.kernel_status(0)}"
        _cuda.stream_synchronize(stream, 0)
        expected = dst_data.copy()
        for d, s_, size in zip(dst_offsets, src_offsets, sizes, strict=True):
            expected[d : d + size] = src_data[s_ : s_ + size]
        np.testing.assert_array_equal(_read(dst, dst_size), expected, err_msg=f"seed {seed}")
    finally:
        if stream:
            _cuda.stream_destroy(stream, 0)
        _cuda.mem_free(dst, 0)
        _cuda.mem_free(src, 0)


@pytest.mark.multigpu
def test_the_copy_kernel_is_built_for_each_device_and_copies_on_each() -> None:
    """Device 1 first, then 0: each device's primary context gets its own module, and a copy on
    one device runs the kernel built for it."""
    from gpushare._cuda import _kernels

    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for ordinal in (1, 0):
        dst_offsets, src_offsets, sizes, dst_size, src_size = _kernel_layout(rng)
        src_data, dst_data = _random_bytes(rng, src_size), _random_bytes(rng, dst_size)
        src, dst = _cuda.mem_alloc(src_size, ordinal), _cuda.mem_alloc(dst_size, ordinal)
        try:
            _cuda.memcpy_htod(src, src_data.ctypes.data, src_size, ordinal)
            _cuda.memcpy_htod(dst, dst_data.ctypes.data, dst_size, ordinal)
            dsts, srcs = [dst + o for o in dst_offsets], [src + o for o in src_offsets]
            _cuda.memcpy_batch_async(dsts, srcs, sizes, ordinal, 0, kernel=True)
            assert _kernels.kernel_status(ordinal) == "ready", _kernels.kernel_status(ordinal)
            _cuda.synchronize(ordinal)
            expected = dst_data.copy()
            for d, s_, size in zip(dst_offsets, src_offsets, sizes, strict=True):
                expected[d : d + size] = src_data[s_ : s_ + size]
            out = np.zeros(dst_size, np.uint8)
            _cuda.memcpy_dtoh(out.ctypes.data, dst, dst_size, ordinal)
            np.testing.assert_array_equal(out, expected, err_msg=f"device {ordinal}, seed {seed}")
        finally:
            _cuda.mem_free(dst, ordinal)
            _cuda.mem_free(src, ordinal)
    assert _driver._kernels[0][0] is not _driver._kernels[1][0]


_KERNEL_SCRIPT = """
import os, sys, numpy as np
sys.path.insert(0, sys.argv[1])
from gpushare import _cuda
from gpushare._cuda import _kernels
n = 3 * 1024 * 1024 + 7
data = np.random.default_rng(5).integers(1, 256, n, dtype=np.uint8)
src, dst = _cuda.mem_alloc(n, 0), _cuda.mem_alloc(n, 0)
_cuda.memcpy_htod(src, data.ctypes.data, n, 0)
half = n // 2
_cuda.memcpy_batch_async([dst, dst + half], [src, src + half], [half, n - half], 0, 0, kernel=True)
_cuda.synchronize(0)
out = np.zeros(n, np.uint8)
_cuda.memcpy_dtoh(out.ctypes.data, dst, n, 0)
print(_kernels.kernel_status(0), "same" if (out == data).all() else "DIFFERENT")
"""


@pytest.mark.gpu
def test_the_copy_kernel_is_compiled_once_then_loaded_from_disk_and_can_be_turned_off(tmp_path: Path) -> None:
    """A fresh process compiles it (NVRTC) and keeps the cubin under $XDG_CACHE_HOME/gpushare; the
    next loads that file; a damaged file is compiled again and replaced; GPUSHARE_COPY_KERNEL=0
    turns it off, and the driver's calls copy."""
    import os

    def run(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _KERNEL_SCRIPT, str(ROOT)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run() == "ready same"
    cubins = list((tmp_path / "gpushare").glob("copy-regions-sm_*.cubin"))
    assert len(cubins) == 1 and cubins[0].read_bytes()[:4] == b"\x7fELF"
    made = cubins[0].stat().st_mtime_ns
    assert run() == "ready same"
    assert cubins[0].stat().st_mtime_ns == made, "the second process compiled the kernel again"
    cubins[0].write_bytes(b"not a cubin")
    assert run() == "ready same"
    assert cubins[0].read_bytes()[:4] == b"\x7fELF", "the damaged file was not replaced"
    assert run(GPUSHARE_COPY_KERNEL="0") == "off: GPUSHARE_COPY_KERNEL=0 same"


@pytest.mark.gpu
def test_a_destroyed_stream_still_runs_what_was_queued_on_it() -> None:
    seed = random.randrange(2**32)
    n = 8 * MiB
    data = _random_bytes(np.random.default_rng(seed), n)
    host = _cuda.host_alloc(n)
    dev = _cuda.mem_alloc(n, 0)
    try:
        ctypes.memmove(host, data.ctypes.data, n)
        stream = _cuda.stream_create(0)
        _cuda.memcpy_htod_async(dev, host, n, 0, stream)
        _cuda.stream_destroy(stream, 0)
        assert stream not in _driver._stream_handles
        _cuda.synchronize(0)
        np.testing.assert_array_equal(_read(dev, n), data, err_msg=f"seed {seed}")
    finally:
        _cuda.mem_free(dev, 0)
        _cuda.host_free(host)


@pytest.mark.gpu
def test_host_memory_misuse_raises_cuda_error_naming_the_call() -> None:
    n = 2 * MiB
    m = mmap.mmap(-1, n)
    view = np.frombuffer(m, dtype=np.uint8)
    ptr = view.ctypes.data
    try:
        with pytest.raises(CUDAError, match="cuMemHostUnregister") as never_registered:
            _cuda.host_unregister(ptr)
        assert never_registered.value.call == "cuMemHostUnregister"
        assert never_registered.value.name == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"
        _cuda.host_register(ptr, n)
        try:
            with pytest.raises(CUDAError, match="cuMemHostRegister") as twice:
                _cuda.host_register(ptr, n)
            assert twice.value.name == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
        finally:
            _cuda.host_unregister(ptr)
    finally:
        del view
        m.close()


@pytest.mark.gpu
def test_a_plain_event_orders_a_created_stream_after_the_default_stream() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(1 << 22, device="cuda:0")
    nbytes = t.numel() * 4
    out = _cuda.mem_alloc(nbytes, 0)
    event = _cuda.event_create(0)
    stream = _cuda.stream_create(0)
    try:
        assert _cuda.event_done(event, 0), "an event never recorded counts as done"
        fill_behind_a_running_kernel(torch, t, 3.0)
        _cuda.event_record(event, 0)  # the legacy default stream, behind torch's kernel
        assert not _cuda.event_done(event, 0)
        _cuda.stream_wait_event(stream, event, 0)
        _cuda.memcpy_async(out, t.data_ptr(), nbytes, 0, stream)
        _cuda.event_synchronize(event, 0)
        assert _cuda.event_done(event, 0)
        _cuda.stream_synchronize(stream, 0)
        host = np.zeros(t.numel(), np.float32)
        _cuda.memcpy_dtoh(host.ctypes.data, out, nbytes, 0)
        assert (host == 3.0).all(), "the copy on the created stream ran before the fill it waited for"
    finally:
        torch.cuda.synchronize()
        _cuda.stream_destroy(stream, 0)
        _cuda.event_destroy(event, 0)
        _cuda.mem_free(out, 0)


# ---------------------------------------------------------------------------
# without a GPU: a stand-in driver
# ---------------------------------------------------------------------------

KEY = 0xC0DE  # the stand-in primary context of device 0, as an int
STREAM = 0x5000  # a stream made by stream_create, for the stand-in


class _Handle:
    """CUdeviceptr, CUstream, CUcontext, CUevent: a value with ``int()``."""

    def __init__(self, value: int = 0) -> None:
        self.value = int(value)

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handle) and type(other) is type(self) and other.value == self.value


class FakeDriver:
    """The part of ``cuda.bindings.driver`` that copies, host memory, events and streams
    use, on host memory. ``batch`` is what ``cuMemcpyBatchAsync`` does: "works", "missing"
    (cuda-bindings without it), "not found" (raises as cuda-bindings does when the driver
    library lacks it), or a CUresult it returns. ``failing`` holds destinations
    ``cuMemcpyAsync`` refuses."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2
        CUDA_ERROR_ILLEGAL_ADDRESS = 700
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUmemcpySrcAccessOrder(enum.IntEnum):
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
        CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3

    class CUevent_flags(enum.IntEnum):  # noqa: N801 - the driver's name
        CU_EVENT_DISABLE_TIMING = 2
        CU_EVENT_INTERPROCESS = 4

    class CUdeviceptr(_Handle):
        pass

    class CUstream(_Handle):
        pass

    class CUcontext(_Handle):
        pass

    class CUmemcpyAttributes:
        srcAccessOrder: Any = 0  # noqa: N815 - the driver's field name

    CU_MEMHOSTALLOC_PORTABLE = 0x11  # not the real values: the test sees which one was passed
    CU_MEMHOSTREGISTER_PORTABLE = 0x21

    def __init__(self, batch: str | int = "works") -> None:
        self.batch = batch
        self.failing: set[int] = set()
        self.calls: list[tuple[Any, ...]] = []
        self.current: Any = self.CUcontext(KEY)
        self.host_results: dict[str, int] = {}

    def __getattribute__(self, name: str) -> Any:
        if name == "cuMemcpyBatchAsync" and object.__getattribute__(self, "batch") == "missing":
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return 0, self.CUresult(err).name.encode()

    def cuGetErrorString(self, err: int) -> tuple[int, bytes]:
        return 0, b"stand-in explanation"

    def cuCtxGetCurrent(self) -> tuple[int, Any]:
        return 0, self.current

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[int]:
        self.calls.append(("cuCtxPushCurrent", int(ctx)))
        return (0,)

    def cuCtxPopCurrent(self) -> tuple[int, Any]:
        self.calls.append(("cuCtxPopCurrent",))
        return 0, self.CUcontext(KEY)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[int]:
        self.calls.append(("cuCtxSetCurrent", int(ctx)))
        self.current = ctx
        return (0,)

    def cuMemcpyAsync(self, dst: int, src: int, size: int, stream: Any) -> tuple[int]:
        assert isinstance(stream, self.CUstream)
        self.calls.append(("cuMemcpyAsync", dst, src, size, int(stream)))
        if dst in self.failing:
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
        ctypes.memmove(dst, src, size)
        return (0,)

    def cuMemcpyBatchAsync(
        self,
        dsts: list[Any],
        srcs: list[Any],
        sizes: list[int],
        count: int,
        attrs: list[Any],
        idxs: list[int],
        num_attrs: int,
        stream: Any,
    ) -> tuple[int]:
        # What cuda-bindings 13.x checks and passes on (driver.pyx, cuMemcpyBatchAsync).
        assert all(isinstance(p, self.CUdeviceptr) for p in [*dsts, *srcs]), "pointers must be CUdeviceptr"
        assert all(type(n) is int for n in sizes)
        assert count == len(dsts) == len(srcs) == len(sizes)
        assert num_attrs == len(attrs) == len(idxs) == 1 and idxs == [0]
        assert attrs[0].srcAccessOrder == self.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        assert isinstance(stream, self.CUstream)
        self.calls.append(("cuMemcpyBatchAsync", count, int(stream)))
        if self.batch == "not found":
            raise RuntimeError("function cuMemcpyBatchAsync is not found")  # FunctionNotFoundError
        if self.batch != "works":
            return (self.CUresult(int(self.batch)),)
        for dst, src, size in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(int(dst), int(src), size)
        return (0,)

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[int, int]:
        self.calls.append(("cuMemHostAlloc", nbytes, flags))
        return 0, 0x7000

    def cuMemFreeHost(self, ptr: int) -> tuple[int]:
        self.calls.append(("cuMemFreeHost", ptr))
        return (0,)

    def cuMemHostRegister(self, ptr: int, nbytes: int, flags: int) -> tuple[int]:
        self.calls.append(("cuMemHostRegister", ptr, nbytes, flags))
        return (self.host_results.get("cuMemHostRegister", 0),)

    def cuMemHostUnregister(self, ptr: int) -> tuple[int]:
        self.calls.append(("cuMemHostUnregister", ptr))
        return (self.host_results.get("cuMemHostUnregister", 0),)

    def cuEventCreate(self, flags: int) -> tuple[int, Any]:
        self.calls.append(("cuEventCreate", flags))
        return 0, _Handle(0xE7)

    def cuStreamDestroy(self, stream: Any) -> tuple[int]:
        self.calls.append(("cuStreamDestroy", stream))
        return (0,)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """The stand-in, loaded as the driver, with device 0's primary context retained and
    current on this thread; the batch probe not yet run."""
    driver = FakeDriver()
    monkeypatch.setattr(_driver, "_bindings", driver)
    monkeypatch.setattr(_driver, "_primary", {0: driver.CUcontext(KEY)})
    monkeypatch.setattr(_driver, "_primary_ints", {0: KEY})
    monkeypatch.setattr(_driver, "_stream_handles", {})
    monkeypatch.setattr(_copies, "_batch", None)
    return driver


class Copies:
    """Host buffers for a batch: random source and destination, the expected result."""

    def __init__(self, count: int = 50, seed: int | None = None) -> None:
        self.seed = random.randrange(2**32) if seed is None else seed
        rng = np.random.default_rng(self.seed)
        self.dst_offsets, self.src_offsets, self.sizes = _layout(rng, count, 1 << 16)
        self.src = _random_bytes(rng, 1 << 16)
        self.dst = _random_bytes(rng, self.dst_offsets[-1] + self.sizes[-1] + 100)
        self.expected = self.dst.copy()
        for d, s, n in zip(self.dst_offsets, self.src_offsets, self.sizes, strict=True):
            self.expected[d : d + n] = self.src[s : s + n]

    def run(self, stream: int = STREAM) -> None:
        dst, src = self.dst.ctypes.data, self.src.ctypes.data
        _cuda.memcpy_batch_async(
            [dst + o for o in self.dst_offsets], [src + o for o in self.src_offsets], self.sizes, 0, stream
        )

    def check(self) -> None:
        np.testing.assert_array_equal(self.dst, self.expected, err_msg=f"seed {self.seed}")


def test_a_working_batch_is_one_call_and_the_probe_sticks(fake: FakeDriver) -> None:
    for _ in range(2):
        copies = Copies()
        copies.run()
        copies.check()
    assert fake.names() == ["cuMemcpyBatchAsync", "cuMemcpyBatchAsync"]
    assert [call[1:] for call in fake.calls] == [(50, STREAM), (50, STREAM)]
    assert _copies._batch is True


@pytest.mark.parametrize(
    "batch",
    [
        "missing",
        "not found",
        FakeDriver.CUresult.CUDA_ERROR_NOT_SUPPORTED,
        FakeDriver.CUresult.CUDA_ERROR_INVALID_VALUE,
    ],
)
def test_without_a_working_batch_the_copies_go_one_by_one_and_the_probe_runs_once(
    fake: FakeDriver, batch: str | int
) -> None:
    fake.batch = batch
    for _ in range(3):
        copies = Copies()
        copies.run()
        copies.check()
    probes = 0 if batch == "missing" else 1
    assert fake.names().count("cuMemcpyBatchAsync") == probes
    assert fake.names().count("cuMemcpyAsync") == 3 * 50
    assert _copies._batch is False


@pytest.mark.parametrize("legacy", [0, 1])
def test_the_legacy_default_stream_copies_one_by_one_and_decides_nothing(fake: FakeDriver, legacy: int) -> None:
    copies = Copies()
    copies.run(stream=legacy)
    copies.check()
    assert fake.names() == ["cuMemcpyAsync"] * 50
    assert {call[4] for call in fake.calls} == {legacy}
    assert _copies._batch is None
    Copies().run()
    assert fake.names()[-1] == "cuMemcpyBatchAsync"


def test_a_refused_probe_whose_copies_fail_decides_nothing(fake: FakeDriver) -> None:
    fake.batch = FakeDriver.CUresult.CUDA_ERROR_INVALID_VALUE
    copies = Copies(count=5)
    fake.failing.add(copies.dst.ctypes.data + copies.dst_offsets[3])
    with pytest.raises(CUDAError, match=r"copy 3 of 5") as caught:
        copies.run()
    assert caught.value.call == "cuMemcpyAsync"
    assert caught.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert _copies._batch is None, "bad copies must not turn batching off for the process"
    fake.batch, fake.failing = "works", set()
    good = Copies()
    good.run()
    good.check()
    assert fake.names()[-1] == "cuMemcpyBatchAsync"
    assert _copies._batch is True


def test_after_batching_worked_a_refusal_sends_only_that_batch_down_the_loop(fake: FakeDriver) -> None:
    Copies().run()
    fake.batch = FakeDriver.CUresult.CUDA_ERROR_NOT_SUPPORTED
    refused = Copies()
    refused.run()
    refused.check()
    assert fake.names()[1:] == ["cuMemcpyBatchAsync"] + ["cuMemcpyAsync"] * 50
    assert _copies._batch is True
    fake.batch = "works"
    Copies().run()
    assert fake.names()[-1] == "cuMemcpyBatchAsync"


def test_other_batch_errors_raise_naming_the_call(fake: FakeDriver) -> None:
    fake.batch = FakeDriver.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CUDAError, match="cuMemcpyBatchAsync failed with CUDA_ERROR_ILLEGAL_ADDRESS") as caught:
        Copies().run()
    assert caught.value.call == "cuMemcpyBatchAsync"
    assert "cuMemcpyAsync" not in fake.names()


def test_mismatched_lists_are_refused_and_an_empty_batch_calls_nothing(fake: FakeDriver) -> None:
    with pytest.raises(ValueError, match="2 destinations, 1 sources, 2 sizes"):
        _cuda.memcpy_batch_async([1, 2], [3], [4, 5], 0, STREAM)
    _cuda.memcpy_batch_async([], [], [], 0, STREAM)
    assert fake.calls == []


def test_the_context_is_pushed_and_popped_only_when_another_is_current(fake: FakeDriver) -> None:
    Copies().run()
    assert "cuCtxPushCurrent" not in fake.names()
    fake.current = fake.CUcontext(KEY + 8)  # torch's own context, say
    Copies().run()
    assert fake.names()[-3:] == ["cuCtxPushCurrent", "cuMemcpyBatchAsync", "cuCtxPopCurrent"]
    fake.current = None  # a thread with no context yet: the primary one is made current and left
    data, out = _random_bytes(np.random.default_rng(), 64), np.zeros(64, np.uint8)
    _cuda.memcpy_async(out.ctypes.data, data.ctypes.data, 64, 0, STREAM)
    assert fake.names()[-2:] == ["cuCtxSetCurrent", "cuMemcpyAsync"]
    np.testing.assert_array_equal(out, data)


def test_host_memory_is_portable_and_failures_name_the_call(fake: FakeDriver) -> None:
    assert _cuda.host_alloc(4096) == 0x7000
    _cuda.host_free(0x7000)
    _cuda.host_register(0x9000, 8192)
    _cuda.host_unregister(0x9000)
    pushed = [call for call in fake.calls if call[0] == "cuCtxPushCurrent"]
    assert pushed == [("cuCtxPushCurrent", KEY)] * 4, "each call runs in device 0's primary context"
    assert fake.names().count("cuCtxPopCurrent") == 4
    assert ("cuMemHostAlloc", 4096, FakeDriver.CU_MEMHOSTALLOC_PORTABLE) in fake.calls
    assert ("cuMemHostRegister", 0x9000, 8192, FakeDriver.CU_MEMHOSTREGISTER_PORTABLE) in fake.calls
    fake.host_results["cuMemHostUnregister"] = FakeDriver.CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    with pytest.raises(CUDAError, match="cuMemHostUnregister failed with CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"):
        _cuda.host_unregister(0xA000)
    assert fake.names()[-1] == "cuCtxPopCurrent", "a failing call still pops the context it pushed"


def test_a_plain_event_is_not_interprocess_and_a_destroyed_stream_leaves_the_cache(fake: FakeDriver) -> None:
    _cuda.event_create(0)
    assert ("cuEventCreate", FakeDriver.CUevent_flags.CU_EVENT_DISABLE_TIMING) in fake.calls
    _driver._stream(fake, STREAM)
    assert STREAM in _driver._stream_handles
    _cuda.stream_destroy(STREAM, 0)
    assert STREAM not in _driver._stream_handles
    assert ("cuStreamDestroy", FakeDriver.CUstream(STREAM)) in fake.calls


def test_the_copy_kernel_is_only_asked_for_device_copies_of_two_or_more(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernel=True with one copy, or the kernel turned off, goes to the driver's copies; the
    reason it is off is kept, and it is not tried again."""
    from gpushare._cuda import _kernels

    monkeypatch.setattr(_driver, "_kernels", {})
    monkeypatch.setattr(_driver, "_kernel_errors", {})
    monkeypatch.setenv("GPUSHARE_COPY_KERNEL", "0")
    assert _kernels.kernel_status(0) == "not built"
    one = Copies(count=1)
    dst, src = one.dst.ctypes.data, one.src.ctypes.data
    _cuda.memcpy_batch_async([dst + one.dst_offsets[0]], [src + one.src_offsets[0]], one.sizes, 0, STREAM, kernel=True)
    one.check()
    assert _kernels.kernel_status(0) == "not built"  # one copy: the kernel was not asked for
    for _ in range(2):
        copies = Copies()
        dst, src = copies.dst.ctypes.data, copies.src.ctypes.data
        dsts, srcs = [dst + o for o in copies.dst_offsets], [src + o for o in copies.src_offsets]
        _cuda.memcpy_batch_async(dsts, srcs, copies.sizes, 0, STREAM, kernel=True)
        copies.check()
    assert _kernels.kernel_status(0) == "off: GPUSHARE_COPY_KERNEL=0"
    assert fake.names() == ["cuMemcpyBatchAsync"] * 3


def test_a_copy_kernel_the_driver_refuses_to_launch_is_given_up_and_the_driver_copies(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused first launch (too many resources on some other GPU, say) queues nothing: that
    batch, and every later one, goes to the driver's copies, and the reason is kept."""
    from gpushare._cuda import _kernels

    launches: list[tuple[Any, ...]] = []

    def refuse(*args: Any) -> tuple[int]:
        launches.append(args)
        return (FakeDriver.CUresult.CUDA_ERROR_NOT_SUPPORTED,)

    fake.cuLaunchKernel = refuse  # type: ignore[attr-defined]
    fake.cuGetErrorName = lambda err: (0, b"CUDA_ERROR_NOT_SUPPORTED")  # type: ignore[attr-defined]
    monkeypatch.setattr(_driver, "_kernels", {0: ("kernel", 264)})  # as if built
    monkeypatch.setattr(_driver, "_kernel_errors", {})
    for _ in range(2):
        copies = Copies(count=150)  # two launches' worth: the first is refused
        dst, src = copies.dst.ctypes.data, copies.src.ctypes.data
        dsts, srcs = [dst + o for o in copies.dst_offsets], [src + o for o in copies.src_offsets]
        _cuda.memcpy_batch_async(dsts, srcs, copies.sizes, 0, STREAM, kernel=True)
        copies.check()
    assert len(launches) == 1 and launches[0][0] == "kernel" and launches[0][4] == _kernels.THREADS
    assert _kernels.kernel_status(0) == "off: cuLaunchKernel refused it (CUDA_ERROR_NOT_SUPPORTED)"
    assert fake.names() == ["cuMemcpyBatchAsync"] * 2


def _emulate_kernel(launches: list[tuple[Any, ...]]) -> Any:
    """A stand-in for ``cuLaunchKernel`` of the copy kernel that reads its argument as the
    kernel does (count, destinations, sources, sizes, each copy's first chunk) and makes the
    copies in host memory, chunk by chunk."""
    from gpushare._cuda import _kernels

    def launch(function: Any, blocks: int, gy: int, gz: int, threads: int, *rest: Any) -> tuple[int]:
        params = rest[-2]
        address = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        args = type(_kernels._Regions()).from_address(address)
        launches.append((address, blocks, threads, args.count))
        chunks = args.first[args.count]
        assert blocks == min(chunks, 264)
        for i in range(args.count):
            size, first = args.bytes[i], args.first[i]
            assert args.first[i + 1] - first == -(-size // _kernels.CHUNK)
            for c in range(args.first[i + 1] - first):
                offset = c * _kernels.CHUNK
                ctypes.memmove(args.dst[i] + offset, args.src[i] + offset, min(_kernels.CHUNK, size - offset))
        return (FakeDriver.CUresult.CUDA_SUCCESS,)

    return launch


def test_the_copy_kernels_arguments_describe_the_copies_and_are_kept_for_the_same_copies(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the host side of the kernel does, read back as the kernel reads it: 150 copies in
    two launches (96 + 54), every byte where it belongs. The same copies again launch from
    the same arguments (the fill is not redone); other copies get their own, and only the
    last PREPARED sets are kept."""
    from gpushare._cuda import _kernels

    launches: list[tuple[Any, ...]] = []
    fake.cuLaunchKernel = _emulate_kernel(launches)  # type: ignore[attr-defined]
    monkeypatch.setattr(_driver, "_kernels", {0: ("kernel", 264)})  # as if built
    monkeypatch.setattr(_driver, "_kernel_launches", {})
    copies = Copies(count=150)
    dst, src = copies.dst.ctypes.data, copies.src.ctypes.data
    dsts, srcs = [dst + o for o in copies.dst_offsets], [src + o for o in copies.src_offsets]
    _cuda.memcpy_batch_async(dsts, srcs, copies.sizes, 0, STREAM, kernel=True)
    copies.check()
    assert [(threads, count) for _, _, threads, count in launches] == [(_kernels.THREADS, 96), (_kernels.THREADS, 54)]
    copies.dst[:] = 0
    copies.expected = copies.dst.copy()
    for d, s_, n in zip(copies.dst_offsets, copies.src_offsets, copies.sizes, strict=True):
        copies.expected[d : d + n] = copies.src[s_ : s_ + n]
    _cuda.memcpy_batch_async(list(dsts), list(srcs), list(copies.sizes), 0, STREAM, kernel=True)  # equal lists
    copies.check()
    assert [a for a, *_ in launches[2:]] == [a for a, *_ in launches[:2]], "the kept arguments were not used"
    assert len(_driver._kernel_launches) == 1
    for n in range(_kernels.PREPARED + 3):
        other = Copies(count=3 + n)
        dst, src = other.dst.ctypes.data, other.src.ctypes.data
        other_dsts = [dst + o for o in other.dst_offsets]
        _cuda.memcpy_batch_async(other_dsts, [src + o for o in other.src_offsets], other.sizes, 0, STREAM, kernel=True)
        other.check()
    assert len(_driver._kernel_launches) == _kernels.PREPARED
    assert "cuMemcpyBatchAsync" not in fake.names(), "every copy went to the kernel"


def test_importing_the_package_loads_no_driver_and_nothing_heavy() -> None:
    """``import gpushare._cuda`` adds only its own modules to what gpushare._errors loads:
    no cuda-bindings (loaded on first use), no ctypes, typing or threading."""
    script = (
        "import sys, types\n"
        "package = types.ModuleType('gpushare'); package.__path__ = [sys.argv[1]]\n"
        "sys.modules['gpushare'] = package  # the package's own __init__ is not what is measured\n"
        "import gpushare._errors\n"
        "before = set(sys.modules)\n"
        "import gpushare._cuda\n"
        "print(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-B", "-c", script, str(ROOT / "gpushare")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out and all(name.startswith("gpushare._cuda") for name in out), out
    assert "gpushare._cuda._queries" not in out, "the GIL-keeping queries (and ctypes) load with the driver"
