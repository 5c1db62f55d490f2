"""``first_share``: ``m.empty()`` of a fresh allocation through one consumer mapping it, against the raw driver."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

from ..consumers import _queue_consumer, _raw_reference_consumer
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


class _RawIpc:
    """The legacy IPC sequence (the target's reference): cuMemAlloc, cuIpcGetMemHandle,
    the handle on ``work``. Each mechanism: ``share`` (timed; returns what to free),
    ``free`` and ``settled`` (untimed, once the consumer closed), ``close``."""

    kind = "ipc"

    def __init__(self, ctx: Any, cuda: Any) -> None:
        self.cuda = cuda
        self.work = ctx.Queue()
        self.sock: socket.socket | None = None  # the consumer's end, if the mechanism has one

    def share(self, nbytes: int) -> Any:
        ptr = self.cuda.mem_alloc(nbytes, 0)
        try:
            self.work.put(self.cuda.ipc_get_handle(ptr, 0))
        except BaseException:
            self.cuda.mem_free(ptr, 0)
            raise
        return ptr

    def free(self, ptr: Any, nbytes: int) -> None:
        self.cuda.mem_free(ptr, 0)

    def consumer_work(self) -> Any:
        """What the consumer reads items from besides ``sock`` (None: only ``sock``)."""
        return self.work

    def settled(self) -> None:
        pass

    def close(self) -> None:
        pass


class _FdSender:
    """The VMM reference's work queue: ``put((nbytes, fd))`` sends both in one SCM_RIGHTS
    message; ``put(None)`` (``settled_loop``'s stop) sends a message with no fd."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def put(self, item: tuple[int, int] | None) -> None:
        if item is None:
            self.sock.sendall(b"stop")
        else:
            socket.send_fds(self.sock, [struct.pack("q", item[0])], [item[1]])


class _RawVmm(_RawIpc):
    """cuMemCreate, reserve, map, set access, cuMemExportToShareableHandle, and the fd
    with the size in one SCM_RIGHTS message on a socketpair."""

    kind = "vmm"

    def __init__(self, ctx: Any, cuda: Any) -> None:
        self.cuda = cuda
        ours, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.work = _FdSender(ours)

    def share(self, nbytes: int) -> Any:
        ptr, handle = self.cuda.vmm_alloc(nbytes, 0)
        try:
            fd = self.cuda.vmm_export(handle, 0)
            try:
                self.work.put((nbytes, fd))
            finally:
                os.close(fd)
        except BaseException:
            self.cuda.vmm_free(ptr, handle, nbytes, 0)
            raise
        return ptr, handle

    def free(self, held: Any, nbytes: int) -> None:
        self.cuda.vmm_free(*held, nbytes, 0)

    def consumer_work(self) -> Any:
        return None  # the items travel on the socket (our end must not go to the consumer)

    def close(self) -> None:
        self.work.sock.close()
        assert self.sock is not None
        self.sock.close()


class _RawPool(_RawIpc):
    """cuMemAllocFromPoolAsync from an IPC pool the consumer imported before timing,
    cuMemPoolExportPointer, the 64 bytes on ``work``; the pool trimmed to 0 once settled."""

    kind = "pool"

    def __init__(self, ctx: Any, cuda: Any) -> None:
        super().__init__(ctx, cuda)
        ours, self.sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pool, fd = cuda.pool_create(0)
        try:
            # Queued before the consumer starts: it imports the pool before it says it is ready.
            socket.send_fds(ours, [b"p"], [fd])
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)
            ours.close()

    def share(self, nbytes: int) -> Any:
        ptr, data = self.cuda.pool_alloc(self.pool, nbytes, 0)
        try:
            self.work.put(data)
        except BaseException:
            self.cuda.pool_free(ptr, 0)
            raise
        return ptr

    def free(self, ptr: Any, nbytes: int) -> None:
        self.cuda.pool_free(ptr, 0)

    def settled(self) -> None:
        self.cuda.pool_trim(self.pool, 0)  # as m.trim(): the next allocation grows the pool

    def close(self) -> None:
        assert self.sock is not None
        self.sock.close()
        self.cuda.pool_destroy(self.pool, 0)


def _raw_sequence(bench: Bench, nbytes: int, mechanism: type[_RawIpc]) -> list[int]:
    """One mechanism's bare first share, timed like ``first_share``: allocate, export, send,
    the consumer opens and acks. Between iterations (untimed) the consumer closes, then the
    producer frees, so every allocation is memory the consumer never opened."""
    import multiprocessing

    from gpushare import _cuda

    ctx = multiprocessing.get_context("spawn")
    raw = mechanism(ctx, _cuda)
    acks = ctx.Queue()
    proc = ctx.Process(
        target=_raw_reference_consumer, args=(raw.kind, raw.consumer_work(), acks, 0, raw.sock), daemon=True
    )
    held: list[Any] = []

    def settle() -> None:
        while held:
            ack = _get_ack(acks, [proc])
            if ack != "closed":
                raise BenchError(f"the raw-driver consumer sent {ack!r} instead of 'closed'")
            raw.free(held.pop(), nbytes)
        raw.settled()

    def step(i: int) -> None:
        held.append(raw.share(nbytes))
        _check_ack(_get_ack(acks, [proc]))

    try:
        return settled_loop(bench, proc, raw.work, acks, step, settle, nbytes >= 64 * MiB)
    finally:
        while held:
            raw.free(held.pop(), nbytes)
        raw.close()


def first_share_raw(bench: Bench, nbytes: int) -> list[int]:
    """The legacy IPC sequence: the reference the target is judged on."""
    return _raw_sequence(bench, nbytes, _RawIpc)


def first_share_raw_vmm(bench: Bench, nbytes: int) -> list[int]:
    """cuda_vmm's own bare sequence."""
    return _raw_sequence(bench, nbytes, _RawVmm)


def first_share_raw_pool(bench: Bench, nbytes: int) -> list[int]:
    """cuda_pool's own bare sequence."""
    return _raw_sequence(bench, nbytes, _RawPool)


_MECHANISMS = ((RAW_VMM, "cuda_vmm", first_share_raw_vmm), (RAW_POOL, "cuda_pool", first_share_raw_pool))
