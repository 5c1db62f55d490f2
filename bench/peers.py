"""The systems gpushare is measured against: the floors and the other libraries.

The Pipe and Queue floors (a small tuple: no handoff can cost less than this
notification), ``torch.multiprocessing`` (CUDA tensors through its Queue) and cuda.core
(buffers of an IPC-enabled memory resource). Each ``*_skip`` says why a peer cannot run here.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

from .consumers import _pipe_consumer
from .harness import _await_ready, _check_ack, _pipes_poll, _recv_pipe, _stop, _time_loop
from .patterns import queue_fanout, stream_queue
from .settings import HANDOFF_BYTES, HANDOFF_SHAPE, MiB, _cuda_core

if TYPE_CHECKING:
    from .runner import Bench


def pipe_floor(bench: Bench, n: int) -> list[int]:
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

        return _time_loop(step, bench.cfg.warmup, bench.cfg.iters)
    finally:
        _stop(procs, send_stop)
        for conn in mine:
            conn.close()


def queue_floor(bench: Bench, n: int, per_queue: bool = False) -> list[int]:
    import multiprocessing

    message = ("job", 0, b"x" * 16)
    ctx = multiprocessing.get_context("spawn")
    return queue_fanout(bench, ctx, n, "plain", lambda i: message, per_queue=per_queue)


def stream_floor(bench: Bench) -> list[int]:
    import multiprocessing

    return stream_queue(bench, multiprocessing.get_context("spawn"), "plain", ("job", 0, b"x" * 16))


def torch_handoff(bench: Bench, n: int, fresh: bool, per_queue: bool = False) -> list[int]:
    import torch
    import torch.multiprocessing as tmp

    device = bench.device or 0
    cuda = torch.device("cuda", device)
    keep = torch.zeros(HANDOFF_SHAPE, dtype=torch.float32, device=cuda)
    torch.cuda.synchronize(cuda)

    def produce(i: int) -> Any:
        if fresh:
            return torch.empty(HANDOFF_SHAPE, dtype=torch.float32, device=cuda)
        return keep

    try:
        return queue_fanout(bench, tmp.get_context("spawn"), n, "torch", produce, device=device, per_queue=per_queue)
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.ipc_collect()


def stream_torch(bench: Bench, nbytes: int) -> list[int]:
    import torch
    import torch.multiprocessing as tmp

    device = bench.device or 0
    keep = torch.zeros((nbytes // 4,), dtype=torch.float32, device=torch.device("cuda", device))
    torch.cuda.synchronize(device)
    try:
        return stream_queue(bench, tmp.get_context("spawn"), "torch", keep, device=device)
    finally:
        del keep
        with contextlib.suppress(Exception):
            torch.cuda.ipc_collect()


def cuda_core_handoff(bench: Bench, n: int, fresh: bool, per_queue: bool = False) -> list[int]:
    import multiprocessing

    cc = _cuda_core()
    device = bench.device or 0
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

        return queue_fanout(
            bench,
            multiprocessing.get_context("spawn"),
            n,
            "cuda_core",
            produce,
            drop=(lambda buf: buf.close()) if fresh else None,
            device=device,
            extra=mr,
            per_queue=per_queue,
        )
    finally:
        if kept is not None:
            with contextlib.suppress(Exception):
                kept.close()
        with contextlib.suppress(Exception):
            stream.sync()
        with contextlib.suppress(Exception):
            mr.close()


def torch_skip(bench: Bench) -> str | None:
    if bench.gpu_reason is not None:
        return bench.gpu_reason
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


def cuda_core_skip(bench: Bench) -> str | None:
    if bench.gpu_reason is not None:
        return bench.gpu_reason
    try:
        _cuda_core()
    except Exception as exc:
        return f"cuda.core is not importable with memory IPC ({exc})"
    return None
