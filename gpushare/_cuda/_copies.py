"""Copies between host and device memory, done on the device before they return.

gpushare's own writes are of this kind: a buffer filled and put on a queue must
read as filled in the consumer, whose context and stream know nothing of ours.
"""

from __future__ import annotations

from ._driver import _check, on_device

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


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
