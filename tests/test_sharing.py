"""Buffers across real processes on the host backend: sharing, fan-out, leases, recycling.

Every worker is a spawned gpushare Process; every wait has a timeout and
the ``reap`` fixture kills survivors.
"""

from __future__ import annotations

import gc
import os
import pickle
import time

import numpy as np
import pytest
from conftest import wait_until

import gpushare as mp
from gpushare import _backends, _lifetime

# -- workers (module level: spawn pickles them by reference) -------------------------


def echo_sum(jobs, results) -> None:
    buf = jobs.get(timeout=30)
    results.put((os.getpid(), float(buf.numpy().astype(np.float64).sum()), buf.shape, str(buf.dtype)))
    buf.release()


def write_back(jobs, results) -> None:
    buf = jobs.get(timeout=30)
    seen = buf.numpy().copy()
    buf.copy_from(np.arange(buf.size, dtype=buf.dtype).reshape(buf.shape) * 2)
    results.put(seen)
    buf.release()
    results.put("released")


def hold_until_told(jobs, results, control) -> None:
    held = jobs.get(timeout=30)
    results.put(("holding", os.getpid()))
    control.get(timeout=60)
    held.release()


def count_opens(jobs, results, n) -> None:
    held = [jobs.get(timeout=30) for _ in range(n)]
    same = len({b.ptr for b in held}) == 1
    results.put((_backends.get("host").opens, same))
    for b in held:
        b.release()
    again = jobs.get(timeout=30)  # same allocation, recycled or re-sent
    results.put((_backends.get("host").opens, float(again.numpy()[0])))
    again.release()


def unpickle_bytes(data, results) -> None:
    try:
        buf = pickle.loads(data)
    except mp.GpushareError as exc:
        results.put((type(exc).__name__, str(exc)))
    else:
        results.put(("ok", float(buf.numpy().sum())))


def lambda_runner(results) -> None:
    results.put("unused")


# -- tests ----------------------------------------------------------------------------


def start(reap, target, *args, **kwargs):
    proc = mp.Process(target=target, args=args, **kwargs)
    proc.start()
    reap.append(proc)
    return proc


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


def test_buffer_as_process_argument_and_through_pipe(manager, reap) -> None:
    buf = manager.full((10,), 3, "int32", device="cpu")
    a, b = mp.Pipe()
    results = mp.Queue()
    q = mp.Queue()
    start(reap, echo_sum, q, results)
    a.send(buf)
    q.put(b.recv())  # received in this (owner) process, then sent on
    assert results.get(timeout=30)[1] == 30


def test_memory_outlives_owner_reference_while_leased(manager, reap) -> None:
    jobs, results, control = mp.Queue(), mp.Queue(), mp.Queue()
    start(reap, hold_until_told, jobs, results, control)
    buf = manager.full((8,), 1, device="cpu")
    jobs.put(buf)
    results.get(timeout=30)
    del buf
    gc.collect()
    stats = manager.stats()
    assert stats["live_buffers"] == 1 and stats["pooled_buffers"] == 0  # the lease pins it
    control.put("go")
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1, timeout=5)


def test_one_open_per_allocation_and_recycled_reuse(manager, reap) -> None:
    buf = manager.full((16,), 7, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    start(reap, count_opens, jobs, results, 10)
    for _ in range(10):
        jobs.put(buf)
    opens, same = results.get(timeout=30)
    assert opens == 1 and same
    wait_until(lambda: manager.stats()["leases"] == 0)
    del buf
    gc.collect()
    recycled = manager.full((16,), 9, device="cpu")  # same size class: the same allocation
    assert manager.stats()["reused"] == 1
    jobs.put(recycled)
    opens, first = results.get(timeout=30)
    assert opens == 1  # the worker's retained mapping served the recycled allocation
    assert first == 9


def test_descriptor_unpickled_twice_is_refused(manager, reap) -> None:
    buf = manager.full((4,), 1.0, device="cpu")
    data = pickle.dumps(buf)
    results = mp.Queue()
    start(reap, unpickle_bytes, data, results)
    assert results.get(timeout=30) == ("ok", 4.0)
    start(reap, unpickle_bytes, data, results)
    kind, message = results.get(timeout=30)
    assert kind == "DescriptorError" and "unpickled once" in message


def test_descriptor_from_a_closed_manager(reap) -> None:
    with mp.Manager(release_timeout=0.2) as m:
        data = pickle.dumps(m.zeros((4,), device="cpu"))
        with pytest.warns(mp.LeakWarning):
            m.shutdown()
    results = mp.Queue()
    start(reap, unpickle_bytes, data, results)
    kind, message = results.get(timeout=30)
    assert kind == "OwnerGoneError" and "exited or shut" in message


def test_wrong_authkey_is_refused(manager, reap) -> None:
    buf = manager.zeros((4,), device="cpu")
    desc = pickle.dumps(buf)
    results = mp.Queue()
    proc = mp.Process(target=unpickle_bytes, args=(desc, results))
    proc.authkey = b"not the manager's key"
    proc.start()
    reap.append(proc)
    kind, message = results.get(timeout=30)
    assert kind == "OwnerGoneError" and "authentication" in message
    assert manager.stats()["consumers"] == 0


def test_pool_map_over_buffers(manager) -> None:
    buf = manager.from_numpy(np.arange(40, dtype=np.int64).reshape(4, 10), device="cpu")
    with mp.Pool(2) as pool:
        sums = pool.map(_row_sum, [(r, buf) for r in range(4)])
    assert sums == [45, 145, 245, 345]
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=5)


def _row_sum(item) -> int:
    row, buf = item
    return int(buf.numpy()[row].sum())


def test_lambda_and_closure_targets(reap) -> None:
    results = mp.Queue()
    offset = 5
    proc = start(reap, lambda q: q.put(offset + 1), results)
    assert results.get(timeout=30) == 6
    proc.join(timeout=30)
    assert proc.exitcode == 0


def test_process_device_cpu_binds_host_backend(reap) -> None:
    results = mp.Queue()
    proc = start(reap, lambda q: q.put(os.environ.get("GPUSHARE_BACKEND")), results, device="cpu")
    assert proc.device == "cpu"
    assert results.get(timeout=30) == "host"


def test_fork_refused_after_cuda_init(monkeypatch) -> None:
    # Without a GPU CUDA cannot really be initialised here; the GPU suite checks
    # the real thing. This checks the refusal and its message.
    from gpushare import _process

    monkeypatch.setattr(_process, "cuda_initialized", lambda: True)
    proc = mp.get_context("fork").Process(target=print)
    with pytest.raises(mp.StartMethodError, match="spawn"):
        proc.start()


def test_fork_allowed_without_cuda(manager, reap) -> None:
    from gpushare._process import cuda_initialized

    if cuda_initialized():
        pytest.skip("CUDA is initialised in this test process (GPU machine); test_gpu checks the refusal")
    buf = manager.full((3,), 4, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    proc = mp.get_context("fork").Process(target=echo_sum, args=(jobs, results))
    proc.start()
    reap.append(proc)
    jobs.put(buf)
    assert results.get(timeout=30)[1] == 12


def test_link_stats_in_owner_process(manager) -> None:
    stats = _lifetime.link_stats()
    assert stats["owners"] == 0  # the owner maps nothing of its own through a link


def test_put_then_release_is_safe(manager, reap) -> None:
    # multiprocessing.Queue would pickle later, in a feeder thread, after release().
    buf = manager.full((4,), 2.0, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    start(reap, echo_sum, jobs, results)
    jobs.put(buf)
    buf.release()
    assert results.get(timeout=30)[1] == 8.0


def echo_items(jobs, results, count) -> None:
    for _ in range(count):
        item = jobs.get(timeout=30)
        if isinstance(item, mp.Buffer):
            item = ("buffer", float(item.numpy().sum()))
        results.put(item)


def test_items_shaped_like_a_queued_buffer_arrive_as_themselves(manager, reap) -> None:
    # A Buffer crosses a gpushare queue as its pickle, which get() reads without the
    # unpickler; bytes, and tuples of bytes, that look like that pickle (or are it)
    # must come out of get() as they went in.
    from gpushare._reduction import queue_pickle

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


def test_put_of_unpicklable_item_raises_in_caller() -> None:
    q = mp.Queue()
    with pytest.raises(Exception, match="pickle"):
        q.put(lambda: None)
    jq = mp.JoinableQueue()
    jq.put(1)
    assert jq.get(timeout=5) == 1
    jq.task_done()
    jq.join()


def unpickle_twice_and_touch(data, results) -> None:
    first = pickle.loads(data)  # claims the lease and maps the allocation
    try:
        pickle.loads(data)
    except mp.DescriptorError as exc:
        results.put(("same process", str(exc), float(first.numpy().sum())))
    first.release()
    time.sleep(0.5)  # the release reaches the owner; the mapping stays cached here
    stale = pickle.loads(data)  # mapping cached: claimed asynchronously, refused by the owner
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            stale.numpy()
        except mp.DescriptorError as exc:
            results.put(("refused", str(exc), None))
            return
        time.sleep(0.01)
    results.put(("accepted", None, None))


def test_a_descriptor_unpickled_twice_in_one_process(manager, reap) -> None:
    buf = manager.full((4,), 1.0, device="cpu")
    results = mp.Queue()
    start(reap, unpickle_twice_and_touch, pickle.dumps(buf), results)
    kind, message, first_sum = results.get(timeout=30)
    assert kind == "same process" and "unpickled once" in message
    assert first_sum == 4.0  # the legitimate copy is unaffected
    kind, message, _ = results.get(timeout=30)
    assert kind == "refused" and "unknown" in message
    wait_until(lambda: manager.stats()["leases"] == 0)
