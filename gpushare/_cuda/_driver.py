"""Loading the driver, devices and their primary contexts: the state of this layer.

- Every piece of module-level state of ``gpushare._cuda`` lives here, mostly set lazily;
  the other modules read it as ``_driver.<name>`` at call time, never copy it at import.
- :func:`_check` turns a failing ``CUresult`` into a :class:`~gpushare._errors.CUDAError`.
- :class:`on_device` pushes a device's primary context for a block and pops it after.
- :func:`_enter` is for per-handoff calls: it pushes only when that context is not current.
"""

from __future__ import annotations

import _thread  # threading.RLock() is _thread.RLock(); importing threading would add to a child's start
import os

from .._errors import CUDAError, CUDAOutOfMemoryError, NoDeviceError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see gpushare._seams)
if TYPE_CHECKING:
    from typing import Any

IPC_HANDLE_SIZE = 64

_lock = _thread.RLock()
_bindings: Any = None  # cuda.bindings.driver, set by _load once cuInit succeeded
_init_error: BaseException | None = None
_success: Any = None  # CUresult.CUDA_SUCCESS and CUDA_ERROR_NOT_READY, set by _load
_not_ready: Any = None
_queries: Any = None  # the per-handoff queries that keep the GIL (_queries.load), set by _load
_count: int | None = None
_visible_at_load: tuple[str | None] | None = None  # (CUDA_VISIBLE_DEVICES,) when _load first ran
_primary: dict[int, Any] = {}  # ordinal -> retained primary context
_primary_ints: dict[int, int] = {}  # ordinal -> that context as an int (what cuCtxGetCurrent compares to)
_uuids: dict[int, bytes] = {}
_ordinals: dict[bytes, int] = {}  # device UUID -> ordinal here (every first mapping asks)
_stream_handles: dict[int, Any] = {}  # int stream handle -> the driver's CUstream for it
_kernels: dict[int, Any] = {}  # ordinal -> (CUfunction, blocks) of the region-copy kernel, or None (see _kernels)
_kernel_errors: dict[int, str] = {}  # ordinal -> why that kernel could not be had
_kernel_lock = _thread.allocate_lock()  # held while one is built
_kernel_launches: dict[tuple[Any, ...], list[Any]] = {}  # copies -> that kernel's filled launches (_kernels._prepared)
_kernel_launches_lock = _thread.allocate_lock()

# Where this is raised a CUDA device was asked for (device=N, a CUDA backend, a CUDA buffer
# received): device=None never gets here, it falls back to host memory. GPUSHARE_BACKEND
# only changes what device=None means, so it is no fix to name.
_NO_GPU_HINT = (
    "Use device='cpu' (host shared memory) instead of a CUDA device, or device=None "
    "(a GPU when one is usable, host memory otherwise), or run where an NVIDIA GPU and driver are usable"
)


def _load() -> Any:
    """Import cuda.bindings and run cuInit once; raise NoDeviceError if impossible."""
    global _bindings, _init_error, _success, _not_ready, _queries, _visible_at_load
    if _bindings is not None:
        return _bindings
    with _lock:
        if _bindings is not None:
            return _bindings
        if _init_error is not None:  # a new error each time, with the first one's cause (not chained to it)
            raise NoDeviceError(str(_init_error)) from _init_error.__cause__
        if _visible_at_load is None:
            _visible_at_load = (os.environ.get("CUDA_VISIBLE_DEVICES"),)
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            _init_error = NoDeviceError(
                f"cuda-bindings is not installed ({exc}). Install it with "
                f"'pip install cuda-bindings', or: {_NO_GPU_HINT}."
            )
            raise _init_error from exc
        try:
            (err,) = driver.cuInit(0)
        except RuntimeError as exc:  # cuda.pathfinder: libcuda.so not found
            _init_error = NoDeviceError(f"No NVIDIA driver library was found ({exc}). {_NO_GPU_HINT}.")
            raise _init_error from exc
        if err != driver.CUresult.CUDA_SUCCESS:
            name = _error_name(driver, err)
            _init_error = NoDeviceError(
                f"cuInit failed with {name}: the CUDA driver sees no usable GPU. {_NO_GPU_HINT}."
            )
            raise _init_error
        _success, _not_ready = driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_NOT_READY
        from ._queries import load  # ctypes comes with the driver, not with this package

        _queries = load()
        _bindings = driver
        from .. import _seams  # with the driver, not with this package (which loads nothing else)

        _seams.mark_cuda_initialized()
        return driver


def _error_name(driver: Any, err: Any) -> str:
    try:
        res, name = driver.cuGetErrorName(err)
        if res == driver.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # pragma: no cover - only with a broken driver
        pass
    return str(err)


def _check(call: str, result: tuple[Any, ...], hint: str = "") -> Any:
    """Unpack a cuda-bindings result tuple, raising CUDAError on failure."""
    driver = _bindings
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        name = _error_name(driver, err)
        _, text = driver.cuGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else str(text)
        cls = CUDAOutOfMemoryError if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY else CUDAError
        raise cls(call, int(err), name, text, hint)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def available() -> bool:
    """True when a driver and at least one GPU are usable (never raises)."""
    try:
        return device_count() > 0
    except NoDeviceError:
        return False


def initialized() -> bool:
    """True once this process has initialised the CUDA driver through gpushare."""
    return _bindings is not None


def driver_version() -> int:
    driver = _load()
    return int(_check("cuDriverGetVersion", driver.cuDriverGetVersion()))


def bindings_version() -> str:
    try:
        from cuda.bindings import __version__
    except ImportError:
        return "not installed"
    return str(__version__)


# -- devices ------------------------------------------------------------------------


def device_count() -> int:
    """Devices this process sees (fixed once ``cuInit`` ran, so asked once)."""
    global _count
    if _count is None:
        driver = _load()
        _count = int(_check("cuDeviceGetCount", driver.cuDeviceGetCount()))
    return _count


def present_device_count() -> int | None:
    """An upper bound on the CUDA devices a child started now would see, read without
    loading the driver (which would cost this process the driver's start and the fork
    start method): the NVIDIA GPUs the kernel driver lists, at most as many as
    ``CUDA_VISIBLE_DEVICES`` names. None where the machine may have devices the kernel
    driver does not list (WSL, Tegra) or lists none of while its device nodes exist.
    Raises :class:`NoDeviceError` when the machine plainly has no NVIDIA GPU."""
    try:
        present = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        present = 0
    if present == 0:
        if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg", "/dev/nvhost-ctrl", "/dev/nvgpu")):
            return None
        raise NoDeviceError(
            "this machine has no NVIDIA GPU (no NVIDIA kernel driver lists one, and there is no "
            "/dev/nvidiactl). Use device='cpu' (host shared memory) or device=None, which means the "
            "host where there is no GPU"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # an entry CUDA cannot read hides it and the rest: never more than named
        present = min(present, len([v for v in visible.split(",") if v.strip()]))
    return present


def child_device_count() -> int | None:
    """The devices a child started now, with this process's environment, will see: this
    process's count (loading the driver, which makes no context), unless
    ``CUDA_VISIBLE_DEVICES`` changed since the driver loaded here; then None, for only
    the child can tell. Raises :class:`NoDeviceError` as :func:`device_count` does."""
    loaded = _visible_at_load
    if loaded is not None and loaded[0] != os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None
    return device_count()


def _device(ordinal: int) -> Any:
    driver = _load()
    count = device_count()
    if not 0 <= ordinal < count:
        raise NoDeviceError(
            f"CUDA device {ordinal} does not exist: this process sees {count} device(s) "
            f"(ordinals 0..{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)."
        )
    return _check("cuDeviceGet", driver.cuDeviceGet(ordinal))


def device_uuid(ordinal: int) -> bytes:
    """The 16-byte UUID of device ``ordinal``; the same in every process."""
    cached = _uuids.get(ordinal)
    if cached is not None:
        return cached
    import ctypes  # loaded with the driver already; kept out of this package's import

    driver = _load()
    uuid = _check("cuDeviceGetUuid", driver.cuDeviceGetUuid(_device(ordinal)))
    raw = ctypes.string_at(uuid.getPtr(), 16)
    _uuids[ordinal] = raw
    return raw


def ordinal_from_uuid(uuid: bytes) -> int:
    """The ordinal, in this process, of the device with this UUID."""
    ordinal = _ordinals.get(uuid)
    if ordinal is not None:
        return ordinal
    for ordinal in range(device_count()):
        if device_uuid(ordinal) == uuid:
            _ordinals[bytes(uuid)] = ordinal
            return ordinal
    raise NoDeviceError(
        f"The buffer lives on GPU {format_uuid(uuid)}, which this process cannot see "
        f"(it sees {device_count()} device(s)). Check CUDA_VISIBLE_DEVICES in the consumer."
    )


def format_uuid(uuid: bytes) -> str:
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_name(ordinal: int) -> str:
    driver = _load()
    name = _check("cuDeviceGetName", driver.cuDeviceGetName(256, _device(ordinal)))
    return name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)


def device_total_memory(ordinal: int) -> int:
    driver = _load()
    return int(_check("cuDeviceTotalMem", driver.cuDeviceTotalMem(_device(ordinal))))


def can_access_peer(ordinal: int, peer: int) -> bool:
    driver = _load()
    return bool(_check("cuDeviceCanAccessPeer", driver.cuDeviceCanAccessPeer(_device(ordinal), _device(peer))))


def supports(ordinal: int, what: str) -> bool:
    """Whether device ``ordinal`` supports a sharing mechanism: "vmm", "posix_fd" or "pool_ipc"."""
    driver = _load()
    attrs = driver.CUdevice_attribute
    dev = _device(ordinal)
    if what == "vmm":
        names = ["CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"]
    elif what == "posix_fd":
        names = [
            "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
            "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        ]
    elif what == "pool_ipc":
        names = ["CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED"]
    else:
        raise ValueError(what)
    for name in names:
        if not int(_check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(getattr(attrs, name), dev))):
            return False
    if what == "pool_ipc":
        types = int(
            _check(
                "cuDeviceGetAttribute",
                driver.cuDeviceGetAttribute(attrs.CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, dev),
            )
        )
        return bool(types & int(driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return True


# -- primary contexts ---------------------------------------------------------------


def _primary_context(ordinal: int) -> Any:
    ctx = _primary.get(ordinal)
    if ctx is None:
        with _lock:
            ctx = _primary.get(ordinal)
            if ctx is None:
                driver = _load()
                ctx = _check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(_device(ordinal)))
                _primary[ordinal] = ctx
    return ctx


class _OnDevice:
    """``with on_device(ordinal) as driver:`` runs the block with device ``ordinal``'s
    primary context current: pushed on entry, popped on exit.

    A class rather than a generator-based context manager: it costs less per call,
    and this package's import does not pull in contextlib.
    """

    __slots__ = ("ordinal",)

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal

    def __enter__(self) -> Any:
        driver = _load()
        _check("cuCtxPushCurrent", driver.cuCtxPushCurrent(_primary_context(self.ordinal)))
        return driver

    def __exit__(self, *exc: object) -> None:
        _bindings.cuCtxPopCurrent()


on_device = _OnDevice


def _enter(ordinal: int) -> tuple[Any, bool]:
    """``(driver, pushed)``: device ``ordinal``'s primary context is current on this
    thread; ``pushed`` says whether it was pushed here (the caller pops it after).

    The per-handoff calls (event record, query and wait; stream query; the
    asynchronous copies) come through here instead of :class:`on_device`: most of
    the time the device's primary context is already current on the calling thread
    (make_current at worker start-up, torch's or CuPy's own set-up, or an earlier
    _enter on a thread that had none), and then one cuCtxGetCurrent replaces a
    push, a pop and a context manager, a cost every handoff paid.
    """
    driver = _bindings if _bindings is not None else _load()
    key = _primary_ints.get(ordinal)
    if key is None:
        key = _primary_ints.setdefault(ordinal, int(_primary_context(ordinal)))
    err, current = driver.cuCtxGetCurrent()
    if err == driver.CUresult.CUDA_SUCCESS:
        now = 0 if current is None else int(current)
        if now == key:
            return driver, False
        if now == 0:
            # No context on this thread yet: make the primary one current and leave it,
            # as the runtime (torch, CuPy) does on its first call on a thread. The next
            # handoff on this thread then pushes nothing.
            _check("cuCtxSetCurrent", driver.cuCtxSetCurrent(_primary[ordinal]))
            return driver, False
    _check("cuCtxPushCurrent", driver.cuCtxPushCurrent(_primary[ordinal]))
    return driver, True


def _stream(driver: Any, stream: int) -> Any:
    """The driver's handle object for the int stream handle ``stream`` (cached: made per call
    it cost as much as the query it was for)."""
    handle = _stream_handles.get(stream)
    if handle is None:
        handle = driver.CUstream(stream)
        if len(_stream_handles) < 64:  # the default streams and a few user streams
            _stream_handles[stream] = handle
    return handle


def start_context(ordinal: int) -> None:
    """Begin making device ``ordinal``'s primary context on a thread of its own, and return.

    A worker bound to a device calls this before it unpickles its target and
    arguments, so that the context (a large share of a GPU worker's start: the
    `startup` benchmark scenario's "CUDA context alone" column) is made while
    those imports run (torch for a dataset, say) instead of after them.
    :func:`make_current` then waits for it (the module lock).
    A failure is kept for that call to raise with its own message.
    """

    def make() -> None:
        try:
            _primary_context(ordinal)
        except BaseException:  # make_current raises it again, on the main thread
            pass

    _thread.start_new_thread(make, ())


def make_current(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current on this thread (worker start-up)."""
    driver = _load()
    _check("cuCtxSetCurrent", driver.cuCtxSetCurrent(_primary_context(ordinal)))
