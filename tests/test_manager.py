"""The Manager: allocation, pooling and recycling, trim, limits, leases, shutdown, owner modes, stats.

What a BufferManager does with the memory it owns (host backend unless
marked ``gpu``): allocations round up to 2 MiB; a buffer no one holds goes
back to a size-class pool and the next allocation of that size reuses it; a
lease pins its memory; ``trim()`` frees the pool, ``pool_limit`` bounds it,
and running out of memory empties it before raising; ``shutdown()`` frees
what it can and leaves this process's own buffers valid; ``owner="server"``
moves the memory into the Manager's server process. What happens when a
process dies holding buffers is in test_faults.py; the backend contract,
trim with live workers included, in test_backends.py.

Every worker is a spawned gpushare Process; every wait has a timeout and
the ``reap`` fixture kills survivors.
"""

from __future__ import annotations

import gc
import os
import pickle
import time
import warnings
from typing import Any

import numpy as np
import pytest
from conftest import (
    BACKENDS,
    GPU_TIMEOUT,
    MiB,
    device_for,
    join_ok,
    recv,
    run_guarded,
    start,
    start_guarded,
    subprocess_env,
    wait_until,
)
from workers import total, w_hold_until_told, w_sum_each

import gpushare as mp
from gpushare import _cuda, _lifetime
from gpushare._service import process_alive

N = 1024  # float32 elements per test buffer


# -- workers and helpers ---------------------------------------------------------------


def hold_buffer_until_told(jobs, results, control) -> None:
    held = jobs.get(timeout=30)
    results.put(("holding", os.getpid()))
    control.get(timeout=60)
    held.release()


def _w_map_until_none(out: Any, q: Any) -> None:
    """Map each buffer sent, read its first elements, release it; stop at None."""
    while True:
        buf = q.get(timeout=GPU_TIMEOUT)
        if buf is None:
            out.put(("bye",))
            return
        _, size = _cuda.address_range(buf.ptr, buf.device)
        head = buf.view(shape=(4,))
        first = head.numpy().tolist()
        head.release()
        buf.release()
        out.put(("mapped", size, first))


def more_than_there_is(device: int | str) -> int:
    """Bytes that cannot fit: the device's whole memory, or all of /dev/shm, plus 1 GiB."""
    if device == "cpu":
        fs = os.statvfs("/dev/shm")
        return fs.f_frsize * fs.f_blocks + (1 << 30)
    from gpushare import _cuda

    return _cuda.device_total_memory(int(device)) + (1 << 30)


# -- allocation ------------------------------------------------------------------------


def test_sizes_over_2mib_round_up(manager: mp.BufferManager) -> None:
    manager.empty((3 << 20,), "uint8", device="cpu")
    assert manager.stats()["bytes_allocated"] == 4 << 20


def test_huge_shape_fails_before_touching_any_device(manager) -> None:
    with pytest.raises(mp.OutOfMemoryError, match="more than any device"):
        manager.empty((1 << 40, 1 << 20), "float64", device="cpu")
    assert manager.stats()["bytes_allocated"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_memory_is_a_memory_error_and_loses_nothing(manager, reap, backend) -> None:
    device = device_for(backend)
    held = manager.full((600_000,), 4.0, "float32", device=device, backend=backend)
    jobs = mp.Queue()
    out = run_guarded(reap, w_sum_each, jobs, 3, device=device)
    jobs.put(held)  # the worker is up (its CUDA context made) before memory runs out
    assert recv(out) == ("sum", 2_400_000.0)
    pooled = manager.full((16,), 1.0, "float32", device=device, backend=backend)  # another size class
    pooled.release()  # one unused allocation in the pool
    wait_until(lambda: manager.stats()["leases"] == 0)
    before = manager.stats()
    assert before["pooled_buffers"] == 1 and before["live_buffers"] == 1
    with pytest.raises(mp.OutOfMemoryError) as info:
        manager.buffer(more_than_there_is(device), device=device, backend=backend)
    assert isinstance(info.value, MemoryError)
    if backend != "host":
        assert isinstance(info.value, mp.CUDAOutOfMemoryError) and isinstance(info.value, mp.CUDAError)
    after = manager.stats()
    # The pool was emptied to make room (and the retry still failed); nothing else moved.
    assert after["pooled_buffers"] == 0 and after["live_buffers"] == 1
    assert after["leases"] == 0 and after["leaked_buffers"] == 0
    jobs.put(held)  # the buffer in use is untouched and still shares
    assert recv(out) == ("sum", 2_400_000.0)
    again = manager.full((16,), 5.0, "float32", device=device, backend=backend)
    jobs.put(again)
    assert recv(out) == ("sum", 80.0)
    wait_until(lambda: manager.stats()["leases"] == 0)


# -- pooling, recycling, trim, limits --------------------------------------------------


def test_garbage_collection_recycles(manager: mp.BufferManager) -> None:
    buf = manager.empty((10,), device="cpu")
    del buf
    gc.collect()
    stats = manager.stats()
    assert stats["live_buffers"] == 0 and stats["pooled_buffers"] == 1
    again = manager.empty((20,), device="cpu")  # same size class: reused
    assert manager.stats()["reused"] == 1
    assert again.shape == (20,)


def test_memory_outlives_owner_reference_while_leased(manager, reap) -> None:
    jobs, results, control = mp.Queue(), mp.Queue(), mp.Queue()
    start(reap, hold_buffer_until_told, jobs, results, control)
    buf = manager.full((8,), 1, device="cpu")
    jobs.put(buf)
    results.get(timeout=30)
    del buf
    gc.collect()
    stats = manager.stats()
    assert stats["live_buffers"] == 1 and stats["pooled_buffers"] == 0  # the lease pins it
    control.put("go")
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1, timeout=5)


def test_trim_frees_pool(manager: mp.BufferManager) -> None:
    for _ in range(3):
        manager.empty((3 << 20,), "uint8", device="cpu").release()
    assert manager.stats()["bytes_pooled"] == 4 << 20
    assert manager.trim() == 4 << 20
    assert manager.stats()["bytes_allocated"] == 0


def _w_scratch(allocator: Any, out: Any, transient: bool) -> None:
    """A worker's scratch memory: allocated from another process's owner, written, released."""
    buf = allocator.empty((3 << 20,), "uint8", "cpu", transient=transient)
    buf.numpy()[:] = 7
    buf.release()
    allocator.released_transient()  # the owner reads this process's releases now
    out.put("released")


@pytest.mark.parametrize("owner", ["process", "server"])
def test_transient_allocations_are_freed_not_pooled(owner: str, reap: list[Any]) -> None:
    """An allocation asked for as transient (a loader worker's first-batch scratch) is freed
    once unused instead of waiting in the pool for a request of its size that never comes;
    an ordinary one is pooled. From another process (an alloc request) and in the owner's own."""
    with mp.Manager(owner=owner) as m:
        allocator = m.allocator()
        for transient in (False, True):
            out = mp.Queue()
            proc = start(reap, _w_scratch, allocator, out, transient)
            assert out.get(timeout=30) == "released"
            join_ok(proc)
            if transient:
                wait_until(lambda: m.stats()["bytes_allocated"] == 0, timeout=2)
                assert m.stats()["pooled_buffers"] == 0
            else:
                wait_until(lambda: m.stats()["pooled_buffers"] == 1, timeout=5)
                assert m.stats()["bytes_pooled"] == 4 << 20
                assert m.trim() == 4 << 20
        # This process: the owner's own (owner="process"), or a client of the server's.
        mine = allocator.empty((1 << 20,), "uint8", "cpu", transient=True)
        assert m.stats()["live_buffers"] == 1
        mine.release()
        allocator.released_transient()
        wait_until(lambda: m.stats()["bytes_allocated"] == 0, timeout=2)
        assert m.stats()["pooled_buffers"] == 0


def test_pool_limit_is_enforced(tmp_path) -> None:
    with mp.Manager(pool_limit=2 << 20) as m:
        bufs = [m.empty((1,), "uint8", device="cpu") for _ in range(4)]
        del bufs
        gc.collect()
        # Over the limit, the oldest are taken out of the pool under the lock
        # and freed after it: bytes_pooled falls first, bytes_allocated when
        # the frees are done. Wait for the end state, not for the first step.
        wait_until(lambda: m.stats()["bytes_allocated"] == 2 << 20, timeout=5)
        assert m.stats()["bytes_pooled"] == 2 << 20


@pytest.mark.gpu
def test_device_memory_back_to_baseline(manager: mp.BufferManager, reap: list[Any]) -> None:
    # The baseline is taken with the worker running and CUDA (context, IPC
    # open, copies) already initialised in both processes by a small buffer
    # that stays alive to the end, so only the 256 MiB buffer is measured.
    q, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_map_until_none, out, q, device=0)
    warm = manager.full((16,), 1.0, dtype="float32", device=0)
    q.put(warm)
    assert recv(out, proc, timeout=60) == ("mapped", 2 * MiB, [1.0] * 4)
    baseline = _cuda.mem_info(0)[0]

    big = manager.full((64, 1024, 1024), 2.0, dtype="float32", device=0)  # 256 MiB
    assert big.nbytes == 256 * MiB
    assert baseline - _cuda.mem_info(0)[0] >= 248 * MiB
    q.put(big)
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("mapped", 256 * MiB, [2.0] * 4)
    big.release()
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    wait_until(lambda: manager.stats()["bytes_pooled"] == 256 * MiB, timeout=10)
    assert manager.trim() == 256 * MiB  # the worker unmapped it when asked, then it was freed
    stats = manager.stats()
    assert stats["bytes_pooled"] == 0 and stats["leaked_buffers"] == 0
    wait_until(lambda: _cuda.mem_info(0)[0] >= baseline - 8 * MiB, timeout=10)

    q.put(None)  # the worker was part of the baseline: stop it only now
    assert recv(out, proc, timeout=GPU_TIMEOUT) == ("bye",)
    join_ok(proc, timeout=GPU_TIMEOUT)
    np.testing.assert_array_equal(warm.numpy(), np.ones(16, np.float32))


# -- shutdown, owner modes, stats ------------------------------------------------------


def test_shutdown_keeps_owner_buffers_valid_until_dropped() -> None:
    m = mp.Manager()
    buf = m.full((4,), 2, "int32", device="cpu")
    pooled = m.zeros((4,), device="cpu")
    pooled.release()
    m.shutdown()
    with pytest.raises(mp.ManagerClosedError):
        m.empty((2,), device="cpu")
    with pytest.raises(mp.ManagerClosedError, match="shutting down"):
        pickle.dumps(buf)
    # Still this process's memory: libraries holding views of it stay valid.
    np.testing.assert_array_equal(buf.numpy(), [2, 2, 2, 2])
    stats = m.stats()
    assert stats["closed"] is True and stats["bytes_allocated"] == mp.GRANULARITY  # the pooled one is freed
    buf.release()
    assert m.stats()["bytes_allocated"] == 0


def test_shutdown_waits_for_no_buffer_received_in_its_own_process(reap) -> None:
    """A buffer put on a queue and got back in the Manager's own process (a lease claimed here)
    neither delays shutdown nor counts as a leak: like the owner's own buffers, it stays valid
    until dropped, and its memory is freed then."""
    m = mp.Manager(release_timeout=5.0)
    q = mp.Queue()
    buf = m.full((4,), 3, "int32", device="cpu")
    q.put(buf)
    got = q.get(timeout=10)
    again = pickle.loads(pickle.dumps(buf))  # a second lease claimed here, on the same memory
    buf.release()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        m.shutdown()
        assert time.monotonic() - started < 2.0  # the 5 s release_timeout is not waited
    assert not [w for w in caught if issubclass(w.category, mp.LeakWarning)], [str(w.message) for w in caught]
    np.testing.assert_array_equal(got.numpy(), [3, 3, 3, 3])
    assert m.stats()["bytes_allocated"] == mp.GRANULARITY
    got.release()
    assert m.stats()["bytes_allocated"] == mp.GRANULARITY  # the second lease still holds it
    np.testing.assert_array_equal(again.numpy(), [3, 3, 3, 3])
    again.release()
    assert m.stats()["bytes_allocated"] == 0


def test_unstarted_manager() -> None:
    with pytest.raises(mp.ManagerClosedError, match="not started"):
        mp.BufferManager().empty((2,), device="cpu")


def test_server_mode_manager_api(reap) -> None:
    with mp.Manager(owner="server", release_timeout=0.5) as m:
        assert m.owner == "server"
        buf = m.full((N,), 4.0, "float32", device="cpu")
        assert total(buf) == 4.0 * N
        stats = m.stats()
        assert stats["live_buffers"] == 1 and stats["leases"] == 1 and stats["consumer_pids"] == [os.getpid()]
        jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
        start_guarded(reap, w_hold_until_told, out, jobs, control)
        jobs.put(buf)
        assert recv(out) == ("holding", 4.0 * N)
        buf.release()
        wait_until(lambda: m.stats()["leases"] == 1)  # the worker's
        control.put("go")
        assert recv(out) == ("after", 4.0 * N)
        assert recv(out) == ("released",)
        wait_until(lambda: m.stats()["pooled_buffers"] == 1)
        assert m.trim() == mp.GRANULARITY
        kept = m.zeros((4,), "int64", device="cpu")
    with pytest.raises(mp.OwnerGoneError, match="Manager shut down"):
        kept.numpy()
    with pytest.raises(mp.ManagerClosedError, match="shut down"):
        m.empty((4,), device="cpu")


def test_a_dropped_server_owned_manager_keeps_its_memory_while_buffers_are_held(reap) -> None:
    """Collected without shutdown(), a server-owned Manager leaves its server running until
    the last buffer on its memory is released (here and in a worker); then the server exits."""
    m = mp.Manager(owner="server")
    buf = m.full((N,), 6.0, "float32", device="cpu")
    server = m._process.pid
    jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
    start_guarded(reap, w_hold_until_told, out, jobs, control)
    jobs.put(buf)
    assert recv(out) == ("holding", 6.0 * N)
    del m
    gc.collect()
    assert not any(p.pid == server for p in mp.active_children())  # not joined at this process's exit
    control.put("go")
    assert recv(out) == ("after", 6.0 * N)
    assert recv(out) == ("released",)
    assert process_alive(server, sentinel=False)
    assert total(buf) == 6.0 * N  # this process's buffer is a lease like the worker's
    buf.release()
    wait_until(lambda: not process_alive(server, sentinel=False), timeout=5.0)


def test_a_dropped_server_owned_manager_with_nothing_held_ends_its_server() -> None:
    m = mp.Manager(owner="server")
    m.full((N,), 1.0, "float32", device="cpu").release()
    server = m._process.pid
    del m
    gc.collect()
    wait_until(lambda: not process_alive(server, sentinel=False), timeout=2.0)


def test_owner_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="owner='thread'; valid: 'process', 'server'"):
        mp.BufferManager(owner="thread")


def test_link_stats_in_owner_process(manager) -> None:
    stats = _lifetime.link_stats()
    assert stats["owners"] == 0  # the owner maps nothing of its own through a link


def test_an_idle_record_its_sharer_still_holds_stays_open_until_it_lets_go() -> None:
    """The pool's rule for foreign memory (Owner.share_foreign): an unused transient record
    whose sharer still ``held`` its anchor is neither freed nor pooled, and a share revives
    it, as it revives one set aside that housekeeping has not yet taken; once taken to be
    freed, a record can no longer be revived."""
    from gpushare import _backends
    from gpushare._lifetime._records import AllocationPool, AllocRecord, OwnerState

    held = {"anchor"}
    pool = AllocationPool(OwnerState(), None)
    kicks = []
    pool.kick = lambda: kicks.append(1)
    record = AllocRecord(1, _backends.Allocation("host", 0, 4096, None, b"", native="anchor"), _backends.get("host"))
    record.transient = True
    record.held = lambda anchor: anchor in held
    pool.offer(record)
    assert pool.to_free() == [] and not kicks  # held: stays open, nothing to free
    assert pool.revive(record) and not pool.revive(record)  # a share takes it back once
    pool.offer(record)
    held.clear()
    assert pool.to_free() == [record]  # let go: freed by the next housekeeping round
    assert not pool.revive(record) and pool.to_free() == []
    record.held = None
    pool.offer(record)  # no way to tell: set aside to be freed once unused, as any transient record
    assert kicks and pool.revive(record)  # a share before housekeeping takes it back
    pool.offer(record)
    assert pool.to_free() == [record] and not record.pooled and not pool.revive(record)


_SHARED_MEMORY_THEN_FORKSERVER = """
import {package} as mp
from {package}.managers import SharedMemoryManager


def double(x):
    return x * 2


if __name__ == "__main__":
    with SharedMemoryManager() as smm:
        print(list(smm.ShareableList([1, 2, 3])))
    p = mp.get_context("forkserver").Process(target=double, args=(1,))
    p.start()
    p.join()
    print("exit", p.exitcode)
"""


@pytest.mark.parametrize("package", ["multiprocessing", "gpushare"])
def test_a_shared_memory_manager_then_a_forkserver_child_exits_quietly(tmp_path, package) -> None:
    """As multiprocessing does: nothing on stderr at exit (a strong reference to the main module once
    kept the manager alive past multiprocessing's own teardown, and its __del__ failed there)."""
    import subprocess
    import sys

    script = tmp_path / "smm.py"
    script.write_text(_SHARED_MEMORY_THEN_FORKSERVER.format(package=package))
    done = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[1, 2, 3]", "exit 0"]
    assert done.stderr == "", done.stderr
