"""Scripted regressions for what the chaos tests found (test_chaos.py, chaos_run.py).

Each test replays, step by step, a schedule under which the lifetime
protocol left something behind, and checks that nothing is left now.

1. A consumer kept its connection to an owner that was gone -- reader and
   writer threads, socket, journal and every cached mapping -- for as long
   as the consumer lived. A long-lived consumer of a producer that restarts
   thus gathered one dead connection per producer, and on a GPU the
   mappings pinned each dead producer's device memory (an imported
   allocation is freed only when every importer closed it).
2. A SIGKILLed ``owner="process"`` producer's host segments stayed in
   ``/dev/shm`` until the resource tracker exited, that is until the whole
   process tree ended: a producer restarted under a long-lived parent
   filled ``/dev/shm``.
3. A chaos run reported "left behind" for a segment and a socket directory
   that were there before it started: an earlier process, killed with its
   whole group, had left them, and a consumer of the run got the same pid
   (pids wrap at ``pid_max``). Leftovers are now what a run made, not every
   file that carries one of its pids.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from chaos import existing, leftovers, shm_segments, wait_for
from conftest import BACKENDS, device_for, guarded, recv

import gpushare as mp
from gpushare import _lifetime

T = 60
N = 1024


def links() -> dict:
    stats = _lifetime.link_stats()
    return {"owners": stats["owners"], "open_mappings": stats["open_mappings"], "threads": threading.active_count()}


def w_holder(out, jobs, control, release_first) -> None:
    """Takes a buffer; reports; waits for the owner's death; touches, releases, reports again."""
    out.put(("started", None))  # this queue's feeder thread runs from here on
    before = links()
    out.put(("before", before))
    buf = jobs.get(timeout=T)
    held = float(buf.numpy()[0])
    if release_first:
        buf.release()  # the mapping stays cached in this process
    out.put(("holding", held, links()))
    control.get(timeout=T)  # the producer is dead now
    touched = "released"
    if not release_first:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                buf.numpy()
            except mp.OwnerGoneError:
                touched = "OwnerGoneError"
                break
            time.sleep(0.02)
        buf.release()
    took = wait_for(lambda: links() == before, 5.0)  # the link's threads end a moment after it is dropped
    out.put(("after", touched, took, links()))


def w_allocate_and_send(out, jobs, backend) -> None:
    m = mp.Manager()
    buf = m.full((N,), 3.0, "float32", device=device_for(backend), backend=backend)
    jobs.put(buf)
    out.put(("sent", os.getpid()))
    time.sleep(T)  # the test kills this process


@pytest.mark.parametrize("release_first", [False, True], ids=["holding", "released"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_consumer_lets_go_of_a_dead_owner(reap, backend, release_first) -> None:
    device = device_for(backend)
    jobs, control, out, producer_out = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    consumer = mp.Process(target=guarded, args=(w_holder, out, jobs, control, release_first), device=device)
    consumer.start()
    reap.append(consumer)
    recv(out)
    _, before = recv(out)
    producer = mp.Process(target=guarded, args=(w_allocate_and_send, producer_out, jobs, backend), device=device)
    producer.start()
    reap.append(producer)
    _, pid = recv(producer_out)
    _, held, holding = recv(out)
    assert held == 3.0 and holding["owners"] == 1 and holding["open_mappings"] == 1
    os.kill(pid, signal.SIGKILL)
    producer.join(timeout=T)
    control.put("go")
    _, touched, took, after = recv(out)
    assert touched == ("released" if release_first else "OwnerGoneError")
    # The dead owner's connection, its threads and its mappings are all gone from the consumer.
    assert took is not None, f"the consumer still keeps the dead owner: {after}"
    assert after == before, (before, after)


def test_a_killed_owners_shared_memory_is_unlinked(reap) -> None:
    jobs, out, producer_out, control = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    consumer = mp.Process(target=guarded, args=(w_holder, out, jobs, control, False))
    consumer.start()
    reap.append(consumer)
    recv(out)
    recv(out)
    producer = mp.Process(target=guarded, args=(w_allocate_and_send, producer_out, jobs, "host"))
    producer.start()
    reap.append(producer)
    _, pid = recv(producer_out)
    recv(out)
    assert shm_segments([pid])  # the producer's segment, mapped by the consumer
    os.kill(pid, signal.SIGKILL)
    producer.join(timeout=T)
    # The Manager's server notices its parent died and unlinks what it left in /dev/shm.
    assert wait_for(lambda: not shm_segments([pid]), 5.0) is not None, shm_segments([pid])
    control.put("go")
    _, touched, _, _ = recv(out)
    assert touched == "OwnerGoneError"


def test_files_there_before_a_run_are_not_its_leftovers() -> None:
    """Regression 3: a stale segment and socket directory named for a pid the run reuses."""
    import tempfile

    proc = mp.Process(target=time.sleep, args=(0.1,))
    proc.start()
    pid = proc.pid
    proc.join(timeout=T)
    stale_shm = f"/dev/shm/gpushare-{pid}-stale-1"
    stale_dir = tempfile.mkdtemp(prefix=f"gpushare-owner-{pid}-")
    try:
        with open(stale_shm, "wb"):
            pass
        before = existing()
        assert stale_shm in before and stale_dir in before
        assert leftovers([pid]) == {"processes": [], "shm": [stale_shm], "socket_dirs": [stale_dir]}
        assert leftovers([pid], before) == {"processes": [], "shm": [], "socket_dirs": []}
        # What appears after the snapshot is still found.
        fresh = tempfile.mkdtemp(prefix=f"gpushare-ring-{pid}-")
        try:
            assert leftovers([pid], before)["socket_dirs"] == [fresh]
        finally:
            os.rmdir(fresh)
    finally:
        os.unlink(stale_shm)
        os.rmdir(stale_dir)
