"""``queue``: gpushare's Queue against multiprocessing.Queue and faster-fifo, in one run.

Rows: the ping-pong round trip of a 64-byte ``bytes`` (one echo consumer, a Queue each
way); one-way throughput of 64-byte ``bytes`` from one producer to 1, 4 and 8 consumers
reading one Queue (microseconds per item: items/s is 1e6 over it); a 1 MiB Manager
buffer handed to 1, 4 and 8 consumers through one Queue each, every consumer acking on one
Queue of the same system; and that fan-out with a small tuple instead of the buffer (what
the pattern's messages cost a system apart from any buffer). faster-fifo is a peer from the
package index: where it is not installed (the GPU machine has no index: install
``.wheels/``), its column is skipped.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from ..harness import _await_ready, _check_ack, _get_ack, _queue_poll, _stop, _time_loop
from ..results import Scenario, _bind
from ..settings import ACK_TIMEOUT, HANDOFF_SHAPE, BenchError, _gpushare

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("queue",)
MP, FF, GS = "mp.Queue", "faster-fifo", "gpushare Queue"
SYSTEMS = (MP, FF, GS)
PAYLOAD = b"x" * 64
ROUND_TRIP = "round trip, 64 B"
ONE_WAY = (1, 4, 8)
BUFFERS = (1, 4, 8)
TUPLES = BUFFERS
TUPLE = (1, 2, 3)
STREAM_COUNT, STREAM_COUNT_QUICK = 20_000, 5_000  # items per timed repeat of a one-way row
STREAM_REPEATS, STREAM_REPEATS_QUICK = 5, 3
FF_BYTES = 64 << 20  # faster-fifo's buffer: large enough that a burst never blocks its producer

HOW = (
    "`queue` puts gpushare's Queue next to `multiprocessing.Queue` and `faster_fifo.Queue` (spawned "
    "consumers, one system per column). The round trip is a 64-byte `bytes` sent to an echo consumer and "
    f"back, one Queue each way. One-way rows time {STREAM_COUNT} puts of a 64-byte `bytes` ({STREAM_COUNT_QUICK} "
    "with --quick) into one Queue that N consumers drain, until every consumer has taken an end marker "
    "queued behind them; the figure is microseconds per item. Buffer rows hand the same 1 MiB Manager buffer "
    "(host backend without a GPU) to N consumers through one Queue each and wait for every ack; each consumer "
    "touches and releases it. Tuple rows are the same fan-out with the tuple `(1, 2, 3)` instead of the buffer: "
    "the cost of the pattern's messages and acks alone."
)


def faster_fifo_skip() -> str | None:
    try:
        import faster_fifo  # noqa: F401
    except ImportError:
        return (
            "faster_fifo is not installed (pip install faster-fifo, or the wheel in .wheels/ on a machine "
            "with no package index)"
        )
    return None


def _rows() -> list[str]:
    return (
        [ROUND_TRIP]
        + [f"one-way, {n} consumer{'s' * (n > 1)}" for n in ONE_WAY]
        + [f"1 MiB buffer, {n} consumer{'s' * (n > 1)}" for n in BUFFERS]
        + [f"small tuple, {n} consumer{'s' * (n > 1)}" for n in TUPLES]
    )


def plan(bench: Bench) -> None:
    rows = _rows()
    if not bench.add(
        Scenario(
            "queue",
            "Queues: small-object round trip, one-way throughput, 1 MiB buffer handoffs",
            "case",
            rows,
            floor=None,
            plot=False,
            extra_ratios=[(GS, MP), (GS, FF)],
        )
    ):
        return
    bench.scenarios["queue"].notes.append(
        "One-way rows: microseconds per item over a burst (items/s = 1e6 / the figure). Buffer rows: a 1 MiB "
        f"buffer of the Manager ({bench.gs_columns()[0][0]}), through one Queue per consumer. Tuple rows: the same "
        "fan-out carrying a small tuple, so a buffer row over its tuple row is what the buffer adds."
    )
    skips = {MP: None, FF: faster_fifo_skip(), GS: None}
    for system in SYSTEMS:
        bench.task("queue", system, ROUND_TRIP, _bind(round_trip, bench, system), skips[system])
        for n in ONE_WAY:
            row = rows[1 + ONE_WAY.index(n)]
            bench.task("queue", system, row, _bind(one_way, bench, system, n), skips[system])
        for n in BUFFERS:
            row = rows[1 + len(ONE_WAY) + BUFFERS.index(n)]
            bench.task("queue", system, row, _bind(buffer_fanout, bench, system, n), skips[system])
        for n in TUPLES:
            row = rows[1 + len(ONE_WAY) + len(BUFFERS) + TUPLES.index(n)]
            bench.task("queue", system, row, _bind(tuple_fanout, bench, system, n), skips[system])


# -- the systems --------------------------------------------------------------------------------


def _ctx(system: str) -> Any:
    """The spawn context a system's consumers start in."""
    if system == GS:
        return _gpushare().get_context("spawn")
    import multiprocessing

    return multiprocessing.get_context("spawn")


def _make_queue(system: str) -> Any:
    if system == FF:
        import faster_fifo

        return faster_fifo.Queue(max_size_bytes=FF_BYTES)
    return _ctx(system).Queue()


# -- consumers (module level: spawn imports them) --------------------------------------------


def _echo(inq: Any, outq: Any) -> None:
    outq.put(("ready", 0))
    while True:
        item = inq.get(timeout=ACK_TIMEOUT)
        if item is None:
            return
        outq.put(item)


def _drain(work: Any, acks: Any) -> None:
    """Count items until an end marker (None): ack the count; "stop" ends it."""
    acks.put(("ready", 0))
    count = 0
    while True:
        item = work.get(timeout=ACK_TIMEOUT)
        if item is None or item == "stop":
            acks.put(count)
            count = 0
            if item == "stop":
                return
        else:
            count += 1


def _take_items(work: Any, acks: Any) -> None:
    """Take a buffer (touch and release it) or a tuple (read its first item) until None; ack each."""
    acks.put(("ready", 0))
    while True:
        item = work.get(timeout=ACK_TIMEOUT)
        if item is None:
            return
        if type(item) is tuple:
            _ = item[0]
        else:
            _ = item.numpy()[0] if item.device == "cpu" else item.ptr
            item.release()
        acks.put(1)


def _stop_queues(queues: list[Any]) -> None:
    for q in queues:
        with contextlib.suppress(Exception):
            q.cancel_join_thread()
            q.close()


# -- the cases ------------------------------------------------------------------------------------


def round_trip(bench: Bench, system: str) -> list[int]:
    inq, outq = _make_queue(system), _make_queue(system)
    proc = _ctx(system).Process(target=_echo, args=(inq, outq), daemon=True)
    try:
        proc.start()
        _await_ready(_queue_poll(outq), [proc], 1)

        def step(i: int) -> None:
            inq.put(PAYLOAD)
            if _get_ack(outq, [proc]) != PAYLOAD:
                raise BenchError("the echo consumer sent back something else")

        cfg = bench.cfg
        return _time_loop(step, cfg.warmup, max(cfg.iters, 200))
    finally:
        _stop([proc], lambda: inq.put(None))
        _stop_queues([inq, outq])


def one_way(bench: Bench, system: str, n: int) -> list[int]:
    import multiprocessing

    work = _make_queue(system)
    acks = multiprocessing.get_context("spawn").SimpleQueue()  # the same for every system
    procs = [_ctx(system).Process(target=_drain, args=(work, acks), daemon=True) for _ in range(n)]
    quick = bench.cfg.quick
    count = STREAM_COUNT_QUICK if quick else STREAM_COUNT
    repeats = STREAM_REPEATS_QUICK if quick else STREAM_REPEATS
    total = 0
    counted = 0

    def ack() -> int:
        deadline = time.monotonic() + ACK_TIMEOUT
        while not acks._reader.poll(1.0):  # type: ignore[attr-defined]
            if any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
                raise BenchError("a consumer died or stopped answering")
        got = acks.get()
        if not isinstance(got, int):
            raise BenchError(f"a consumer sent {got!r}")
        return got

    def burst(k: int) -> None:
        nonlocal total, counted
        put = work.put
        for _ in range(k):
            put(PAYLOAD)
        for _ in range(n):
            put(None)
        total += k
        counted += sum(ack() for _ in range(n))

    try:
        for p in procs:
            p.start()
        _await_ready(lambda t: acks.get() if acks._reader.poll(t) else None, procs, n)  # type: ignore[attr-defined]
        burst(count // 4)  # warm-up
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            burst(count)
            samples.append(max(1, (time.perf_counter_ns() - t0) // count))
        for _ in range(n):
            work.put("stop")
        counted += sum(ack() for _ in range(n))
        if counted != total:
            raise BenchError(f"the consumers counted {counted} items; {total} were put")
        return samples
    finally:
        _stop(procs, lambda: None)
        _stop_queues([work])


def buffer_fanout(bench: Bench, system: str, n: int) -> list[int]:
    m = bench.manager()
    _, backend, device, skip = bench.gs_columns()[0]  # the host backend, or the first CUDA one
    if skip is not None:
        raise BenchError(skip)
    buf = m.zeros(HANDOFF_SHAPE, "float32", device=device, backend=backend)
    try:
        return _fanout(bench, system, n, buf)
    finally:
        buf.release()


def tuple_fanout(bench: Bench, system: str, n: int) -> list[int]:
    return _fanout(bench, system, n, TUPLE)


def _fanout(bench: Bench, system: str, n: int, item: Any) -> list[int]:
    """Put ``item`` once on each of ``n`` consumers' Queues, then wait for every ack."""
    works = [_make_queue(system) for _ in range(n)]
    acks = _make_queue(system)
    procs = [_ctx(system).Process(target=_take_items, args=(w, acks), daemon=True) for w in works]
    try:
        for p in procs:
            p.start()
        _await_ready(_queue_poll(acks), procs, n)

        def step(i: int) -> None:
            for work in works:
                work.put(item)
            for _ in range(n):
                _check_ack(_get_ack(acks, procs))

        cfg = bench.cfg
        return _time_loop(step, cfg.warmup, cfg.iters)
    finally:
        _stop(procs, lambda: _put_all(works, None))
        _stop_queues([*works, acks])


def _put_all(queues: list[Any], item: Any) -> None:
    for q in queues:
        q.put(item)
