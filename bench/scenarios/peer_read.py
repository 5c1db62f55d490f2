"""``peer_read``: a consumer on a second GPU copies a 1 GiB buffer mapped from the first (two GPUs and torch)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

from ..patterns import one_buffer_to_one_consumer
from ..peers import torch_skip
from ..results import Scenario, Series, _bind
from ..settings import (
    PEER_DEVICE,
    PEER_HOME,
    PEER_ITERS,
    PEER_ITERS_QUICK,
    PEER_LOCAL_MAPPED,
    PEER_LOCAL_PLAIN,
    PEER_PEER_MAPPED,
    PEER_PEER_PLAIN,
    PEER_SHAPE,
    PEER_SYSTEMS,
    PEER_TIMEOUT,
    PEER_WARMUP,
    PEER_WARMUP_QUICK,
    BenchError,
)

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("peer_read",)

HOW = (
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
    "drops its tensors before answering; the producer joins it with a timeout."
)


def plan(bench: Bench) -> None:
    if not bench.add(
        Scenario(
            "peer_read",
            f"Peer read: a 1 GiB buffer on cuda:{PEER_HOME}, copied by a consumer on cuda:{PEER_DEVICE}",
            "backend",
            list(bench.cfg.backends),
            floor=None,
            plot=False,
            kind="throughput",
            throughput_bytes=math.prod(PEER_SHAPE) * 4,
        )
    ):
        return
    scenario = bench.scenarios["peer_read"]
    scenario.skipped = peer_read_skip(bench)
    if scenario.skipped is None:
        for system in PEER_SYSTEMS:
            scenario.systems[system] = Series()
        for backend in bench.cfg.backends:
            bench.task("peer_read", None, backend, _bind(peer_read, bench, backend), None)


def peer_read(bench: Bench, backend: str) -> dict[str, list[int]]:
    """Copy times (ns) per system of ``peer_read`` for one backend, from one consumer on cuda:1."""
    return one_buffer_to_one_consumer(bench,
        "peer_read", backend, PEER_SHAPE, PEER_HOME, PEER_DEVICE, _peer_read_measure,
        (bench.cfg.peer_warmup, bench.cfg.peer_iters), PEER_TIMEOUT, PEER_SYSTEMS,
    )  # fmt: skip


def peer_read_skip(bench: Bench) -> str | None:
    if bench.gpu_reason is not None:
        return bench.gpu_reason
    if bench.gpu_count <= PEER_DEVICE:
        return (
            f"needs {PEER_DEVICE + 1} GPUs (a producer on cuda:{PEER_HOME}, a consumer on "
            f"cuda:{PEER_DEVICE}); this machine has {bench.gpu_count}"
        )
    reason = torch_skip(bench)
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
