"""``kernel_read``: ``x.sum()`` over a 1 GiB buffer mapped on the consumer's own GPU, against a local tensor."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from ..patterns import one_buffer_to_one_consumer
from ..peers import torch_skip
from ..results import Scenario, Series, _bind
from ..settings import (
    KERNEL_DEVICE,
    KERNEL_ITERS,
    KERNEL_ITERS_QUICK,
    KERNEL_LOCAL,
    KERNEL_MAPPED,
    KERNEL_SHAPE,
    KERNEL_SYSTEMS,
    KERNEL_TARGET,
    KERNEL_TIMEOUT,
    KERNEL_WARMUP,
    KERNEL_WARMUP_QUICK,
    BenchError,
)

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("kernel_read",)

HOW = (
    f"`kernel_read` (a GPU and torch only): per backend, the producer fills a 1 GiB float32 buffer on "
    f"cuda:{KERNEL_DEVICE} and sends it to one consumer on the same GPU, which views it with "
    "`x = torch.from_dlpack(buf)` (checked to alias the mapping) and times `x.sum()` with CUDA events on the "
    "current stream, interleaved with the same reduction over `torch.empty_like(x)`, filled by the consumer "
    f"itself; median of {KERNEL_ITERS} after {KERNEL_WARMUP} warm-up rounds ({KERNEL_ITERS_QUICK} after "
    f"{KERNEL_WARMUP_QUICK} with --quick). GB/s is bytes read once / median time; the target is mapped / local "
    f">= {KERNEL_TARGET:.2f}. Both sums are checked against the fills, and the consumer drops its tensors and "
    "releases the buffer before it answers."
)


def plan(bench: Bench) -> None:
    if not bench.add(
        Scenario(
            "kernel_read",
            f"Kernel read: x.sum() over a 1 GiB buffer mapped from the producer, same GPU (cuda:{KERNEL_DEVICE})",
            "backend",
            list(bench.cfg.backends),
            floor=None,
            plot=False,
            kind="kernel",
            throughput_bytes=math.prod(KERNEL_SHAPE) * 4,
        )
    ):
        return
    scenario = bench.scenarios["kernel_read"]
    scenario.skipped = kernel_read_skip(bench)
    if scenario.skipped is None:
        for system in KERNEL_SYSTEMS:
            scenario.systems[system] = Series()
        for backend in bench.cfg.backends:
            bench.task("kernel_read", None, backend, _bind(kernel_read, bench, backend), None)


def kernel_read(bench: Bench, backend: str) -> dict[str, list[int]]:
    """``x.sum()`` times (ns) per system of ``kernel_read`` for one backend, from one consumer on the same GPU."""
    return one_buffer_to_one_consumer(bench,
        "kernel_read", backend, KERNEL_SHAPE, KERNEL_DEVICE, KERNEL_DEVICE, _kernel_read_measure,
        (bench.cfg.kernel_warmup, bench.cfg.kernel_iters), KERNEL_TIMEOUT, KERNEL_SYSTEMS,
    )  # fmt: skip


def kernel_read_skip(bench: Bench) -> str | None:
    reason = torch_skip(bench)  # includes "no GPU" and "host backend"
    if reason is not None:
        return reason
    if bench.gpu_count and bench.gpu_count <= KERNEL_DEVICE:
        return f"needs cuda:{KERNEL_DEVICE}; this machine has {bench.gpu_count} GPU(s)"
    return None


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
