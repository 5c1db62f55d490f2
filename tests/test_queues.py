"""Queue and JoinableQueue: buffers and ordinary items through gpushare's queues.

A buffer put on a queue is pickled in put(), in the caller (so releasing it
right after is safe), and travels as its descriptor; what ``get()`` returns
is the same memory. Also here: ``empty()`` and timeouts, a queue whose
creator exited (``get()`` ends with ``OwnerGoneError`` after every item the
creator put, and not while others still feed it), and on a GPU the stream
ordering a buffer carries (its consumer waits for the producer's kernel).

Every worker is a spawned gpushare Process; every wait has a timeout and
the ``reap`` fixture kills survivors.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import (
    GPU_TIMEOUT,
    assert_prompt,
    fill_behind_a_running_kernel,
    guarded,
    join_ok,
    kill_quietly,
    recv,
    require,
    start,
    start_guarded,
    subprocess_env,
    wait_until,
)
from workers import echo_sum

import gpushare as mp

T = 60  # seconds any single wait in a worker may take


# -- workers (module level: spawn pickles them by reference) ---------------------------


def write_back(jobs, results) -> None:
    buf = jobs.get(timeout=30)
    seen = buf.numpy().copy()
    buf.copy_from(np.arange(buf.size, dtype=buf.dtype).reshape(buf.shape) * 2)
    results.put(seen)
    buf.release()
    results.put("released")


def echo_items(jobs, results, count) -> None:
    for _ in range(count):
        item = jobs.get(timeout=30)
        if isinstance(item, mp.Buffer):
            item = ("buffer", float(item.numpy().sum()))
        results.put(item)


def w_drain(out, work, ready) -> None:
    ready.put("started")
    got = []
    try:
        while True:
            got.append(work.get(timeout=T))
    except mp.OwnerGoneError as exc:
        out.put(("drained", got, str(exc)))


def w_put_and_return(out, kind, n) -> None:
    """Puts n items on a queue its own consumer reads, then returns (exit runs its finalizers)."""
    work, ready = getattr(mp, kind)(), mp.Queue()
    consumer = mp.Process(target=guarded, args=(w_drain, out, work, ready))
    consumer.start()
    for i in range(n):
        work.put(("item", i))
    ready.get(timeout=T)  # a spawned child must have unpickled its queues before their creator goes
    out.put(("consumer", consumer.pid))


def w_feed_slowly(work, ready, n) -> None:
    ready.put("started")
    for i in range(n):
        time.sleep(0.05)
        work.put(("more", i))
    work.put(None)


def w_drain_until_none(out, work, ready) -> None:
    ready.put("started")
    got = []
    while (item := work.get(timeout=T)) is not None:
        got.append(item)
    out.put(("drained", got))


def w_put_start_feeder_and_return(out, n) -> None:
    """Puts one item, leaves a child feeding the same queue, and returns."""
    work, ready = mp.Queue(), mp.Queue()
    consumer = mp.Process(target=guarded, args=(w_drain_until_none, out, work, ready))
    consumer.start()
    work.put(("first", 0))
    ready.get(timeout=T)
    feeder = mp.Process(target=w_feed_slowly, args=(work, ready, n))
    feeder.start()
    ready.get(timeout=T)  # both children hold the queue before its creator returns
    out.put(("pids", consumer.pid, feeder.pid))


def _w_ordered_read(out: Any, q: Any, how: str) -> None:
    if how == "torch_dlpack":
        import torch

        torch.zeros(1, device="cuda")
    elif how == "cupy_cai":
        import cupy

        cupy.zeros(1)
    out.put(("ready",))
    buf = q.get(timeout=GPU_TIMEOUT)
    if how == "numpy":
        values = buf.numpy()
    elif how == "torch_dlpack":
        values = torch.from_dlpack(buf).cpu().numpy()  # its stream waits on the ready event
    else:
        values = cupy.asnumpy(cupy.asarray(buf))  # CAI v3: CuPy orders after the given stream
    out.put(("seen", float(values.min()), float(values.max())))
    buf.release()


# -- buffers through a queue -----------------------------------------------------------


def test_values_cross_both_ways(manager, reap) -> None:
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    buf = manager.from_numpy(src, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    start(reap, write_back, jobs, results)
    jobs.put(buf)
    np.testing.assert_array_equal(results.get(timeout=30), src)  # parent -> worker
    assert results.get(timeout=30) == "released"
    np.testing.assert_array_equal(buf.numpy(), src * 2)  # worker -> parent, same memory
    wait_until(lambda: manager.stats()["leases"] == 0)


def test_fan_out_to_four_workers(manager, reap) -> None:
    buf = manager.full((64, 3, 8, 8), 0.5, dtype="float16", device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    for _ in range(4):
        start(reap, echo_sum, jobs, results)
    for _ in range(4):
        jobs.put(buf)
    answers = [results.get(timeout=30) for _ in range(4)]
    assert len({pid for pid, *_ in answers}) == 4
    assert all(
        total == 0.5 * buf.size and shape == (64, 3, 8, 8) and dt == "float16" for _, total, shape, dt in answers
    )
    wait_until(lambda: manager.stats()["leases"] == 0)
    assert manager.stats()["bytes_allocated"] == mp.GRANULARITY  # one allocation, no copies


def test_put_then_release_is_safe(manager, reap) -> None:
    # multiprocessing.Queue would pickle later, in a feeder thread, after release().
    buf = manager.full((4,), 2.0, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    start(reap, echo_sum, jobs, results)
    jobs.put(buf)
    buf.release()
    assert results.get(timeout=30)[1] == 8.0


def test_items_shaped_like_a_queued_buffer_arrive_as_themselves(manager, reap) -> None:
    # A Buffer crosses a gpushare queue as its pickle, which get() reads without the
    # unpickler; bytes, and tuples of bytes, that look like that pickle (or are it)
    # must come out of get() as they went in.
    from gpushare._buffer import queue_pickle

    buf = manager.full((4,), 2.0, device="cpu")
    looks_like = queue_pickle(manager.full((4,), 1.0, device="cpu"))  # a real one, sent as bytes
    items = [
        looks_like,
        (looks_like,),
        looks_like[:-3] + b"\x85R.",
        b"\x80\x05" + b"\x85R.",
        ("buffer", 8.0),
    ]
    jobs, results = mp.Queue(), mp.Queue()
    start(reap, echo_items, jobs, results, len(items) + 1)
    for item in items[:-1]:
        jobs.put(item)
    jobs.put(buf)
    buf.release()
    assert [results.get(timeout=30) for _ in items] == items
    local = mp.Queue()  # and in the putting process
    local.put(looks_like)
    assert local.get(timeout=5) == looks_like


# -- items, empty() and timeouts -------------------------------------------------------


def test_put_of_unpicklable_item_raises_in_caller() -> None:
    q = mp.Queue()
    with pytest.raises(Exception, match="pickle"):
        q.put(threading.Lock())  # a lambda would go: the queue pickles as a Process's arguments are
    jq = mp.JoinableQueue()
    jq.put(1)
    assert jq.get(timeout=5) == 1
    jq.task_done()
    jq.join()


def test_queue_empty_while_another_thread_waits_in_get() -> None:
    # The queue polls its pipe with one poll object per process; a thread asking empty()
    # while another waits in get() polls it at the same time, which must still answer.
    q = mp.Queue()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(q.get(timeout=T)))
    waiter.start()
    for _ in range(300):
        assert q.empty()
        time.sleep(0.001)
    q.put("item")
    waiter.join(timeout=T)
    assert got == ["item"]


def test_queue_get_timeout_is_still_queue_empty() -> None:
    q = mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get(block=False)


def test_a_get_spins_before_it_sleeps_only_after_a_short_wait(monkeypatch) -> None:
    # A blocking get() looks at the ring, yielding the CPU, for at most SPIN_SECONDS before
    # it sleeps, and only when this handle's previous wait was shorter than that.
    from gpushare import _queues

    yields: list[int] = []
    monkeypatch.setattr(_queues.os, "sched_yield", lambda: yields.append(1), raising=False)
    q = mp.Queue()

    def get_after(delay: float) -> int:
        """get() an item another thread puts ``delay`` s later; how often the get yielded."""
        yields.clear()
        putter = threading.Timer(delay, q.put, args=("item",))
        putter.start()
        try:
            assert q.get(timeout=T) == "item"
        finally:
            putter.join(timeout=T)
        return len(yields)

    assert q._spin.seconds == _queues.SPIN_SECONDS
    q._spin.seconds = 0.01
    assert get_after(0.2) > 0  # the first wait spins, 10 ms, then sleeps
    assert get_after(0.2) == 0  # the last wait was longer than the spin: sleep at once
    q._spin.seconds = 1.0
    assert get_after(0.2) == 0  # still no spin, but this wait was shorter than 1 s...
    assert get_after(0.2) > 0  # ...so the next one spins again
    with pytest.raises(queue.Empty):  # a timeout shorter than the spin still holds
        started = time.monotonic()
        q.get(timeout=0.05)
    assert_prompt(time.monotonic() - started, 0.5, "get(timeout=0.05) with a 1 s spin", cap=0.9)
    q._spin.seconds = 0.01
    with pytest.raises(queue.Empty):  # a timeout longer than the spin is a long wait too
        q.get(timeout=0.05)
    for _ in range(10):  # long waits in a row: none spins
        assert get_after(0.05) == 0


# -- a queue whose creator exited ------------------------------------------------------


@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue"])
def test_a_queue_ends_after_everything_its_exited_creator_put(reap, kind) -> None:
    out = mp.Queue()
    producer = start_guarded(reap, w_put_and_return, out, kind, 3)
    _, consumer_pid = recv(out)
    try:
        producer.join(timeout=T)
        assert producer.exitcode == 0  # it did not hang at exit joining its consumer
        _, got, message = recv(out)
        assert got == [("item", 0), ("item", 1), ("item", 2)]
        assert f"pid {producer.pid}" in message and "exited" in message
    finally:
        kill_quietly(consumer_pid)


def test_a_queue_still_fed_by_others_outlives_its_exited_creator(reap) -> None:
    # The creator's end-of-queue marker must not cut off items that other living
    # processes keep putting (the drop-in promise for multi-producer queues).
    out = mp.Queue()
    creator = start_guarded(reap, w_put_start_feeder_and_return, out, 20)
    _, consumer_pid, feeder_pid = recv(out, waiting_for="the creator")
    try:
        creator.join(timeout=T)  # it exits (joining its children) while the feeder still puts
        assert creator.exitcode == 0
        _, got = recv(out, waiting_for="the consumer")
        assert got == [("first", 0)] + [("more", i) for i in range(20)]
    finally:
        kill_quietly(consumer_pid)
        kill_quietly(feeder_pid)


# -- GPU: the consumer orders after the producer's stream ------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["numpy", "torch_dlpack", "cupy_cai"])
def test_consumer_waits_for_a_long_running_producer_kernel(
    manager: mp.BufferManager, reap: list[Any], how: str
) -> None:
    torch = require("torch")
    if how == "cupy_cai":
        require("cupy")
    q, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_ordered_read, out, q, how, device=0)
    assert recv(out, proc, timeout=120) == ("ready",)
    buf = manager.zeros((1 << 22,), "float32", device=0)
    t = torch.from_dlpack(buf)
    fill_behind_a_running_kernel(torch, t, 7.0)  # still running at put() time
    q.put(buf)  # no synchronize: the ready event recorded at pickling carries the ordering
    tag, low, high = recv(out, proc, timeout=60)
    assert tag == "seen"
    assert (low, high) == (7.0, 7.0), f"consumer read before the producer's kernel finished ({how})"
    del t
    join_ok(proc, timeout=GPU_TIMEOUT)


# -- the shared-memory ring: bounds, overflow, large messages, lifecycle -----------------


def w_put_range(q, start, stop, size) -> None:
    for i in range(start, stop):
        q.put((i, b"y" * size))


def w_get_n(q, out, n) -> None:
    out.put([q.get(timeout=T)[0] for _ in range(n)])


def w_task_done_all(q, n) -> None:
    for _ in range(n):
        q.get(timeout=T)
        time.sleep(0.01)
        q.task_done()


def test_maxsize_blocks_and_times_out_like_the_stdlib() -> None:
    q = mp.Queue(2)
    q.put(1)
    q.put_nowait(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.05)
    with pytest.raises(queue.Full):
        q.put(3, block=False)
    assert q.get(timeout=5) == 1
    q.put(3, timeout=5)
    assert [q.get(timeout=5), q.get_nowait()] == [2, 3]
    assert q.empty() and not q.full()


def test_a_backlog_and_messages_larger_than_the_ring_arrive_in_order(reap) -> None:
    # 4 MiB of small items outgrow the 1 MiB ring (the producer's backlog thread writes
    # them as room frees); 2 MiB items spill past the ring. The child exits
    # after its last put: at exit it writes out its backlog, as multiprocessing's does.
    q, out = mp.Queue(), mp.Queue()
    small = 4000
    start(reap, w_put_range, q, 0, small, 1000)
    start(reap, w_get_n, q, out, small)
    assert out.get(timeout=T) == list(range(small))
    start(reap, w_put_range, q, 0, 3, 2 << 20)
    assert [q.get(timeout=T)[0] for _ in range(3)] == [0, 1, 2]
    local = mp.Queue()  # and in one process, mixed
    items = [(i, b"z" * (3 << 20 if i % 50 == 0 else 500)) for i in range(3000)]
    for item in items:
        local.put(item)
    assert [local.get(timeout=T) for _ in items] == items


_SPILL_CHILD = """
import os, gpushare as mp
q = mp.Queue()
q.put(b"x" * (8 << 20))  # spilled, never read
paths = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        paths.add(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
with open("/proc/self/maps") as maps:
    paths.update(line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6)
print(os.getpid(), sorted(p for p in paths if p.startswith("/dev/shm/")))
"""


def test_a_spilled_item_lives_in_the_queues_own_memory_and_goes_once_read(reap) -> None:
    from gpushare import _queues

    def allocated(q) -> int:
        return os.fstat(q._region.fd).st_blocks * 512

    q = mp.Queue()
    ring = allocated(q)
    big = bytes(range(256)) * (12 << 12)  # 12 MiB, over a quarter of the ring
    q.put(big)
    q.put(big[::-1])
    assert allocated(q) >= ring + 2 * len(big)
    assert q.get(timeout=5) == big
    assert q.get(timeout=5) == big[::-1]
    assert allocated(q) <= ring + 2 * _queues.PAGE  # punched out once read
    # Never read: gone with the queue, as the ring is (no file of its own anywhere). The
    # child reports every /dev/shm file it holds open or mapped while the item waits: files
    # other processes make there at the same time (pytest-xdist workers, the chaos tests'
    # killed processes) cannot be told apart by name, so the directory alone cannot say.
    before = set(os.listdir("/dev/shm"))
    command = [sys.executable, "-c", _SPILL_CHILD]
    child = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    pid, held = child.stdout.split(None, 1)
    assert held.strip() == "[]", f"the queue's child held files in /dev/shm: {held.strip()}"
    left = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("gpushare-") and f"-{pid}-" in n]
    assert left == []


def test_several_producers_and_consumers_get_each_item_once(reap) -> None:
    q, out = mp.Queue(), mp.Queue()
    for k in range(3):
        start(reap, w_put_range, q, k * 1000, (k + 1) * 1000, 100)
    for _ in range(3):
        start(reap, w_get_n, q, out, 1000)
    got = [out.get(timeout=T) for _ in range(3)]
    assert sorted(i for part in got for i in part) == list(range(3000))
    for part in got:  # each producer's items stay in its order
        for k in range(3):
            mine = [i for i in part if k * 1000 <= i < (k + 1) * 1000]
            assert mine == sorted(mine)


def test_joinable_queue_join_waits_for_every_task_done(reap) -> None:
    q = mp.JoinableQueue()
    for i in range(20):
        q.put(i)
    start(reap, w_task_done_all, q, 20)
    q.join()
    assert q.empty()
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()


def test_close_join_thread_and_cancel_join_thread() -> None:
    q = mp.Queue()
    with pytest.raises(AssertionError):
        q.join_thread()
    q.put(1)
    q.close()
    q.join_thread()
    with pytest.raises(ValueError, match="is closed"):
        q.put(2)
    with pytest.raises(ValueError, match="is closed"):
        q.get()
    r = mp.Queue()
    r.cancel_join_thread()
    r.close()
    r.join_thread()


def test_a_queue_is_shared_only_by_inheritance() -> None:
    import pickle

    with pytest.raises(RuntimeError, match="inheritance"):
        pickle.dumps(mp.Queue())


def w_carry_by(method, report) -> None:
    """Start a child by ``method`` that gets two items from an inherited Queue; report them."""
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    q.put((0, b""))
    proc = ctx.Process(target=w_get_n, args=(q, out, 2))
    proc.start()
    q.put((1, b""))
    report.put(out.get(timeout=T))
    proc.join(T)


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_every_start_method_carries_the_queue(reap, method) -> None:
    # From a fresh spawned process: this one may have initialised CUDA (a GPU run), and
    # gpushare refuses to fork after that (test_process_args.py).
    report = mp.Queue()
    driver = mp.get_context("spawn").Process(target=w_carry_by, args=(method, report))
    driver.start()
    reap.append(driver)
    assert report.get(timeout=T) == [0, 1]
    join_ok(driver)


def test_a_collected_queue_gives_its_file_descriptors_back() -> None:
    import gc

    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        q = mp.Queue()
        q.put(i)
        assert q.get(timeout=5) == i
        del q
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
