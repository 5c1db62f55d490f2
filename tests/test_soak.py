"""Soak: many handoffs with fan-out and recycling, and nothing grows.

Four consumers each receive every buffer (fan-out through one queue per
consumer); the producer cycles through three buffers, rewrites each one
before every round (the consumers check the value, so a stale or recycled
view would show), and every 25th round swaps one buffer for a fresh
allocation from the pool. After a warm-up, the producer and every consumer
take a baseline; at the end they compare: open file descriptors, threads,
leases, live and pooled buffers, the consumers' cached mappings, and on a
GPU the device's free memory (cuMemGetInfo).

``--soak N`` sets the number of handoffs (default 2000 here and in CI; the
GPU run uses 100000), ``--soak-report PATH`` appends the figures as JSON.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback

import pytest
from conftest import BACKENDS, device_for, wait_until

import gpushare as mp
from gpushare import _lifetime

CONSUMERS = 4
BUFFERS = 3
SHAPE = (1 << 18,)  # float32: 1 MiB
SWAP_EVERY = 25  # rounds
WARMUP_ROUNDS = 50
T = 120


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def w_consume(out, jobs, acks) -> None:
    try:
        out.put(("started", os.getpid()))  # starts this queue's feeder thread before any baseline
        acks.put(True)
        while True:
            item = jobs.get(timeout=T)
            if item is None:
                return
            if item == "report":
                out.put(("report", os.getpid(), open_fds(), threading.active_count(),
                         _lifetime.link_stats()["open_mappings"]))  # fmt: skip
                continue
            expected, buf = item
            head = buf.view(shape=(4,))  # copy 16 bytes, not the whole buffer, off a GPU
            first = float(head.numpy().mean())
            head.release()
            buf.release()
            acks.put(first == expected)
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


def device_free(device: int | str) -> int | None:
    if device == "cpu":
        return None
    from gpushare import _cuda

    return _cuda.mem_info(int(device))[0]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("backend", BACKENDS)
def test_soak(request, reap, backend) -> None:
    handoffs = int(request.config.getoption("--soak"))
    rounds = max(handoffs // CONSUMERS, WARMUP_ROUNDS + 1)
    device = device_for(backend)
    out, acks = mp.Queue(), mp.Queue()
    jobs = [mp.Queue() for _ in range(CONSUMERS)]
    with mp.Manager(release_timeout=2.0) as m:
        procs = []
        for q in jobs:
            proc = mp.Process(target=w_consume, args=(out, q, acks), device=device)
            proc.start()
            reap.append(proc)
            procs.append(proc)
        for _ in procs:
            assert out.get(timeout=T)[0] == "started"
            assert acks.get(timeout=T) is True
        bufs = [m.empty(SHAPE, "float32", device=device, backend=backend) for _ in range(BUFFERS)]
        wrong = 0
        swaps = 0

        def reports() -> dict[int, tuple[int, int, int]]:
            for q in jobs:
                q.put("report")
            got = {}
            for _ in jobs:
                msg = out.get(timeout=T)
                if msg[0] == "error":
                    pytest.fail(f"consumer failed:\n{msg[1]}")
                got[msg[1]] = msg[2:]
            return got

        def snapshot() -> dict[str, object]:
            stats = m.stats()
            return {
                "fds": open_fds(),
                "threads": threading.active_count(),
                "thread_ids": {t.ident for t in threading.enumerate()},
                "device_free": device_free(device),
                "leases": stats["leases"],
                "live_buffers": stats["live_buffers"],
                "pooled_buffers": stats["pooled_buffers"],
                "bytes_allocated": stats["bytes_allocated"],
                "consumers": reports(),
            }

        started = time.monotonic()
        baseline: dict[str, object] = {}
        for r in range(rounds):
            if r == WARMUP_ROUNDS:
                baseline = snapshot()
                started = time.monotonic()
            i = r % BUFFERS
            if r % SWAP_EVERY == SWAP_EVERY - 1:
                bufs[i].release()  # back to the pool once the consumers' leases are gone ...
                bufs[i] = m.empty(SHAPE, "float32", device=device, backend=backend)  # ... or new memory
                swaps += 1
            value = float(r % 1000)
            bufs[i].fill(value)
            for q in jobs:
                q.put((value, bufs[i]))
            for _ in jobs:
                if not acks.get(timeout=T):
                    wrong += 1
        elapsed = time.monotonic() - started
        wait_until(lambda: m.stats()["leases"] == 0, timeout=10)
        final = snapshot()
        for q in jobs:
            q.put(None)
        for proc in procs:
            proc.join(timeout=T)
            assert proc.exitcode == 0

    timed = (rounds - WARMUP_ROUNDS) * CONSUMERS
    figures = {
        "backend": backend,
        "handoffs": rounds * CONSUMERS,
        "timed_handoffs": timed,
        "handoffs_per_s": round(timed / elapsed) if elapsed > 0 else None,
        "swaps": swaps,
        "wrong_values": wrong,
        "owner_fd_delta": final["fds"] - baseline["fds"],  # type: ignore[operator]
        "owner_thread_delta": final["threads"] - baseline["threads"],  # type: ignore[operator]
        # A thread of an earlier test (the VMM export thread ends after 2 s idle) may end during the soak, so
        # the count can fall; growth is a thread that the soak started and that is still running.
        "owner_new_threads": sorted(
            t.name
            for t in threading.enumerate()
            if t.ident not in baseline["thread_ids"]  # type: ignore[operator]
        ),
        "device_free_delta": (
            None if final["device_free"] is None else final["device_free"] - baseline["device_free"]  # type: ignore[operator]
        ),
        "leases_end": final["leases"],
        "live_buffers": (baseline["live_buffers"], final["live_buffers"]),
        "pooled_buffers": (baseline["pooled_buffers"], final["pooled_buffers"]),
        "bytes_allocated": (baseline["bytes_allocated"], final["bytes_allocated"]),
        "consumer_deltas": {
            str(pid): [a - b for a, b in zip(final["consumers"][pid], before, strict=True)]  # type: ignore[index]
            for pid, before in baseline["consumers"].items()  # type: ignore[attr-defined]
        },
    }
    print("soak", json.dumps(figures))
    path = request.config.getoption("--soak-report")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")

    assert wrong == 0, f"{wrong} consumers saw a stale value"
    assert figures["leases_end"] == 0
    assert figures["owner_fd_delta"] <= 0 and figures["owner_new_threads"] == [], figures
    assert baseline["live_buffers"] == final["live_buffers"] == BUFFERS
    assert final["bytes_allocated"] <= baseline["bytes_allocated"]  # type: ignore[operator]
    for pid, deltas in figures["consumer_deltas"].items():  # fds, threads, cached mappings
        assert deltas[0] == 0 and deltas[1] == 0, f"consumer {pid} grew: {deltas}"
        assert deltas[2] <= 0, f"consumer {pid} holds more mappings: {deltas}"
    if figures["device_free_delta"] is not None:
        assert abs(figures["device_free_delta"]) <= 2 << 20, figures
