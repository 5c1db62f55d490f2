"""A CPU stand-in for the part of ``cuda.bindings.driver`` that cuda_pool_killed_importers.py uses.

Selected with ``CUDA_POOL_REPRO_DRIVER=fake_driver`` (this folder on
``PYTHONPATH``); spawned importers inherit the setting. It exists so that
``tests/test_driver_repro.py`` can run the script's real process
orchestration on a machine without a GPU: spawn, the pool fd passed by
SCM_RIGHTS, SIGKILL, reaping, timeouts and the report.

Model: a pool's memory is a memfd (sparse) that every process maps, so an
importer's writes are seen by the owner. Allocations come from the pool in
whole 2 MiB chunks; freed ones stay reserved until ``cuMemPoolTrimTo``.
The memfd's first page counts imported pointers and importer frees, which
lets a run simulate the driver keeping memory for imports never freed.

Like every result of the real bindings, each call returns ``(CUresult, values...)``.

Environment knobs (tests set them):

* ``FAKE_CUDA_NO_DRIVER=1``: ``cuInit`` raises RuntimeError, as cuda.pathfinder
  does without libcuda.
* ``FAKE_CUDA_FAIL=call@role``: that call returns CUDA_ERROR_INVALID_VALUE;
  role is ``owner``, ``importer`` or ``any``.
* ``FAKE_CUDA_HANG=call@role``: that call sleeps for an hour.
* ``FAKE_CUDA_LEAK_PER_IMPORT=bytes``: each imported pointer that its importer
  did not free makes the owner's device that much shorter of free memory ...
* ``FAKE_CUDA_LEAK_UNTIL=destroy|forever``: ... until the pool is destroyed
  (default) or for the process's life.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import multiprocessing
import os
import struct
import time
from typing import Any

MiB = 1 << 20
TOTAL = 80 << 30
CONTEXT_COST = 500 * MiB
CHUNK = 2 * MiB
CAPACITY = 16 << 30  # sparse
HEADER = struct.Struct("<8sQQQ")  # magic, token, imports, frees
MAGIC = b"FAKEPOOL"


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_HANDLE = 400


OK = CUresult.CUDA_SUCCESS
BAD = CUresult.CUDA_ERROR_INVALID_VALUE


class CUdevice_attribute(enum.IntEnum):  # noqa: N801 - the real name
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115
    CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES = 119


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemPool_attribute(enum.IntEnum):  # noqa: N801 - the real name
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8


class cuuint64_t:  # noqa: N801 - the real name
    def __init__(self, value: int = 0) -> None:
        self.value = int(value)

    def __int__(self) -> int:
        return self.value


class CUstream:
    def __init__(self, value: int = 0) -> None:
        self.value = int(value)


class CUmemLocation:
    def __init__(self) -> None:
        self.type: Any = None
        self.id = 0


class CUmemPoolProps:
    def __init__(self) -> None:
        self.allocType: Any = None
        self.handleTypes: Any = None
        self.location: Any = None


class CUmemPoolPtrExportData:
    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)


_ERROR_NAMES = {e: e.name.encode() for e in CUresult}

# -- this process's state ---------------------------------------------------------------------------

_state: dict[str, Any] = {"init": False, "ctx": False, "leaked_forever": 0}
_pools: list[_Pool] = []  # every pool this process created or imported


def _role() -> str:
    return "importer" if multiprocessing.parent_process() is not None else "owner"


def _injected(knob: str, call: str) -> bool:
    spec = os.environ.get(knob, "")
    if not spec:
        return False
    name, _, role = spec.partition("@")
    return name == call and role in ("", "any", _role())


def _enter(call: str) -> CUresult | None:
    if _injected("FAKE_CUDA_HANG", call):
        time.sleep(3600)
    if _injected("FAKE_CUDA_FAIL", call):
        return BAD
    if call != "cuInit" and not _state["init"]:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED
    return None


class _Pool:
    """A pool's memory: a memfd mapped here; chunks handed out by offset."""

    _next_base = 0x7000_0000_0000

    def __init__(self, fd: int, owned: bool) -> None:
        self.fd, self.owned = fd, owned
        self.map = mmap.mmap(fd, CAPACITY)
        self.base = _Pool._next_base
        _Pool._next_base += CAPACITY
        self.live: dict[int, int] = {}  # offset -> size
        self.cached: dict[int, list[int]] = {}  # rounded size -> offsets freed, still reserved
        self.trimmed: dict[int, list[int]] = {}  # rounded size -> offsets released, reusable
        self.bump = CHUNK  # the first chunk holds the header
        self.exported = False
        self.destroyed = False
        self.high_reserved = self.high_used = 0

    def header(self) -> tuple[bytes, int, int, int]:
        return HEADER.unpack_from(self.map, 0)

    def count(self, field: int) -> None:
        values = list(self.header())
        values[field] += 1
        HEADER.pack_into(self.map, 0, *values)

    def reserved(self) -> int:
        return sum(_round(s) for s in self.live.values()) + sum(k * len(v) for k, v in self.cached.items())

    def used(self) -> int:
        return sum(self.live.values())

    def address(self, offset: int) -> int:
        return self.base + offset


def _round(size: int) -> int:
    return -(-size // CHUNK) * CHUNK


def _find(ptr: Any) -> tuple[_Pool, int] | None:
    addr = int(ptr)
    for pool in _pools:
        if not pool.destroyed and pool.base <= addr < pool.base + CAPACITY:
            return pool, addr - pool.base
    return None


# -- the calls ----------------------------------------------------------------------------------------


def cuGetErrorName(err: Any) -> tuple[CUresult, bytes | None]:
    try:
        return OK, _ERROR_NAMES[CUresult(int(err))]
    except ValueError:
        return BAD, None


def cuGetErrorString(err: Any) -> tuple[CUresult, bytes | None]:
    return cuGetErrorName(err)


def cuInit(flags: int) -> tuple[CUresult]:
    if os.environ.get("FAKE_CUDA_NO_DRIVER"):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search (fake)')
    err = _enter("cuInit")
    if err is None:
        _state["init"] = True
    return (err or OK,)


def cuDeviceGetCount() -> tuple[CUresult, int]:
    return (_enter("cuDeviceGetCount") or OK), 1


def cuDeviceGet(ordinal: int) -> tuple[CUresult, int]:
    err = _enter("cuDeviceGet")
    return (err or (OK if ordinal == 0 else CUresult.CUDA_ERROR_INVALID_VALUE)), ordinal


def cuDeviceGetName(length: int, dev: int) -> tuple[CUresult, bytes]:
    return (_enter("cuDeviceGetName") or OK), b"Fake GPU".ljust(length, b"\0")


def cuDeviceGetAttribute(attr: Any, dev: int) -> tuple[CUresult, int]:
    value = {115: 1, 119: 9}.get(int(attr), 0)
    return (_enter("cuDeviceGetAttribute") or OK), value


def cuDriverGetVersion() -> tuple[CUresult, int]:
    return (_enter("cuDriverGetVersion") or OK), 13000


def cuDevicePrimaryCtxRetain(dev: int) -> tuple[CUresult, str]:
    err = _enter("cuDevicePrimaryCtxRetain")
    if err is None:
        _state["ctx"] = True
    return (err or OK), "primary-context"


def cuCtxSetCurrent(ctx: Any) -> tuple[CUresult]:
    return (_enter("cuCtxSetCurrent") or OK,)


def cuCtxSynchronize() -> tuple[CUresult]:
    return (_enter("cuCtxSynchronize") or OK,)


def cuStreamSynchronize(stream: Any) -> tuple[CUresult]:
    return (_enter("cuStreamSynchronize") or OK,)


def cuMemGetInfo() -> tuple[CUresult, int, int]:
    err = _enter("cuMemGetInfo")
    if err is None and not _state["ctx"]:
        err = CUresult.CUDA_ERROR_INVALID_HANDLE
    used = CONTEXT_COST + _state["leaked_forever"]
    for pool in _pools:
        if pool.owned and not pool.destroyed:
            used += pool.reserved() + _leak(pool)
    return (err or OK), TOTAL - used, TOTAL


def _leak(pool: _Pool) -> int:
    _, _, imports, frees = pool.header()
    return max(0, imports - frees) * int(os.environ.get("FAKE_CUDA_LEAK_PER_IMPORT", "0"))


def cuMemPoolCreate(props: CUmemPoolProps) -> tuple[CUresult, _Pool | None]:
    err = _enter("cuMemPoolCreate")
    if err is None and (props.allocType is None or props.location is None):
        err = BAD
    if err:
        return err, None
    fd = os.memfd_create("fake-cuda-pool")
    os.ftruncate(fd, CAPACITY)
    pool = _Pool(fd, owned=True)
    HEADER.pack_into(pool.map, 0, MAGIC, int.from_bytes(os.urandom(8), "little"), 0, 0)
    _pools.append(pool)
    return OK, pool


def cuMemPoolSetAttribute(pool: _Pool, attr: Any, value: Any) -> tuple[CUresult]:
    return (_enter("cuMemPoolSetAttribute") or OK,)


def cuMemPoolGetAttribute(pool: _Pool, attr: Any) -> tuple[CUresult, cuuint64_t]:
    err = _enter("cuMemPoolGetAttribute")
    if pool.destroyed:
        err = err or BAD
    pool.high_reserved = max(pool.high_reserved, pool.reserved())
    pool.high_used = max(pool.high_used, pool.used())
    value = {
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: pool.reserved(),
        CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT: pool.used(),
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: pool.high_reserved,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH: pool.high_used,
    }.get(attr, 0)
    return (err or OK), cuuint64_t(value)


def cuMemPoolExportToShareableHandle(pool: _Pool, handle_type: Any, flags: int) -> tuple[CUresult, int]:
    err = _enter("cuMemPoolExportToShareableHandle")
    if err or pool.destroyed or not pool.owned:
        return err or BAD, -1
    pool.exported = True
    return OK, os.dup(pool.fd)


def cuMemAllocFromPoolAsync(size: int, pool: _Pool, stream: Any) -> tuple[CUresult, int]:
    err = _enter("cuMemAllocFromPoolAsync")
    if err or pool.destroyed or not pool.owned or size < 1:
        return err or BAD, 0
    rounded = _round(size)
    if pool.cached.get(rounded):
        offset = pool.cached[rounded].pop()
    elif pool.trimmed.get(rounded):
        offset = pool.trimmed[rounded].pop()
    else:
        if pool.bump + rounded > CAPACITY:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0
        offset, pool.bump = pool.bump, pool.bump + rounded
    pool.live[offset] = size
    return OK, pool.address(offset)


def cuMemFreeAsync(ptr: Any, stream: Any) -> tuple[CUresult]:
    err = _enter("cuMemFreeAsync")
    found = _find(ptr)
    if err or found is None or found[1] not in found[0].live:
        return (err or BAD,)
    pool, offset = found
    size = pool.live.pop(offset)
    if pool.owned:
        pool.cached.setdefault(_round(size), []).append(offset)
    else:
        pool.count(3)  # an importer freed its import
    return (OK,)


def cuMemPoolTrimTo(pool: _Pool, keep: int) -> tuple[CUresult]:
    err = _enter("cuMemPoolTrimTo")
    if err or pool.destroyed:
        return (err or BAD,)
    for rounded, offsets in pool.cached.items():
        pool.trimmed.setdefault(rounded, []).extend(offsets)
    pool.cached.clear()
    return (OK,)


def cuMemPoolDestroy(pool: _Pool) -> tuple[CUresult]:
    err = _enter("cuMemPoolDestroy")
    if err or pool.destroyed:
        return (err or BAD,)
    if pool.owned and os.environ.get("FAKE_CUDA_LEAK_UNTIL", "destroy") == "forever":
        _state["leaked_forever"] += _leak(pool)
    pool.destroyed = True
    pool.map.close()
    os.close(pool.fd)
    return (OK,)


def cuMemPoolExportPointer(ptr: Any) -> tuple[CUresult, CUmemPoolPtrExportData | None]:
    err = _enter("cuMemPoolExportPointer")
    found = _find(ptr)
    if err or found is None or not found[0].exported:  # the real driver: the pool must be exported first
        return err or BAD, None
    pool, offset = found
    data = CUmemPoolPtrExportData()
    token = pool.header()[1]
    struct.pack_into("<8sQQQ", data._buf, 0, MAGIC, token, offset, pool.live[offset])
    return OK, data


def cuMemPoolImportFromShareableHandle(fd: int, handle_type: Any, flags: int) -> tuple[CUresult, _Pool | None]:
    err = _enter("cuMemPoolImportFromShareableHandle")
    if err:
        return err, None
    pool = _Pool(os.dup(fd), owned=False)
    if pool.header()[0] != MAGIC:
        return BAD, None
    _pools.append(pool)
    return OK, pool


def cuMemPoolImportPointer(pool: _Pool, data: CUmemPoolPtrExportData) -> tuple[CUresult, int]:
    err = _enter("cuMemPoolImportPointer")
    magic, token, offset, size = struct.unpack_from("<8sQQQ", data._buf, 0)
    if err or magic != MAGIC or token != pool.header()[1] or pool.owned:
        return err or BAD, 0
    pool.live[offset] = size
    pool.count(2)
    return OK, pool.address(offset)


def cuMemsetD8(ptr: Any, value: int, n: int) -> tuple[CUresult]:
    err = _enter("cuMemsetD8")
    found = _find(ptr)
    if err or found is None:
        return (err or BAD,)
    pool, offset = found
    pool.map[offset : offset + n] = bytes([value]) * n
    return (OK,)


def cuMemcpyDtoH(dst: int, src: Any, n: int) -> tuple[CUresult]:
    err = _enter("cuMemcpyDtoH")
    found = _find(src)
    if err or found is None:
        return (err or BAD,)
    pool, offset = found
    ctypes.memmove(dst, pool.map[offset : offset + n], n)
    return (OK,)
