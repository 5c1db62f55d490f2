"""Copies between host and device memory, and the page-locked host memory they run from.

Two kinds of copy:

* Synchronous (:func:`memset`, :func:`memcpy_htod`, :func:`memcpy`, ...): done
  on the device before they return. gpushare's own writes are of this kind: a
  buffer filled and put on a queue must read as filled in the consumer, whose
  context and stream know nothing of ours.
* Asynchronous (:func:`memcpy_htod_async`, :func:`memcpy_async`,
  :func:`memcpy_batch_async`): queued on an int stream handle and not waited
  for. The caller orders later work after them (``event_record`` then
  ``stream_wait_event``) or waits (``stream_synchronize``,
  ``event_synchronize``), and keeps the source and destination alive and
  unchanged until then. They enter the device's context the per-handoff way
  (:func:`~gpushare._cuda._driver._enter`).

A copy from host memory is asynchronous only when that memory is page-locked:
allocated by :func:`host_alloc`, or an existing range (an mmap of POSIX shared
memory, say) registered with :func:`host_register`. Both are *portable*:
pinned for every context of this process, whichever device's context was
current when they were made. From pageable memory the driver stages the copy
and returns once it has read the source.
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
    writes. Which path runs:

    * gpushare's copy kernel (:mod:`._kernels`), one launch per 96 copies,
      where the caller says ``kernel=True`` (every pointer is device memory
      that ``ordinal``'s context reaches: no host memory, no other GPU's),
      there are two copies or more, and the kernel could be built here;
    * ``cuMemcpyBatchAsync`` (CUDA 12.8 and later), one driver call for all of
      them, with every source read in stream order;
    * otherwise one ``cuMemcpyAsync`` per copy: where the caller says ``batch=False``
      (copies between two GPUs, see :func:`gpushare._fanout._copy.copy_regions`), on the legacy default stream
      (``stream`` 0 or 1, which the batched call refuses), where cuda-bindings or
      the driver lack the batched call, or where it refused
      (``CUDA_ERROR_NOT_SUPPORTED`` / ``CUDA_ERROR_INVALID_VALUE``) copies that
      ``cuMemcpyAsync`` then made. The first batch on another stream decides for
      the process (module flag ``_batch``); a refusal after batching has worked
      only sends that batch down the loop.

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
