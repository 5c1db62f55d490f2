"""Copies between host and device memory, and the page-locked host memory they run from.

- Synchronous copies (:func:`memset`, :func:`memcpy_htod`, :func:`memcpy`, ...) are done
  on the device when they return.
- Asynchronous ones (:func:`memcpy_htod_async`, :func:`memcpy_async`,
  :func:`memcpy_batch_async`) are queued on a stream; the caller orders or waits, and keeps
  both sides alive and unchanged until then.
- A copy from the host is asynchronous only from page-locked memory (:func:`host_alloc`,
  :func:`host_register`; both portable). See dev/design-notes.md, "The CUDA layer".
"""

from __future__ import annotations

from . import _kernels
from ._driver import _check, _enter, _stream, on_device

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

# Whether cuMemcpyBatchAsync works in this process: None until the first batch
# on a stream it accepts has told (see memcpy_batch_async), then True or False.
_batch: bool | None = None
_LEGACY_STREAMS = (0, 1)  # the NULL stream and CU_STREAM_LEGACY: cuMemcpyBatchAsync refuses both


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


def memcpy(dst: int, src: int, nbytes: int, ordinal: int) -> None:
    """Copy between any two device (or mapped) addresses; unified addressing finds them."""
    with on_device(ordinal) as driver:
        _check("cuMemcpy", driver.cuMemcpy(dst, src, nbytes))
        _finish(driver)


# -- page-locked host memory ----------------------------------------------------------


def host_alloc(nbytes: int, ordinal: int = 0) -> int:
    """``nbytes`` of page-locked host memory (``cuMemHostAlloc``, portable), as its address.

    The driver needs a context for the call: device ``ordinal``'s primary context
    (device 0's unless given) is pushed for it; the memory is pinned for every
    device all the same. Costly: the driver maps and locks every page, so allocate
    once and reuse. Free it with :func:`host_free`. When it fails (out of memory,
    or the locked-memory limit), use ordinary host memory: copies from it work,
    only synchronously.
    """
    with on_device(ordinal) as driver:
        ptr = _check(
            "cuMemHostAlloc",
            driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_PORTABLE),
            hint=f"Could not page-lock {nbytes} bytes of host memory; pin fewer or smaller buffers, "
            "raise the locked-memory limit (ulimit -l), or copy from ordinary host memory",
        )
    return int(ptr)


def host_free(ptr: int, ordinal: int = 0) -> None:
    """Free memory from :func:`host_alloc` (``cuMemFreeHost``), once the copies from it are done."""
    with on_device(ordinal) as driver:
        _check("cuMemFreeHost", driver.cuMemFreeHost(ptr))


def host_register(ptr: int, nbytes: int, ordinal: int = 0) -> None:
    """Page-lock the existing host range ``[ptr, ptr + nbytes)`` (``cuMemHostRegister``, portable).

    Then torch sees tensors on it as pinned and host-to-device copies from it are
    asynchronous. Costly like :func:`host_alloc` (every page is faulted in and
    locked): register a long-lived range once. Unregister it with
    :func:`host_unregister` before it is unmapped. When it fails (the range, or
    part of it, is registered already; the locked-memory limit), copies from the
    range still work, synchronously. ``ordinal`` as for :func:`host_alloc`.
    """
    with on_device(ordinal) as driver:
        _check(
            "cuMemHostRegister",
            driver.cuMemHostRegister(ptr, nbytes, driver.CU_MEMHOSTREGISTER_PORTABLE),
            hint=f"Could not page-lock the {nbytes} bytes at {ptr:#x}; copy from them unregistered instead",
        )


def host_unregister(ptr: int, ordinal: int = 0) -> None:
    """Undo :func:`host_register` (``cuMemHostUnregister``); ``ptr`` is the address registered.

    Call it once the copies from the range are done and before the range is unmapped.
    """
    with on_device(ordinal) as driver:
        _check(
            "cuMemHostUnregister",
            driver.cuMemHostUnregister(ptr),
            hint="Pass the address given to host_register, once",
        )


# -- asynchronous copies ------------------------------------------------------------


def memcpy_htod_async(dst: int, src_host: int, nbytes: int, ordinal: int, stream: int) -> None:
    """Queue a host-to-device copy on ``stream`` (``cuMemcpyHtoDAsync``) without waiting for it.

    Asynchronous when ``src_host`` is page-locked (see the module's docstring).
    Costs one driver call to queue (and a context push and pop when another
    context is current on this thread).
    """
    driver, pushed = _enter(ordinal)
    try:
        _check("cuMemcpyHtoDAsync", driver.cuMemcpyHtoDAsync(dst, src_host, nbytes, _stream(driver, stream)))
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def memcpy_async(dst: int, src: int, nbytes: int, ordinal: int, stream: int) -> None:
    """Queue a copy on ``stream`` (``cuMemcpyAsync``) without waiting for it.

    Unified addressing tells the kinds of memory apart: device to device, from a
    peer GPU, to or from host memory. Costs one driver call to queue, as
    :func:`memcpy_htod_async`.
    """
    driver, pushed = _enter(ordinal)
    try:
        _check("cuMemcpyAsync", driver.cuMemcpyAsync(dst, src, nbytes, _stream(driver, stream)))
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def memcpy_batch_async(
    dsts: list[int],
    srcs: list[int],
    sizes: list[int],
    ordinal: int,
    stream: int,
    *,
    batch: bool = True,
    kernel: bool = False,
) -> None:
    """Queue the copies ``srcs[i] -> dsts[i]`` of ``sizes[i]`` bytes on ``stream``, not waiting.

    The copies are not ordered among themselves, so none may read what another
    writes. The path, first that applies: gpushare's copy kernel (``kernel=True``:
    every pointer is device memory ``ordinal``'s context reaches; two copies or more;
    the kernel was built); one ``cuMemcpyBatchAsync``; else one ``cuMemcpyAsync`` per
    copy (``batch=False`` for copies between GPUs, the legacy default stream, or a
    batched call missing or refused; the first batch decides for the process).
    dev/design-notes.md, "The CUDA layer", has the table.

    A failing copy raises :class:`~gpushare._errors.CUDAError` naming the call,
    and in the loop which copy; check that copy's pointers and size, or queue the
    copies one by one with :func:`memcpy_async`.
    """
    global _batch
    count = len(dsts)
    if len(srcs) != count or len(sizes) != count:
        raise ValueError(
            f"memcpy_batch_async needs one source and one size per destination: "
            f"got {count} destinations, {len(srcs)} sources, {len(sizes)} sizes"
        )
    if not count:
        return
    if kernel and count > 1 and _kernels.launch_copies(dsts, srcs, sizes, ordinal, stream):
        return
    driver, pushed = _enter(ordinal)
    try:
        handle = _stream(driver, stream)
        if not batch or _batch is False or stream in _LEGACY_STREAMS:
            _copy_each(driver, dsts, srcs, sizes, handle)
            return
        probing = _batch is None
        if _copy_batch(driver, dsts, srcs, sizes, handle):
            _batch = True
            return
        _copy_each(driver, dsts, srcs, sizes, handle)  # raises when the copies themselves are wrong
        if probing:
            _batch = False  # it refused copies that cuMemcpyAsync makes: it does not work here
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def _copy_batch(driver: Any, dsts: list[int], srcs: list[int], sizes: list[int], handle: Any) -> bool:
    """One ``cuMemcpyBatchAsync``: True when it queued the copies, False when it is
    missing or refused them; raises on any other error."""
    batch = getattr(driver, "cuMemcpyBatchAsync", None)
    if batch is None:  # cuda-bindings before 12.8
        return False
    attrs = driver.CUmemcpyAttributes()
    attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    ptr = driver.CUdeviceptr
    try:
        result = batch(
            [ptr(d) for d in dsts], [ptr(s) for s in srcs], [int(n) for n in sizes], len(dsts), [attrs], [0], 1, handle
        )
    except RuntimeError:  # cuda-bindings' FunctionNotFoundError: the driver library lacks it
        return False
    err = result[0]  # 12.x bindings also return the index of a failing copy; 13.x only the error
    codes = driver.CUresult
    if err == codes.CUDA_SUCCESS:
        return True
    if err in (codes.CUDA_ERROR_NOT_SUPPORTED, codes.CUDA_ERROR_INVALID_VALUE):
        return False
    _check("cuMemcpyBatchAsync", result)
    return False  # not reached: _check raised


def _copy_each(driver: Any, dsts: list[int], srcs: list[int], sizes: list[int], handle: Any) -> None:
    copy, success = driver.cuMemcpyAsync, driver.CUresult.CUDA_SUCCESS
    for i, (dst, src, size) in enumerate(zip(dsts, srcs, sizes, strict=True)):
        result = copy(dst, src, size, handle)
        if result[0] != success:
            _check("cuMemcpyAsync", result, hint=f"copy {i} of {len(dsts)}: {size} bytes from {src:#x} to {dst:#x}")
