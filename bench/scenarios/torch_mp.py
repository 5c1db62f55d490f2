"""``torch_mp``: CUDA tensors through a Queue, ``torch.multiprocessing`` against ``gpushare.torch.multiprocessing``.

The drop-in's own comparison (issue 42): the same script written with ``import
torch.multiprocessing as mp`` and with ``import gpushare.torch.multiprocessing as mp``.
One iteration is ``handoff_per_queue``'s: the producer puts the tensor once on each
consumer's own Queue and waits for every ack (one ack Queue); a consumer gets the tensor,
reads ``t.data_ptr()``, drops it and acks. Cases: a 1 MiB and a 64 MiB float32 tensor,
*recycled* (the same tensor put every iteration) and *fresh* (``torch.empty`` every
iteration, dropped after the acks); rows: 1, 4 and 8 consumers (``--consumers`` when it is
given). Neither system calls ``torch.cuda.ipc_collect()``. The fresh cases have a third column,
``GS_MANAGER``: the drop-in again, each new tensor over a new buffer of a Manager in the
producer, which the receivers already map once the Manager's pool hands the allocation out again.

Keeping the systems apart: importing ``gpushare.torch.multiprocessing`` registers its tensor
reducer with multiprocessing's ``ForkingPickler`` for the whole process, so a process that
imported it sends CUDA tensors gpushare's way even through torch.multiprocessing's Queue.
Neither system runs in the bench's own process: each cell runs in a producer process of its
own (stdlib spawn), which imports only its system's module and starts its consumers from
that module's spawn context; each consumer imports only that module too. The producer and
every consumer check, before they do anything else, that the reducer registered for
``torch.Tensor`` is their system's (``torch.multiprocessing.reductions`` or
``gpushare.torch._sharing``) and that ``gpushare.torch.multiprocessing`` is imported exactly
when the system is gpushare's; a process that fails the check fails its cell. A producer
process also takes with it whatever torch keeps for tensors it sent.

``torch_mp_memory``: each system's producer sends a fresh 1 MiB tensor 1,000 times to one
consumer (no warm-up, no ``ipc_collect()``): ``torch.cuda.memory_allocated()`` before the
first send, ``torch.cuda.max_memory_allocated()`` over the sends (after
``reset_peak_memory_stats()``), the allocated memory at the last ack and 2 s after it (the
consumer still running). Target: gpushare's peak at most ``FLAT_MIB`` above where it started
(flat); torch's is reported beside it.

``DEVICE`` ``"cpu"`` (the plumbing test) runs everything with CPU tensors, which both systems
share as torch does, and reports no device memory.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import queue
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from ..harness import _await_ready, _check_ack, _get_ack, _queue_poll, _stop, _time_loop, run_in_child
from ..peers import torch_skip
from ..results import Check, Scenario, Table, _bind
from ..settings import ACK_TIMEOUT, CONSUMERS, JOIN_TIMEOUT, READY_TIMEOUT, TORCH, BenchError, MiB
from ..stats import Target

if TYPE_CHECKING:
    from ..runner import Bench


KEY = "torch_mp"
KEYS = (KEY,)
MEMORY_KEY = f"{KEY}_memory"

TORCH_MP = TORCH  # "torch.multiprocessing"
GS_MP = "gpushare.torch.multiprocessing"
#: The fresh cases' third column: the drop-in, each new tensor made over a new Manager buffer
#: (``torch.from_dlpack(manager.empty(...))``), the way docs/guides/torch-multiprocessing.md
#: gives for a sender that makes a tensor per send.
GS_MANAGER = "gpushare.torch.multiprocessing, Manager buffers"
SYSTEMS = (TORCH_MP, GS_MP)
FRESH_SYSTEMS = (TORCH_MP, GS_MP, GS_MANAGER)
#: The module each system's processes import (and the only one of the two they may import).
MODULES = {TORCH_MP: "torch.multiprocessing", GS_MP: "gpushare.torch.multiprocessing"}
MODULES[GS_MANAGER] = MODULES[GS_MP]
#: The module of the reducer registered for torch.Tensor once that module is imported.
REDUCERS = {TORCH_MP: "torch.multiprocessing.reductions", GS_MP: "gpushare.torch._sharing"}
REDUCERS[GS_MANAGER] = REDUCERS[GS_MP]

DEVICE = "cuda"  # "cpu": the plumbing test (CPU tensors, no device memory)
SIZES = (1 * MiB, 64 * MiB)  # float32 tensors
DEFAULT_CONSUMERS = (1, 4, 8)  # the rows unless --consumers is given
MEMORY_SENDS = 1000
MEMORY_BYTES = 1 * MiB
SETTLE_S = 2.0  # the memory reading after the last send
FLAT_MIB = 16.0  # gpushare's peak above its start at most this: flat (tests/test_torch_mp.py's bound)
RECYCLED_TARGET = 0.5  # gpushare recycled <= this x torch's time: at least 2x faster (issue 42)
FRESH_TARGET = 1.0  # gpushare fresh no slower than torch's

POLL_S = 1.0  # a consumer's get() waits this long, then checks that its producer is alive
IDLE_TIMEOUT = 300.0  # a consumer with no item for this long gives up
PER_ITERATION_S = 0.5  # the bench's backstop on a producer process: this much per iteration on top of start-up

HOW = (
    f"`{KEY}` (a GPU and torch only) compares `import torch.multiprocessing as mp` with `import "
    f"gpushare.torch.multiprocessing as mp` on the `handoff_per_queue` pattern: the producer puts a float32 CUDA "
    "tensor once on each consumer's own Queue (`mp.get_context('spawn').Queue()`) and waits for every ack on one "
    "ack Queue; a consumer gets it, reads `t.data_ptr()`, drops it and acks. Tables per size (1 MiB, 64 MiB; "
    "both with the standard iteration counts: neither system copies, so no cost grows with the size) and case: "
    "*recycled* puts the same tensor every iteration, *fresh* a "
    "`torch.empty` tensor made in the iteration and dropped after its acks (and, in a third column, "
    f"`{GS_MANAGER}`, a `torch.from_dlpack(manager.empty(...))` tensor over a new buffer of a Manager in the "
    "producer, the drop-in's way for a sender that makes a tensor per send); rows: 1, 4 and 8 consumers (the "
    "`--consumers` counts when given). torch.multiprocessing's column is each table's floor, so `/ floor` is "
    f"gpushare over torch; targets: recycled <= {RECYCLED_TARGET:g}x torch's (2x faster), fresh <= "
    f"{FRESH_TARGET:g}x. Neither system calls `torch.cuda.ipc_collect()`. The two systems never share a process: "
    "importing gpushare.torch.multiprocessing registers its tensor reducer for the whole process, so every cell "
    "runs in a spawned producer process of its own that imports only its system's module and starts its "
    "consumers from that module's context, and each of those processes checks, before it starts, that the "
    f"reducer registered for `torch.Tensor` is its system's. `{MEMORY_KEY}`: each system's producer sends a "
    f"fresh {MEMORY_BYTES // MiB} MiB tensor {MEMORY_SENDS:,} times to one consumer, from the first send (no "
    "warm-up), with no `ipc_collect()`: `torch.cuda.memory_allocated()` before the first send, "
    "`max_memory_allocated()` over the sends (after `reset_peak_memory_stats()`), and the allocated memory at "
    f"the last ack and {SETTLE_S:g} s later, the consumer still running; target: gpushare's peak at most "
    f"{FLAT_MIB:g} MiB above its start (flat). Its latency table is those {MEMORY_SENDS:,} sends."
)


# -- planning ----------------------------------------------------------------------------------


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def case_key(nbytes: int, fresh: bool) -> str:
    """The scenario key of one case: ``torch_mp_1mib_recycled``, ``torch_mp_64mib_fresh``, ..."""
    size = size_label(nbytes).replace(" ", "").lower()
    return f"{KEY}_{size}_{'fresh' if fresh else 'recycled'}"


def cases() -> list[tuple[int, bool]]:
    return [(nbytes, fresh) for nbytes in SIZES for fresh in (False, True)]


def consumer_rows(bench: Bench) -> list[str]:
    """1, 4 and 8 consumers; the ``--consumers`` counts when they are not the default."""
    counts = bench.cfg.consumers
    return [str(n) for n in (DEFAULT_CONSUMERS if tuple(counts) == CONSUMERS else counts)]


def skip_reason(bench: Bench) -> str | None:
    """Why the scenario cannot run: ``torch_skip`` on a GPU; with ``DEVICE="cpu"``, only a missing torch."""
    if DEVICE != "cpu":
        return torch_skip(bench)
    try:
        import torch  # noqa: F401
    except Exception as exc:
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    return None


def plan(bench: Bench) -> None:
    if bench.cfg.only is not None and KEY not in bench.cfg.only:
        return
    rows = consumer_rows(bench)
    kind = "CPU" if DEVICE == "cpu" else "CUDA"  # the plumbing test's tensors are CPU tensors
    planned: list[tuple[str, int, bool]] = []
    for nbytes, fresh in cases():
        key = case_key(nbytes, fresh)
        how = "a new tensor every iteration" if fresh else "the same tensor every iteration"
        limit = FRESH_TARGET if fresh else RECYCLED_TARGET
        scenario = Scenario(
            key,
            f"{size_label(nbytes)} {kind} tensor to N consumers, one Queue each, {how}: {TORCH_MP} vs {GS_MP}",
            "consumers",
            rows,
            floor=(key, TORCH_MP),
            targets={row: Target("ratio_max", limit) for row in rows},
            target_systems=[GS_MP, GS_MANAGER] if fresh else [GS_MP],
            plot=False,
        )
        scenario.notes.append(
            f"Floor: {TORCH_MP}'s own column, so `{GS_MP} / floor` is gpushare's time over torch's. Each cell ran "
            "in a producer process of its own that imported only its system's module; no `ipc_collect()`."
        )
        bench.scenarios[key] = scenario
        planned.append((key, nbytes, fresh))
    memory = Scenario(
        MEMORY_KEY,
        f"{MEMORY_SENDS:,} sends of a fresh {MEMORY_BYTES // MiB} MiB {kind} tensor to 1 consumer, no ipc_collect(): "
        "latency per send and the producer's device memory",
        "consumers",
        ["1"],
        floor=(MEMORY_KEY, TORCH_MP),
        plot=False,
    )
    bench.scenarios[MEMORY_KEY] = memory
    skip = skip_reason(bench)
    if skip is not None:
        for key, _, _ in planned:
            bench.scenarios[key].skipped = skip
        memory.skipped = skip
        return
    for key, nbytes, fresh in planned:
        for row in rows:
            for system in FRESH_SYSTEMS if fresh else SYSTEMS:
                bench.task(key, system, row, _bind(measure, bench, system, nbytes, fresh, int(row)), None)
    for system in SYSTEMS:
        bench.task(MEMORY_KEY, system, "1", _bind(measure_memory, bench, system), None)


def _device(bench: Bench) -> int | str:
    return "cpu" if DEVICE == "cpu" else (bench.device or 0)


def measure(bench: Bench, system: str, nbytes: int, fresh: bool, n: int) -> list[int]:
    """One cell, in a producer process of its own: the samples (ns)."""
    cfg = bench.cfg
    # Every size gets the standard counts: neither system copies the tensor, so nothing a
    # handoff does grows with its size, and the heavy counts (2 warm-ups, 20 samples under
    # --quick) left the 64 MiB cells both noisy and cold.
    warmup, iters = cfg.warmup, cfg.iters
    samples: list[int] = in_own_producer(
        "case", (system, _device(bench), nbytes, fresh, n, warmup, iters), warmup + iters
    )
    return samples


def measure_memory(bench: Bench, system: str) -> list[int]:
    """The memory cell, in a producer process of its own: the per-send samples (ns); the
    figures go to ``details["producer_memory"]`` and the table and check under the scenario."""
    samples, figures = in_own_producer("memory", (system, _device(bench), MEMORY_SENDS), MEMORY_SENDS)
    scenario = bench.scenarios[MEMORY_KEY]
    if figures is not None:
        scenario.details.setdefault("producer_memory", {})[system] = figures
    elif f"{system}: no device memory to read (CPU tensors)." not in scenario.notes:
        scenario.notes.append(f"{system}: no device memory to read (CPU tensors).")
    refresh_memory(scenario)
    return list(samples)


def refresh_memory(scenario: Scenario) -> None:
    """The memory table and gpushare's flatness check, from ``details["producer_memory"]``."""
    figures: dict[str, dict[str, float]] = scenario.details.get("producer_memory") or {}
    scenario.tables.clear()
    scenario.checks.clear()
    if not figures:
        return
    header = [
        "system",
        "allocated before the first send",
        f"peak over the {MEMORY_SENDS:,} sends",
        "peak above the start",
        "allocated at the last ack",
        f"allocated {SETTLE_S:g} s after the last send",
    ]
    rows = []
    for system in SYSTEMS:
        f = figures.get(system)
        if f is None:
            rows.append([system, *("-" for _ in header[1:])])
            continue
        rows.append(
            [
                system,
                f"{f['before_mib']:,.1f}",
                f"{f['peak_mib']:,.1f}",
                f"{f['peak_mib'] - f['before_mib']:+,.1f}",
                f"{f['last_ack_mib']:,.1f}",
                f"{f['settled_mib']:,.1f}",
            ]
        )
    caption = (
        f"`{MEMORY_KEY}` device memory in the producer, MiB (`torch.cuda.memory_allocated()`; the peak: "
        "`max_memory_allocated()` after `reset_peak_memory_stats()`)"
    )
    scenario.tables.append(Table(caption, header, rows))
    mine, theirs = figures.get(GS_MP), figures.get(TORCH_MP)
    met: bool | None = None
    measured = "-"
    if mine is not None:
        above = mine["peak_mib"] - mine["before_mib"]
        met = above <= FLAT_MIB
        measured = f"{above:+,.1f} MiB"
        if theirs is not None:
            measured += f"; {TORCH_MP}: {theirs['peak_mib'] - theirs['before_mib']:+,.1f} MiB"
    text = f"{GS_MP} peak device memory over {MEMORY_SENDS:,} sends flat (at most {FLAT_MIB:g} MiB above the start)"
    scenario.checks.append(Check("1", text, met, measured))


# -- the producer process ----------------------------------------------------------------------


def in_own_producer(what: str, args: tuple[Any, ...], iterations: int) -> Any:
    """Run ``run_case(*args)`` (``what`` "case") or ``run_memory(*args)`` ("memory") in a spawned
    producer process of its own, and return what it returns; its failure is a BenchError."""
    timeout = READY_TIMEOUT + 2 * ACK_TIMEOUT + 2 * JOIN_TIMEOUT + SETTLE_S + iterations * PER_ITERATION_S
    return run_in_child(_producer_main, (what, args), f"{args[0]}: the producer process", timeout)


def _producer_main(what: str, args: tuple[Any, ...], conn: Any) -> None:
    try:
        result = run_case(*args) if what == "case" else run_memory(*args)
        conn.send(("ok", result))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def system_module(system: str) -> Any:
    """Import ``system``'s module (and only it), then check this process is ``system``'s."""
    module = importlib.import_module(MODULES[system])
    check_system(system)
    return module


def check_system(system: str) -> None:
    """Raise BenchError unless this process sends tensors the way of ``system`` alone: the reducer
    registered for torch.Tensor is its system's, and gpushare.torch.multiprocessing is imported
    exactly when the system is gpushare's."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    reducer = ForkingPickler._extra_reducers.get(torch.Tensor)  # type: ignore[attr-defined]
    where = getattr(reducer, "__module__", None)
    if where != REDUCERS[system]:
        name = getattr(reducer, "__name__", repr(reducer))
        raise BenchError(
            f"{system}: torch.Tensor is pickled by {where}.{name}, not by {REDUCERS[system]}: "
            f"the systems are mixed in process {os.getpid()}"
        )
    imported = MODULES[GS_MP] in sys.modules
    if imported != (MODULES[system] == MODULES[GS_MP]):
        raise BenchError(f"{system}: {MODULES[GS_MP]} is {'' if imported else 'not '}imported in process {os.getpid()}")


def _torch_device(torch: Any, device: int | str) -> Any:
    if device == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(int(device))
    torch.cuda.init()
    return torch.device("cuda", int(device))


def _start(system: str, device: int | str, nbytes: int, n: int) -> tuple[Any, list[Any], Any, list[Any]]:
    """The system's module, one work Queue per consumer, the ack Queue and the started, ready consumers."""
    module = system_module(system)
    ctx = module.get_context("spawn")
    works = [ctx.Queue() for _ in range(n)]
    acks = ctx.Queue()
    procs = [ctx.Process(target=consumer, args=(system, work, acks, device, nbytes), daemon=True) for work in works]
    return module, works, acks, procs


def _fan_out(works: list[Any], acks: Any, procs: list[Any], tensor: Any) -> None:
    """Put ``tensor`` once on each consumer's Queue, then take every consumer's ack."""
    for work in works:
        work.put(tensor)
    for _ in works:
        _check_ack(_get_ack(acks, procs))


def _stop_consumers(works: list[Any], acks: Any, procs: list[Any]) -> None:
    def send_stop() -> None:
        for work in works:
            work.put(None)

    _stop(procs, send_stop, [*works, acks])


def run_case(system: str, device: int | str, nbytes: int, fresh: bool, n: int, warmup: int, iters: int) -> list[int]:
    """In the producer process: time ``iters`` iterations (after ``warmup``) of ``nbytes`` to ``n`` consumers."""
    _, works, acks, procs = _start(system, device, nbytes, n)
    import torch

    dev = _torch_device(torch, device)
    shape = (nbytes // 4,)
    kept = None if fresh else torch.zeros(shape, dtype=torch.float32, device=dev)
    manager = None
    if system == GS_MANAGER:
        import gpushare

        manager = gpushare.Manager()
        where = "cpu" if dev.type == "cpu" else dev.index

        def new_tensor() -> Any:
            # The buffer goes with the tensor: its allocation returns to the Manager's pool
            # once the receivers let go, and the next send takes it again.
            return torch.from_dlpack(manager.empty(shape, "float32", device=where))
    else:

        def new_tensor() -> Any:
            return torch.empty(shape, dtype=torch.float32, device=dev)

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)

    def step(i: int) -> None:
        tensor = new_tensor() if fresh else kept
        _fan_out(works, acks, procs, tensor)  # a fresh tensor is dropped on return

    try:
        for p in procs:
            p.start()
        _await_ready(_queue_poll(acks), procs, n)
        return _time_loop(step, warmup, iters)
    finally:
        _stop_consumers(works, acks, procs)
        if manager is not None:
            manager.shutdown()


def run_memory(system: str, device: int | str, sends: int) -> tuple[list[int], dict[str, float] | None]:
    """In the producer process: ``sends`` fresh 1 MiB tensors to one consumer, timed per send, and the
    producer's device memory (None on the CPU)."""
    _, works, acks, procs = _start(system, device, MEMORY_BYTES, 1)
    import torch

    dev = _torch_device(torch, device)
    cuda = dev.type == "cuda"
    shape = (MEMORY_BYTES // 4,)

    def allocated() -> float:
        return torch.cuda.memory_allocated(dev) / MiB if cuda else 0.0

    def step(i: int) -> None:
        _fan_out(works, acks, procs, torch.empty(shape, dtype=torch.float32, device=dev))

    try:
        for p in procs:
            p.start()
        _await_ready(_queue_poll(acks), procs, 1)
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        before = allocated()
        samples = _time_loop(step, 0, sends)
        last = time.monotonic()
        last_ack = allocated()
        gc.collect()
        time.sleep(max(0.0, last + SETTLE_S - time.monotonic()))
        settled = allocated()
        if not cuda:
            return samples, None
        peak = torch.cuda.max_memory_allocated(dev) / MiB
        figures = {
            "sends": float(sends),
            "before_mib": round(before, 2),
            "peak_mib": round(peak, 2),
            "last_ack_mib": round(last_ack, 2),
            "settled_mib": round(settled, 2),
        }
        return samples, figures
    finally:
        _stop_consumers(works, acks, procs)


# -- a consumer (module level: spawn imports it by name) ---------------------------------------


def _parent_gone() -> bool:
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def consumer(system: str, work: Any, acks: Any, device: int | str, nbytes: int) -> None:
    """Get tensors from ``work`` until None: read each one's data pointer, check its size, drop it, ack.

    Every get is bounded (``POLL_S``, then the producer must still be alive; ``IDLE_TIMEOUT`` with
    no item at all); a failure is sent as ("error", text), which fails the producer's cell."""
    try:
        system_module(system)
        import torch

        _torch_device(torch, device)
    except BaseException as exc:
        acks.put(("error", f"{system} consumer setup failed: {type(exc).__name__}: {exc}"))
        return
    acks.put(("ready", os.getpid()))
    idle_since = time.monotonic()
    while True:
        try:
            tensor = work.get(timeout=POLL_S)
        except queue.Empty:
            if _parent_gone():
                return
            if time.monotonic() - idle_since > IDLE_TIMEOUT:
                acks.put(("error", f"{system} consumer: no item for {IDLE_TIMEOUT:g} s"))
                return
            continue
        except BaseException as exc:
            acks.put(("error", f"{system} consumer could not receive the tensor: {type(exc).__name__}: {exc}"))
            return
        if tensor is None:
            return
        try:
            _ = tensor.data_ptr()
            got = tensor.numel() * tensor.element_size()
            if got != nbytes:
                raise BenchError(f"a tensor of {got} bytes arrived; {nbytes} were sent")
        except BaseException as exc:
            acks.put(("error", f"{system} consumer failed: {type(exc).__name__}: {exc}"))
            return
        del tensor
        idle_since = time.monotonic()
        acks.put(1)
