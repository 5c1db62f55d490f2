"""The only place in gpushare that imports ``cuda.bindings``.

Everything above this package speaks in plain Python values: device
ordinals (ints valid in *this* process), device UUIDs (16 bytes, valid in
every process whatever ``CUDA_VISIBLE_DEVICES`` says), device pointers
(ints) and IPC handles (64 bytes).

Protocol of this layer:

* The driver is loaded lazily, on the first call that needs it, and
  ``cuInit`` runs once per process. With no driver library, or no GPU,
  :class:`~gpushare._errors.NoDeviceError` says so and what to do instead.
* Every driver call goes through :func:`_check`: a failing ``CUresult``
  becomes one :class:`~gpushare._errors.CUDAError` carrying the driver's
  error name and text (out of memory becomes
  :class:`~gpushare._errors.CUDAOutOfMemoryError`, a ``MemoryError``).
* Work on a device runs inside that device's *primary* context, pushed
  for the call and popped after, so the caller's current context (torch's,
  CuPy's) is left as it was and any thread may call in.
* Handles cross the process boundary as bytes. cuda-bindings changed the
  fields of ``CUipcMemHandle`` between releases, so bytes are copied
  through the struct's address with ctypes, which works on 12.x and 13.x.
* The per-handoff queries (``cuCtxGetCurrent``, ``cuStreamQuery``,
  ``cuEventQuery``: :func:`stream_idle`, :func:`event_done`) keep the GIL.
  cuda-bindings releases it around every driver call, which lets another
  thread (a Queue's feeder, woken by the put before) take it in the middle
  of a put for a call that lasts a microsecond. These three never block,
  so they are called through ``ctypes.PyDLL`` on the driver library that
  cuda-bindings loaded (:class:`_Queries`); every other call, and these
  when that library cannot be found that way, go through cuda-bindings.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

from .._errors import CUDAError, CUDAOutOfMemoryError, NoDeviceError

__all__ = [
    "IPC_HANDLE_SIZE",
    "address_range",
    "available",
    "bindings_version",
    "can_access_peer",
    "device_count",
    "device_name",
    "device_total_memory",
    "device_uuid",
    "driver_version",
    "initialized",
    "ipc_close",
    "ipc_get_handle",
    "ipc_open",
    "mem_alloc",
    "mem_free",
    "mem_info",
    "memcpy_dtoh",
    "memcpy_htod",
    "memset",
    "ordinal_from_uuid",
    "pointer_device",
    "synchronize",
]

IPC_HANDLE_SIZE = 64
_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

_lock = threading.RLock()
_driver: Any = None
_init_error: BaseException | None = None
_primary: dict[int, Any] = {}
_uuids: dict[int, bytes] = {}
_ordinals: dict[bytes, int] = {}  # device UUID -> ordinal here (every first mapping asks)
_count: int | None = None
_success: Any = None  # CUresult.CUDA_SUCCESS and CUDA_ERROR_NOT_READY, set by _load
_not_ready: Any = None
_queries: _Queries | None = None  # the per-handoff queries that keep the GIL, set by _load

_NO_GPU_HINT = (
    "Use device='cpu' (or set GPUSHARE_BACKEND=host) to share host memory instead, "
    "or run on a machine with an NVIDIA GPU and driver"
)


def _load() -> Any:
    """Import cuda.bindings and run cuInit once; raise NoDeviceError if impossible."""
    global _driver, _init_error, _success, _not_ready, _queries
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is not None:
            return _driver
        if _init_error is not None:
            raise NoDeviceError(str(_init_error)) from _init_error
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
        _queries = _Queries.load()
        _driver = driver
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
    driver = _driver
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
    return _driver is not None


def driver_version() -> int:
    driver = _load()
    return int(_check("cuDriverGetVersion", driver.cuDriverGetVersion()))


def bindings_version() -> str:
    try:
        from cuda.bindings import __version__
    except ImportError:
        return "not installed"
    return str(__version__)


def device_count() -> int:
    """Devices this process sees (fixed once ``cuInit`` ran, so asked once)."""
    global _count
    if _count is None:
        driver = _load()
        _count = int(_check("cuDeviceGetCount", driver.cuDeviceGetCount()))
    return _count


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


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[Any]:
    """Run the block with device ``ordinal``'s primary context current."""
    driver = _load()
    ctx = _primary_context(ordinal)
    _check("cuCtxPushCurrent", driver.cuCtxPushCurrent(ctx))
    try:
        yield driver
    finally:
        driver.cuCtxPopCurrent()


# The per-handoff calls (event record, query and wait; stream query) go through
# _enter instead of on_device: most of the time the device's primary context is
# already current on the calling thread (make_current at worker start-up, torch's or
# CuPy's own set-up, or an earlier _enter on a thread that had none), and then one
# cuCtxGetCurrent replaces a push, a pop and a generator-based context manager, a few
# microseconds per call that every handoff paid.
_primary_ints: dict[int, int] = {}
_streams: dict[int, Any] = {}


def _enter(ordinal: int) -> tuple[Any, bool]:
    """``(driver, pushed)``: device ``ordinal``'s primary context is current on this
    thread; ``pushed`` says whether it was pushed here (the caller pops it after)."""
    driver = _driver if _driver is not None else _load()
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
    handle = _streams.get(stream)
    if handle is None:
        handle = driver.CUstream(stream)
        if len(_streams) < 64:  # the default streams and a few user streams
            _streams[stream] = handle
    return handle


def make_current(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current on this thread (worker start-up)."""
    driver = _load()
    _check("cuCtxSetCurrent", driver.cuCtxSetCurrent(_primary_context(ordinal)))


def mem_alloc(nbytes: int, ordinal: int) -> int:
    with on_device(ordinal) as driver:
        ptr = _check(
            "cuMemAlloc",
            driver.cuMemAlloc(nbytes),
            hint=f"Could not allocate {nbytes} bytes on device {ordinal}; free buffers or call Manager.trim()",
        )
    return int(ptr)


def mem_free(ptr: int, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuMemFree", driver.cuMemFree(ptr))


def mem_info(ordinal: int) -> tuple[int, int]:
    """(free, total) bytes of device ``ordinal``."""
    with on_device(ordinal) as driver:
        free, total = _check("cuMemGetInfo", driver.cuMemGetInfo())
    return int(free), int(total)


def address_range(ptr: int, ordinal: int) -> tuple[int, int]:
    """(base, size) of the allocation that contains ``ptr``."""
    with on_device(ordinal) as driver:
        base, size = _check("cuMemGetAddressRange", driver.cuMemGetAddressRange(ptr))
    return int(base), int(size)


def pointer_device(ptr: int) -> int:
    driver = _load()
    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(_check("cuPointerGetAttribute", driver.cuPointerGetAttribute(attr, ptr)))


def ipc_get_handle(ptr: int, ordinal: int) -> bytes:
    with on_device(ordinal) as driver:
        handle = _check("cuIpcGetMemHandle", driver.cuIpcGetMemHandle(ptr))
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)


def ipc_open(handle: bytes, ordinal: int) -> int:
    """Map another process's allocation into this one, on device ``ordinal``.

    Peer access is enabled lazily, so a buffer of another GPU opens too.
    """
    if len(handle) != IPC_HANDLE_SIZE:
        raise ValueError(f"an IPC memory handle is {IPC_HANDLE_SIZE} bytes, got {len(handle)}")
    with on_device(ordinal) as driver:
        h = driver.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_SIZE)
        ptr = _check(
            "cuIpcOpenMemHandle",
            driver.cuIpcOpenMemHandle(h, _IPC_LAZY_ENABLE_PEER_ACCESS),
            hint="The owner may have exited, or the processes do not share a PID namespace",
        )
    return int(ptr)


def ipc_close(ptr: int, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuIpcCloseMemHandle", driver.cuIpcCloseMemHandle(ptr))


# Memsets and host-to-device copies may return before the device has finished
# them. gpushare's own writes complete before they return: a buffer filled and
# put on a queue must read as filled in the consumer, whose context and
# stream know nothing of ours.


def _finish(driver: Any) -> None:
    _check("cuStreamSynchronize", driver.cuStreamSynchronize(driver.CUstream(0)))


def memset(ptr: int, value: int, nbytes: int, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuMemsetD8", driver.cuMemsetD8(ptr, value, nbytes))
        _finish(driver)


def memset32(ptr: int, value: int, count: int, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuMemsetD32", driver.cuMemsetD32(ptr, value, count))
        _finish(driver)


def memcpy_htod(dst: int, src_host: int, nbytes: int, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuMemcpyHtoD", driver.cuMemcpyHtoD(dst, src_host, nbytes))
        _finish(driver)


def memcpy_dtoh(dst_host: int, src: int, nbytes: int, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuMemcpyDtoH", driver.cuMemcpyDtoH(dst_host, src, nbytes))


def synchronize(ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuCtxSynchronize", driver.cuCtxSynchronize())


def memcpy(dst: int, src: int, nbytes: int, ordinal: int) -> None:
    """Copy between any two device (or mapped) addresses; unified addressing finds them."""
    with on_device(ordinal) as driver:
        _check("cuMemcpy", driver.cuMemcpy(dst, src, nbytes))
        _finish(driver)


def stream_synchronize(stream: int, ordinal: int) -> None:
    """Wait for the work queued on ``stream`` (a CUstream handle as an int; 1 and 2 are
    the legacy and per-thread default streams)."""
    with on_device(ordinal) as driver:
        _check("cuStreamSynchronize", driver.cuStreamSynchronize(driver.CUstream(stream)))


# -- VMM allocations shared as POSIX file descriptors ---------------------------------


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


def _device_location(driver: Any, ordinal: int) -> Any:
    loc = driver.CUmemLocation()
    loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    return loc


def _access_descs(driver: Any, ordinals: list[int]) -> list[Any]:
    descs = []
    for ordinal in ordinals:
        desc = driver.CUmemAccessDesc()
        desc.location = _device_location(driver, ordinal)
        desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(desc)
    return descs


def vmm_granularity(ordinal: int) -> int:
    with on_device(ordinal) as driver:
        prop = _vmm_prop(driver, ordinal)
        option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(_check("cuMemGetAllocationGranularity", driver.cuMemGetAllocationGranularity(prop, option)))


def _vmm_prop(driver: Any, ordinal: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _device_location(driver, ordinal)
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


class _Undo:
    """All-or-nothing construction: undo steps run in reverse unless committed."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def __enter__(self) -> _Undo:
        return self

    def add(self, fn: Any, *args: Any) -> None:
        self.steps.append((fn, args))

    def commit(self) -> None:
        self.steps.clear()

    def __exit__(self, *exc: object) -> None:
        for fn, args in reversed(self.steps):
            try:
                fn(*args)
            except Exception:  # an undo step must not hide the original error
                pass


def _map_handle(driver: Any, handle: Any, nbytes: int, ordinals: list[int], undo: _Undo) -> int:
    ptr = _check("cuMemAddressReserve", driver.cuMemAddressReserve(nbytes, 0, 0, 0))
    undo.add(driver.cuMemAddressFree, ptr, nbytes)
    _check("cuMemMap", driver.cuMemMap(ptr, nbytes, 0, handle, 0))
    undo.add(driver.cuMemUnmap, ptr, nbytes)
    descs = _access_descs(driver, ordinals)
    _check("cuMemSetAccess", driver.cuMemSetAccess(ptr, nbytes, descs, len(descs)))
    return int(ptr)


def vmm_alloc(nbytes: int, ordinal: int) -> tuple[int, Any]:
    """cuMemCreate + reserve + map + set access: (ptr, handle). All or nothing."""
    with on_device(ordinal) as driver, _Undo() as undo:
        prop = _vmm_prop(driver, ordinal)
        handle = _check(
            "cuMemCreate",
            driver.cuMemCreate(nbytes, prop, 0),
            hint=f"Could not allocate {nbytes} bytes on device {ordinal}; free buffers or call Manager.trim()",
        )
        undo.add(driver.cuMemRelease, handle)
        ptr = _map_handle(driver, handle, nbytes, [ordinal], undo)
        undo.commit()
    return ptr, handle


def vmm_export(handle: Any, ordinal: int) -> int:
    """A POSIX fd for a VMM allocation handle (about 0.7 ms: do it once per allocation)."""
    with on_device(ordinal) as driver:
        fd = _check(
            "cuMemExportToShareableHandle",
            driver.cuMemExportToShareableHandle(
                handle, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
        )
    return int(fd)


def vmm_import(fd: int, nbytes: int, ordinals: list[int]) -> tuple[int, Any]:
    """Import a VMM allocation from a POSIX fd and map it for ``ordinals``: (ptr, handle)."""
    with on_device(ordinals[0]) as driver, _Undo() as undo:
        handle = _check(
            "cuMemImportFromShareableHandle",
            driver.cuMemImportFromShareableHandle(
                fd, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
        )
        undo.add(driver.cuMemRelease, handle)
        ptr = _map_handle(driver, handle, nbytes, ordinals, undo)
        undo.commit()
    return ptr, handle


def vmm_free(ptr: int, handle: Any, nbytes: int, ordinal: int) -> None:
    """Unmap, free the address range and release the handle (owner and importers alike)."""
    with on_device(ordinal) as driver:
        _check("cuMemUnmap", driver.cuMemUnmap(ptr, nbytes))
        _check("cuMemAddressFree", driver.cuMemAddressFree(ptr, nbytes))
        _check("cuMemRelease", driver.cuMemRelease(handle))


# -- IPC memory pools ----------------------------------------------------------------


def pool_create(ordinal: int) -> tuple[Any, int]:
    """An IPC-enabled memory pool on ``ordinal``, exported once: (pool, fd)."""
    with on_device(ordinal) as driver, _Undo() as undo:
        props = driver.CUmemPoolProps()
        props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        props.location = _device_location(driver, ordinal)
        pool = _check("cuMemPoolCreate", driver.cuMemPoolCreate(props))
        undo.add(driver.cuMemPoolDestroy, pool)
        # Keep freed memory in the pool instead of returning it at every synchronisation.
        threshold = driver.cuuint64_t(0xFFFFFFFFFFFFFFFF)
        attr = driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        _check("cuMemPoolSetAttribute", driver.cuMemPoolSetAttribute(pool, attr, threshold))
        fd = _check(
            "cuMemPoolExportToShareableHandle",
            driver.cuMemPoolExportToShareableHandle(
                pool, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
        )
        undo.commit()
    return pool, int(fd)


def pool_destroy(pool: Any, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuMemPoolDestroy", driver.cuMemPoolDestroy(pool))


def pool_alloc(pool: Any, nbytes: int, ordinal: int) -> tuple[int, bytes]:
    """Allocate from ``pool`` (stream-ordered, then synchronised) and export it: (ptr, 64 bytes)."""
    with on_device(ordinal) as driver, _Undo() as undo:
        stream = driver.CUstream(0)
        ptr = _check(
            "cuMemAllocFromPoolAsync",
            driver.cuMemAllocFromPoolAsync(nbytes, pool, stream),
            hint=f"Could not allocate {nbytes} bytes on device {ordinal}; free buffers or call Manager.trim()",
        )
        undo.add(_pool_free_now, driver, ptr)
        _check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))
        data = _check("cuMemPoolExportPointer", driver.cuMemPoolExportPointer(ptr))
        undo.commit()
    return int(ptr), ctypes.string_at(data.getPtr(), IPC_HANDLE_SIZE)


def _pool_free_now(driver: Any, ptr: Any) -> None:
    stream = driver.CUstream(0)
    _check("cuMemFreeAsync", driver.cuMemFreeAsync(ptr, stream))
    _check("cuStreamSynchronize", driver.cuStreamSynchronize(stream))


def pool_free(ptr: int, ordinal: int) -> None:
    """Free a pool allocation (stream-ordered, then synchronised); importers call it too."""
    with on_device(ordinal) as driver:
        _pool_free_now(driver, ptr)


def pool_import(fd: int, ordinals: list[int], home: int | None) -> Any:
    """Import an exported pool from its fd; grant access to the ordinals it does not live on."""
    with on_device(ordinals[0]) as driver, _Undo() as undo:
        pool = _check(
            "cuMemPoolImportFromShareableHandle",
            driver.cuMemPoolImportFromShareableHandle(
                fd, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
        )
        undo.add(driver.cuMemPoolDestroy, pool)
        peers = [o for o in ordinals if o != home]
        if peers:
            descs = _access_descs(driver, peers)
            _check("cuMemPoolSetAccess", driver.cuMemPoolSetAccess(pool, descs, len(descs)))
        undo.commit()
    return pool


def pool_import_pointer(pool: Any, data: bytes, ordinal: int) -> int:
    if len(data) != IPC_HANDLE_SIZE:
        raise ValueError(f"pool pointer export data is {IPC_HANDLE_SIZE} bytes, got {len(data)}")
    with on_device(ordinal) as driver:
        export = driver.CUmemPoolPtrExportData()
        ctypes.memmove(export.getPtr(), data, IPC_HANDLE_SIZE)
        return int(_check("cuMemPoolImportPointer", driver.cuMemPoolImportPointer(pool, export)))


def pool_trim(pool: Any, ordinal: int) -> None:
    """Return a pool's unused memory to the device."""
    with on_device(ordinal) as driver:
        _check("cuMemPoolTrimTo", driver.cuMemPoolTrimTo(pool, 0))


# -- IPC events: stream ordering between processes --------------------------------------

_EVENT_FLAGS = 6  # CU_EVENT_DISABLE_TIMING (2) | CU_EVENT_INTERPROCESS (4)


def event_create_ipc(ordinal: int) -> tuple[Any, bytes]:
    """An interprocess event on ``ordinal`` and its 64-byte handle (created once, recorded often)."""
    with on_device(ordinal) as driver:
        event = _check("cuEventCreate", driver.cuEventCreate(_EVENT_FLAGS))
        try:
            handle = _check("cuIpcGetEventHandle", driver.cuIpcGetEventHandle(event))
        except BaseException:
            driver.cuEventDestroy(event)
            raise
    return event, ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)


def event_record(event: Any, ordinal: int, stream: int = 0) -> None:
    """Record ``event`` on ``stream`` (0: the legacy default stream, where torch's default work runs)."""
    driver, pushed = _enter(ordinal)
    try:
        _check("cuEventRecord", driver.cuEventRecord(event, _stream(driver, stream)))
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def event_open(handle: bytes, ordinal: int) -> Any:
    """Open another process's interprocess event (about 0.3 ms: cache the result)."""
    with on_device(ordinal) as driver:
        h = driver.CUipcEventHandle()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_SIZE)
        return _check("cuIpcOpenEventHandle", driver.cuIpcOpenEventHandle(h))


def event_destroy(event: Any, ordinal: int) -> None:
    with on_device(ordinal) as driver:
        _check("cuEventDestroy", driver.cuEventDestroy(event))


def event_synchronize(event: Any, ordinal: int) -> None:
    """Block the calling thread until the work before the event's last record is done."""
    driver, pushed = _enter(ordinal)
    try:
        _check("cuEventSynchronize", driver.cuEventSynchronize(event))
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def stream_idle(ordinal: int, stream: int = 0) -> bool:
    """Whether every piece of work queued on ``stream`` (0: the legacy default stream)
    has finished (``cuStreamQuery``; about a microsecond, never blocks)."""
    driver = _driver if _driver is not None else _load()
    queries = _queries
    if queries is not None:
        done = queries.done(_primary_ints.get(ordinal), queries.stream, stream)
        if done is not None:
            return done
    return _finished(driver, ordinal, "cuStreamQuery", driver.cuStreamQuery, _stream(driver, stream))


def event_done(event: Any, ordinal: int) -> bool:
    """Whether the work before ``event``'s last record has finished (``cuEventQuery``;
    never blocks). An event never recorded counts as done."""
    driver = _driver if _driver is not None else _load()
    queries = _queries
    if queries is not None:
        done = queries.done(_primary_ints.get(ordinal), queries.event, int(event))
        if done is not None:
            return done
    return _finished(driver, ordinal, "cuEventQuery", driver.cuEventQuery, event)


def _finished(driver: Any, ordinal: int, name: str, query: Any, handle: Any) -> bool:
    """``query(handle)`` (``cuStreamQuery``, ``cuEventQuery``) in device ``ordinal``'s
    context, through cuda-bindings: True when done, False on CUDA_ERROR_NOT_READY,
    else raises.

    The common case (the primary context already current on this thread) is
    checked inline: one ``cuCtxGetCurrent``, the query, and two comparisons with
    results cached at load, about half of what going through :func:`_enter` cost."""
    key = _primary_ints.get(ordinal)
    if key is not None:
        err, current = driver.cuCtxGetCurrent()
        if err == _success and current is not None and int(current) == key:
            err = query(handle)[0]
            if err == _not_ready:
                return False
            _check(name, (err,))
            return True
    driver, pushed = _enter(ordinal)
    try:
        result = query(handle)
    finally:
        if pushed:
            driver.cuCtxPopCurrent()
    if result[0] == _not_ready:
        return False
    _check(name, result)
    return True


_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600


class _Queries:
    """``cuCtxGetCurrent``, ``cuStreamQuery`` and ``cuEventQuery`` called with the GIL held.

    ``ctypes.PyDLL`` calls a C function without releasing the GIL (see the
    module's docstring for why these should not release it). The library is the
    ``libcuda.so.1`` cuda-bindings already loaded in this process
    (``RTLD_NOLOAD`` never loads a second copy), so its handles are valid here.
    Not used when cuda-bindings runs on the per-thread default stream
    (``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM``), since these plain symbols
    name the legacy one.
    """

    __slots__ = ("ctx", "event", "stream")

    def __init__(self, lib: Any) -> None:
        self.ctx = lib.cuCtxGetCurrent
        self.ctx.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.stream = lib.cuStreamQuery
        self.event = lib.cuEventQuery
        for fn in (self.stream, self.event):
            fn.argtypes = [ctypes.c_void_p]
        for fn in (self.ctx, self.stream, self.event):
            fn.restype = ctypes.c_int

    @classmethod
    def load(cls, library: str = "libcuda.so.1") -> _Queries | None:
        """The queries on the driver library already loaded, or None (use cuda-bindings)."""
        if os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0"):
            return None
        no_load = getattr(os, "RTLD_NOLOAD", None)
        if no_load is None:  # no way to ask for the copy already loaded only
            return None
        try:
            return cls(ctypes.PyDLL(library, mode=no_load | ctypes.RTLD_LOCAL))
        except (OSError, AttributeError):  # not loaded under that name, or not a CUDA driver
            return None

    def done(self, key: int | None, query: Any, handle: int) -> bool | None:
        """``query(handle)`` when the primary context ``key`` is current on this thread:
        True when done, False when not yet; None when this cannot answer (another
        context current, or an error: the caller asks again through cuda-bindings,
        which sets the context or reports the error with its name)."""
        if key is None:
            return None
        current = ctypes.c_void_p()
        if self.ctx(current) != _CUDA_SUCCESS or current.value != key:
            return None
        err = query(handle)
        if err == _CUDA_SUCCESS:
            return True
        if err == _CUDA_ERROR_NOT_READY:
            return False
        return None


def stream_wait_event(stream: int, event: Any, ordinal: int) -> None:
    """Make ``stream`` (an int handle; 1 and 2 are the legacy and per-thread default
    streams) wait for ``event`` without blocking the host."""
    driver, pushed = _enter(ordinal)
    try:
        _check("cuStreamWaitEvent", driver.cuStreamWaitEvent(_stream(driver, stream), event, 0))
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def stream_create(ordinal: int) -> int:
    """A new non-blocking stream on ``ordinal``, as an int handle."""
    with on_device(ordinal) as driver:
        stream = _check("cuStreamCreate", driver.cuStreamCreate(1))  # CU_STREAM_NON_BLOCKING
    return int(stream)
