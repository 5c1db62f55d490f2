"""``first_share``: ``m.empty()`` of a fresh allocation through one consumer mapping it, against the raw driver."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

from ..consumers import _queue_consumer, _raw_open_consumer, _raw_pool_consumer, _raw_vmm_consumer
from ..fmt import _gs_label, _size_label
from ..harness import _check_ack, _get_ack
from ..patterns import settled_loop
from ..results import Scenario, _bind
from ..settings import (
    FIRST_SHARE_TARGET,
    GS_NOTE,
    RAW_DRIVER,
    RAW_POOL,
    RAW_VMM,
    SETTLE_TIMEOUT,
    BenchError,
    GiB,
    MiB,
    _gpushare,
)

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("first_share",)


def plan(bench: Bench) -> None:
    gs_columns = bench.gs_columns()
    labels = {backend: label for label, backend, _, _ in gs_columns}
    # Each mechanism's own driver sequence, next to the legacy IPC one the target is judged on.
    mechanisms = [(raw, labels[b], fn) for raw, b, fn in _MECHANISMS if b in labels]
    sizes = [2 * MiB, 64 * MiB] + ([GiB] if bench.cfg.backend == "cuda" else [])
    if not bench.add(
        Scenario(
            "first_share",
            "First share of a fresh allocation: m.empty() -> one consumer maps it -> ack",
            "size",
            [_size_label(s) for s in sizes],
            floor=("first_share", RAW_DRIVER),
            ratio_systems=[label for label, _, _, _ in gs_columns],
            extra_ratios=[(label, raw) for raw, label, _ in mechanisms],
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
    if mechanisms:
        bench.scenarios["first_share"].notes.append(
            f"Each mechanism's own bare sequence, shown next to it (`gpushare X / raw driver, Y` columns; the "
            f"target is judged on `{RAW_DRIVER}`): `{RAW_VMM}` is cuMemCreate, reserve, map and set access, "
            "cuMemExportToShareableHandle, the fd and the size in one SCM_RIGHTS message on a socketpair, "
            "cuMemImportFromShareableHandle, reserve, map and set access in the consumer, ack; the consumer "
            f"unmapping and the producer freeing between iterations, untimed. `{RAW_POOL}` is "
            "cuMemAllocFromPoolAsync from an IPC pool the consumer imported before timing (then a stream "
            "synchronize), cuMemPoolExportPointer, the 64 bytes through the same kind of Queue, "
            "cuMemPoolImportPointer in the consumer, ack; between iterations (untimed) the consumer frees its "
            "import, the producer frees and trims the pool to 0, as `m.trim()` does, so every allocation grows it."
        )
    raw_skip = bench.gpu_reason
    for size in sizes:
        row = _size_label(size)
        bench.task("first_share", RAW_DRIVER, row, _bind(first_share_raw, bench, size), raw_skip)
        for raw, _, fn in mechanisms:
            bench.task("first_share", raw, row, _bind(fn, bench, size), raw_skip)
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


class _FdSender:
    """``settled_loop``'s work queue for the VMM reference: ``put((nbytes, fd))`` sends both in one
    SCM_RIGHTS message; ``put(None)`` sends the stop message (no fd)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def put(self, item: tuple[int, int] | None) -> None:
        if item is None:
            self.sock.sendall(b"stop")
        else:
            socket.send_fds(self.sock, [struct.pack("q", item[0])], [item[1]])

    def close(self) -> None:
        self.sock.close()


def first_share_raw_vmm(bench: Bench, nbytes: int) -> list[int]:
    """cuda_vmm's bare first share: create, map, export an fd, send it, import and map."""
    import multiprocessing

    from gpushare import _cuda

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    work = _FdSender(ours)
    acks = ctx.Queue()
    proc = ctx.Process(target=_raw_vmm_consumer, args=(theirs, acks, 0), daemon=True)
    held: list[tuple[int, Any]] = []
    heavy = nbytes >= 64 * MiB

    def settle() -> None:
        while held:
            ack = _get_ack(acks, [proc])
            if ack != "closed":
                raise BenchError(f"the raw-driver consumer sent {ack!r} instead of 'closed'")
            ptr, handle = held.pop()
            _cuda.vmm_free(ptr, handle, nbytes, 0)

    def step(i: int) -> None:
        ptr, handle = _cuda.vmm_alloc(nbytes, 0)
        held.append((ptr, handle))
        fd = _cuda.vmm_export(handle, 0)
        try:
            work.put((nbytes, fd))
        finally:
            os.close(fd)
        _check_ack(_get_ack(acks, [proc]))

    try:
        samples = settled_loop(bench, proc, work, acks, step, settle, heavy)
    finally:
        theirs.close()
        work.close()
        while held:
            ptr, handle = held.pop()
            _cuda.vmm_free(ptr, handle, nbytes, 0)
    return samples


def first_share_raw_pool(bench: Bench, nbytes: int) -> list[int]:
    """cuda_pool's bare first share: allocate from an IPC pool, export the pointer, import it."""
    import multiprocessing

    from gpushare import _cuda

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    work = ctx.Queue()
    acks = ctx.Queue()
    proc = ctx.Process(target=_raw_pool_consumer, args=(theirs, work, acks, 0), daemon=True)
    held: list[int] = []
    heavy = nbytes >= 64 * MiB
    pool, pool_fd = _cuda.pool_create(0)

    def settle() -> None:
        while held:
            ack = _get_ack(acks, [proc])
            if ack != "closed":
                raise BenchError(f"the raw-driver consumer sent {ack!r} instead of 'closed'")
            _cuda.pool_free(held.pop(), 0)
        _cuda.pool_trim(pool, 0)

    def step(i: int) -> None:
        ptr, data = _cuda.pool_alloc(pool, nbytes, 0)
        held.append(ptr)
        work.put(data)
        _check_ack(_get_ack(acks, [proc]))

    try:
        # Queued before the consumer starts: it imports the pool before it says it is ready.
        socket.send_fds(ours, [b"p"], [pool_fd])
        return settled_loop(bench, proc, work, acks, step, settle, heavy)
    finally:
        for sock in (ours, theirs):
            sock.close()
        os.close(pool_fd)
        while held:
            _cuda.pool_free(held.pop(), 0)
        _cuda.pool_destroy(pool, 0)


_MECHANISMS = ((RAW_VMM, "cuda_vmm", first_share_raw_vmm), (RAW_POOL, "cuda_pool", first_share_raw_pool))
