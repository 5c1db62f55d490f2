"""The consumer side: module-level functions that spawn imports in every worker.

Each consumer sets itself up, says ``("ready", pid)``, then loops: get an item, touch it
(its device pointer or first element), let it go, ack -- on a Queue (``_queue_consumer``,
``_raw_reference_consumer``, ``_torch_consumer``) or
on its own Pipe (``_pipe_consumer``, ``_ring_consumer``, ``_stream_consumer``). A failure is
sent as ``("error", text)``, so the producer fails that cell, not the run; a sentinel (None)
or the producer's exit stops it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
from collections.abc import Callable, Sequence
from typing import Any

from .settings import RING_GET_TIMEOUT, BenchError, _cuda_core, _gpushare


def _touch_plain(item: Any) -> None:
    pass


def _touch_gpushare(buf: Any) -> None:
    _ = buf.ptr  # the mapping is real: ptr is this process's address of the memory
    buf.release()


def _touch_gpushare_host(buf: Any) -> None:
    _ = buf.numpy()[0]
    buf.release()


def _touch_numpy(array: Any) -> None:
    _ = array[0]


def _touch_torch(tensor: Any) -> None:
    _ = tensor.data_ptr()


def _touch_cuda_core(buf: Any) -> None:
    _ = int(buf.handle)
    buf.close()


_TOUCH: dict[str, Callable[[Any], None]] = {
    "plain": _touch_plain,
    "gpushare": _touch_gpushare,
    "gpushare_host": _touch_gpushare_host,
    "numpy": _touch_numpy,
    "torch": _touch_torch,
    "cuda_core": _touch_cuda_core,
}


def _consumer_setup(kind: str, device: int | None) -> None:
    if kind == "torch":
        import torch

        torch.cuda.set_device(device or 0)
        torch.cuda.init()
    elif kind == "cuda_core":
        _cuda_core().Device(device or 0).set_current()


def _queue_consumer(kind: str, work: Any, acks: Any, device: int | None, extra: Any = None) -> None:
    """Get items from ``work`` until None; touch each one, then ack on ``acks``.

    ``extra`` is carried only so that it is unpickled at spawn (cuda.core maps
    its memory resource there, which its buffers need on arrival).
    """
    try:
        _consumer_setup(kind, device)
        touch = _TOUCH[kind]
    except BaseException as exc:
        acks.put(("error", f"consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    acks.put(("ready", os.getpid()))
    while True:
        try:
            item = work.get()  # unpickling maps the memory: a backend that cannot open it fails here
        except BaseException as exc:
            acks.put(("error", f"consumer could not receive the item: {type(exc).__name__}: {exc}"))
            return
        if item is None:
            return
        try:
            touch(item)
        except BaseException as exc:
            acks.put(("error", f"consumer failed: {type(exc).__name__}: {exc}"))
            return
        del item
        acks.put(1)


def _raw_reference_consumer(kind: str, work: Any, acks: Any, device: int, sock: Any = None) -> None:
    """``first_share``'s reference consumer for one mechanism: take each shared
    allocation, open it with the bare driver calls, ack, close it, say ``"closed"``.

    ``kind`` ``"ipc"``: a 64-byte IPC handle per item on ``work``. ``"vmm"``: the size
    and an exported fd in one SCM_RIGHTS message per item on ``sock`` (imported, mapped).
    ``"pool"``: the producer's pool fd once on ``sock`` (imported before "ready"), then
    a pointer's 64 export bytes per item on ``work``."""
    try:
        from gpushare import _cuda

        _cuda.make_current(device)
        take, open_, close = _RAW_KINDS[kind](_cuda, work, sock, device)
    except BaseException as exc:
        acks.put(("error", f"consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    acks.put(("ready", os.getpid()))
    while True:
        item = take()
        if item is None:
            return
        try:
            mapped = open_(item)
        except BaseException as exc:
            acks.put(("error", f"opening the {kind} allocation failed: {type(exc).__name__}: {exc}"))
            return
        acks.put(1)
        close(mapped)
        acks.put("closed")


_Raw = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]  # take, open, close


def _raw_ipc(cuda: Any, work: Any, sock: Any, device: int) -> _Raw:
    return work.get, lambda handle: cuda.ipc_open(handle, device), lambda ptr: cuda.ipc_close(ptr, device)


def _raw_vmm(cuda: Any, work: Any, sock: Any, device: int) -> _Raw:
    import socket
    import struct

    def take() -> tuple[int, int] | None:
        data, fds, _, _ = socket.recv_fds(sock, 8, 1)
        if len(data) != 8 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None  # the stop message (or the producer's end closed)
        return struct.unpack("q", data)[0], fds[0]

    def open_(item: tuple[int, int]) -> tuple[int, Any, int]:
        nbytes, fd = item
        try:
            return (*cuda.vmm_import(fd, nbytes, [device]), nbytes)
        finally:
            os.close(fd)

    return take, open_, lambda mapped: cuda.vmm_free(*mapped, device)


def _raw_pool(cuda: Any, work: Any, sock: Any, device: int) -> _Raw:
    import socket

    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        raise RuntimeError("the producer sent no pool fd")
    try:
        pool = cuda.pool_import(fds[0], [device], device)
    finally:
        os.close(fds[0])
    return work.get, lambda data: cuda.pool_import_pointer(pool, data, device), lambda ptr: cuda.pool_free(ptr, device)


_RAW_KINDS = {"ipc": _raw_ipc, "vmm": _raw_vmm, "pool": _raw_pool}


def _torch_consumer(work: Any, results: Any, device: int, measure: Callable[..., Any], warmup: int, iters: int) -> None:
    """On ``device``, get one buffer at a time (until None), answer ``("result", measure(torch,
    buf, device, warmup, iters))`` (``peer_read`` and ``kernel_read``).

    Every answer comes after the tensors are dropped and the buffer is released, so
    the producer's lease is back (or on its way) when it reads the answer.
    """
    try:
        import torch

        if torch.cuda.device_count() <= device:
            raise BenchError(
                f"torch sees {torch.cuda.device_count()} CUDA device(s); this consumer needs cuda:{device}"
            )
        torch.cuda.set_device(device)
        torch.cuda.init()
    except BaseException as exc:
        results.put(("error", f"consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    results.put(("ready", os.getpid()))
    while True:
        try:
            buf = work.get()  # unpickling maps the memory
        except BaseException as exc:
            results.put(("error", f"consumer could not receive the buffer: {type(exc).__name__}: {exc}"))
            return
        if buf is None:
            return
        reply: Any
        try:
            reply = ("result", measure(torch, buf, device, warmup, iters))
        except BaseException as exc:
            reply = ("error", f"consumer failed: {type(exc).__name__}: {exc}")
        finally:
            gc.collect()  # a DLPack tensor holds its own reference: drop it before the release
            with contextlib.suppress(Exception):
                buf.release()
        del buf
        gc.collect()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        results.put(reply)


def _pipe_consumer(conn: Any) -> None:
    conn.send(("ready", os.getpid()))
    while True:
        if conn.recv() is None:
            return
        conn.send(1)


def _send_quiet(conn: Any, message: Any) -> None:
    with contextlib.suppress(Exception):
        conn.send(message)


def _parent_gone() -> bool:
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def _stop_requested(conn: Any) -> bool:
    """True when the producer sent the stop sentinel (None) or is gone."""
    try:
        if conn.poll(0):
            return conn.recv() is None
    except (EOFError, OSError):
        return True
    return _parent_gone()


def _ring_consumer(ring: Any, conn: Any, checkpoints: Sequence[int] | None = None) -> None:
    """Get ring items until the ring closes; touch each (``item.ptr``), release it, then ack on ``conn``.

    The ring registered this consumer when it was unpickled (as this process's argument),
    before this function runs. ``checkpoints`` None: ack every item with 1, exactly like the
    Pipe floor's consumer (the fan-out pattern). Otherwise ack only when the number of items
    received reaches one of the ``checkpoints`` (sending that count): the pipelined pattern.
    """
    gpushare = _gpushare()
    try:
        if ring.closed:
            ring.get(timeout=0)  # raises the reason the registration failed
        conn.send(("ready", os.getpid()))
    except BaseException as exc:
        _send_quiet(conn, ("error", f"ring consumer could not register: {type(exc).__name__}: {exc}"))
        return
    marks = None if checkpoints is None else frozenset(checkpoints)
    count = 0
    while True:
        try:
            item = ring.get(timeout=RING_GET_TIMEOUT)
        except gpushare.RingClosedError:
            return
        except TimeoutError:
            if _stop_requested(conn):
                return
            continue
        except BaseException as exc:
            _send_quiet(conn, ("error", f"ring consumer could not get an item: {type(exc).__name__}: {exc}"))
            return
        try:
            _ = item.ptr
            item.release()
        except BaseException as exc:
            _send_quiet(conn, ("error", f"ring consumer failed: {type(exc).__name__}: {exc}"))
            return
        del item
        count += 1
        try:
            if marks is None:
                conn.send(1)
            elif count in marks:
                conn.send(count)
        except (OSError, EOFError):
            return  # the producer is gone


def _stream_consumer(kind: str, work: Any, conn: Any, device: int | None, ack_every: int) -> None:
    """Get items from ``work`` until None; touch each one; every ``ack_every`` items send the count so far."""
    try:
        _consumer_setup(kind, device)
        touch = _TOUCH[kind]
    except BaseException as exc:
        _send_quiet(conn, ("error", f"consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    _send_quiet(conn, ("ready", os.getpid()))
    count = 0
    while True:
        try:
            item = work.get(timeout=RING_GET_TIMEOUT)
        except queue.Empty:
            if _stop_requested(conn):
                return
            continue
        except BaseException as exc:
            _send_quiet(conn, ("error", f"consumer could not receive the item: {type(exc).__name__}: {exc}"))
            return
        if item is None:
            return
        try:
            touch(item)
        except BaseException as exc:
            _send_quiet(conn, ("error", f"consumer failed: {type(exc).__name__}: {exc}"))
            return
        del item
        count += 1
        if count % ack_every == 0:
            try:
                conn.send(count)
            except (OSError, EOFError):
                return
