"""``ring``: fan-out through a ring of pre-shared slots, one column per backend, to the Pipe floor."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ..consumers import _ring_consumer
from ..harness import _await_ready, _check_ack, _pipes_poll, _recv_pipe, _stop, _time_loop
from ..results import Scenario, _bind
from ..settings import (
    ACK_TIMEOUT,
    FLOOR_SCENARIO,
    HANDOFF_SHAPE,
    PIPE_FLOOR_SYSTEM,
    RING_SLOTS,
    RING_SPIN,
    RING_TARGETS,
    _gpushare,
)
from ..stats import Target

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("ring", "ring_roundtrip")
ROUNDTRIP = "ring_roundtrip"
#: ring_roundtrip's target for its spin columns: one round trip through shared memory.
SPIN_ROUNDTRIP_TARGET = Target("us_max", 10.0)

HOW = (
    f"`ring` is the same fan-out through a ring of pre-shared slots (`manager.ring(..., slots={RING_SLOTS}, "
    "consumers=N, backend=name)`, 1 MiB float32 slots, one column per backend), made once per cell and "
    "passed to each consumer as its Process argument (each unpickling registers one consumer). One iteration: "
    "`buf = ring.acquire()`, `ring.publish(buf)`, then one ack from every consumer on its own "
    "`multiprocessing.Pipe`, exactly like the Pipe floor's; each consumer `ring.get()`s the item, reads "
    "`item.ptr`, releases it and acks. Its ratios are therefore to the **Pipe** floor (first table), and "
    f"each row shows its target (1 consumer <= {RING_TARGETS['1'].limit:g}x the Pipe floor, 4 consumers <= "
    f"{RING_TARGETS['4'].limit:g} us, 8 consumers <= {RING_TARGETS['8'].limit:g} us) and whether each backend "
    'met it. The unmarked columns make the ring with the default `spin="auto"` (an end that waits '
    "busy-waits at most 50 us before it sleeps, and only while its previous wait was shorter than that); "
    f"the columns marked *spin* make it with `spin={RING_SPIN:g}` (both ends busy-wait on the shared memory "
    "that long before they sleep). Their acks still go through the Pipes.\n\n"
    "`ring_roundtrip` needs no Pipe: a 1-slot ring to N consumers, so each `ring.acquire()` waits until "
    "every consumer released the item published just before. One iteration: `ring.acquire()` (the previous "
    "item's releases), `ring.publish(buf)`; each consumer `ring.get()`s, reads `item.ptr` and releases, and "
    "never acks otherwise. It is the ring's fan-out with its own acks (the release words and eventfds), shown "
    "against the Pipe floor at the same N. The *spin* columns (`spin="
    f"{RING_SPIN:g}`) are judged: 1 consumer {SPIN_ROUNDTRIP_TARGET.text()}, and the fan-out targets above at "
    "4 and 8 consumers."
)


def plan(bench: Bench) -> None:
    _plan_fanout(bench)
    _plan_roundtrip(bench)


def _plan_fanout(bench: Bench) -> None:
    if not bench.add(
        Scenario(
            "ring",
            f"Ring fan-out: a {RING_SLOTS}-slot ring of 1 MiB buffers to N consumers, wait for every ack",
            "consumers",
            bench.rows(),
            floor=(FLOOR_SCENARIO, PIPE_FLOOR_SYSTEM),
            targets={row: target for row, target in RING_TARGETS.items() if row in bench.rows()},
        )
    ):
        return
    bench.scenarios["ring"].notes.append(
        f"gpushare columns: one per backend (`manager.ring(..., backend=name)`, {RING_SLOTS} slots, "
        "made once per cell). One iteration: `ring.acquire()`, `ring.publish()`, then one ack from "
        "every consumer on its own `multiprocessing.Pipe` (each consumer `ring.get()`, `item.ptr`, "
        "`item.release()`, then acks), so the floor is the Pipe floor: the same acks, with the "
        "small tuple sent down each Pipe instead of the ring's publish."
    )
    for n in bench.cfg.consumers:
        for label, backend, device, skip in bench.gs_columns():
            bench.task("ring", label, str(n), _bind(ring_fanout, bench, n, backend, device), skip)
        for label, backend, device, skip in bench.gs_columns():
            run = _bind(ring_fanout, bench, n, backend, device, RING_SPIN)
            bench.task("ring", f"{label} spin", str(n), run, skip)


def _plan_roundtrip(bench: Bench) -> None:
    columns = bench.gs_columns()
    spin_labels = [f"{label} spin" for label, _, _, _ in columns]
    rows = bench.rows()
    # 1 consumer: the round trip's own target; 4 and 8: the fan-out's.
    targets = {row: SPIN_ROUNDTRIP_TARGET if row == "1" else target for row, target in RING_TARGETS.items()}
    targets = {row: target for row, target in targets.items() if row in rows}
    if not bench.add(
        Scenario(
            ROUNDTRIP,
            "Ring round trip: a 1-slot ring to N consumers, acquire waits for every release (no Pipe)",
            "consumers",
            rows,
            floor=(FLOOR_SCENARIO, PIPE_FLOOR_SYSTEM),
            targets=targets,
            target_systems=spin_labels,
        )
    ):
        return
    for n in bench.cfg.consumers:
        for label, backend, device, skip in columns:
            bench.task(ROUNDTRIP, label, str(n), _bind(ring_roundtrip, bench, n, backend, device, "auto"), skip)
            run = _bind(ring_roundtrip, bench, n, backend, device, RING_SPIN)
            bench.task(ROUNDTRIP, f"{label} spin", str(n), run, skip)


def ring_roundtrip(bench: Bench, n: int, backend: str, device: int | str, spin: float | str) -> list[int]:
    """One iteration: acquire the only slot (every consumer released the last item), publish it."""
    import multiprocessing

    gpushare = _gpushare()
    m = bench.manager()
    ring = m.ring(HANDOFF_SHAPE, "float32", device=device, slots=1, consumers=n, backend=backend, spin=spin)
    pairs: list[tuple[Any, Any]] = []
    procs: list[Any] = []
    try:
        ctx = gpushare.get_context("spawn")
        pairs = [multiprocessing.get_context("spawn").Pipe() for _ in range(n)]
        mine = [a for a, _ in pairs]
        # checkpoints=(): a consumer acks nothing after "ready"; its release is the ack.
        procs = [ctx.Process(target=_ring_consumer, args=(ring, b, ()), daemon=True, device=device) for _, b in pairs]

        def send_stop() -> None:
            with contextlib.suppress(Exception):
                ring.close()
            for conn in mine:
                with contextlib.suppress(Exception):
                    conn.send(None)

        try:
            for p in procs:
                p.start()
            for _, b in pairs:
                b.close()
            _await_ready(_pipes_poll(mine), procs, n)

            def step(i: int) -> None:
                buf = ring.acquire(timeout=ACK_TIMEOUT)
                ring.publish(buf, timeout=ACK_TIMEOUT)

            return _time_loop(step, bench.cfg.warmup, bench.cfg.iters)
        finally:
            _stop(procs, send_stop)
    finally:
        with contextlib.suppress(Exception):
            ring.close()
        for a, b in pairs:
            for conn in (a, b):
                with contextlib.suppress(Exception):
                    conn.close()


def ring_fanout(bench: Bench, n: int, backend: str, device: int | str, spin: float | str = "auto") -> list[int]:
    """One iteration: acquire a slot, publish it to N consumers, wait for N acks (one Pipe each)."""
    import multiprocessing

    gpushare = _gpushare()
    m = bench.manager()
    cfg = bench.cfg
    # BackendUnavailableError here, before any consumer starts.
    ring = m.ring(HANDOFF_SHAPE, "float32", device=device, slots=RING_SLOTS, consumers=n, backend=backend, spin=spin)
    pairs: list[tuple[Any, Any]] = []
    procs: list[Any] = []
    try:
        ctx = gpushare.get_context("spawn")
        pairs = [multiprocessing.get_context("spawn").Pipe() for _ in range(n)]
        mine = [a for a, _ in pairs]
        procs = [ctx.Process(target=_ring_consumer, args=(ring, b, None), daemon=True, device=device) for _, b in pairs]

        def send_stop() -> None:
            with contextlib.suppress(Exception):
                ring.close()  # each consumer's get() raises RingClosedError
            for conn in mine:
                with contextlib.suppress(Exception):
                    conn.send(None)

        try:
            for p in procs:
                p.start()  # unpickling the ring in the child registers one consumer
            for _, b in pairs:
                b.close()  # the children hold their ends now
            _await_ready(_pipes_poll(mine), procs, n)

            def step(i: int) -> None:
                buf = ring.acquire(timeout=ACK_TIMEOUT)
                ring.publish(buf, timeout=ACK_TIMEOUT)
                for conn in mine:
                    _check_ack(_recv_pipe(conn, procs))

            return _time_loop(step, cfg.warmup, cfg.iters)
        finally:
            _stop(procs, send_stop)
    finally:
        with contextlib.suppress(Exception):
            ring.close()
        for a, b in pairs:
            for conn in (a, b):
                with contextlib.suppress(Exception):
                    conn.close()
