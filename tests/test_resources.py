"""Everything that owns something gives it all back: one accounting test per owner.

Each owner -- a Manager (both owner modes), a ring, a tensor set, a trainer
whose weights live in one (``train_in_set``), a Queue, a Pool, a SlotLoader
and the torch DataLoader (persistent workers or not) -- is made,
used and dropped 20 times in this process, once ended explicitly
(``close()`` / ``with``) and once only dropped (the last reference goes).
Afterwards these are back to what they were before the first one:

* child processes (multiprocessing's own resource tracker aside);
* open file descriptors;
* threads;
* ``/dev/shm`` entries and gpushare's socket directories made by this process;
* device memory, on a GPU (every CUDA backend).

A buffer's Ray form is accounted the same way in ``test_ray.py`` (it needs
a Ray cluster). On the host backend this runs in CI; the CUDA backends run
on a GPU machine (``--require-gpu``).
"""

from __future__ import annotations

import gc
import glob
import os
import pickle
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import BACKENDS, device_for, wait_until

import gpushare as mp
from gpushare import _cuda

ROUNDS = 20


# -- what a process holds ----------------------------------------------------------------


def _services() -> set[int | None]:
    """multiprocessing's own helpers, one per process and kept for its life: the resource
    tracker, and the forkserver that loaders start their workers from (it is not any
    owner's: every loader of the process shares it)."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    return {
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
    }


def _children() -> list[int]:
    services = _services()
    pids = []
    for proc in mp.active_children():
        if proc.pid not in services:
            pids.append(proc.pid)
    # Children not started through multiprocessing (a Manager's server is one of its
    # processes), and the forkserver's children (loader workers forked from it) too.
    for parent in (os.getpid(), *(pid for pid in services if pid is not None)):
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                pids += [int(p) for p in f.read().split() if int(p) not in services]
        except OSError:
            pass
    return sorted(set(pids))


def _holdings(device: int | str) -> dict[str, Any]:
    me = os.getpid()
    held = {
        "children": _children(),
        "fds": _open_files(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "shm": sorted(glob.glob(f"/dev/shm/gpushare-{me}-*")),
        "sockets": sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"gpushare-*-{me}-*"))),
    }
    if isinstance(device, int):
        held["device_free"] = _cuda.mem_info(device)[0]
    return held


def _open_files() -> dict[tuple[int, int, int], str]:
    """This process's open fds, each as (fd, device, inode) -> what it is open on."""
    files = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            files[(fd, st.st_dev, st.st_ino)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # listdir's own fd, closed since
            pass
    return files


def _opened_since(baseline: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The fds open now that were not open (on the same file) at ``baseline``."""
    return [f"{key[0]}: {target}" for key, target in sorted(now["fds"].items()) if key not in baseline["fds"]]


def _back_to(baseline: dict[str, Any], device: int | str) -> Callable[[], bool]:
    """Whether everything the rounds since ``baseline`` made is given back: no fd they opened is
    open (an earlier test's fd that closes meanwhile is none of theirs), and every other holding
    is as it was."""

    def same() -> bool:
        gc.collect()
        now = _holdings(device)
        if isinstance(device, int):
            # The driver frees in 2 MiB steps and may keep one granule: tolerate it.
            if abs(now.pop("device_free") - baseline["device_free"]) > (2 << 20):
                return False
        if _opened_since(baseline, now):
            return False
        return all(now[k] == baseline[k] for k in now if k != "fds")

    return same


def _earlier_tests_settled(timeout: float) -> None:
    """Wait until loaders dropped by earlier tests in this process have stopped in the background
    (their owners' shutdown threads, then those owners' own threads), so the baseline holds none of
    it: otherwise it would end *above* what this test's rounds come back to."""

    def no_shutdowns() -> bool:
        gc.collect()
        return not any(t.name == "gpushare-loader-shutdown" for t in threading.enumerate())

    wait_until(no_shutdowns, timeout=timeout, interval=0.1)
    names = sorted(t.name for t in threading.enumerate())

    def steady() -> bool:
        nonlocal names
        time.sleep(0.3)
        now = sorted(t.name for t in threading.enumerate())
        same, names = now == names, now
        return same

    wait_until(steady, timeout=10, interval=0.0)


def account(
    make_and_use: Callable[[bool], None], device: int | str, timeout: float = 30.0, rounds: int = ROUNDS
) -> None:
    """Run ``make_and_use(close)`` ``rounds`` times with close=True, then with close=False;
    everything must come back each time (within ``timeout``). One round first, not
    counted: what a process makes once and keeps (multiprocessing's resource tracker
    and its pipe, the CUDA context, a lazily loaded module's state) is not a leak."""
    _earlier_tests_settled(timeout)
    before = _holdings(device)
    make_and_use(True)

    def settled() -> bool:  # the warm-up's processes and threads ended (its fds may stay)
        gc.collect()
        now = _holdings(device)
        return now["children"] == before["children"] and now["threads"] == before["threads"]

    for close in (True, False):
        wait_until(settled, timeout=timeout, interval=0.1)
        baseline = _holdings(device)
        for _ in range(rounds):
            make_and_use(close)
        same = _back_to(baseline, device)
        try:
            wait_until(same, timeout=timeout, interval=0.1)
        except BaseException:
            gc.collect()
            now = _holdings(device)
            diff = {k: (baseline.get(k), now[k]) for k in now if k != "fds" and baseline.get(k) != now[k]}
            opened = _opened_since(baseline, now)
            if opened:
                diff["fds opened and not closed"] = opened
            pytest.fail(f"close={close}: not given back after {rounds} rounds: {diff}")


# -- the owners ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("owner", ["process", "server"])
@pytest.mark.timeout(240)
def test_managers(backend: str, owner: str) -> None:
    device = device_for(backend)

    def once(close: bool) -> None:
        m = mp.Manager(owner=owner, release_timeout=2.0)
        buf = m.full((1024,), 3.0, device=device, backend=backend)
        twin = pickle.loads(pickle.dumps(buf))  # a lease, claimed here
        assert float(twin.numpy()[0]) == 3.0
        twin.release()
        buf.release()
        if close:
            m.shutdown()
        del m, buf, twin

    account(once, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rings(backend: str, manager: mp.BufferManager) -> None:
    device = device_for(backend)
    manager.empty((4,), device=device, backend=backend).release()  # the Manager's own first allocation

    def once(close: bool) -> None:
        ring = manager.ring((256,), "float32", device, slots=2, backend=backend)
        consumer = pickle.loads(pickle.dumps(ring))  # registers a consumer in this process
        buf = ring.acquire(timeout=10)
        ring.publish(buf, meta=1, timeout=10)
        item = consumer.get(timeout=10)
        assert item.meta == 1
        item.release()
        if close:
            consumer.close()
            ring.close()
        del ring, consumer, buf, item

    account(once, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_sets(backend: str, manager: mp.BufferManager) -> None:
    device = device_for(backend)
    manager.empty((4,), device=device, backend=backend).release()  # the Manager's own first allocation
    layout = {"w": ((256,), "float32"), "b": ((3,), "int64")}

    def once(close: bool) -> None:
        ts = manager.tensor_set(layout, versions=2, device=device, backend=backend)
        reader = pickle.loads(pickle.dumps(ts))  # registers a reader in this process
        ts.publish({"w": np.full(256, 1.0, "float32"), "b": np.arange(3)}, timeout=10)
        draft = ts.draft(timeout=10)  # filled in place and published: version 2
        draft["w"].copy_from(np.full(256, 2.0, "float32"))
        draft["b"].copy_from(np.arange(3))
        ts.publish(draft)
        ts.draft(timeout=10)  # dropped unpublished: its version comes back
        snap = reader.latest(timeout=10)
        assert snap.version == 2 and float(snap["w"].numpy()[0]) == 2.0
        snap.release()
        if close:
            reader.close()
            ts.close()
        del ts, reader, draft, snap

    account(once, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trainers_in_set(backend: str, manager: mp.BufferManager) -> None:
    """A trainer whose weights are a one-version set's (gpushare.torch.train_in_set), with an
    engine reader in this process: its parameters, the set and the reader give everything back,
    detached and closed or only dropped."""
    torch = pytest.importorskip("torch")
    from gpushare.torch import load_state_dict, state_dict_layout, train_in_set

    device = device_for(backend)
    where = "cpu" if device == "cpu" else f"cuda:{device}"
    manager.empty((4,), device=device, backend=backend).release()  # the Manager's own first allocation

    def once(close: bool) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8)).to(where)
        engine = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8)).to(where)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ts = manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device=device, backend=backend)
        reader = pickle.loads(pickle.dumps(ts))  # an engine, in this process
        weights = train_in_set(model, ts, timeout=10)
        model(torch.ones(4, 16, device=where)).sum().backward()
        with weights.update():
            optimizer.step()
        with reader.wait(newer_than=1, timeout=10) as snap:
            load_state_dict(engine, snap)
        assert torch.equal(engine[0].weight, model[0].weight.detach())
        if close:
            weights.close()
            reader.close()
            ts.close()
        del model, engine, optimizer, ts, reader, weights, snap

    account(once, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_queues(backend: str, manager: mp.BufferManager) -> None:
    device = device_for(backend)
    buf = manager.full((256,), 1.0, device=device, backend=backend)

    def once(close: bool) -> None:
        q = mp.Queue()
        q.put(buf)
        q.put({"n": 1})
        got = q.get(timeout=10)
        assert q.get(timeout=10) == {"n": 1}
        got.release()
        if close:
            q.close()
            q.join_thread()
        del q, got

    account(once, device)
    buf.release()


def _square(x: int) -> int:
    return x * x


def test_pools() -> None:
    def once(close: bool) -> None:
        if close:
            with mp.Pool(1) as pool:
                assert pool.map(_square, range(4)) == [0, 1, 4, 9]
            return
        pool = mp.Pool(1)
        assert pool.map(_square, range(4)) == [0, 1, 4, 9]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # "unclosed running multiprocessing pool"
            del pool
            gc.collect()

    account(once, "cpu")


class Arrays:
    """Sample i: a (2, 8) float32 array of i (module level: workers unpickle it)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((2, 8), i, np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
@pytest.mark.timeout(300)
def test_slot_loaders(backend: str, persistent: bool) -> None:
    device = device_for(backend)

    def once(close: bool) -> None:
        loader = mp.SlotLoader(
            Arrays(), batch_size=4, num_workers=1, slots=2, device=device, backend=backend, timeout=60,
            persistent_workers=persistent,
        )  # fmt: skip
        assert [float(b.numpy()[0, 0, 0]) for b in loader] == [0.0, 4.0]
        kept = next(iter(loader))  # a second epoch; a batch the loader handed out outlives it
        if close:
            loader.close()
        del loader
        gc.collect()
        assert float(kept.numpy()[0, 0, 0]) == 0.0
        del kept

    account(once, device, timeout=60)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
@pytest.mark.timeout(600)
def test_torch_data_loaders(backend: str, persistent: bool) -> None:
    torch = pytest.importorskip("torch")
    from gpushare.torch import DataLoader

    device = device_for(backend)

    def once(close: bool) -> None:
        loader = DataLoader(
            Arrays(), batch_size=4, num_workers=1, slots=2, device=device, backend=backend, timeout=60,
            persistent_workers=persistent,
        )  # fmt: skip
        sums = [float(b.sum()) for b in loader]
        assert sums == [float(torch.arange(4).sum() * 16), float(torch.arange(4, 8).sum() * 16)]
        kept = next(iter(loader))  # a second epoch; a batch the loader handed out outlives it
        if close:
            loader.close()
        del loader
        gc.collect()
        assert float(kept[0, 0, 0]) == 0.0
        del kept

    # On a GPU each round's workers import torch and make a CUDA context (seconds a round);
    # one leaked loader already shows (a child, its fds, 4 MiB of slots), so fewer rounds there.
    account(once, device, timeout=60, rounds=ROUNDS if backend == "host" else 4)
