"""``handoff_recycled`` / ``handoff_fresh`` / ``handoff_per_queue``: a 1 MiB buffer to N
consumers through Queues.

gpushare (one column per backend) next to torch.multiprocessing and cuda.core; *recycled*
puts the same buffer every iteration, *fresh* a new one, both on one Queue all consumers
read; *per_queue* puts the same buffer once on each consumer's own Queue (what fan-out
scripts often do), with its own floor: the same tuple through one Queue per consumer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..fmt import _gs_label
from ..patterns import queue_fanout
from ..peers import cuda_core_handoff, cuda_core_skip, queue_floor, torch_handoff, torch_skip
from ..results import Scenario, _bind
from ..settings import CUDA_CORE, GS_NOTE, HANDOFF_SHAPE, TORCH, _gpushare

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("handoff_recycled", "handoff_fresh", "handoff_per_queue")
PER_QUEUE = "handoff_per_queue"
PER_QUEUE_FLOOR = "mp.Queue per consumer"

HOW = (
    "`handoff_per_queue` is the recycled handoff with one work Queue per consumer instead of one shared "
    "Queue: the producer puts the same 1 MiB buffer once on each consumer's Queue, then waits for every ack "
    "(one ack Queue, as in the other handoffs). Its floor is measured in the same pattern, a small tuple "
    "through one `multiprocessing.Queue` per consumer (`mp.Queue per consumer`), and every system's ratio is "
    "to that floor. Systems: gpushare per backend, torch.multiprocessing and cuda.core, as in the shared-queue "
    "table."
)


def plan(bench: Bench) -> None:
    rows = bench.rows()
    gs_columns = bench.gs_columns()
    torch_skip_reason = torch_skip(bench)
    core_skip = cuda_core_skip(bench)
    for fresh in (False, True):
        key = "handoff_fresh" if fresh else "handoff_recycled"
        how = "a new buffer every iteration" if fresh else "the same buffer every iteration"
        if not bench.add(Scenario(key, f"1 MiB buffer to N consumers through a Queue, {how}", "consumers", rows)):
            continue
        bench.scenarios[key].notes.append(GS_NOTE)
        for n in bench.cfg.consumers:
            for label, backend, device, skip in gs_columns:
                bench.task(key, label, str(n), _bind(gpushare_handoff, bench, n, fresh, backend, device), skip)
            bench.task(key, TORCH, str(n), _bind(torch_handoff, bench, n, fresh), torch_skip_reason)
            bench.task(key, CUDA_CORE, str(n), _bind(cuda_core_handoff, bench, n, fresh), core_skip)
    title = "1 MiB buffer to N consumers through one Queue per consumer, the same buffer every iteration"
    if bench.add(Scenario(PER_QUEUE, title, "consumers", rows, floor=(PER_QUEUE, PER_QUEUE_FLOOR))):
        bench.scenarios[PER_QUEUE].notes.append(GS_NOTE)
        for n in bench.cfg.consumers:
            bench.task(PER_QUEUE, PER_QUEUE_FLOOR, str(n), _bind(queue_floor, bench, n, True), None)
            for label, backend, device, skip in gs_columns:
                run = _bind(gpushare_handoff, bench, n, False, backend, device, True)
                bench.task(PER_QUEUE, label, str(n), run, skip)
            bench.task(PER_QUEUE, TORCH, str(n), _bind(torch_handoff, bench, n, False, True), torch_skip_reason)
            bench.task(PER_QUEUE, CUDA_CORE, str(n), _bind(cuda_core_handoff, bench, n, False, True), core_skip)


def gpushare_handoff(
    bench: Bench, n: int, fresh: bool, backend: str, device: int | str, per_queue: bool = False
) -> list[int]:
    gpushare = _gpushare()

    m = bench.manager()
    kind = "gpushare_host" if device == "cpu" else "gpushare"
    # A backend this machine cannot run raises BackendUnavailableError here, before any consumer starts.
    m.empty(HANDOFF_SHAPE, "float32", device=device, backend=backend).release()
    before = m.stats()["reused"]
    if fresh:

        def produce(i: int) -> Any:
            return m.empty(HANDOFF_SHAPE, "float32", device=device, backend=backend)

        samples = queue_fanout(
            bench,
            gpushare.get_context("spawn"),
            n,
            kind,
            produce,
            drop=lambda buf: buf.release(),
            process_kwargs={"device": device},
        )
        reused = m.stats()["reused"] - before
        total = bench.cfg.warmup + bench.cfg.iters
        bench.scenarios["handoff_fresh"].notes.append(
            f"{_gs_label(backend)}, {n} consumer(s): {reused} of {total} allocations came from the pool."
        )
        return samples
    buf = m.zeros(HANDOFF_SHAPE, "float32", device=device, backend=backend)
    try:
        return queue_fanout(
            bench,
            gpushare.get_context("spawn"),
            n,
            kind,
            lambda i: buf,
            process_kwargs={"device": device},
            per_queue=per_queue,
        )
    finally:
        buf.release()
