"""``throughput``: pipelined handoffs per second to one consumer (ring, gpushare's Queue, torch, the floor)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..consumers import _ring_consumer
from ..fmt import _size_label
from ..harness import _await_ready, _pipes_poll, _recv_pipe, _stop
from ..patterns import stream_queue, stream_timing
from ..peers import stream_floor, stream_torch, torch_skip
from ..results import Scenario, _bind
from ..settings import (
    ACK_TIMEOUT,
    RING_SLOTS,
    STREAM_ACK_EVERY,
    STREAM_COUNT,
    STREAM_COUNT_QUICK,
    STREAM_FLOOR,
    STREAM_REPEATS,
    STREAM_REPEATS_QUICK,
    STREAM_RING_TARGET,
    STREAM_SIZES,
    STREAM_TARGET,
    STREAM_TARGET_ROW,
    STREAM_TORCH,
    STREAM_WARMUP,
    STREAM_WARMUP_QUICK,
    STREAM_WINDOW,
    BenchError,
    _gpushare,
)

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("throughput",)

HOW = (
    f"`throughput` counts pipelined handoffs to one consumer, the producer never waiting for each ack, for "
    f'1 MiB and 64 MiB buffers: through the ring ({RING_SLOTS} slots, the default `spin="auto"`; the '
    "producer acquires and publishes as "
    "fast as released slots allow; the consumer gets, touches and releases each item and acks only at the end "
    "of a timed repeat), through gpushare's Queue (the same recycled buffer put again and again), through "
    "torch.multiprocessing's Queue (a recycled CUDA tensor, GPU only) and through a plain "
    f"`multiprocessing.Queue` carrying a small tuple (the floor). The Queue systems keep at most "
    f"{STREAM_WINDOW} items put and not yet acked; their consumer acks every {STREAM_ACK_EVERY} items with its "
    f"count on a Pipe. After {STREAM_WARMUP} warm-up items, {STREAM_REPEATS} repeats of {STREAM_COUNT} items "
    f"({STREAM_WARMUP_QUICK}, {STREAM_REPEATS_QUICK} and {STREAM_COUNT_QUICK} with --quick) are timed whole; "
    "the table shows items/s of the median repeat and of the 10th percentile, and the targets "
    f"at {STREAM_TARGET_ROW} (the ring >= {STREAM_RING_TARGET.limit:,.0f} handoffs/s, gpushare's Queue >= "
    f"{STREAM_TARGET.limit:,.0f})."
)


def plan(bench: Bench) -> None:
    gs_columns = bench.gs_columns()
    stream_rows = [_size_label(size) for size in STREAM_SIZES]
    gs_stream = [f"{label} {how}" for label, *_ in gs_columns for how in ("ring", "Queue")]
    if not bench.add(
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
            system_targets={
                name: {STREAM_TARGET_ROW: STREAM_RING_TARGET} for name in gs_stream if name.endswith(" ring")
            },
        )
    ):
        return
    bench.scenarios["throughput"].notes.append(
        f'ring: {RING_SLOTS} slots, default `spin="auto"`, the producer acquires and publishes as fast as '
        "the slots come back, "
        "the consumer gets, touches (`item.ptr`) and releases. Queue rows (the same recycled "
        f"buffer or tensor, or the small tuple, put again and again): at most {STREAM_WINDOW} items "
        f"put and not yet acked; the consumer gets, touches, lets go, and acks every "
        f"{STREAM_ACK_EVERY} items on a Pipe. Items/s is the median over the timed repeats (in "
        "parentheses: the 10th percentile)."
    )
    torch_skip_reason = torch_skip(bench)
    for size in STREAM_SIZES:
        row = _size_label(size)
        bench.task("throughput", STREAM_FLOOR, row, _bind(stream_floor, bench), None)
        for label, backend, device, skip in gs_columns:
            bench.task("throughput", f"{label} ring", row, _bind(stream_ring, bench, size, backend, device), skip)
            bench.task(
                "throughput",
                f"{label} Queue",
                row,
                _bind(stream_gpushare_queue, bench, size, backend, device),
                skip,
            )
        bench.task("throughput", STREAM_TORCH, row, _bind(stream_torch, bench, size), torch_skip_reason)


def stream_ring(bench: Bench, nbytes: int, backend: str, device: int | str) -> list[int]:
    """Acquire/publish as fast as the ring's back-pressure allows; the consumer acks only at checkpoints."""
    import multiprocessing

    gpushare = _gpushare()
    m = bench.manager()
    cfg = bench.cfg
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
            return stream_timing(bench, pump)
        finally:
            _stop([proc], send_stop)
    finally:
        with contextlib.suppress(Exception):
            ring.close()
        for conn in (parent, child):
            with contextlib.suppress(Exception):
                conn.close()


def stream_gpushare_queue(bench: Bench, nbytes: int, backend: str, device: int | str) -> list[int]:
    gpushare = _gpushare()

    m = bench.manager()
    # BackendUnavailableError here, before the consumer starts.
    buf = m.zeros((nbytes // 4,), "float32", device=device, backend=backend)
    try:
        return stream_queue(bench, gpushare.get_context("spawn"), "gpushare", buf, process_kwargs={"device": device})
    finally:
        buf.release()
