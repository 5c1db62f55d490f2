"""Shares in flight when a Manager shuts down are delivered.

A producer puts a buffer for each waiting worker and leaves its ``with mp.Manager()`` block at
once: every worker still claims and reads its buffer, and the shutdown returns as soon as they
let go, with no leak reported. A worker that comes after the shutdown's bound
(``release_timeout``) gets an error that says the share was not claimed in time.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import BACKENDS, subprocess_env

SCRIPT = """
import sys, time
import numpy as np
import gpushare as mp

def work(q, out, delay):
    time.sleep(delay)
    try:
        buf = q.get(timeout=60)  # claims the share
        out.put(float(buf.numpy().sum()))
        buf.release()
    except mp.OwnerGoneError as exc:
        out.put(str(exc))

if __name__ == "__main__":
    backend, delay, timeout = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    device = "cpu" if backend == "host" else 0
    q, out = mp.Queue(), mp.Queue()
    workers = [mp.Process(target=work, args=(q, out, delay), device=device) for _ in range(3)]
    for w in workers:
        w.start()
    started = time.monotonic()
    with mp.Manager(release_timeout=timeout) as manager:
        ones = np.ones(1024, dtype=np.float32)
        buf = manager.from_numpy(ones, device=device, backend=None if backend == "host" else backend)
        for _ in workers:
            q.put(buf)  # then the block ends at once
    print("shutdown", time.monotonic() - started, flush=True)
    for _ in workers:
        print("got", out.get(timeout=60), flush=True)
    for w in workers:
        w.join(60)
"""


def _run_producer(backend: str, delay: float, timeout: float) -> tuple[float, list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, backend, str(delay), str(timeout)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    shutdown = float(next(line for line in lines if line.startswith("shutdown")).split()[1])
    got = [line.split(" ", 1)[1] for line in lines if line.startswith("got")]
    return shutdown, got, done.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_put_just_before_a_shutdown_are_delivered(backend) -> None:
    shutdown, got, stderr = _run_producer(backend, 0.0, 30.0)
    assert got == ["1024.0"] * 3, got
    assert shutdown < 20, shutdown  # as soon as the workers let go, not the whole 30 s
    assert "LeakWarning" not in stderr and "leaked" not in stderr, stderr[-3000:]


def test_a_share_claimed_after_the_bound_says_it_came_too_late() -> None:
    shutdown, got, _ = _run_producer("host", 3.0, 0.5)
    assert shutdown < 3.0, shutdown
    assert len(got) == 3
    for message in got:
        assert "before this process claimed the buffer it received" in message, message
