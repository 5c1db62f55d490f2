"""Streams and events: stream ordering within a process and between processes.

- An interprocess event (:func:`event_create_ipc`) is made once; each consumer opens its
  handle once (:func:`event_open`), then records and waits on it at every handoff.
- A plain event (:func:`event_create`) orders work within this process.
- The per-handoff calls (:func:`event_record`, :func:`stream_wait_event`, :func:`stream_idle`,
  :func:`event_done`) enter through :func:`~gpushare._cuda._driver._enter`; the queries and
  the record keep the GIL where they can (:func:`_finished` is the fallback).
"""

from __future__ import annotations

from . import _driver
from ._driver import IPC_HANDLE_SIZE, _check, _enter, _load, _stream, on_device

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

_IPC_EVENT_FLAGS = 6  # CU_EVENT_DISABLE_TIMING (2) | CU_EVENT_INTERPROCESS (4)


# -- events -------------------------------------------------------------------------


def event_create_ipc(ordinal: int) -> tuple[Any, bytes]:
    """An interprocess event on ``ordinal`` and its 64-byte handle (created once, recorded often)."""
    import ctypes  # loaded with the driver already; kept out of this package's import

    with on_device(ordinal) as driver:
        event = _check("cuEventCreate", driver.cuEventCreate(_IPC_EVENT_FLAGS))
        try:
            handle = _check("cuIpcGetEventHandle", driver.cuIpcGetEventHandle(event))
        except BaseException:
            driver.cuEventDestroy(event)
            raise
    return event, ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)


def event_create(ordinal: int) -> Any:
    """A plain event on ``ordinal`` (``cuEventCreate`` with ``CU_EVENT_DISABLE_TIMING``).

    Orders work within this process: record it after a copy (:func:`event_record`),
    then wait for it on another stream (:func:`stream_wait_event`), ask
    (:func:`event_done`) or block (:func:`event_synchronize`). Cheap, yet
    create once and record often. Destroy with :func:`event_destroy`.
    To order work in another process, use :func:`event_create_ipc`.
    """
    with on_device(ordinal) as driver:
        flags = int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return _check("cuEventCreate", driver.cuEventCreate(flags))


def event_record(event: Any, ordinal: int, stream: int = 0) -> None:
    """Record ``event`` on ``stream`` (0: the legacy default stream, where torch's default work runs).

    Through the GIL-keeping call when the device's primary context is current on
    this thread (the common case: a short call, and no other thread runs in the
    middle of a handoff), else through cuda-bindings."""
    queries = _driver._queries
    if queries is not None and queries.record(_driver._primary_ints.get(ordinal), int(event), stream):
        return
    driver, pushed = _enter(ordinal)
    try:
        _check("cuEventRecord", driver.cuEventRecord(event, _stream(driver, stream)))
    finally:
        if pushed:
            driver.cuCtxPopCurrent()


def event_open(handle: bytes, ordinal: int) -> Any:
    """Open another process's interprocess event (slow next to a handoff: cache the result)."""
    import ctypes

    with on_device(ordinal) as driver:
        h = driver.CUipcEventHandle()
        ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_SIZE)
        return _check("cuIpcOpenEventHandle", driver.cuIpcOpenEventHandle(h))


def event_destroy(event: Any, ordinal: int) -> None:
    """Destroy an event of any kind: created here, or opened from another process."""
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


# -- queries that never block -------------------------------------------------------


def stream_idle(ordinal: int, stream: int = 0) -> bool:
    """Whether every piece of work queued on ``stream`` (0: the legacy default stream)
    has finished (``cuStreamQuery``; cheap, never blocks)."""
    driver = _driver._bindings  # _driver's lazily set state: one attribute lookup, never a copy
    if driver is None:
        driver = _load()
    queries = _driver._queries
    if queries is not None:
        done = queries.stream_done(_driver._primary_ints.get(ordinal), stream)
        if done is not None:
            return done
    return _finished(driver, ordinal, "cuStreamQuery", driver.cuStreamQuery, _stream(driver, stream))


def event_done(event: Any, ordinal: int) -> bool:
    """Whether the work before ``event``'s last record has finished (``cuEventQuery``;
    never blocks). An event never recorded counts as done."""
    driver = _driver._bindings
    if driver is None:
        driver = _load()
    queries = _driver._queries
    if queries is not None:
        done = queries.event_done(_driver._primary_ints.get(ordinal), int(event))
        if done is not None:
            return done
    return _finished(driver, ordinal, "cuEventQuery", driver.cuEventQuery, event)


def _finished(driver: Any, ordinal: int, name: str, query: Any, handle: Any) -> bool:
    """``query(handle)`` (``cuStreamQuery``, ``cuEventQuery``) in device ``ordinal``'s
    context, through cuda-bindings: True when done, False on CUDA_ERROR_NOT_READY,
    else raises.

    The common case (the primary context already current on this thread) is
    checked inline: one ``cuCtxGetCurrent``, the query, and two comparisons with
    results cached at load, cheaper than going through :func:`_enter` (dev/performance.md,
    "Cheaper stream and event queries")."""
    key = _driver._primary_ints.get(ordinal)
    if key is not None:
        err, current = driver.cuCtxGetCurrent()
        if err == _driver._success and current is not None and int(current) == key:
            err = query(handle)[0]
            if err == _driver._not_ready:
                return False
            _check(name, (err,))
            return True
    driver, pushed = _enter(ordinal)
    try:
        result = query(handle)
    finally:
        if pushed:
            driver.cuCtxPopCurrent()
    if result[0] == _driver._not_ready:
        return False
    _check(name, result)
    return True


# -- streams ------------------------------------------------------------------------


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


def stream_destroy(stream: int, ordinal: int) -> None:
    """Destroy a stream from :func:`stream_create` (``cuStreamDestroy``).

    Work already queued on it still runs; the handle must not be used again (the
    driver may hand the same int to a later stream). Never destroy the default
    streams (0, 1, 2) or another library's stream.
    """
    _driver._stream_handles.pop(stream, None)  # its slot in the handle cache goes with it
    with on_device(ordinal) as driver:
        _check("cuStreamDestroy", driver.cuStreamDestroy(driver.CUstream(stream)))


def stream_synchronize(stream: int, ordinal: int) -> None:
    """Wait for the work queued on ``stream`` (a CUstream handle as an int; 1 and 2 are
    the legacy and per-thread default streams)."""
    with on_device(ordinal) as driver:
        _check("cuStreamSynchronize", driver.cuStreamSynchronize(driver.CUstream(stream)))


def synchronize(ordinal: int) -> None:
    """Wait for all the work of this process on device ``ordinal``."""
    with on_device(ordinal) as driver:
        _check("cuCtxSynchronize", driver.cuCtxSynchronize())
