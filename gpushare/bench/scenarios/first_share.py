"""``first_share``: ``m.empty()`` of a fresh allocation through one consumer mapping it, against the raw driver."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..consumers import _queue_consumer, _raw_open_consumer
from ..fmt import _gs_label, _size_label
from ..harness import _check_ack, _get_ack
from ..patterns import settled_loop
from ..results import Scenario, _bind
from ..settings import FIRST_SHARE_TARGET, GS_NOTE, RAW_DRIVER, SETTLE_TIMEOUT, BenchError, GiB, MiB, _gpushare

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("first_share",)


def plan(bench: Bench) -> None:
    gs_columns = bench.gs_columns()
    sizes = [2 * MiB, 64 * MiB] + ([GiB] if bench.cfg.backend == "cuda" else [])
    if not bench.add(
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
        return
    bench.scenarios["first_share"].notes.append(
        f"{GS_NOTE} The Manager's pool is trimmed between iterations (untimed). "
        f"`{RAW_DRIVER}` is the reference the ratios divide by: the bare driver sequence "
        "(cuMemAlloc, cuIpcGetMemHandle, the 64-byte handle through the same kind of Queue, "
        "cuIpcOpenMemHandle in the consumer, ack), the consumer closing and the producer "
        "freeing between iterations, untimed."
    )
    raw_skip = bench.gpu_reason
    for size in sizes:
        row = _size_label(size)
        bench.task("first_share", RAW_DRIVER, row, _bind(first_share_raw, bench, size), raw_skip)
        for label, backend, device, skip in gs_columns:
            bench.task("first_share", label, row, _bind(first_share, bench, size, backend, device), skip)


def first_share(bench: Bench, nbytes: int, backend: str, device: int | str) -> list[int]:
    gpushare = _gpushare()

    m = bench.manager()
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

    samples = settled_loop(bench, proc, work, acks, step, settle, heavy)
    if reused:
        bench.scenarios["first_share"].notes.append(
            f"{_gs_label(backend)}, {_size_label(nbytes)}: the pool still held memory after trim() "
            f"in {len(reused)} iteration(s)."
        )
    return samples


def first_share_raw(bench: Bench, nbytes: int) -> list[int]:
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
        return settled_loop(bench, proc, work, acks, step, settle, heavy)
    finally:
        while held:
            _cuda.mem_free(held.pop(), 0)
