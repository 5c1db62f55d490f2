"""Device memory and the three ways to share it between processes.

- Plain allocations (``cuMemAlloc``), shared by 64-byte legacy IPC memory handles.
- VMM allocations (``cuMemCreate`` + reserve + map + access), exported once as a POSIX fd.
- IPC memory pools: the pool exported once as an fd, then 64 bytes per allocation.
Creation is all or nothing (:class:`_Undo`). Every call runs in the device's primary
context (:class:`~gpushare._cuda._driver.on_device`).
"""

from __future__ import annotations

from ._driver import IPC_HANDLE_SIZE, _check, _load, on_device

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


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


def segment_of(ptr: int, ordinal: int) -> tuple[int, int, int, bool]:
    """The allocation that holds ``ptr`` (memory another allocator made, such as torch's):
    ``(base, size, buffer id, legacy-IPC capable)``. The buffer id is unique in this process
    for the allocation's life, so a later allocation at the same base has another."""
    with on_device(ordinal) as driver:
        base, size = _check("cuMemGetAddressRange", driver.cuMemGetAddressRange(ptr))
        attrs = driver.CUpointer_attribute
        buffer_id = _check(
            "cuPointerGetAttribute", driver.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)
        )
        capable = _check(
            "cuPointerGetAttribute",
            driver.cuPointerGetAttribute(attrs.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr),
        )
    return int(base), int(size), int(buffer_id), bool(capable)


def pointer_device(ptr: int) -> int:
    driver = _load()
    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(_check("cuPointerGetAttribute", driver.cuPointerGetAttribute(attr, ptr)))


# -- legacy IPC memory handles ------------------------------------------------------
# cuda-bindings changed the fields of CUipcMemHandle between releases, so the 64
# bytes are copied through the struct's address with ctypes (12.x and 13.x alike).
# ctypes is imported where it is used: cuda-bindings has loaded it by then.


def ipc_get_handle(ptr: int, ordinal: int) -> bytes:
    import ctypes

    with on_device(ordinal) as driver:
        handle = _check("cuIpcGetMemHandle", driver.cuIpcGetMemHandle(ptr))
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)


def ipc_open(handle: bytes, ordinal: int) -> int:
    """Map another process's allocation into this one, on device ``ordinal``.

    Peer access is enabled lazily, so a buffer of another GPU opens too.
    """
    import ctypes

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


# -- VMM allocations shared as POSIX file descriptors ---------------------------------


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


def _vmm_prop(driver: Any, ordinal: int) -> Any:
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _device_location(driver, ordinal)
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def vmm_granularity(ordinal: int) -> int:
    with on_device(ordinal) as driver:
        prop = _vmm_prop(driver, ordinal)
        option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(_check("cuMemGetAllocationGranularity", driver.cuMemGetAllocationGranularity(prop, option)))


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
    """A POSIX fd for a VMM allocation handle (a slow driver call: do it once per allocation)."""
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
    import ctypes

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
    import ctypes

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
