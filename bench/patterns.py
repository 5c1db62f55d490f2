"""The handoff patterns scenarios are made of, each a function of the running ``Bench``.

``queue_fanout``: put one item N times on a Queue, collect N acks. ``settled_loop``: one
consumer, an untimed settling step before each timed one. ``stream_timing`` and
``stream_queue``: pipelined handoffs timed per repeat. ``one_buffer_to_one_consumer``: a
filled buffer to one torch consumer that measures a bandwidth (``pick_clock`` chooses its
clock). ``settle_and_trim``: wait for the leases, then free the Manager's pool.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .consumers import _queue_consumer, _stream_consumer, _torch_consumer
from .harness import _await_ready, _check_ack, _get_ack, _pipes_poll, _queue_poll, _recv_pipe, _stop, _time_loop
from .results import Scenario
from .settings import SETTLE_TIMEOUT, STREAM_ACK_EVERY, STREAM_WINDOW, BenchError, _gpushare

if TYPE_CHECKING:
    from .runner import Bench


def queue_fanout(
    bench: Bench,
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
    per_queue: bool = False,
) -> list[int]:
    """One iteration: ``item = produce(i)``, put it N times, collect N acks, ``drop(item)``.

    ``per_queue``: one work Queue per consumer (the item put once on each) instead of
    one Queue all N consumers read; the acks share one Queue either way.
    """
    works = [ctx.Queue() for _ in range(n)] if per_queue else [ctx.Queue()]
    acks = ctx.Queue()
    procs = [
        ctx.Process(
            target=_queue_consumer,
            args=(kind, works[i % len(works)], acks, device, extra),
            daemon=True,
            **(process_kwargs or {}),
        )
        for i in range(n)
    ]
    targets = [works[i % len(works)] for i in range(n)]  # the queue each put goes to

    def send_stop() -> None:
        for work in targets:
            work.put(None)

    try:
        for p in procs:
            p.start()
        _await_ready(_queue_poll(acks), procs, n)

        def step(i: int) -> None:
            item = produce(i)
            for work in targets:
                work.put(item)
            for _ in range(n):
                _check_ack(_get_ack(acks, procs))
            if drop is not None:
                drop(item)

        cfg = bench.cfg
        if heavy:
            return _time_loop(step, cfg.heavy_warmup, cfg.heavy_iters)
        return _time_loop(step, cfg.warmup, cfg.iters)
    finally:
        _stop(procs, send_stop, [*works, acks])


def settled_loop(
    bench: Bench,
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
        cfg = bench.cfg
        warmup, iters = (cfg.heavy_warmup, cfg.heavy_iters) if heavy else (cfg.warmup, cfg.iters)
        samples = _time_loop(step, warmup, iters, between=settle)
        settle()
        return samples
    finally:
        _stop([proc], lambda: work.put(None), [work, acks])


def stream_timing(bench: Bench, pump: Callable[[int], None]) -> list[int]:
    """``pump(warmup)``, then ``repeats`` timed ``pump(count)``: one sample (ns per item) per repeat."""
    cfg = bench.cfg
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


def stream_queue(
    bench: Bench,
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

    cfg = bench.cfg
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
        return stream_timing(bench, pump)
    finally:
        _stop([proc], lambda: work.put(None), [work])
        for conn in (parent, child):
            with contextlib.suppress(Exception):
                conn.close()


def one_buffer_to_one_consumer(
    bench: Bench,
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
    from gpushare import _cuda

    gpushare = _gpushare()
    m = bench.manager()
    scenario = bench.scenarios[key]
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
        settle_and_trim(bench, scenario, backend)
    return pick_clock(scenario, backend, reply, systems)


def settle_and_trim(bench: Bench, scenario: Scenario, backend: str) -> None:
    """Wait (bounded) for outstanding leases, then free the pool: 1 GiB per backend adds up."""
    try:
        m = bench.manager()
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while m.stats()["leases"]:
            if time.monotonic() > deadline:
                scenario.notes.append(f"{backend}: a lease was still out {SETTLE_TIMEOUT:g} s after the run.")
                break
            time.sleep(0.01)
        m.trim()
    except Exception as exc:
        scenario.notes.append(f"{backend}: cleanup after the run failed: {type(exc).__name__}: {exc}")


def pick_clock(scenario: Scenario, backend: str, reply: Any, systems: Sequence[str]) -> dict[str, list[int]]:
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
