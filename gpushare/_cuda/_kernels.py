"""gpushare's one kernel: many device-to-device copies in one launch.

- :func:`launch_copies` queues up to :data:`REGIONS` copies per launch on a stream;
  they are unordered among themselves.
- Every pointer must be device memory the device's primary context reaches: no host
  memory, no other GPU's (callers say so: ``memcpy_batch_async(..., kernel=True)``).
- The source below is compiled once per process and device by NVRTC; the cubin is cached on disk.
- Where the kernel cannot be had, :func:`launch_copies` returns False and
  :func:`kernel_status` says why; the caller queues driver copies instead.
Why a kernel, and how it splits the work: dev/design-notes.md, "The copy kernel".
"""

from __future__ import annotations

import os

from . import _driver
from ._driver import _check, _enter, _stream

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

REGIONS = 96  # copies per launch: the argument stays under 4 KiB
# The fastest of 72 variants of these four, the cache hints and the order of chunks, timed with the
# `weight_sync` benchmark scenarios' layouts: dev/performance.md, "Copy mode: what a copy per tensor costs the GPU".
CHUNK = 128 * 1024  # bytes a block copies before it takes the next chunk
THREADS = 1024
BLOCKS_PER_SM = 2
UNROLL = 8  # 16-byte loads in flight per thread
NAME = b"gpushare_copy_regions"

_SOURCE = (
    r"""
#define REGIONS @REGIONS@
#define CHUNK @CHUNK@ULL
#define UNROLL @UNROLL@
typedef unsigned long long u64;

struct Regions {
    u64 count;
    u64 dst[REGIONS];
    u64 src[REGIONS];
    u64 bytes[REGIONS];
    u64 first[REGIONS + 1];  /* the first chunk of each copy; first[count]: all chunks */
};

extern "C" __global__ void __launch_bounds__(@THREADS@)
gpushare_copy_regions(const __grid_constant__ Regions r)
{
    const u64 chunks = r.first[r.count];
    u64 i = 0;  /* a block's chunks only go up, so its copy index only goes up */
    for (u64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        while (c >= r.first[i + 1]) ++i;
        const u64 offset = (c - r.first[i]) * CHUNK;
        const u64 rest = r.bytes[i] - offset;
        const u64 n = rest < CHUNK ? rest : CHUNK;
        char* d = (char*)r.dst[i] + offset;
        const char* s = (const char*)r.src[i] + offset;
        u64 done = 0;
        if ((((u64)d | (u64)s) & 15) == 0) {
            const u64 words = n >> 4;
            uint4* dw = (uint4*)d;
            const uint4* sw = (const uint4*)s;
            const u64 step = blockDim.x;
            u64 k = threadIdx.x;
            for (; k + (UNROLL - 1) * step < words; k += UNROLL * step) {
                uint4 v[UNROLL];  /* every load in flight before the first store */
#pragma unroll
                for (int j = 0; j < UNROLL; ++j) v[j] = __ldg(sw + k + j * step);
#pragma unroll
                for (int j = 0; j < UNROLL; ++j) __stcs(dw + k + j * step, v[j]);  /* streamed: not read again */
            }
            for (; k < words; k += step) dw[k] = sw[k];
            done = words << 4;
        }
        for (u64 k = done + threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
    }
}
""".replace("@REGIONS@", str(REGIONS))
    .replace("@CHUNK@", str(CHUNK))
    .replace("@THREADS@", str(THREADS))
    .replace("@UNROLL@", str(UNROLL))
)


def kernel_status(ordinal: int, *, build: bool = False) -> str:
    """``"ready"``, ``"not built"`` (not tried yet in this process) or ``"off: <why>"``;
    ``build``: try to build it first (as the first copy that wants it would)."""
    if build:
        _kernel(ordinal)
    if ordinal in _driver._kernels:
        return "ready" if _driver._kernels[ordinal] is not None else f"off: {_driver._kernel_errors[ordinal]}"
    return "not built"


def launch_copies(dsts: list[int], srcs: list[int], sizes: list[int], ordinal: int, stream: int) -> bool:
    """Queue the copies ``srcs[i] -> dsts[i]`` (``sizes[i]`` bytes, device memory of ``ordinal``)
    on ``stream`` with gpushare's kernel; False, with nothing queued, where it cannot be had."""
    kernel = _kernel(ordinal)
    if kernel is None:
        return False
    function, blocks_max = kernel
    launches = _prepared(dsts, srcs, sizes, ordinal, blocks_max)
    driver, pushed = _enter(ordinal)
    try:
        handle = _stream(driver, stream)
        for n, (blocks, params, _kept) in enumerate(launches):
            result = driver.cuLaunchKernel(function, blocks, 1, 1, THREADS, 1, 1, 0, handle, params, 0)
            if result[0] != driver.CUresult.CUDA_SUCCESS and not n and _driver._kernels.get(ordinal) is kernel:
                # The first launch of this call refused, so nothing is queued yet: this device
                # copies with the driver's calls from now on, starting with these copies.
                why = _driver._error_name(driver, result[0])
                _driver._kernels[ordinal] = None
                _driver._kernel_errors[ordinal] = f"cuLaunchKernel refused it ({why})"
                return False
            _check(
                "cuLaunchKernel",
                result,
                hint="gpushare's region-copy kernel; set GPUSHARE_COPY_KERNEL=0 to copy with the driver's calls",
            )
    finally:
        if pushed:
            driver.cuCtxPopCurrent()
    return True


PREPARED = 16  # the argument sets kept (a trainer's two versions, an engine's two, a few more)


def _prepared(dsts: list[int], srcs: list[int], sizes: list[int], ordinal: int, blocks_max: int) -> list[Any]:
    """The launches for these copies: ``(blocks, kernelParams address, what it points at)`` each,
    kept in ``_driver._kernel_launches``.

    Filling the argument structs is a measurable share of a copy-mode sync's
    host time (the `weight_sync_8b` benchmark scenario's 291 copies), and the same copies
    come every step (a version's addresses and a state dict's or an engine's
    tensors'): they are kept by the copies' values, the :data:`PREPARED` used last.
    The driver copies an argument when the launch is queued, so one kept
    argument serves any number of launches, on any stream.
    """
    import ctypes

    kept = _driver._kernel_launches
    key = (ordinal, tuple(dsts), tuple(srcs), tuple(sizes))
    with _driver._kernel_launches_lock:
        found = kept.pop(key, None)
        if found is not None:
            kept[key] = found  # the most recent last: the oldest goes first
            return found  # type: ignore[no-any-return]
    launches = []
    for start in range(0, len(sizes), REGIONS):
        args = _Regions()
        count = chunks = 0
        end = start + REGIONS
        for dst, src, size in zip(dsts[start:end], srcs[start:end], sizes[start:end], strict=True):
            if size <= 0:
                continue
            args.dst[count], args.src[count], args.bytes[count], args.first[count] = dst, src, size, chunks
            chunks += -(-size // CHUNK)
            count += 1
        if not chunks:
            continue
        args.count = count
        args.first[count] = chunks
        pointer = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        launches.append((min(chunks, blocks_max), ctypes.addressof(pointer), (pointer, args)))
    with _driver._kernel_launches_lock:
        kept[key] = launches
        while len(kept) > PREPARED:
            del kept[next(iter(kept))]
    return launches


_struct: Any = None  # the ctypes type of the kernel's argument, made on first launch (ctypes loads then)


def _Regions() -> Any:
    global _struct
    if _struct is None:
        import ctypes

        u64 = ctypes.c_uint64
        _struct = type(
            "Regions",
            (ctypes.Structure,),
            {
                "_fields_": [
                    ("count", u64),
                    ("dst", u64 * REGIONS),
                    ("src", u64 * REGIONS),
                    ("bytes", u64 * REGIONS),
                    ("first", u64 * (REGIONS + 1)),
                ]
            },
        )
    return _struct()


def _kernel(ordinal: int) -> tuple[Any, int] | None:
    """``(CUfunction, most blocks per launch)`` for device ``ordinal``, built on first use; None
    where it cannot be built (the reason in ``_driver._kernel_errors``)."""
    found = _driver._kernels.get(ordinal, False)
    if found is not False:
        return found
    with _driver._kernel_lock:  # not the driver's own lock: a compile is slow
        found = _driver._kernels.get(ordinal, False)
        if found is not False:
            return found
        try:
            built: tuple[Any, int] | None = _build(ordinal)
        except _UnavailableError as why:
            built = None
            _driver._kernel_errors[ordinal] = str(why)
        except Exception as e:  # a driver or NVRTC call failing some other way: copy without it
            built = None
            _driver._kernel_errors[ordinal] = f"building it failed ({type(e).__name__}: {e})"
        _driver._kernels[ordinal] = built
        return built


class _UnavailableError(Exception):
    pass


def _build(ordinal: int) -> tuple[Any, int]:
    if os.environ.get("GPUSHARE_COPY_KERNEL", "1").strip().lower() in ("0", "false", "no", "off"):
        raise _UnavailableError("GPUSHARE_COPY_KERNEL=0")
    driver = _driver._load()
    device = _driver._device(ordinal)
    attr = driver.CUdevice_attribute

    def get(which: Any) -> int:
        return int(_check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(which, device)))

    major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    sms = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    arch = f"sm_{major}{minor}"
    cubin, cached = _cubin(arch)
    err, module = _load_module(driver, ordinal, cubin)
    if err != driver.CUresult.CUDA_SUCCESS and cached:  # a damaged file: compile it again
        cubin, _ = _cubin(arch, fresh=True)
        err, module = _load_module(driver, ordinal, cubin)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise _UnavailableError(f"cuModuleLoadData refused the kernel ({_driver._error_name(driver, err)})")
    with _driver.on_device(ordinal):
        function = _check("cuModuleGetFunction", driver.cuModuleGetFunction(module, NAME))
    return function, max(1, sms) * BLOCKS_PER_SM


def _load_module(driver: Any, ordinal: int, cubin: bytes) -> tuple[Any, Any]:
    with _driver.on_device(ordinal):
        return driver.cuModuleLoadData(cubin)  # type: ignore[no-any-return]


def _cubin(arch: str, *, fresh: bool = False) -> tuple[bytes, bool]:
    """The kernel compiled for ``arch`` and whether it came from the disk cache (``fresh``: compile
    it with NVRTC whatever the cache holds, and replace the file)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # cuda-bindings without its nvrtc module
        raise _UnavailableError(f"cuda.bindings.nvrtc cannot be imported ({e})") from None
    try:
        _, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # the NVRTC library is not installed (cuda-pathfinder found none)
        raise _UnavailableError(f"no NVRTC library ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc") from None
    import hashlib

    key = hashlib.sha256(f"{_SOURCE}\0{arch}\0{major}.{minor}".encode()).hexdigest()[:20]
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpushare")
    path = os.path.join(folder, f"copy-regions-{arch}-{key}.cubin")
    if not fresh:
        try:
            with open(path, "rb") as f:
                return f.read(), True
        except OSError:
            pass
    cubin = _compile(nvrtc, arch)
    try:  # best effort: a read-only home only costs each process a compile
        os.makedirs(folder, exist_ok=True)
        partial = f"{path}.{os.getpid()}"
        with open(partial, "wb") as f:
            f.write(cubin)
        os.replace(partial, path)
    except OSError:
        pass
    return cubin, False


def _compile(nvrtc: Any, arch: str) -> bytes:
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, program = nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"gpushare_copy_regions.cu", 0, [], [])
    if err != ok:
        raise _UnavailableError(f"nvrtcCreateProgram failed ({err})")
    try:
        options = [f"--gpu-architecture={arch}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if err != ok:
            _, size = nvrtc.nvrtcGetProgramLogSize(program)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            text = log.decode(errors="replace").strip()[:300]
            raise _UnavailableError(f"NVRTC could not compile the kernel for {arch} ({err}): {text}")
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        if err != ok or not size:
            raise _UnavailableError(f"NVRTC made no cubin for {arch} ({err})")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        if err != ok:
            raise _UnavailableError(f"nvrtcGetCUBIN failed ({err})")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)
