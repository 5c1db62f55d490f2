"""Benchmarks: gpushare's buffer handoff against its floors and its peers.

``python -m gpushare.bench`` (``--quick`` for a short run, ``--help`` for
the options) measures everything below in one run and writes three files
to ``--out`` (default ``docs``): ``benchmarks.md`` (machine, versions and
one table per scenario: medians, p90 and ratios to the floor),
``benchmarks.json`` (every median, p90, mean and minimum, plus skip
reasons, errors and whether each target is met) and ``benchmarks.png``
(latency against the number of consumers, one panel per fan-out scenario,
one line per system, the ring's panel with the Pipe floor and its targets;
skipped with a note when matplotlib does not import).

gpushare is measured once per CUDA backend (``--backends``, default every
CUDA backend: ``cuda_ipc``, ``cuda_vmm``, ``cuda_pool``), each its own
column ("gpushare cuda_vmm") with its own ratio to the floor, in the same
run as the peers. The backend is chosen per allocation
(``Manager.empty(..., backend=name)``); a backend this machine cannot run
(``BackendUnavailableError``) is a skipped column with the reason.

What one iteration is, per scenario (one producer, N consumer processes):

``floors``
    A small tuple sent down one ``multiprocessing.Pipe`` per consumer, or
    put N times on one ``multiprocessing.Queue`` read by N consumers; each
    consumer acks (on its pipe, or on one ack queue) and the producer
    waits for every ack. No handoff can cost less than this notification,
    so every other table is read as a ratio to the Queue floor (``ring``:
    to the Pipe floor, whose acks it shares).
``handoff_recycled`` / ``handoff_fresh``
    The Queue-floor pattern carrying a 1 MiB buffer instead of the tuple:
    the producer puts the buffer once per consumer; a consumer gets it,
    touches its device pointer, lets it go and acks. Systems: gpushare,
    one column per backend (``Manager.empty(..., backend=name)``;
    consumers ``buf.ptr`` then ``buf.release()``), ``torch.multiprocessing``
    (a CUDA tensor; ``t.data_ptr()`` then ``del t``) and cuda.core (a
    buffer of an IPC-enabled ``DeviceMemoryResource``, which cuda.core
    pickles itself; the memory resource is handed to each consumer at
    spawn). *recycled* puts the same buffer every iteration; *fresh*
    allocates one per iteration and drops it after the acks (each
    library's pool or caching allocator recycles the memory, as it would
    in a pipeline).
``ring``
    Fan-out through a ring (``manager.ring(shape, "float32", device=...,
    slots=4, consumers=N, backend=name)``, 1 MiB float32 slots), one column
    per backend, made once per cell and passed to each consumer as its
    Process argument (each unpickling registers one consumer). One
    iteration: ``buf = ring.acquire()``, ``ring.publish(buf)``, then one ack
    from every consumer, each on its own spawn-context ``multiprocessing.Pipe``
    exactly like the Pipe floor's ack; a consumer takes the item with
    ``ring.get()``, reads ``item.ptr``, gives it back with ``item.release()``,
    then acks. Ratios are to the *Pipe* floor. Targets, printed per row
    with met / not met: 1 consumer <= 1.5x the Pipe floor; 4 consumers
    <= 80 us; 8 consumers <= 150 us.
``throughput``
    Pipelined handoffs per second to one consumer, the producer never
    waiting for each ack, for a 1 MiB and a 64 MiB buffer: the ring (4 slots;
    the producer acquires and publishes as fast as released slots allow, the
    consumer gets, touches, releases and acks only at the end of each timed
    repeat), gpushare through its Queue (the same recycled buffer put again
    and again), ``torch.multiprocessing`` through its Queue (a recycled CUDA
    tensor; GPU only) and the plain ``multiprocessing.Queue`` floor (a small
    tuple). The Queue systems keep at most 8 items put and not yet acked;
    their consumer acks every 4 items with its count on a Pipe. Items/s over
    a fixed count (2000 items, 1000 with ``--quick``) after a warm-up, per
    repeat (5, 3 with ``--quick``); the table shows the median repeat.
    Target: gpushare >= 30,000 handoffs/s at 1 MiB.
``first_share``
    Time from ``m.empty()`` of a fresh allocation through one consumer
    mapping it and acking, one column per backend. Between iterations (not
    timed) the producer waits for the consumer's lease to come back and
    calls ``m.trim()``, so every iteration allocates, exports and maps new
    memory.
``peer_read``
    Only with two or more GPUs and torch. Per backend, the producer fills a
    1 GiB float32 buffer on cuda:0 and sends it to one consumer started
    with ``Process(device=1)``. The consumer views it with
    ``torch.as_tensor(buf, device="cuda:0")`` (the memory's own GPU; the
    view must alias the mapping, else the cell fails) and times
    ``dst.copy_(src)`` into a cuda:1 tensor with CUDA events on the
    destination's stream, median of 20 copies (5 with ``--quick``), as GB/s
    of bytes copied once. The reference, in the same consumer and
    interleaved copy by copy: the same copy from a plain torch tensor the
    consumer allocated on cuda:0 (the NVLink rate). Also a local copy
    (cuda:0 -> cuda:0) of both. The mapped buffer should read at >= 0.90 of
    the plain tensor's rate. The consumer checks the copies hold the
    producer's fill, releases the buffer and drops its tensors before it
    answers.
``kernel_read``
    Only with a GPU and torch. Per backend, the producer fills a 1 GiB
    float32 buffer on cuda:0 and sends it to one consumer on the same GPU
    (``Process(device=0)``), which views it with ``x = torch.from_dlpack(buf)``
    (checked to alias the mapping, float32, the buffer's shape) and times
    ``x.sum()`` with CUDA events on the current stream, interleaved with the
    same reduction over ``torch.empty_like(x)`` filled by the consumer
    itself: median of 10 after 3 warm-up rounds (5 after 2 with ``--quick``).
    Read bandwidth is bytes / median time, for both; the mapped buffer
    should read at >= 0.97 of the local tensor's rate. Both sums are checked
    against the 1.0 fills; the consumer drops its tensors and releases the
    buffer before it answers.
``host``
    A 64 MiB float32 array on the host backend (always runs, GPU or not):
    a gpushare host buffer written in place, the same buffer refilled with
    ``copy_from`` every iteration, and a plain ``multiprocessing.Queue``
    carrying the NumPy array itself (a pickled copy per consumer).
    Consumers touch the first element.

How: everything uses the spawn start method. Consumers are module-level
functions, started once per (scenario, system, N), reused across
iterations, told to stop with a sentinel and always joined with a timeout
(then terminated, then killed). After a warm-up, each iteration is timed
with ``time.perf_counter_ns`` around "produce, put N times, collect N
acks", with the garbage collector off in the producer while timing.
Large transfers (64 MiB and up) run fewer iterations. A peer that cannot
run here (not importable, no GPU, one GPU for ``peer_read``) is recorded
as skipped with the reason; an error in one cell is recorded as that
cell's error and the run goes on. Every wait has a timeout: a consumer that
dies or stops answering fails its cell, not the run. ``throughput`` times
whole repeats (one sample per repeat: elapsed time / items) instead of
single iterations.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["main"]

MiB = 1 << 20
GiB = 1 << 30
HANDOFF_BYTES = 1 * MiB
HANDOFF_SHAPE = (HANDOFF_BYTES // 4,)  # float32
HOST_BYTES = 64 * MiB
HOST_SHAPE = (HOST_BYTES // 4,)
CONSUMERS = (1, 2, 4, 8)
HOST_CONSUMERS = (1, 2, 4)
READY_TIMEOUT = 180.0  # seconds for N spawned consumers to import and set up (torch is slow)
ACK_TIMEOUT = 60.0  # seconds for one ack; only a stuck or dead consumer takes this long
JOIN_TIMEOUT = 10.0
SETTLE_TIMEOUT = 10.0

#: The CUDA backends measured by default, in column order; any other CUDA backend the
#: library lists in ``gpushare._backends.BACKENDS`` is added after them.
CUDA_BACKENDS = ("cuda_ipc", "cuda_vmm", "cuda_pool")
HOST_BACKEND = "host"

PEER_SHAPE = (256 << 20,)  # float32: 1 GiB
PEER_HOME = 0  # the GPU the producer allocates on
PEER_DEVICE = 1  # the consumer's GPU, which reads the memory over the peer link
PEER_ITERS = 20
PEER_ITERS_QUICK = 5
PEER_WARMUP = 3
PEER_WARMUP_QUICK = 2
PEER_TARGET = 0.90  # the mapped buffer's peer-read rate, as a fraction of a plain tensor's
PEER_TIMEOUT = 300.0  # seconds for the consumer's whole measurement (maps 1 GiB, allocates 3 GiB, copies)
PEER_PEER_MAPPED = "peer read, mapped buffer"
PEER_PEER_PLAIN = "peer read, plain tensor"
PEER_LOCAL_MAPPED = "local copy, mapped buffer"
PEER_LOCAL_PLAIN = "local copy, plain tensor"
PEER_SYSTEMS = (PEER_PEER_MAPPED, PEER_PEER_PLAIN, PEER_LOCAL_MAPPED, PEER_LOCAL_PLAIN)

FLOOR_SCENARIO = "floors"
FLOOR_SYSTEM = "mp.Queue"
GPUSHARE = "gpushare"
TORCH = "torch.multiprocessing"
CUDA_CORE = "cuda.core IPC pool"
PIPE_FLOOR_SYSTEM = "mp.Pipe"


@dataclass(frozen=True)
class Target:
    """A goal printed next to a row: ``ratio_max`` (median / floor <= limit), ``us_max``
    (median <= limit us) or ``rate_min`` (items per second >= limit, from a time per item)."""

    kind: str
    limit: float

    def text(self, floor: str = "the floor") -> str:
        if self.kind == "ratio_max":
            return f"<= {self.limit:g}x {floor}"
        if self.kind == "us_max":
            return f"<= {self.limit:g} us"
        return f">= {self.limit:,.0f}/s"

    def met(self, cell: Cell | None, floor: Cell | None = None) -> bool | None:
        """Whether ``cell`` meets it; None when it cannot be judged (no cell, no floor)."""
        if cell is None or cell.median_us <= 0:
            return None
        if self.kind == "ratio_max":
            if floor is None or floor.median_us <= 0:
                return None
            return cell.median_us / floor.median_us <= self.limit
        if self.kind == "us_max":
            return cell.median_us <= self.limit
        return 1e6 / cell.median_us >= self.limit


# ring: fan-out of one ring slot to N consumers, against the Pipe floor
RING_SLOTS = 4
RING_GET_TIMEOUT = 1.0  # seconds a consumer's get() waits before it checks for a stop request
FIRST_SHARE_TARGET = Target("ratio_max", 1.3)  # 2 MiB, to the raw driver sequence
RAW_DRIVER = "raw driver"
RING_TARGETS = {"1": Target("ratio_max", 1.5), "4": Target("us_max", 80.0), "8": Target("us_max", 150.0)}

# throughput: pipelined handoffs to one consumer, the producer never waiting for each ack
STREAM_SIZES = (1 * MiB, 64 * MiB)
STREAM_WINDOW = 8  # queue systems: at most this many items put and not yet acked
STREAM_ACK_EVERY = 4  # queue systems: the consumer acks every this many items (with its count so far)
STREAM_COUNT = 2000  # items per timed repeat
STREAM_COUNT_QUICK = 1000
STREAM_WARMUP = 200
STREAM_WARMUP_QUICK = 100
STREAM_REPEATS = 5
STREAM_REPEATS_QUICK = 3
STREAM_TARGET = Target("rate_min", 30_000.0)  # gpushare, 1 MiB
STREAM_TARGET_ROW = "1 MiB"
STREAM_FLOOR = "mp.Queue (small tuple)"
STREAM_TORCH = "torch.multiprocessing Queue"

# kernel_read: a reduction over a mapped 1 GiB buffer against one over a local tensor
KERNEL_SHAPE = (256 << 20,)  # float32: 1 GiB
KERNEL_DEVICE = 0
KERNEL_ITERS = 10
KERNEL_ITERS_QUICK = 5
KERNEL_WARMUP = 3
KERNEL_WARMUP_QUICK = 2
KERNEL_TARGET = 0.97  # the mapped buffer's read bandwidth, as a fraction of the local tensor's
KERNEL_TIMEOUT = 300.0  # seconds for the consumer's whole measurement
KERNEL_MAPPED = "x.sum() on the mapped buffer"
KERNEL_LOCAL = "x.sum() on a local tensor"
KERNEL_SYSTEMS = (KERNEL_MAPPED, KERNEL_LOCAL)


class BenchError(RuntimeError):
    """A consumer failed, died or did not answer in time."""


# ---------------------------------------------------------------------------
# Consumer side (module level: spawn imports this module in every worker)
# ---------------------------------------------------------------------------


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


def _raw_open_consumer(work: Any, acks: Any, device: int) -> None:
    """``first_share``'s reference consumer: open each IPC handle, ack, close, say so."""
    try:
        from gpushare import _cuda

        _cuda.make_current(device)
    except BaseException as exc:
        acks.put(("error", f"consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    acks.put(("ready", os.getpid()))
    while True:
        handle = work.get()
        if handle is None:
            return
        try:
            ptr = _cuda.ipc_open(handle, device)
        except BaseException as exc:
            acks.put(("error", f"cuIpcOpenMemHandle failed: {type(exc).__name__}: {exc}"))
            return
        acks.put(1)
        _cuda.ipc_close(ptr, device)
        acks.put("closed")


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


def _peer_read_measure(torch: Any, buf: Any, peer: int, warmup: int, iters: int) -> dict[str, Any]:
    """Copy times (ns) for the four copies of ``peer_read``, interleaved copy by copy."""
    home = buf.device
    if not isinstance(home, int):
        raise BenchError(f"the buffer arrived as {home!r}, not as memory of a CUDA device")
    if home == peer:
        raise BenchError(f"the buffer is mapped on cuda:{home}, the consumer's own GPU: no peer read to measure")
    home_dev = torch.device("cuda", home)
    peer_dev = torch.device("cuda", peer)
    # An explicit index: a bare "cuda" means torch's *current* device (cuda:peer in this
    # process), and as_tensor would then copy the buffer there instead of viewing it.
    src = torch.as_tensor(buf, device=home_dev)
    if src.device != home_dev or src.data_ptr() != buf.ptr:
        raise BenchError(
            f"torch.as_tensor did not view the mapped buffer (tensor on {src.device} at {src.data_ptr():#x}, "
            f"buffer on cuda:{home} at {buf.ptr:#x})"
        )
    plain = torch.full_like(src, 2.0)  # on cuda:home, allocated by this process
    dst_peer = torch.empty_like(src, device=peer_dev)
    dst_local = torch.empty_like(src, device=home_dev)
    copies = {
        PEER_PEER_MAPPED: (dst_peer, src),
        PEER_PEER_PLAIN: (dst_peer, plain),
        PEER_LOCAL_MAPPED: (dst_local, src),
        PEER_LOCAL_PLAIN: (dst_local, plain),
    }

    def sync() -> None:
        torch.cuda.synchronize(home_dev)
        torch.cuda.synchronize(peer_dev)

    def timed(dst: Any, source: Any) -> tuple[int, int]:
        # Events on the destination's stream: for a cross-device copy torch orders that
        # stream after the copy (whichever device's stream runs it), so they bracket it.
        stream = torch.cuda.current_stream(dst.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        sync()
        t0 = time.perf_counter_ns()
        start.record(stream)
        dst.copy_(source)
        end.record(stream)
        sync()
        wall = time.perf_counter_ns() - t0
        return round(start.elapsed_time(end) * 1e6), wall

    events: dict[str, list[int]] = {name: [] for name in copies}
    walls: dict[str, list[int]] = {name: [] for name in copies}
    for _ in range(warmup):
        for dst, source in copies.values():
            timed(dst, source)
    for _ in range(iters):
        for name, (dst, source) in copies.items():
            event_ns, wall_ns = timed(dst, source)
            events[name].append(event_ns)
            walls[name].append(wall_ns)
    # The copies really read the producer's memory: its fill (1.0), not the plain tensor's (2.0).
    dst_peer.copy_(src)
    dst_local.copy_(src)
    sync()
    if not (bool((dst_peer == 1.0).all().item()) and bool((dst_local == 1.0).all().item())):
        raise BenchError("a copy of the mapped buffer does not hold the producer's fill (1.0)")
    info: dict[str, Any] = {
        "backend": str(getattr(buf, "backend", "?")),
        "nbytes": int(buf.nbytes),
        "source": f"cuda:{home}",
        "destination": f"cuda:{peer}",
        "torch_peer_access": None,
    }
    with contextlib.suppress(Exception):
        info["torch_peer_access"] = bool(torch.cuda.can_device_access_peer(peer_dev, home_dev))
    del copies, src, plain, dst_peer, dst_local
    return {"events_ns": events, "wall_ns": walls, "info": info}


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


def _kernel_read_measure(torch: Any, buf: Any, device: int, warmup: int, iters: int) -> dict[str, Any]:
    """``x.sum()`` times (ns) on the mapped buffer and on a local tensor, interleaved, CUDA events."""
    home = buf.device
    if not isinstance(home, int):
        raise BenchError(f"the buffer arrived as {home!r}, not as memory of a CUDA device")
    if home != device:
        raise BenchError(f"the buffer is mapped on cuda:{home}, not on the consumer's own cuda:{device}")
    dev = torch.device("cuda", home)
    mapped = torch.from_dlpack(buf)
    if mapped.device != dev or mapped.data_ptr() != buf.ptr:
        raise BenchError(
            f"torch.from_dlpack did not view the mapped buffer (tensor on {mapped.device} at "
            f"{mapped.data_ptr():#x}, buffer on cuda:{home} at {buf.ptr:#x})"
        )
    if mapped.dtype != torch.float32 or tuple(mapped.shape) != tuple(buf.shape):
        raise BenchError(
            f"torch.from_dlpack gave {mapped.dtype} {tuple(mapped.shape)} for a float32 {tuple(buf.shape)} buffer"
        )
    local = torch.empty_like(mapped)  # allocated by this process, by torch's caching allocator
    local.fill_(1.0)
    tensors = {KERNEL_MAPPED: mapped, KERNEL_LOCAL: local}
    stream = torch.cuda.current_stream(dev)
    sums: dict[str, float] = {}

    def timed(name: str, tensor: Any) -> tuple[int, int]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter_ns()
        start.record(stream)
        total = tensor.sum()
        end.record(stream)
        torch.cuda.synchronize(dev)
        wall = time.perf_counter_ns() - t0
        sums[name] = float(total.item())
        return round(start.elapsed_time(end) * 1e6), wall

    events: dict[str, list[int]] = {name: [] for name in tensors}
    walls: dict[str, list[int]] = {name: [] for name in tensors}
    for _ in range(warmup):
        for name, tensor in tensors.items():
            timed(name, tensor)
    for _ in range(iters):
        for name, tensor in tensors.items():
            event_ns, wall_ns = timed(name, tensor)
            events[name].append(event_ns)
            walls[name].append(wall_ns)
    # Both hold 1.0 everywhere (the producer's fill, and this process's): the sums read real memory.
    numel = float(mapped.numel())
    for name, value in sums.items():
        if not abs(value - numel) <= 1e-3 * numel:
            raise BenchError(f"{name}: sum {value!r}, expected about {numel:.0f} (a 1.0 fill)")
    info: dict[str, Any] = {
        "backend": str(getattr(buf, "backend", "?")),
        "nbytes": int(buf.nbytes),
        "device": f"cuda:{home}",
        "sums": sums,
    }
    del tensors, mapped, local
    return {"events_ns": events, "wall_ns": walls, "info": info}


# ---------------------------------------------------------------------------
# Optional peers
# ---------------------------------------------------------------------------


def _cuda_core() -> Any:
    """cuda.core's memory-IPC names: top level (1.x) or ``experimental`` (0.x)."""
    names = ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions")
    errors = []
    for module_name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = importlib.import_module(module_name)
            return SimpleNamespace(**{name: getattr(module, name) for name in names}, module=module)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
    raise ImportError("; ".join(errors))


def _gpushare() -> Any:
    """The public facade (its multiprocessing names are set at import, which mypy cannot see)."""
    return importlib.import_module("gpushare")


def _version_of(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "not installed"


# ---------------------------------------------------------------------------
# Statistics and results
# ---------------------------------------------------------------------------


@dataclass
class Cell:
    median_us: float
    p90_us: float
    mean_us: float
    min_us: float
    n: int

    @classmethod
    def of(cls, samples_ns: list[int]) -> Cell:
        us = np.asarray(samples_ns, dtype=np.float64) / 1000.0
        return cls(
            median_us=round(float(np.median(us)), 2),
            p90_us=round(float(np.percentile(us, 90)), 2),
            mean_us=round(float(us.mean()), 2),
            min_us=round(float(us.min()), 2),
            n=len(samples_ns),
        )


@dataclass
class Series:
    """One system's results in one scenario, per row."""

    cells: dict[str, Cell] = field(default_factory=dict)
    skipped: str | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Scenario:
    key: str
    title: str
    row_label: str
    rows: list[str]
    systems: dict[str, Series] = field(default_factory=dict)
    floor: tuple[str, str] | None = (FLOOR_SCENARIO, FLOOR_SYSTEM)
    floor_row: str | None = None  # None: the same row of the floor scenario
    ratio_systems: list[str] | None = None  # systems with a "/ floor" column; None: all of them
    extra_ratios: list[tuple[str, str]] = field(default_factory=list)  # (numerator, denominator) systems
    notes: list[str] = field(default_factory=list)
    plot: bool = True
    # "latency" (us per iteration), "throughput" (peer_read: GB/s per copy), "rate" (items/s, from a
    # time per item) or "kernel" (kernel_read: GB/s per x.sum())
    kind: str = "latency"
    throughput_bytes: int = 0  # bytes one copy (or one x.sum()) moves, for "throughput" and "kernel"
    skipped: str | None = None  # the whole scenario cannot run here
    row_skips: dict[str, str] = field(default_factory=dict)  # rows that fill several systems at once
    row_errors: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # extra facts per row, for the JSON
    targets: dict[str, Target] = field(default_factory=dict)  # per row: the goal printed next to it
    target_systems: list[str] | None = None  # systems judged against the targets; None: all of them


#: What a cell's run returns: samples in ns for its system, or samples per system of its row.
Samples = list[int] | dict[str, list[int]]


@dataclass
class Task:
    scenario: str
    system: str | None  # None: the run fills several systems of its row (returns a dict)
    row: str
    run: Callable[[], Samples] | None
    skip: str | None = None


# ---------------------------------------------------------------------------
# Timing and worker management
# ---------------------------------------------------------------------------


def _time_loop(
    step: Callable[[int], None], warmup: int, iters: int, between: Callable[[], None] | None = None
) -> list[int]:
    """Run ``step`` ``warmup`` times, then time it ``iters`` times (``between`` runs untimed before each)."""
    for i in range(warmup):
        if between is not None:
            between()
        step(i)
    samples: list[int] = []
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(iters):
            if between is not None:
                between()
            t0 = clock()
            step(i)
            samples.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _check_ack(ack: Any) -> None:
    if ack != 1:
        if isinstance(ack, tuple) and len(ack) == 2 and ack[0] == "error":
            raise BenchError(f"a consumer failed: {ack[1]}")
        raise BenchError(f"a consumer sent {ack!r} instead of an ack")


def _check_alive(procs: list[Any]) -> None:
    dead = [p for p in procs if p.exitcode is not None]
    if dead:
        raise BenchError(f"a consumer (pid {dead[0].pid}) exited with code {dead[0].exitcode}")


def _get_ack(acks: Any, procs: list[Any], timeout: float = ACK_TIMEOUT) -> Any:
    """The next ack; a consumer that died or hangs fails the cell instead of the run."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return acks.get(timeout=1.0)  # the fast path pays no more for a timeout than without one
        except queue.Empty:
            _check_alive(procs)
            if time.monotonic() > deadline:
                raise BenchError(f"no answer from a consumer within {timeout:g} s") from None


def _wait_pipe(conn: Any, procs: list[Any]) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT
    while not conn.poll(1.0):
        _check_alive(procs)
        if time.monotonic() > deadline:
            raise BenchError(f"no ack from a consumer within {ACK_TIMEOUT:g} s")


def _recv_pipe(conn: Any, procs: list[Any]) -> Any:
    """The next message on ``conn`` (bounded wait); a consumer's ("error", text) fails the cell."""
    _wait_pipe(conn, procs)
    try:
        message = conn.recv()
    except (EOFError, OSError) as exc:
        for p in procs:
            p.join(timeout=0.5)  # a consumer that closed its end has usually exited: name it
        _check_alive(procs)
        raise BenchError(f"a consumer closed its pipe ({type(exc).__name__}) without answering") from None
    if isinstance(message, tuple) and len(message) == 2 and message[0] == "error":
        raise BenchError(f"a consumer failed: {message[1]}")
    return message


def _pipes_poll(conns: Sequence[Any]) -> Callable[[float], Any]:
    """A poll for _await_ready over one Pipe end per consumer (one "ready" each)."""
    pending = list(conns)

    def poll(timeout: float) -> Any:
        for conn in list(pending):
            if conn.poll(timeout / max(1, len(pending))):
                pending.remove(conn)
                return conn.recv()
        return None

    return poll


def _await_ready(poll: Callable[[float], Any], procs: list[Any], n: int) -> None:
    """Wait for ``n`` ("ready", pid) messages, failing fast when a consumer dies."""
    deadline = time.monotonic() + READY_TIMEOUT
    ready = 0
    while ready < n:
        if time.monotonic() > deadline:
            raise BenchError(f"only {ready} of {n} consumers were ready after {READY_TIMEOUT:g} s")
        message = poll(0.25)
        if message is None:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise BenchError(
                    f"a consumer (pid {dead[0].pid}) exited with code {dead[0].exitcode} before it was ready"
                )
            continue
        if isinstance(message, tuple) and message[:1] == ("ready",):
            ready += 1
        else:
            raise BenchError(f"a consumer did not start: {message[1] if isinstance(message, tuple) else message!r}")


def _queue_poll(q: Any) -> Callable[[float], Any]:
    def poll(timeout: float) -> Any:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            return None

    return poll


def _stop(procs: list[Any], send_stop: Callable[[], None], queues: Sequence[Any] = ()) -> None:
    """Tell consumers to stop, join with a timeout, then terminate and kill survivors."""
    try:
        send_stop()
    except Exception:
        pass
    deadline = time.monotonic() + JOIN_TIMEOUT
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    for q in queues:
        # Whatever is left unread must not keep this process waiting at exit.
        with contextlib.suppress(Exception):
            q.cancel_join_thread()
            q.close()


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------


@dataclass
class Config:
    out: str
    quick: bool
    backend: str  # "cuda" or "host"
    iters: int
    warmup: int
    heavy_iters: int
    heavy_warmup: int
    consumers: tuple[int, ...]
    host_consumers: tuple[int, ...]
    only: frozenset[str] | None
    backends: tuple[str, ...] = CUDA_BACKENDS  # gpushare CUDA backends, one column each
    peer_iters: int = PEER_ITERS
    peer_warmup: int = PEER_WARMUP
    stream_count: int = STREAM_COUNT
    stream_warmup: int = STREAM_WARMUP
    stream_repeats: int = STREAM_REPEATS
    kernel_iters: int = KERNEL_ITERS
    kernel_warmup: int = KERNEL_WARMUP


class Bench:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stack = contextlib.ExitStack()
        self._manager: Any = None
        self.scenarios: dict[str, Scenario] = {}
        self.tasks: list[Task] = []
        self.meta: dict[str, Any] = {}
        self.gpu_reason: str | None = None  # why CUDA scenarios cannot run; None when they can
        self.device: int | None = None
        self.gpu_count = 0

    # -- environment -----------------------------------------------------------------
    def probe(self) -> None:
        from . import __version__, _cuda

        cfg = self.cfg
        gpu_ok = False
        try:
            gpu_ok = _cuda.available()
        except Exception:
            gpu_ok = False
        if gpu_ok:
            with contextlib.suppress(Exception):
                self.gpu_count = int(_cuda.device_count())
        if cfg.backend == "host":
            self.gpu_reason = "run with the host backend (--backend host)" + (
                "" if gpu_ok else "; no usable GPU or CUDA driver on this machine"
            )
        elif not gpu_ok:
            self.gpu_reason = "no usable GPU or CUDA driver on this machine"
        else:
            self.device = 0
        meta: dict[str, Any] = {
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "backend": cfg.backend,
            "backends": ", ".join(cfg.backends) + (" (not run: host backend)" if cfg.backend == "host" else ""),
            "gpus": self.gpu_count,
            "device": "none (host backend)" if cfg.backend == "host" else "none usable",
            "driver": "none",
            "cuda_driver_api": "none",
            "cuda_bindings": _cuda.bindings_version(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpushare": __version__,
            "numpy": np.__version__,
            "torch": "not used (host backend)" if cfg.backend == "host" else _version_of("torch"),
            "cuda_core": "not used (host backend)" if cfg.backend == "host" else _version_of("cuda-core"),
            "iters": cfg.iters,
            "warmup": cfg.warmup,
            "heavy_iters": cfg.heavy_iters,
            "quick": cfg.quick,
        }
        if gpu_ok:
            with contextlib.suppress(Exception):
                version = _cuda.driver_version()
                meta["cuda_driver_api"] = f"CUDA {version // 1000}.{version % 1000 // 10}"
            with contextlib.suppress(Exception):
                meta["device"] = f"{_cuda.device_name(0)} (cuda:0)"
                if cfg.backend == "host":
                    meta["device"] += ", unused: host backend"
            meta["driver"] = _nvidia_driver() or meta["cuda_driver_api"]
        self.meta = meta

    def manager(self) -> Any:
        if self._manager is None:
            gpushare = _gpushare()

            self._manager = self.stack.enter_context(gpushare.Manager())
        return self._manager

    def gs_columns(self) -> list[tuple[str, str, int | str, str | None]]:
        """gpushare's columns: (label, backend, device, skip reason), one per backend.

        With the host backend, the host column runs and the CUDA columns are listed as skipped.
        """
        columns: list[tuple[str, str, int | str, str | None]] = []
        if self.cfg.backend == "host":
            columns.append((_gs_label(HOST_BACKEND), HOST_BACKEND, "cpu", None))
        for name in self.cfg.backends:
            columns.append((_gs_label(name), name, self.device or 0, self.gpu_reason))
        return columns

    # -- plan ----------------------------------------------------------------------
    def plan(self) -> None:
        cfg = self.cfg
        rows = [str(n) for n in cfg.consumers]
        gs_columns = self.gs_columns()
        gs_note = (
            "gpushare columns: one per backend, chosen per allocation (`Manager.empty(..., backend=name)`); "
            "each is measured in this run, next to the peers."
        )

        def add(scenario: Scenario) -> bool:
            if cfg.only is not None and scenario.key not in cfg.only:
                return False
            self.scenarios[scenario.key] = scenario
            return True

        def task(
            scenario: str, system: str | None, row: str, run: Callable[[], Samples] | None, skip: str | None
        ) -> None:
            if system is not None:
                self.scenarios[scenario].systems.setdefault(system, Series())
            self.tasks.append(Task(scenario, system, row, run, skip))

        if add(
            Scenario(
                FLOOR_SCENARIO,
                "Handoff floors: a small tuple to N consumers, wait for every ack",
                "consumers",
                rows,
                floor=None,
                extra_ratios=[("mp.Queue", "mp.Pipe")],
            )
        ):
            for n in cfg.consumers:
                task(FLOOR_SCENARIO, "mp.Pipe", str(n), _bind(self.pipe_floor, n), None)
                task(FLOOR_SCENARIO, "mp.Queue", str(n), _bind(self.queue_floor, n), None)

        torch_skip = self.torch_skip()
        core_skip = self.cuda_core_skip()
        for fresh in (False, True):
            key = "handoff_fresh" if fresh else "handoff_recycled"
            how = "a new buffer every iteration" if fresh else "the same buffer every iteration"
            if not add(Scenario(key, f"1 MiB buffer to N consumers through a Queue, {how}", "consumers", rows)):
                continue
            self.scenarios[key].notes.append(gs_note)
            for n in cfg.consumers:
                for label, backend, device, skip in gs_columns:
                    task(key, label, str(n), _bind(self.gpushare_handoff, n, fresh, backend, device), skip)
                task(key, TORCH, str(n), _bind(self.torch_handoff, n, fresh), torch_skip)
                task(key, CUDA_CORE, str(n), _bind(self.cuda_core_handoff, n, fresh), core_skip)

        if add(
            Scenario(
                "ring",
                f"Ring fan-out: a {RING_SLOTS}-slot ring of 1 MiB buffers to N consumers, wait for every ack",
                "consumers",
                rows,
                floor=(FLOOR_SCENARIO, PIPE_FLOOR_SYSTEM),
                targets={row: target for row, target in RING_TARGETS.items() if row in rows},
            )
        ):
            self.scenarios["ring"].notes.append(
                f"gpushare columns: one per backend (`manager.ring(..., backend=name)`, {RING_SLOTS} slots, "
                "made once per cell). One iteration: `ring.acquire()`, `ring.publish()`, then one ack from "
                "every consumer on its own `multiprocessing.Pipe` (each consumer `ring.get()`, `item.ptr`, "
                "`item.release()`, then acks), so the floor is the Pipe floor: the same acks, with the "
                "small tuple sent down each Pipe instead of the ring's publish."
            )
            for n in cfg.consumers:
                for label, backend, device, skip in gs_columns:
                    task("ring", label, str(n), _bind(self.ring_fanout, n, backend, device), skip)

        stream_rows = [_size_label(size) for size in STREAM_SIZES]
        gs_stream = [f"{label} {how}" for label, *_ in gs_columns for how in ("ring", "Queue")]
        if add(
            Scenario(
                "throughput",
                "Pipelined handoffs to one consumer: items per second, the producer never waiting for each ack",
                "size",
                stream_rows,
                floor=None,
                plot=False,
                kind="rate",
                targets={STREAM_TARGET_ROW: STREAM_TARGET} if STREAM_TARGET_ROW in stream_rows else {},
                target_systems=gs_stream,
            )
        ):
            self.scenarios["throughput"].notes.append(
                f"ring: {RING_SLOTS} slots, the producer acquires and publishes as fast as the slots come back, "
                "the consumer gets, touches (`item.ptr`) and releases. Queue rows (the same recycled "
                f"buffer or tensor, or the small tuple, put again and again): at most {STREAM_WINDOW} items "
                f"put and not yet acked; the consumer gets, touches, lets go, and acks every "
                f"{STREAM_ACK_EVERY} items on a Pipe. Items/s is the median over the timed repeats (in "
                "parentheses: the 10th percentile)."
            )
            for size in STREAM_SIZES:
                row = _size_label(size)
                task("throughput", STREAM_FLOOR, row, self.stream_floor, None)
                for label, backend, device, skip in gs_columns:
                    task("throughput", f"{label} ring", row, _bind(self.stream_ring, size, backend, device), skip)
                    task(
                        "throughput",
                        f"{label} Queue",
                        row,
                        _bind(self.stream_gpushare_queue, size, backend, device),
                        skip,
                    )
                task("throughput", STREAM_TORCH, row, _bind(self.stream_torch, size), torch_skip)

        sizes = [2 * MiB, 64 * MiB] + ([GiB] if cfg.backend == "cuda" else [])
        if add(
            Scenario(
                "first_share",
                "First share of a fresh allocation: m.empty() -> one consumer maps it -> ack",
                "size",
                [_size_label(s) for s in sizes],
                floor=("first_share", RAW_DRIVER),
                ratio_systems=[label for label, _, _, _ in gs_columns],
                targets={_size_label(2 * MiB): FIRST_SHARE_TARGET},
                target_systems=[label for label, _, _, _ in gs_columns],
            )
        ):
            self.scenarios["first_share"].notes.append(
                f"{gs_note} The Manager's pool is trimmed between iterations (untimed). "
                f"`{RAW_DRIVER}` is the reference the ratios divide by: the bare driver sequence "
                "(cuMemAlloc, cuIpcGetMemHandle, the 64-byte handle through the same kind of Queue, "
                "cuIpcOpenMemHandle in the consumer, ack), the consumer closing and the producer "
                "freeing between iterations, untimed."
            )
            raw_skip = self.gpu_reason
            for size in sizes:
                row = _size_label(size)
                task("first_share", RAW_DRIVER, row, _bind(self.first_share_raw, size), raw_skip)
                for label, backend, device, skip in gs_columns:
                    task("first_share", label, row, _bind(self.first_share, size, backend, device), skip)

        if add(
            Scenario(
                "peer_read",
                f"Peer read: a 1 GiB buffer on cuda:{PEER_HOME}, copied by a consumer on cuda:{PEER_DEVICE}",
                "backend",
                list(cfg.backends),
                floor=None,
                plot=False,
                kind="throughput",
                throughput_bytes=math.prod(PEER_SHAPE) * 4,
            )
        ):
            scenario = self.scenarios["peer_read"]
            scenario.skipped = self.peer_read_skip()
            if scenario.skipped is None:
                for system in PEER_SYSTEMS:
                    scenario.systems[system] = Series()
                for backend in cfg.backends:
                    task("peer_read", None, backend, _bind(self.peer_read, backend), None)

        if add(
            Scenario(
                "kernel_read",
                f"Kernel read: x.sum() over a 1 GiB buffer mapped from the producer, same GPU (cuda:{KERNEL_DEVICE})",
                "backend",
                list(cfg.backends),
                floor=None,
                plot=False,
                kind="kernel",
                throughput_bytes=math.prod(KERNEL_SHAPE) * 4,
            )
        ):
            scenario = self.scenarios["kernel_read"]
            scenario.skipped = self.kernel_read_skip()
            if scenario.skipped is None:
                for system in KERNEL_SYSTEMS:
                    scenario.systems[system] = Series()
                for backend in cfg.backends:
                    task("kernel_read", None, backend, _bind(self.kernel_read, backend), None)

        host_rows = [str(n) for n in cfg.host_consumers]
        if add(
            Scenario(
                "host",
                "64 MiB float32 array to N consumers on the host: gpushare host backend vs a pickled array",
                "consumers",
                host_rows,
                ratio_systems=["gpushare (in place)"],
                extra_ratios=[("mp.Queue (pickled array)", "gpushare (in place)")],
            )
        ):
            for n in cfg.host_consumers:
                task("host", "gpushare (in place)", str(n), _bind(self.host_gpushare, n, False), None)
                task("host", "gpushare (copy_from)", str(n), _bind(self.host_gpushare, n, True), None)
                task("host", "mp.Queue (pickled array)", str(n), _bind(self.host_pickled, n), None)

    def torch_skip(self) -> str | None:
        if self.gpu_reason is not None:
            return self.gpu_reason
        try:
            import torch
        except Exception as exc:
            return f"torch is not importable ({type(exc).__name__}: {exc})"
        try:
            if not torch.cuda.is_available():
                return f"torch {torch.__version__} sees no CUDA device"
        except Exception as exc:
            return f"torch.cuda failed: {type(exc).__name__}: {exc}"
        return None

    def peer_read_skip(self) -> str | None:
        if self.gpu_reason is not None:
            return self.gpu_reason
        if self.gpu_count <= PEER_DEVICE:
            return (
                f"needs {PEER_DEVICE + 1} GPUs (a producer on cuda:{PEER_HOME}, a consumer on "
                f"cuda:{PEER_DEVICE}); this machine has {self.gpu_count}"
            )
        reason = self.torch_skip()
        if reason is not None:
            return reason
        try:
            import torch

            count = torch.cuda.device_count()
        except Exception as exc:
            return f"torch.cuda failed: {type(exc).__name__}: {exc}"
        if count <= PEER_DEVICE:
            return f"torch sees {count} CUDA device(s); the consumer needs cuda:{PEER_DEVICE}"
        return None

    def kernel_read_skip(self) -> str | None:
        reason = self.torch_skip()  # includes "no GPU" and "host backend"
        if reason is not None:
            return reason
        if self.gpu_count and self.gpu_count <= KERNEL_DEVICE:
            return f"needs cuda:{KERNEL_DEVICE}; this machine has {self.gpu_count} GPU(s)"
        return None

    def cuda_core_skip(self) -> str | None:
        if self.gpu_reason is not None:
            return self.gpu_reason
        try:
            _cuda_core()
        except Exception as exc:
            return f"cuda.core is not importable with memory IPC ({exc})"
        return None

    # -- run -----------------------------------------------------------------------
    def run(self) -> None:
        total = len(self.tasks)
        width = len(str(total))
        with self.stack:
            for index, t in enumerate(self.tasks, 1):
                scenario = self.scenarios[t.scenario]
                series = None if t.system is None else scenario.systems[t.system]
                head = f"[{index:>{width}}/{total}] {t.scenario} | {t.system or 'all'} | {t.row}"
                if t.skip is not None or t.run is None:
                    reason = t.skip or "not run"
                    if series is not None:
                        series.skipped = reason
                    else:
                        scenario.row_skips[t.row] = reason
                    _progress(f"{head}: skipped ({reason})")
                    continue
                if series is not None and series.skipped is not None:
                    # An earlier row found this column's backend unavailable.
                    _progress(f"{head}: skipped ({series.skipped})")
                    continue
                started = time.monotonic()
                try:
                    samples = t.run()
                except Exception as exc:
                    message = f"{type(exc).__name__}: {exc}"
                    unavailable = _unavailable(exc)
                    if series is None:
                        (scenario.row_skips if unavailable else scenario.row_errors)[t.row] = message
                    elif unavailable and not series.cells and not series.errors:
                        series.skipped = message  # the whole column: its backend cannot run here
                    else:
                        series.errors[t.row] = message
                    _progress(f"{head}: skipped ({message})" if unavailable else f"{head}: ERROR {message}")
                    continue
                try:
                    summary = _record(scenario, series, t.row, samples, time.monotonic() - started)
                except Exception as exc:  # malformed samples: that cell's error, not the run's
                    message = f"could not record the samples: {type(exc).__name__}: {exc}"
                    (scenario.row_errors if series is None else series.errors)[t.row] = message
                    _progress(f"{head}: ERROR {message}")
                    continue
                _progress(f"{head}: {summary}")

    # -- floors ---------------------------------------------------------------------
    def pipe_floor(self, n: int) -> list[int]:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(n)]
        mine = [a for a, _ in pairs]
        procs = [ctx.Process(target=_pipe_consumer, args=(b,), daemon=True) for _, b in pairs]

        def send_stop() -> None:
            for conn in mine:
                with contextlib.suppress(Exception):
                    conn.send(None)

        try:
            for p in procs:
                p.start()
            for _, b in pairs:
                b.close()  # the children hold their ends now
            _await_ready(_pipes_poll(mine), procs, n)
            message = ("job", 0, b"x" * 16)

            def step(i: int) -> None:
                for conn in mine:
                    conn.send(message)
                for conn in mine:
                    _check_ack(_recv_pipe(conn, procs))

            return _time_loop(step, self.cfg.warmup, self.cfg.iters)
        finally:
            _stop(procs, send_stop)
            for conn in mine:
                conn.close()

    def queue_floor(self, n: int) -> list[int]:
        import multiprocessing

        message = ("job", 0, b"x" * 16)
        return self.queue_fanout(multiprocessing.get_context("spawn"), n, "plain", lambda i: message)

    # -- the shared fan-out pattern -------------------------------------------------------
    def queue_fanout(
        self,
        ctx: Any,
        n: int,
        kind: str,
        produce: Callable[[int], Any],
        *,
        drop: Callable[[Any], None] | None = None,
        device: int | None = None,
        extra: Any = None,
        process_kwargs: dict[str, Any] | None = None,
        heavy: bool = False,
    ) -> list[int]:
        """One iteration: ``item = produce(i)``, put it N times, collect N acks, ``drop(item)``."""
        work = ctx.Queue()
        acks = ctx.Queue()
        procs = [
            ctx.Process(
                target=_queue_consumer,
                args=(kind, work, acks, device, extra),
                daemon=True,
                **(process_kwargs or {}),
            )
            for _ in range(n)
        ]

        def send_stop() -> None:
            for _ in procs:
                work.put(None)

        try:
            for p in procs:
                p.start()
            _await_ready(_queue_poll(acks), procs, n)

            def step(i: int) -> None:
                item = produce(i)
                for _ in range(n):
                    work.put(item)
                for _ in range(n):
                    _check_ack(_get_ack(acks, procs))
                if drop is not None:
                    drop(item)

            cfg = self.cfg
            if heavy:
                return _time_loop(step, cfg.heavy_warmup, cfg.heavy_iters)
            return _time_loop(step, cfg.warmup, cfg.iters)
        finally:
            _stop(procs, send_stop, [work, acks])

    # -- gpushare ----------------------------------------------------------------------
    def gpushare_handoff(self, n: int, fresh: bool, backend: str, device: int | str) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        kind = "gpushare_host" if device == "cpu" else "gpushare"
        # A backend this machine cannot run raises BackendUnavailableError here, before any consumer starts.
        m.empty(HANDOFF_SHAPE, "float32", device=device, backend=backend).release()
        before = m.stats()["reused"]
        if fresh:

            def produce(i: int) -> Any:
                return m.empty(HANDOFF_SHAPE, "float32", device=device, backend=backend)

            samples = self.queue_fanout(
                gpushare.get_context("spawn"),
                n,
                kind,
                produce,
                drop=lambda buf: buf.release(),
                process_kwargs={"device": device},
            )
            reused = m.stats()["reused"] - before
            total = self.cfg.warmup + self.cfg.iters
            self.scenarios["handoff_fresh"].notes.append(
                f"{_gs_label(backend)}, {n} consumer(s): {reused} of {total} allocations came from the pool."
            )
            return samples
        buf = m.zeros(HANDOFF_SHAPE, "float32", device=device, backend=backend)
        try:
            return self.queue_fanout(
                gpushare.get_context("spawn"), n, kind, lambda i: buf, process_kwargs={"device": device}
            )
        finally:
            buf.release()

    def first_share(self, nbytes: int, backend: str, device: int | str) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        kind = "gpushare_host" if device == "cpu" else "gpushare"
        # BackendUnavailableError here, before the consumer starts (the pool is trimmed before timing).
        m.empty((nbytes // 4,), "float32", device=device, backend=backend).release()
        ctx = gpushare.get_context("spawn")
        work = ctx.Queue()
        acks = ctx.Queue()
        proc = ctx.Process(target=_queue_consumer, args=(kind, work, acks, None, None), daemon=True, device=device)
        reused: list[int] = []
        heavy = nbytes >= 64 * MiB

        def settle() -> None:
            # Wait until the consumer's lease is back, then free the pool: the next
            # allocation is new memory the consumer has never mapped.
            deadline = time.monotonic() + SETTLE_TIMEOUT
            while m.stats()["leases"]:
                if time.monotonic() > deadline:
                    raise BenchError(f"the consumer's lease did not come back within {SETTLE_TIMEOUT:g} s")
                time.sleep(0.0002)
            m.trim()
            stats = m.stats()
            if stats["bytes_pooled"]:
                reused.append(stats["bytes_pooled"])

        def step(i: int) -> None:
            buf = m.empty((nbytes // 4,), "float32", device=device, backend=backend)
            work.put(buf)
            _check_ack(_get_ack(acks, [proc]))
            buf.release()

        samples = self._settled_loop(proc, work, acks, step, settle, heavy)
        if reused:
            self.scenarios["first_share"].notes.append(
                f"{_gs_label(backend)}, {_size_label(nbytes)}: the pool still held memory after trim() "
                f"in {len(reused)} iteration(s)."
            )
        return samples

    def first_share_raw(self, nbytes: int) -> list[int]:
        """The driver's own first-share sequence, the reference for ``first_share``."""
        import multiprocessing

        from gpushare import _cuda

        ctx = multiprocessing.get_context("spawn")
        work = ctx.Queue()
        acks = ctx.Queue()
        proc = ctx.Process(target=_raw_open_consumer, args=(work, acks, 0), daemon=True)
        held: list[int] = []
        heavy = nbytes >= 64 * MiB

        def settle() -> None:
            # The consumer closes its mapping, then the producer frees: the next
            # allocation is memory the consumer never opened.
            while held:
                ack = _get_ack(acks, [proc])
                if ack != "closed":
                    raise BenchError(f"the raw-driver consumer sent {ack!r} instead of 'closed'")
                _cuda.mem_free(held.pop(), 0)

        def step(i: int) -> None:
            ptr = _cuda.mem_alloc(nbytes, 0)
            held.append(ptr)
            work.put(_cuda.ipc_get_handle(ptr, 0))
            _check_ack(_get_ack(acks, [proc]))

        try:
            return self._settled_loop(proc, work, acks, step, settle, heavy)
        finally:
            while held:
                _cuda.mem_free(held.pop(), 0)

    def _settled_loop(
        self,
        proc: Any,
        work: Any,
        acks: Any,
        step: Callable[[int], None],
        settle: Callable[[], None],
        heavy: bool,
    ) -> list[int]:
        """Start the one consumer, time ``step`` with ``settle`` (untimed) before each, stop it."""
        try:
            proc.start()
            _await_ready(_queue_poll(acks), [proc], 1)
            cfg = self.cfg
            warmup, iters = (cfg.heavy_warmup, cfg.heavy_iters) if heavy else (cfg.warmup, cfg.iters)
            samples = _time_loop(step, warmup, iters, between=settle)
            settle()
            return samples
        finally:
            _stop([proc], lambda: work.put(None), [work, acks])

    def peer_read(self, backend: str) -> dict[str, list[int]]:
        """Copy times (ns) per system of ``peer_read`` for one backend, from one consumer on cuda:1."""
        return self._one_buffer_to_one_consumer(
            "peer_read", backend, PEER_SHAPE, PEER_HOME, PEER_DEVICE, _peer_read_measure,
            (self.cfg.peer_warmup, self.cfg.peer_iters), PEER_TIMEOUT, PEER_SYSTEMS,
        )  # fmt: skip

    def _one_buffer_to_one_consumer(
        self,
        key: str,
        backend: str,
        shape: tuple[int, ...],
        home: int,
        consumer_device: int,
        measure: Callable[..., Any],
        timing: tuple[int, int],
        timeout: float,
        systems: Sequence[str],
    ) -> dict[str, list[int]]:
        """Fill one buffer on ``home``, hand it to one consumer bound to ``consumer_device``,
        and return the timings it measured (``measure(torch, buf, device, warmup, iters)``)."""
        from . import _cuda

        gpushare = _gpushare()
        m = self.manager()
        scenario = self.scenarios[key]
        # BackendUnavailableError here, before the consumer starts.
        buf = m.empty(shape, "float32", device=home, backend=backend)
        reply: Any = None
        try:
            buf.fill(1.0)
            _cuda.synchronize(home)  # the fill is on the device before another process reads it
            ctx = gpushare.get_context("spawn")
            work = ctx.Queue()
            results = ctx.Queue()
            proc = ctx.Process(
                target=_torch_consumer,
                args=(work, results, consumer_device, measure, *timing),
                daemon=True,
                device=consumer_device,
            )
            try:
                proc.start()
                _await_ready(_queue_poll(results), [proc], 1)
                work.put(buf)
                reply = _get_ack(results, [proc], timeout=timeout)
            finally:
                _stop([proc], lambda: work.put(None), [work, results])  # joins with a timeout
        finally:
            buf.release()
            self._settle_and_trim(scenario, backend)
        return _pick_clock(scenario, backend, reply, systems)

    def _settle_and_trim(self, scenario: Scenario, backend: str) -> None:
        """Wait (bounded) for outstanding leases, then free the pool: 1 GiB per backend adds up."""
        try:
            m = self.manager()
            deadline = time.monotonic() + SETTLE_TIMEOUT
            while m.stats()["leases"]:
                if time.monotonic() > deadline:
                    scenario.notes.append(f"{backend}: a lease was still out {SETTLE_TIMEOUT:g} s after the run.")
                    break
                time.sleep(0.01)
            m.trim()
        except Exception as exc:
            scenario.notes.append(f"{backend}: cleanup after the run failed: {type(exc).__name__}: {exc}")

    def host_gpushare(self, n: int, copy: bool) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        src = np.arange(HOST_SHAPE[0], dtype=np.float32)
        buf = m.from_numpy(src, device="cpu")
        view = buf.numpy()  # zero-copy on the host backend

        def produce(i: int) -> Any:
            if copy:
                buf.copy_from(src)
            else:
                view[0] = i  # the producer writes in place
            return buf

        try:
            return self.queue_fanout(
                gpushare.get_context("spawn"),
                n,
                "gpushare_host",
                produce,
                process_kwargs={"device": "cpu"},
                heavy=True,
            )
        finally:
            buf.release()

    def host_pickled(self, n: int) -> list[int]:
        import multiprocessing

        src = np.arange(HOST_SHAPE[0], dtype=np.float32)

        def produce(i: int) -> Any:
            src[0] = i
            return src

        return self.queue_fanout(multiprocessing.get_context("spawn"), n, "numpy", produce, heavy=True)

    # -- ring -----------------------------------------------------------------------------
    def ring_fanout(self, n: int, backend: str, device: int | str) -> list[int]:
        """One iteration: acquire a slot, publish it to N consumers, wait for N acks (one Pipe each)."""
        import multiprocessing

        gpushare = _gpushare()
        m = self.manager()
        cfg = self.cfg
        # BackendUnavailableError here, before any consumer starts.
        ring = m.ring(HANDOFF_SHAPE, "float32", device=device, slots=RING_SLOTS, consumers=n, backend=backend)
        pairs: list[tuple[Any, Any]] = []
        procs: list[Any] = []
        try:
            ctx = gpushare.get_context("spawn")
            pairs = [multiprocessing.get_context("spawn").Pipe() for _ in range(n)]
            mine = [a for a, _ in pairs]
            procs = [
                ctx.Process(target=_ring_consumer, args=(ring, b, None), daemon=True, device=device) for _, b in pairs
            ]

            def send_stop() -> None:
                with contextlib.suppress(Exception):
                    ring.close()  # each consumer's get() raises RingClosedError
                for conn in mine:
                    with contextlib.suppress(Exception):
                        conn.send(None)

            try:
                for p in procs:
                    p.start()  # unpickling the ring in the child registers one consumer
                for _, b in pairs:
                    b.close()  # the children hold their ends now
                _await_ready(_pipes_poll(mine), procs, n)

                def step(i: int) -> None:
                    buf = ring.acquire(timeout=ACK_TIMEOUT)
                    ring.publish(buf, timeout=ACK_TIMEOUT)
                    for conn in mine:
                        _check_ack(_recv_pipe(conn, procs))

                return _time_loop(step, cfg.warmup, cfg.iters)
            finally:
                _stop(procs, send_stop)
        finally:
            with contextlib.suppress(Exception):
                ring.close()
            for a, b in pairs:
                for conn in (a, b):
                    with contextlib.suppress(Exception):
                        conn.close()

    # -- throughput -------------------------------------------------------------------------
    def _stream_timing(self, pump: Callable[[int], None]) -> list[int]:
        """``pump(warmup)``, then ``repeats`` timed ``pump(count)``: one sample (ns per item) per repeat."""
        cfg = self.cfg
        pump(cfg.stream_warmup)
        samples: list[int] = []
        clock = time.perf_counter_ns
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(cfg.stream_repeats):
                t0 = clock()
                pump(cfg.stream_count)
                samples.append(max(1, (clock() - t0) // cfg.stream_count))
        finally:
            if gc_was_enabled:
                gc.enable()
        return samples

    def stream_ring(self, nbytes: int, backend: str, device: int | str) -> list[int]:
        """Acquire/publish as fast as the ring's back-pressure allows; the consumer acks only at checkpoints."""
        import multiprocessing

        gpushare = _gpushare()
        m = self.manager()
        cfg = self.cfg
        # BackendUnavailableError here, before the consumer starts.
        ring = m.ring((nbytes // 4,), "float32", device=device, slots=RING_SLOTS, consumers=1, backend=backend)
        parent, child = multiprocessing.get_context("spawn").Pipe()
        try:
            marks = [cfg.stream_warmup + k * cfg.stream_count for k in range(cfg.stream_repeats + 1)]
            proc = gpushare.get_context("spawn").Process(
                target=_ring_consumer, args=(ring, child, marks), daemon=True, device=device
            )
            published = 0

            def pump(total: int) -> None:
                nonlocal published
                for _ in range(total):
                    buf = ring.acquire(timeout=ACK_TIMEOUT)
                    ring.publish(buf, timeout=ACK_TIMEOUT)
                published += total
                got = _recv_pipe(parent, [proc])
                if got != published:
                    raise BenchError(f"the consumer counted {got!r} items; {published} were published")

            def send_stop() -> None:
                with contextlib.suppress(Exception):
                    ring.close()
                parent.send(None)

            try:
                proc.start()
                child.close()
                _await_ready(_pipes_poll([parent]), [proc], 1)
                return self._stream_timing(pump)
            finally:
                _stop([proc], send_stop)
        finally:
            with contextlib.suppress(Exception):
                ring.close()
            for conn in (parent, child):
                with contextlib.suppress(Exception):
                    conn.close()

    def stream_queue(
        self,
        ctx: Any,
        kind: str,
        item: Any,
        *,
        device: int | None = None,
        process_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Put ``item`` again and again with at most STREAM_WINDOW un-acked; the consumer acks every
        STREAM_ACK_EVERY items (with its count so far) on a Pipe."""
        import multiprocessing

        cfg = self.cfg
        if cfg.stream_warmup % STREAM_ACK_EVERY or cfg.stream_count % STREAM_ACK_EVERY:
            raise BenchError(f"item counts must be multiples of {STREAM_ACK_EVERY} (the consumer's ack interval)")
        work = ctx.Queue()
        parent, child = multiprocessing.get_context("spawn").Pipe()
        proc = ctx.Process(
            target=_stream_consumer,
            args=(kind, work, child, device, STREAM_ACK_EVERY),
            daemon=True,
            **(process_kwargs or {}),
        )
        put = acked = 0

        def take_ack() -> None:
            nonlocal acked
            got = _recv_pipe(parent, [proc])
            if not isinstance(got, int) or got <= acked or got > put:
                raise BenchError(f"the consumer sent {got!r}; expected a count above {acked} and at most {put}")
            acked = got

        def pump(total: int) -> None:
            nonlocal put
            target = put + total
            while put < target:
                while put - acked >= STREAM_WINDOW:
                    take_ack()
                work.put(item)
                put += 1
            while acked < target:
                take_ack()

        try:
            proc.start()
            child.close()
            _await_ready(_pipes_poll([parent]), [proc], 1)
            return self._stream_timing(pump)
        finally:
            _stop([proc], lambda: work.put(None), [work])
            for conn in (parent, child):
                with contextlib.suppress(Exception):
                    conn.close()

    def stream_gpushare_queue(self, nbytes: int, backend: str, device: int | str) -> list[int]:
        gpushare = _gpushare()

        m = self.manager()
        # BackendUnavailableError here, before the consumer starts.
        buf = m.zeros((nbytes // 4,), "float32", device=device, backend=backend)
        try:
            return self.stream_queue(gpushare.get_context("spawn"), "gpushare", buf, process_kwargs={"device": device})
        finally:
            buf.release()

    def stream_torch(self, nbytes: int) -> list[int]:
        import torch
        import torch.multiprocessing as tmp

        device = self.device or 0
        keep = torch.zeros((nbytes // 4,), dtype=torch.float32, device=torch.device("cuda", device))
        torch.cuda.synchronize(device)
        try:
            return self.stream_queue(tmp.get_context("spawn"), "torch", keep, device=device)
        finally:
            del keep
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()

    def stream_floor(self) -> list[int]:
        import multiprocessing

        return self.stream_queue(multiprocessing.get_context("spawn"), "plain", ("job", 0, b"x" * 16))

    # -- kernel_read --------------------------------------------------------------------------
    def kernel_read(self, backend: str) -> dict[str, list[int]]:
        """``x.sum()`` times (ns) per system of ``kernel_read`` for one backend, from one consumer on the same GPU."""
        return self._one_buffer_to_one_consumer(
            "kernel_read", backend, KERNEL_SHAPE, KERNEL_DEVICE, KERNEL_DEVICE, _kernel_read_measure,
            (self.cfg.kernel_warmup, self.cfg.kernel_iters), KERNEL_TIMEOUT, KERNEL_SYSTEMS,
        )  # fmt: skip

    # -- peers ---------------------------------------------------------------------------
    def torch_handoff(self, n: int, fresh: bool) -> list[int]:
        import torch
        import torch.multiprocessing as tmp

        device = self.device or 0
        cuda = torch.device("cuda", device)
        keep = torch.zeros(HANDOFF_SHAPE, dtype=torch.float32, device=cuda)
        torch.cuda.synchronize(cuda)

        def produce(i: int) -> Any:
            if fresh:
                return torch.empty(HANDOFF_SHAPE, dtype=torch.float32, device=cuda)
            return keep

        try:
            return self.queue_fanout(tmp.get_context("spawn"), n, "torch", produce, device=device)
        finally:
            with contextlib.suppress(Exception):
                torch.cuda.ipc_collect()

    def cuda_core_handoff(self, n: int, fresh: bool) -> list[int]:
        import multiprocessing

        cc = _cuda_core()
        device = self.device or 0
        dev = cc.Device(device)
        dev.set_current()
        stream = dev.default_stream
        options = cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=64 * MiB)
        with warnings.catch_warnings():
            # cuda.core warns when multiprocessing's *global* start method is fork; every
            # process here is started from an explicit spawn context.
            warnings.filterwarnings("ignore", message="multiprocessing start method is 'fork'")
            mr = cc.DeviceMemoryResource(dev, options=options)
        kept: Any = None
        try:
            if not fresh:
                kept = mr.allocate(HANDOFF_BYTES, stream=stream)
                stream.sync()

            def produce(i: int) -> Any:
                if not fresh:
                    return kept
                buf = mr.allocate(HANDOFF_BYTES, stream=stream)
                stream.sync()
                return buf

            return self.queue_fanout(
                multiprocessing.get_context("spawn"),
                n,
                "cuda_core",
                produce,
                drop=(lambda buf: buf.close()) if fresh else None,
                device=device,
                extra=mr,
            )
        finally:
            if kept is not None:
                with contextlib.suppress(Exception):
                    kept.close()
            with contextlib.suppress(Exception):
                stream.sync()
            with contextlib.suppress(Exception):
                mr.close()


def _pick_clock(scenario: Scenario, backend: str, reply: Any, systems: Sequence[str]) -> dict[str, list[int]]:
    """The samples (ns) per system from a bandwidth consumer's ("result", data) reply.

    Events bracket the operation on its stream. If they ever read far below the wall clock
    around synchronize (a torch that orders streams differently), the wall clock is trusted.
    """
    if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "result"):
        detail = reply[1] if isinstance(reply, tuple) and len(reply) == 2 else repr(reply)
        raise BenchError(f"the consumer did not measure: {detail}")
    data = reply[1]
    events: dict[str, list[int]] = data["events_ns"]
    walls: dict[str, list[int]] = data["wall_ns"]
    info: dict[str, Any] = dict(data.get("info") or {})
    chosen: dict[str, list[int]] = {}
    clocks: dict[str, str] = {}
    for system in systems:
        event_median = float(np.median(events[system]))
        wall_median = float(np.median(walls[system]))
        info.setdefault("wall_median_us", {})[system] = round(wall_median / 1000.0, 2)
        info.setdefault("event_median_us", {})[system] = round(event_median / 1000.0, 2)
        if event_median > 0 and event_median >= 0.5 * wall_median:
            chosen[system], clocks[system] = events[system], "cuda events"
        else:
            chosen[system], clocks[system] = walls[system], "perf_counter around synchronize"
            scenario.notes.append(
                f"{backend}, {system}: CUDA events ({event_median / 1000:.0f} us) disagreed with the wall "
                f"clock ({wall_median / 1000:.0f} us); the wall clock is reported."
            )
    info["clock"] = clocks
    scenario.details[backend] = info
    return chosen


def _bind(fn: Callable[..., Samples], *args: Any) -> Callable[[], Samples]:
    return lambda: fn(*args)


def _record(scenario: Scenario, series: Series | None, row: str, samples: Samples, took: float) -> str:
    """Store one cell's samples (or one row's, per system); return the progress line."""
    if isinstance(samples, dict):
        parts = []
        for system, values in samples.items():
            cell = Cell.of(values)
            scenario.systems.setdefault(system, Series()).cells[row] = cell
            parts.append(f"{system} {_fmt_gbps(_gbps(scenario, cell))} GB/s")
        return f"{'; '.join(parts)} ({took:.1f} s)"
    if series is None:
        raise BenchError("a task that fills several systems must return samples per system")
    cell = Cell.of(samples)
    series.cells[row] = cell
    if scenario.kind == "rate":
        return (
            f"{_fmt_rate(_rate(cell))} items/s ({cell.median_us:.1f} us per item; median of {cell.n} repeats, "
            f"{took:.1f} s)"
        )
    return f"median {cell.median_us:.1f} us, p90 {cell.p90_us:.1f} us ({cell.n} iters, {took:.1f} s)"


def _gs_label(backend: str) -> str:
    return f"{GPUSHARE} {backend}"


def _unavailable(exc: BaseException) -> bool:
    """True for gpushare's BackendUnavailableError: the backend cannot run on this machine."""
    try:
        cls = getattr(_gpushare(), "BackendUnavailableError", None)
    except Exception:
        return False
    return isinstance(cls, type) and isinstance(exc, cls)


def _size_label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except Exception:
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------


def _fmt_us(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _fmt_cell(cell: Cell | None) -> str:
    return "-" if cell is None else f"{_fmt_us(cell.median_us)} ({_fmt_us(cell.p90_us)})"


def _ratio(num: Cell | None, den: Cell | None) -> str:
    if num is None or den is None or den.median_us <= 0:
        return "-"
    ratio = num.median_us / den.median_us
    return f"{ratio:.0f}" if ratio >= 100 else f"{ratio:.1f}" if ratio >= 10 else f"{ratio:.2f}"


def _gbps(scenario: Scenario, cell: Cell | None) -> float | None:
    """Bytes copied once per second, in GB/s (10^9), from a cell of copy times."""
    if cell is None or cell.median_us <= 0 or scenario.throughput_bytes <= 0:
        return None
    return scenario.throughput_bytes / cell.median_us / 1e3


def _fmt_gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _peer_row(scenario: Scenario, row: str) -> dict[str, Any]:
    """One backend's peer_read numbers (GB/s), the mapped/plain ratio and whether it meets the target."""

    def rate(system: str) -> float | None:
        series = scenario.systems.get(system)
        return _gbps(scenario, series.cells.get(row) if series else None)

    mapped, plain = rate(PEER_PEER_MAPPED), rate(PEER_PEER_PLAIN)
    ratio = None if mapped is None or not plain else mapped / plain
    return {
        "peer_read_mapped_gb_s": None if mapped is None else round(mapped, 1),
        "peer_read_plain_gb_s": None if plain is None else round(plain, 1),
        "ratio": None if ratio is None else round(ratio, 3),
        "meets_target": None if ratio is None else ratio >= PEER_TARGET,
        "local_copy_mapped_gb_s": None if (v := rate(PEER_LOCAL_MAPPED)) is None else round(v, 1),
        "local_copy_plain_gb_s": None if (v := rate(PEER_LOCAL_PLAIN)) is None else round(v, 1),
    }


def _render_peer_read(scenario: Scenario) -> list[str]:
    out = [
        f"`{scenario.key}`: GB/s (bytes copied once / median time of one copy); "
        f"target: mapped / plain >= {PEER_TARGET:.2f}",
        "",
    ]
    header = [
        scenario.row_label,
        "peer read of the mapped buffer (GB/s)",
        "peer read of a plain tensor (GB/s)",
        "mapped / plain",
        "local copy of the mapped buffer (GB/s)",
        "local copy of a plain tensor (GB/s)",
    ]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    below = []
    for row in scenario.rows:
        values = _peer_row(scenario, row)
        ratio = values["ratio"]
        if ratio is None:
            ratio_text = "-"
        else:
            ratio_text = f"{ratio:.2f}" + ("" if values["meets_target"] else " (below target)")
            if not values["meets_target"]:
                below.append(row)
        out.append(
            "| "
            + " | ".join(
                [
                    row,
                    _fmt_gbps(values["peer_read_mapped_gb_s"]),
                    _fmt_gbps(values["peer_read_plain_gb_s"]),
                    ratio_text,
                    _fmt_gbps(values["local_copy_mapped_gb_s"]),
                    _fmt_gbps(values["local_copy_plain_gb_s"]),
                ]
            )
            + " |"
        )
    out.append("")
    for row, reason in scenario.row_skips.items():
        out.append(f"- {row}: skipped: {reason}")
    for row, error in scenario.row_errors.items():
        out.append(f"- {row}: error: {error}")
    for name, series in scenario.systems.items():
        for row, error in series.errors.items():
            out.append(f"- {name}, {row}: error: {error}")
    if below:
        out.append(f"- Below the {PEER_TARGET:.2f} target: {', '.join(below)}.")
    for row, info in scenario.details.items():
        access = info.get("torch_peer_access")
        if access is False:
            out.append(f"- {row}: torch reports no peer access from {info.get('destination')} to {info.get('source')}.")
    for note in scenario.notes:
        out.append(f"- {note}")
    if out[-1] != "":
        out.append("")
    return out


def _floor_cell(bench_scenarios: dict[str, Scenario], scenario: Scenario, row: str) -> Cell | None:
    if scenario.floor is None:
        return None
    floor_scenario = bench_scenarios.get(scenario.floor[0])
    if floor_scenario is None:
        return None
    series = floor_scenario.systems.get(scenario.floor[1])
    return None if series is None else series.cells.get(scenario.floor_row or row)


def render_markdown(scenarios: dict[str, Scenario], meta: dict[str, Any], plot_note: str) -> str:
    lines = [
        "# gpushare benchmarks",
        "",
        f"Written by `python -m gpushare.bench` on {meta['date']}; run it again rather than editing this file.",
        "",
        "| | |",
        "|---|---|",
    ]
    for label, key in (
        ("device", "device"),
        ("driver", "driver"),
        ("CUDA (driver API)", "cuda_driver_api"),
        ("cuda-bindings", "cuda_bindings"),
        ("python", "python"),
        ("gpushare", "gpushare"),
        ("torch", "torch"),
        ("cuda-core", "cuda_core"),
        ("numpy", "numpy"),
        ("gpushare backend", "backend"),
        ("gpushare CUDA backends", "backends"),
        ("GPUs", "gpus"),
        ("CPUs", "cpus"),
        ("platform", "platform"),
    ):
        lines.append(f"| {label} | {meta.get(key)} |")
    lines.append(
        f"| iterations | {meta['iters']} timed after {meta['warmup']} warm-up "
        f"({meta['heavy_iters']} for 64 MiB and larger){'; --quick' if meta['quick'] else ''} |"
    )
    lines += [
        "",
        "## How measured",
        "",
        "One producer process and N consumer processes, all started with spawn. Consumers are started once "
        "per cell (scenario, system, N), warmed up, then reused for every timed iteration. One iteration is: "
        "produce the item (or reuse it), put it on the transport once per consumer, and wait until every "
        "consumer has acknowledged it; each consumer gets the item, touches it (device pointer, first "
        "element) and lets it go before acking. The iteration is timed with `time.perf_counter_ns` with the "
        "producer's garbage collector off. Cells show the median and, in parentheses, the 90th percentile, "
        "in microseconds; ratio columns divide medians by the floor: the same pattern carrying a small "
        "tuple through `multiprocessing.Queue` (the first table), which no handoff can beat.",
        "",
        "gpushare has one column per backend (`--backends`; `Manager.empty(..., backend=name)` picks it per "
        "allocation), measured in the same run as the peers, each with its own ratio to the floor. A backend this "
        "machine cannot run (`BackendUnavailableError`) is listed as a skipped column with the reason.",
        "",
        f"`ring` is the same fan-out through a ring of pre-shared slots (`manager.ring(..., slots={RING_SLOTS}, "
        "consumers=N, backend=name)`, 1 MiB float32 slots, one column per backend), made once per cell and "
        "passed to each consumer as its Process argument (each unpickling registers one consumer). One iteration: "
        "`buf = ring.acquire()`, `ring.publish(buf)`, then one ack from every consumer on its own "
        "`multiprocessing.Pipe`, exactly like the Pipe floor's; each consumer `ring.get()`s the item, reads "
        "`item.ptr`, releases it and acks. Its ratios are therefore to the **Pipe** floor (first table), and "
        "each row shows its target (1 consumer <= 1.5x the Pipe floor, 4 consumers <= 80 us, 8 consumers <= "
        "150 us) and whether each backend met it.",
        "",
        f"`throughput` counts pipelined handoffs to one consumer, the producer never waiting for each ack, for "
        f"1 MiB and 64 MiB buffers: through the ring ({RING_SLOTS} slots; the producer acquires and publishes as "
        "fast as released slots allow; the consumer gets, touches and releases each item and acks only at the end "
        "of a timed repeat), through gpushare's Queue (the same recycled buffer put again and again), through "
        "torch.multiprocessing's Queue (a recycled CUDA tensor, GPU only) and through a plain "
        f"`multiprocessing.Queue` carrying a small tuple (the floor). The Queue systems keep at most "
        f"{STREAM_WINDOW} items put and not yet acked; their consumer acks every {STREAM_ACK_EVERY} items with its "
        f"count on a Pipe. After {STREAM_WARMUP} warm-up items, {STREAM_REPEATS} repeats of {STREAM_COUNT} items "
        f"({STREAM_WARMUP_QUICK}, {STREAM_REPEATS_QUICK} and {STREAM_COUNT_QUICK} with --quick) are timed whole; "
        "the table shows items/s of the median repeat and of the 10th percentile, and the target "
        f"(gpushare >= {STREAM_TARGET.limit:,.0f} handoffs/s at {STREAM_TARGET_ROW}).",
        "",
        f"`peer_read` (two GPUs and torch only) is a bandwidth test, not a handoff: per backend, the producer fills "
        f"a 1 GiB float32 buffer on cuda:{PEER_HOME} and sends it to one consumer started with "
        f"`Process(device={PEER_DEVICE})`. The consumer views it with `torch.as_tensor(buf, "
        f'device="cuda:{PEER_HOME}")` (checked to alias the mapping) and times `dst.copy_(src)` into a '
        f"cuda:{PEER_DEVICE} tensor with CUDA events on the destination's stream, both GPUs synchronized before "
        f"each copy, median of {PEER_ITERS} copies after {PEER_WARMUP} warm-up rounds ({PEER_ITERS_QUICK} after "
        f"{PEER_WARMUP_QUICK} with --quick). GB/s is bytes copied once / median time. The reference is the same copy "
        f"from a plain torch tensor the consumer allocated on cuda:{PEER_HOME} itself (the NVLink rate), "
        "interleaved copy by copy with the mapped one; local copies on the memory's own GPU are shown for "
        "scale. Afterwards the consumer checks that the copies hold the producer's fill, releases the buffer and "
        "drops its tensors before answering; the producer joins it with a timeout.",
        "",
        f"`kernel_read` (a GPU and torch only): per backend, the producer fills a 1 GiB float32 buffer on "
        f"cuda:{KERNEL_DEVICE} and sends it to one consumer on the same GPU, which views it with "
        "`x = torch.from_dlpack(buf)` (checked to alias the mapping) and times `x.sum()` with CUDA events on the "
        "current stream, interleaved with the same reduction over `torch.empty_like(x)`, filled by the consumer "
        f"itself; median of {KERNEL_ITERS} after {KERNEL_WARMUP} warm-up rounds ({KERNEL_ITERS_QUICK} after "
        f"{KERNEL_WARMUP_QUICK} with --quick). GB/s is bytes read once / median time; the target is mapped / local "
        f">= {KERNEL_TARGET:.2f}. Both sums are checked against the fills, and the consumer drops its tensors and "
        "releases the buffer before it answers.",
        "",
        "**Absolute times mean something only on a GPU machine** (and only on one like the one named above): "
        "CPU count, scheduler noise and the host-only backend change them a lot. Compare ratios to the floor, "
        "which were measured in the same run and the same pattern.",
        "",
    ]
    for scenario in scenarios.values():
        lines += _render_scenario(scenarios, scenario)
    lines += ["## Plot", "", plot_note, ""]
    return "\n".join(lines)


def _render_scenario(scenarios: dict[str, Scenario], scenario: Scenario) -> list[str]:
    if scenario.skipped is not None:
        return [f"## {scenario.title}", "", f"`{scenario.key}`: skipped: {scenario.skipped}", ""]
    if scenario.kind == "throughput":
        return [f"## {scenario.title}", "", *_render_peer_read(scenario)]
    if scenario.kind == "kernel":
        return [f"## {scenario.title}", "", *_render_kernel_read(scenario)]
    if scenario.kind == "rate":
        return [f"## {scenario.title}", "", *_render_rate(scenario)]
    systems = [name for name, s in scenario.systems.items() if s.skipped is None]
    if scenario.floor is not None and scenario.floor[0] == scenario.key:
        systems = [name for name in systems if name != scenario.floor[1]]  # shown once, as the floor
    wanted = scenario.ratio_systems
    ratio_systems = [n for n in systems if scenario.floor is not None and (wanted is None or n in wanted)]
    judged = _judged(scenario, systems)
    header = [scenario.row_label]
    if scenario.floor is not None:
        header.append(f"floor ({scenario.floor[1]})")
    header += systems
    header += [f"{name} / floor" for name in ratio_systems]
    header += [f"{a} / {b}" for a, b in scenario.extra_ratios]
    if scenario.targets:
        header.append("target")
        header += [f"{name}: target" for name in judged]
    out = [f"## {scenario.title}", "", f"`{scenario.key}`: median us (p90 us)", ""]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for row in scenario.rows:
        floor = _floor_cell(scenarios, scenario, row)
        cells = [row]
        if scenario.floor is not None:
            cells.append(_fmt_cell(floor))
        cells += [_fmt_cell(scenario.systems[name].cells.get(row)) for name in systems]
        cells += [_ratio(scenario.systems[name].cells.get(row), floor) for name in ratio_systems]
        for a, b in scenario.extra_ratios:
            sa, sb = scenario.systems.get(a), scenario.systems.get(b)
            cells.append(_ratio(sa.cells.get(row) if sa else None, sb.cells.get(row) if sb else None))
        if scenario.targets:
            target = scenario.targets.get(row)
            cells.append("-" if target is None else target.text("floor"))
            for name in judged:
                met = None if target is None else target.met(scenario.systems[name].cells.get(row), floor)
                cells.append(_met_text(met))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    if scenario.targets and scenario.floor is not None:
        goals = "; ".join(
            f"{scenario.row_label} {row}: {target.text(f'the {scenario.floor[1]} floor')}"
            for row, target in scenario.targets.items()
        )
        out.append(f"- Targets (median): {goals}.")
    return _with_trailer(out, scenario)


def _with_trailer(out: list[str], scenario: Scenario) -> list[str]:
    """``out`` followed by the skipped columns, errors and notes, ending with a blank line."""
    out = list(out)
    for name, series in scenario.systems.items():
        if series.skipped is not None:
            out.append(f"- {name}: skipped: {series.skipped}")
        for row, error in series.errors.items():
            out.append(f"- {name}, {scenario.row_label} {row}: error: {error}")
    for row, reason in scenario.row_skips.items():
        out.append(f"- {scenario.row_label} {row}: skipped: {reason}")
    for row, error in scenario.row_errors.items():
        out.append(f"- {scenario.row_label} {row}: error: {error}")
    for note in scenario.notes:
        out.append(f"- {note}")
    if not out or out[-1] != "":
        out.append("")
    return out


def _judged(scenario: Scenario, systems: Sequence[str]) -> list[str]:
    """The systems (among ``systems``) judged against the scenario's targets."""
    if not scenario.targets:
        return []
    wanted = scenario.target_systems
    return [name for name in systems if wanted is None or name in wanted]


def _met_text(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "not met"


def _rate(cell: Cell | None, p90: bool = False) -> float | None:
    """Items per second from a cell of times per item (the p90 time gives the 10th-percentile rate)."""
    if cell is None:
        return None
    us = cell.p90_us if p90 else cell.median_us
    return None if us <= 0 else 1e6 / us


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _rate_floor(scenario: Scenario, row: str) -> Cell | None:
    series = scenario.systems.get(STREAM_FLOOR)
    return None if series is None else series.cells.get(row)


def _render_rate(scenario: Scenario) -> list[str]:
    """One row per system (the sizes are columns: the systems are many, the sizes few)."""
    systems = [name for name, s in scenario.systems.items() if s.skipped is None]
    has_floor = STREAM_FLOOR in systems
    judged = _judged(scenario, systems)
    goals = [(row, target) for row, target in scenario.targets.items() if row in scenario.rows]
    out = [
        f"`{scenario.key}`: items per second, median over the timed repeats (10th percentile)"
        + (f"; `/ floor`: that rate over the {STREAM_FLOOR} rate of the same size" if has_floor else ""),
        "",
    ]
    header = ["system", *(f"{row} (items/s)" for row in scenario.rows)]
    if has_floor:
        header += [f"{row} / floor" for row in scenario.rows]
    header += [f"target: {target.text()} at {row}" for row, target in goals]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for name in systems:
        series = scenario.systems[name]
        cells = [f"{name} (floor)" if name == STREAM_FLOOR else name]
        for row in scenario.rows:
            cell = series.cells.get(row)
            cells.append("-" if cell is None else f"{_fmt_rate(_rate(cell))} ({_fmt_rate(_rate(cell, p90=True))})")
        if has_floor:
            for row in scenario.rows:
                rate, floor = _rate(series.cells.get(row)), _rate(_rate_floor(scenario, row))
                cells.append("-" if rate is None or not floor else f"{rate / floor:.2f}")
        for row, target in goals:
            cells.append(_met_text(target.met(series.cells.get(row))) if name in judged else "-")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    return _with_trailer(out, scenario)


def _kernel_row(scenario: Scenario, row: str) -> dict[str, Any]:
    """One backend's kernel_read numbers (GB/s), the mapped/local ratio and whether it meets the target."""

    def rate(system: str) -> float | None:
        series = scenario.systems.get(system)
        return _gbps(scenario, series.cells.get(row) if series else None)

    mapped, local = rate(KERNEL_MAPPED), rate(KERNEL_LOCAL)
    ratio = None if mapped is None or not local else mapped / local
    return {
        "mapped_gb_s": None if mapped is None else round(mapped, 1),
        "local_gb_s": None if local is None else round(local, 1),
        "ratio": None if ratio is None else round(ratio, 3),
        "meets_target": None if ratio is None else ratio >= KERNEL_TARGET,
    }


def _render_kernel_read(scenario: Scenario) -> list[str]:
    out = [
        f"`{scenario.key}`: GB/s (bytes read once / median time of one `x.sum()`); "
        f"target: mapped / local >= {KERNEL_TARGET:.2f}",
        "",
    ]
    header = [scenario.row_label, f"{KERNEL_MAPPED} (GB/s)", f"{KERNEL_LOCAL} (GB/s)", "mapped / local", "target"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for row in scenario.rows:
        values = _kernel_row(scenario, row)
        ratio = values["ratio"]
        out.append(
            "| "
            + " | ".join(
                [
                    row,
                    _fmt_gbps(values["mapped_gb_s"]),
                    _fmt_gbps(values["local_gb_s"]),
                    "-" if ratio is None else f"{ratio:.3f}",
                    _met_text(values["meets_target"]),
                ]
            )
            + " |"
        )
    out.append("")
    return _with_trailer(out, scenario)


def render_json(scenarios: dict[str, Scenario], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "scenarios": {key: _scenario_json(scenarios, s) for key, s in scenarios.items()}}


def _scenario_json(scenarios: dict[str, Scenario], s: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {
        "title": s.title,
        "row_label": s.row_label,
        "rows": s.rows,
        "kind": s.kind,
        "skipped": s.skipped,
        "floor": list(s.floor) if s.floor else None,
        "floor_row": s.floor_row,
        "notes": s.notes,
        "systems": {
            name: {
                "skipped": series.skipped,
                "errors": series.errors,
                "cells": {row: asdict(cell) for row, cell in series.cells.items()},
            }
            for name, series in s.systems.items()
        },
    }
    if s.row_skips or s.row_errors:
        out["row_skips"] = s.row_skips
        out["row_errors"] = s.row_errors
    if s.targets:
        out["targets"] = {row: _target_json(scenarios, s, row, target) for row, target in s.targets.items()}
    if s.kind == "rate":
        # The cells above are times per item (us); this is the table of the report, in items/s.
        out["window"] = STREAM_WINDOW
        out["ack_every"] = STREAM_ACK_EVERY
        out["table"] = {
            row: {
                name: {
                    "items_per_s": None if (r := _rate(cell)) is None else round(r, 1),
                    "items_per_s_p10": None if (r := _rate(cell, p90=True)) is None else round(r, 1),
                    "us_per_item": cell.median_us,
                }
                for name, series in s.systems.items()
                if (cell := series.cells.get(row)) is not None
            }
            for row in s.rows
        }
    if s.kind == "kernel":
        out["bytes_per_sum"] = s.throughput_bytes
        out["target_ratio"] = KERNEL_TARGET
        out["table"] = {row: _kernel_row(s, row) for row in s.rows if any(row in x.cells for x in s.systems.values())}
        out["details"] = s.details
    if s.kind == "throughput":
        # The cells above are times of one copy (us); this is the table of the report, in GB/s.
        out["bytes_per_copy"] = s.throughput_bytes
        out["target_ratio"] = PEER_TARGET
        out["table"] = {row: _peer_row(s, row) for row in s.rows if any(row in x.cells for x in s.systems.values())}
        out["details"] = s.details
    return out


def _target_json(scenarios: dict[str, Scenario], s: Scenario, row: str, target: Target) -> dict[str, Any]:
    floor = _rate_floor(s, row) if s.kind == "rate" else _floor_cell(scenarios, s, row)
    return {
        "kind": target.kind,
        "limit": target.limit,
        "text": target.text("floor"),
        "floor": None if s.floor is None else list(s.floor),
        "met": {
            name: target.met(series.cells.get(row), floor)
            for name, series in s.systems.items()
            if series.skipped is None and (s.target_systems is None or name in s.target_systems)
        },
    }


def _target_us(scenarios: dict[str, Scenario], scenario: Scenario, row: str, target: Target) -> float | None:
    """A latency target as a time (us) to plot, or None."""
    if target.kind == "us_max":
        return target.limit
    if target.kind == "ratio_max":
        floor = _floor_cell(scenarios, scenario, row)
        return None if floor is None else target.limit * floor.median_us
    return None


def render_plot(scenarios: dict[str, Scenario], meta: dict[str, Any], path: str) -> str:
    """Latency against consumers, one panel per fan-out scenario; returns a line for the report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"No plot: matplotlib does not import here ({type(exc).__name__}: {exc})."
    panels = [s for s in scenarios.values() if s.plot and s.row_label == "consumers"]
    if not panels:
        return "No plot: no scenario with a consumer axis was run."
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax, scenario in zip(axes.flat, panels, strict=False):
        if scenario.floor is not None:
            xs = [int(r) for r in scenario.rows if _floor_cell(scenarios, scenario, r) is not None]
            ys = [c.median_us for r in scenario.rows if (c := _floor_cell(scenarios, scenario, r)) is not None]
            if xs:
                ax.plot(xs, ys, "k--", marker="o", label=f"floor ({scenario.floor[1]}, small tuple)")
        for name, series in scenario.systems.items():
            points = [(int(r), series.cells[r].median_us) for r in scenario.rows if r in series.cells]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        goals = [(int(r), us) for r, t in scenario.targets.items() if (us := _target_us(scenarios, scenario, r, t))]
        if goals:
            ax.plot([x for x, _ in goals], [y for _, y in goals], "rv", linestyle="none", label="target (at most)")
        ax.set_title(scenario.title, fontsize=9)
        ax.set_xlabel("consumers")
        ax.set_ylabel("median latency per iteration (us)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([int(r) for r in scenario.rows])
        ax.set_xticklabels(scenario.rows)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"gpushare benchmarks: {meta['device']}, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"![median latency against the number of consumers]({os.path.basename(path)})"


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

SCENARIO_KEYS = (
    "floors",
    "handoff_recycled",
    "handoff_fresh",
    "ring",
    "throughput",
    "first_share",
    "peer_read",
    "kernel_read",
    "host",
)


def _known_cuda_backends() -> tuple[str, ...]:
    """CUDA_BACKENDS, then any other CUDA backend the library lists (never fails)."""
    names = list(CUDA_BACKENDS)
    try:
        from ._backends import BACKENDS

        names += [name for name in BACKENDS if name != HOST_BACKEND and name not in names]
    except Exception:
        pass
    return tuple(names)


def _backend_list(text: str) -> tuple[str, ...]:
    known = _known_cuda_backends()
    names: list[str] = []
    for name in (v.strip() for v in text.split(",")):
        if name and name not in names:
            names.append(name)
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one backend ({', '.join(known)})")
    if HOST_BACKEND in names:
        raise argparse.ArgumentTypeError(
            "--backends lists CUDA backends; the host backend is measured with --backend host"
        )
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown CUDA backend(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    return tuple(names)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: consumer counts are ints >= 1")
    return values


def _parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m gpushare.bench",
        description="Measure gpushare's buffer handoff (one column per backend) against multiprocessing floors, "
        "torch.multiprocessing and cuda.core, its ring's fan-out and pipelined throughput, and the bandwidth of "
        "kernels reading mapped memory (same GPU; peer GPU with two); write benchmarks.md, benchmarks.json and "
        "benchmarks.png.",
    )
    parser.add_argument("--out", default="docs", help="directory for the reports (default: docs)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, for smoke and CI runs")
    parser.add_argument(
        "--backend",
        choices=("host", "cuda"),
        default=None,
        help="gpushare backend for the handoff scenarios (default: cuda when a GPU is usable, else host)",
    )
    parser.add_argument(
        "--backends",
        type=_backend_list,
        default=None,
        help="gpushare CUDA backends to measure, one column each, comma-separated (default: every CUDA "
        f"backend: {','.join(CUDA_BACKENDS)}); ignored with --backend host",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per cell (default 300; 100 quick)")
    parser.add_argument(
        "--consumers", type=_counts, default=CONSUMERS, help="consumer counts, comma-separated (default 1,2,4,8)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=f"run only these scenarios, comma-separated: {', '.join(SCENARIO_KEYS)} "
        "(the floors always run: every ratio is taken to them)",
    )
    args = parser.parse_args(argv)
    backend = args.backend
    if backend is None:
        from . import _cuda

        backend = "cuda" if _cuda.available() else "host"
    iters = args.iters if args.iters is not None else (100 if args.quick else 300)
    if iters < 1:
        parser.error("--iters must be at least 1")
    only = None
    if args.only:
        only = frozenset(k.strip() for k in args.only.split(",") if k.strip())
        unknown = sorted(only - set(SCENARIO_KEYS))
        if unknown:
            parser.error(f"unknown scenario(s) {', '.join(unknown)}; valid: {', '.join(SCENARIO_KEYS)}")
        only |= {FLOOR_SCENARIO}
    host_consumers = tuple(n for n in args.consumers if n <= max(HOST_CONSUMERS)) or (1,)
    return Config(
        out=args.out,
        quick=args.quick,
        backend=backend,
        iters=iters,
        warmup=10 if args.quick else 20,
        heavy_iters=max(20, iters // 5),
        heavy_warmup=2 if args.quick else 3,
        consumers=args.consumers,
        host_consumers=host_consumers,
        only=only,
        backends=args.backends or _known_cuda_backends(),
        peer_iters=PEER_ITERS_QUICK if args.quick else PEER_ITERS,
        peer_warmup=PEER_WARMUP_QUICK if args.quick else PEER_WARMUP,
        stream_count=STREAM_COUNT_QUICK if args.quick else STREAM_COUNT,
        stream_warmup=STREAM_WARMUP_QUICK if args.quick else STREAM_WARMUP,
        stream_repeats=STREAM_REPEATS_QUICK if args.quick else STREAM_REPEATS,
        kernel_iters=KERNEL_ITERS_QUICK if args.quick else KERNEL_ITERS,
        kernel_warmup=KERNEL_WARMUP_QUICK if args.quick else KERNEL_WARMUP,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = _parse(argv)
    bench = Bench(cfg)
    bench.probe()
    bench.plan()
    _progress(
        f"gpushare.bench: backend {cfg.backend} ({', '.join(cfg.backends)}), {len(bench.tasks)} cells, "
        f"{cfg.iters} iterations each "
        f"({cfg.heavy_iters} for 64 MiB and larger); reports go to {cfg.out}/"
    )
    started = time.monotonic()
    bench.run()
    os.makedirs(cfg.out, exist_ok=True)
    try:
        plot_note = render_plot(bench.scenarios, bench.meta, os.path.join(cfg.out, "benchmarks.png"))
    except Exception as exc:  # a plot must never cost the measurements
        plot_note = f"No plot: drawing it failed ({type(exc).__name__}: {exc})."
    bench.meta["elapsed_s"] = round(time.monotonic() - started, 1)
    # A report that fails to render must not lose the measurements: fall back to the raw results.
    try:
        report = render_json(bench.scenarios, bench.meta)
    except Exception as exc:
        report = {
            "meta": bench.meta,
            "render_error": f"{type(exc).__name__}: {exc}",
            "scenarios": {key: asdict(s) for key, s in bench.scenarios.items()},
        }
    with open(os.path.join(cfg.out, "benchmarks.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    try:
        markdown = render_markdown(bench.scenarios, bench.meta, plot_note)
    except Exception as exc:
        markdown = (
            f"# gpushare benchmarks\n\nThe report failed to render ({type(exc).__name__}: {exc}); "
            "every measurement is in benchmarks.json.\n"
        )
    with open(os.path.join(cfg.out, "benchmarks.md"), "w", encoding="utf-8") as f:
        f.write(markdown)
    _progress(f"gpushare.bench: done in {bench.meta['elapsed_s']} s; wrote {cfg.out}/benchmarks.md, .json")
    _progress(plot_note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
