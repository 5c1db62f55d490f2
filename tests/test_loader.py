"""SlotLoader: batches built by worker processes into pre-shared slots (host backend, real processes).

Every loader here has a ``timeout`` so a lost batch fails instead of
hanging; workers are joined (and terminated past a bound) when an epoch
ends, and the tests check that they are gone.

The PyTorch adapter (``gpushare.torch``) is tested in test_torch.py: it
needs torch at import, and every loader worker started here imports this
module to unpickle its dataset, which must not cost a torch import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, all_gone, no_leases, subprocess_env, wait_until

import gpushare as mp

# -- datasets (module level: spawn pickles them by reference) --------------------------------


class Squares:
    """Sample i: a (3, 4) float32 array full of i, the int i, and the string "s{i}"."""

    def __init__(self, n: int = 40, raise_at: int | None = None, kill_at: int | None = None) -> None:
        self.n, self.raise_at, self.kill_at = n, raise_at, kill_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int, str]:
        if i == self.raise_at:
            raise ValueError(f"sample {i} is broken")
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.full((3, 4), i, np.float32), i, f"s{i}"


class Sized:
    """Sample i: ``size[i]`` bytes (uint8), to test slots that are too small."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.sizes[i], i % 251, np.uint8)


class WhoAmI:
    """Sample i: the id of the worker that built it (set by ``tag_worker``)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        return int(os.environ["LOADER_TEST_WORKER"])


class ParentOf:
    """Sample i: the pid of the process the worker that built it was started from."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return os.getppid()


def tag_worker(worker: int) -> None:
    os.environ["LOADER_TEST_WORKER"] = str(worker)


Pair = namedtuple("Pair", ["image", "label"])


def pair_collate(samples: list[tuple[np.ndarray, int, str]], writer: mp.SlotWriter) -> Pair:
    """A collate that writes into the slot itself: images doubled, labels as int64."""
    images = writer.empty((len(samples), 3, 4), "float32")
    view = images.numpy()
    for row, (image, _, _) in enumerate(samples):
        view[row] = image * 2
    return Pair(images, np.array([label for _, label, _ in samples], np.int64))


def loader(dataset: object, manager: mp.BufferManager, **options: object) -> mp.SlotLoader:
    options.setdefault("batch_size", 4)
    options.setdefault("num_workers", 2)
    options.setdefault("slots", 2)
    return mp.SlotLoader(dataset, device="cpu", timeout=60, manager=manager, **options)  # type: ignore[arg-type]


# -- order, zero copy, bounded memory ------------------------------------------------------


def test_batches_come_in_order_as_views_of_a_bounded_set_of_slots(server: mp.BufferManager) -> None:
    data = loader(Squares(200), server, num_workers=3, slots=2)
    assert len(data) == 50
    epoch = iter(data)
    pids = epoch.worker_pids  # type: ignore[attr-defined]
    addresses = set()
    allocated = []
    labels_seen: list[int] = []
    for step, (images, labels, names) in enumerate(epoch):
        assert isinstance(images, mp.SlotArray) and images.shape == (4, 3, 4) and images.dtype == np.float32
        values = images.numpy()
        expected = list(range(4 * step, 4 * step + 4))
        assert labels.numpy().tolist() == expected
        assert (values == np.array(expected, np.float32)[:, None, None]).all()
        assert names == [f"s{i}" for i in expected]
        labels_seen += expected
        addresses.add(images.ptr)
        if step % 10 == 9:
            allocated.append(server.stats()["bytes_allocated"])
    assert labels_seen == list(range(200))
    # Every batch is a view of one of the 3 x 2 slots: nothing new is allocated per batch (the
    # memory can only fall: the scratch of the workers' first batches is freed when housekeeping runs).
    assert len(addresses) <= 6
    assert all(a <= allocated[0] for a in allocated), allocated
    del images, labels, values, epoch
    wait_until(lambda: all_gone(pids), timeout=15)
    wait_until(lambda: no_leases(server), timeout=10)


class Wide:
    """Sample i: 64 Ki float32 values equal to i, and i. A batch of 16: 4 MiB and 128 bytes."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(1 << 16, i, np.float32), i


def test_a_workers_slots_are_one_allocation_and_its_scratch_is_freed() -> None:
    """Without slot_bytes a worker lays its first batch out in scratch memory (one
    allocation per array) to size its slots: the Owner frees that memory once unused
    instead of pooling it for a size nobody asks for again, and the worker's slots are
    windows of one allocation, not one 2 MiB-rounded allocation each."""
    with mp.Manager(owner="server", release_timeout=2.0) as own:  # its own: nothing pooled by other tests
        _check_one_allocation_and_no_scratch(own)


def _check_one_allocation_and_no_scratch(server: mp.BufferManager) -> None:
    data = loader(Wide(), server, batch_size=16, num_workers=2, slots=3)
    epoch = iter(data)
    images, labels = next(epoch)
    assert images.numpy()[:, 0].tolist() == list(range(16)) and labels.numpy().tolist() == list(range(16))
    second = next(epoch)  # from the other worker: both rings made, both first batches' scratch released
    assert second[1].numpy().tolist() == list(range(16, 32))
    del second
    slot = data.stats()["slot_bytes"]
    assert slot == (4 << 20) + 256  # the labels start on the next 256-byte boundary
    # A slot starts every 64 KiB: 3 x (4 MiB + 64 KiB) = 12.2 MiB, rounded up to 14 MiB per worker,
    # where 3 allocations of 6 MiB each took 18, and the first batch's 4 + 2 MiB of scratch stayed pooled.
    per_worker = 14 << 20
    wait_until(lambda: server.stats()["pooled_buffers"] == 0 and server.stats()["live_buffers"] == 2, timeout=10)
    assert server.stats()["bytes_allocated"] == 2 * per_worker
    seen = [int(x) for x in labels.numpy()] + list(range(16, 32))
    del images, labels
    for images, labels in epoch:
        seen += [int(x) for x in labels.numpy()]
        assert (images.numpy()[:, 0] == labels.numpy()).all()
    assert seen == list(range(64))
    assert server.stats()["bytes_allocated"] == 2 * per_worker  # nothing allocated per batch
    del images, labels, epoch
    wait_until(lambda: no_leases(server), timeout=10)


def test_collate_writes_into_the_slot_and_structures_come_back(server: mp.BufferManager) -> None:
    data = loader(Squares(12), server, collate=pair_collate, slot_bytes=4096)
    batches = [(b.image.numpy().copy(), b.label.numpy().copy(), type(b).__name__) for b in data]
    assert [name for _, _, name in batches] == ["Pair"] * 3
    for step, (image, label, _) in enumerate(batches):
        assert label.dtype == np.int64 and label.tolist() == list(range(4 * step, 4 * step + 4))
        assert (image[:, 0, 0] == 2 * label).all()


def test_workers_take_batches_round_robin_and_run_worker_init(server: mp.BufferManager) -> None:
    data = loader(WhoAmI(), server, num_workers=3, worker_init=tag_worker)
    workers = [batch.numpy().tolist() for batch in data]
    assert workers == [[step % 3] * 4 for step in range(6)]


def test_shuffle_visits_every_index_once_and_drop_last_drops_the_tail(server: mp.BufferManager) -> None:
    data = loader(Squares(30), server, shuffle=True, seed=7, drop_last=True)
    assert len(data) == 7
    seen = [int(v) for _, labels, _ in data for v in labels.numpy()]
    assert len(seen) == 28 and len(set(seen)) == 28 and seen != sorted(seen)


def test_a_slot_comes_back_when_the_batch_is_dropped(server: mp.BufferManager) -> None:
    data = loader(Squares(40), server, num_workers=1, slots=2)
    epoch = iter(data)
    kept = [next(epoch), next(epoch)]  # both slots of the only worker
    with pytest.raises(mp.LoaderError, match="holds all 2 slots of loader worker 0"):
        next(epoch)
    first = kept[0][1].numpy().tolist()
    assert first == [0, 1, 2, 3]
    kept.clear()  # dropping the batches gives the slots back
    with pytest.raises(StopIteration):  # the error ended that epoch
        next(epoch)
    epoch = iter(data)
    kept = [next(epoch), next(epoch)]
    kept.pop(0)
    assert next(epoch)[1].numpy().tolist() == [8, 9, 10, 11]


def test_arrays_keep_their_slot_after_the_epoch_ends(server: mp.BufferManager) -> None:
    data = loader(Squares(40), server)
    epoch = iter(data)
    pids = epoch.worker_pids  # type: ignore[attr-defined]
    images, labels, _ = next(epoch)
    as_numpy = images.numpy()
    del images
    epoch.close()  # type: ignore[attr-defined]
    wait_until(lambda: all_gone(pids), timeout=15)
    assert labels.numpy().tolist() == [0, 1, 2, 3]
    assert (as_numpy[:, 0, 0] == [0, 1, 2, 3]).all()
    assert server.stats()["leases"] > 0
    del labels, as_numpy
    wait_until(lambda: no_leases(server), timeout=10)


# -- who owns what; persistent workers; stopping clean ---------------------------------------


def _my_segments() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"gpushare-{os.getpid()}-"))


def test_a_loader_owns_its_slots_in_the_trainer_and_starts_no_server() -> None:
    before = set(mp.active_children())
    segments = set(_my_segments())  # earlier tests' leaks on purpose are not this loader's
    data = mp.SlotLoader(Squares(40), batch_size=4, num_workers=2, slots=2, device="cpu", timeout=60)
    epoch = iter(data)
    images, labels, _ = next(epoch)
    second = next(epoch)  # from the other worker: both rings are registered now
    started = set(mp.active_children()) - before
    assert sorted(p.pid for p in started) == sorted(epoch.worker_pids)  # type: ignore[attr-defined]
    assert labels.numpy().tolist() == [0, 1, 2, 3]
    # The slots are this process's own shared memory: a worker asked this process to allocate them.
    assert set(_my_segments()) - segments
    stats = data.stats()
    assert stats["slots"] == 4 and stats["slot_bytes"] >= images.nbytes and stats["host_bytes"] >= 4 * images.nbytes
    pids = epoch.worker_pids  # type: ignore[attr-defined]
    data.close()
    wait_until(lambda: all_gone(pids), timeout=15)
    assert (images.numpy()[:, 0, 0] == [0, 1, 2, 3]).all()  # a batch outlives its loader
    del images, labels, second, epoch, data
    wait_until(lambda: set(_my_segments()) <= segments, timeout=15)  # the memory goes with the last batch


def test_a_dropped_loader_stops_and_frees_like_a_closed_one() -> None:
    segments = set(_my_segments())
    data = mp.SlotLoader(Squares(40), batch_size=4, num_workers=1, slots=2, device="cpu", timeout=60,
                         persistent_workers=True)  # fmt: skip
    epoch = iter(data)
    pids = epoch.worker_pids  # type: ignore[attr-defined]
    batch = next(epoch)
    del data, epoch
    wait_until(lambda: all_gone(pids), timeout=15)  # the loader was collected: its workers stop
    assert batch[1].numpy().tolist() == [0, 1, 2, 3]
    del batch
    wait_until(lambda: set(_my_segments()) <= segments, timeout=15)


def test_persistent_workers_keep_their_processes_and_rings_across_epochs() -> None:
    with mp.SlotLoader(Squares(40), batch_size=4, num_workers=2, slots=2, device="cpu", timeout=60,
                       persistent_workers=True) as data:  # fmt: skip
        pids, rings = None, None
        for number in range(4):
            epoch = iter(data)
            if pids is None:
                pids, rings = epoch.worker_pids, None  # type: ignore[attr-defined]
            assert epoch.worker_pids == pids  # type: ignore[attr-defined]
            if number == 1:  # left early: the next epoch must not see its batches
                assert next(epoch)[1].numpy().tolist() == [0, 1, 2, 3]
                epoch.close()  # type: ignore[attr-defined]
                continue
            labels = [int(v) for _, batch, _ in epoch for v in batch.numpy()]
            assert labels == list(range(40)), f"epoch {number}: {labels}"
            if rings is None:
                rings = list(epoch._rings)  # type: ignore[attr-defined]
            assert list(epoch._rings) == rings  # type: ignore[attr-defined]  # the same ring objects
        assert all(not all_gone([pid]) for pid in pids)  # still running between epochs
    wait_until(lambda: all_gone(pids), timeout=15)  # and stopped by close()


def test_stats_say_where_the_first_batch_spent_its_time() -> None:
    with mp.SlotLoader(Squares(16), batch_size=4, num_workers=2, slots=2, device="cpu", timeout=60,
                       persistent_workers=True) as data:  # fmt: skip
        assert data.stats()["first_batch_s"] is None
        assert len(list(data)) == 4
        first = data.stats()["first_batch_s"]
        # Workers started for this epoch: worker 0's start-up, in the order it happened, then the
        # trainer's receipt of its ring and of the batch; seconds since iter() began the epoch.
        steps = ["spawned", "started", "linked", "fetched", "collated", "ring", "ring_received", "returned"]
        assert list(first) == steps, first
        assert list(first.values()) == sorted(first.values()) and first["spawned"] >= 0, first
        assert len(list(data)) == 4  # the same workers again: their start-up is no part of this epoch
        assert list(data.stats()["first_batch_s"]) == ["returned"]


def test_workers_fork_from_the_forkserver_unless_told_otherwise() -> None:
    """By default workers are forked from multiprocessing's forkserver, which imports the worker's
    module (and numpy, torch where the trainer has them) once and never the main script; it outlives
    the loader, shared by the next ones. Workers bound to a GPU are spawned while none runs (they make
    their context while they import) and the forkserver starts after their first batch. ``multiprocessing_context
    ="spawn"`` starts them from this process; a wrong name fails when the loader is made."""
    from multiprocessing import forkserver

    from gpushare._loader_workers import worker_context

    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._stop()  # so that this test's first loader starts it
    ctx, then_forkserver = worker_context(None, gpu=True)
    assert ctx.get_start_method() == "spawn" and then_forkserver  # no forkserver yet: spawn, start one
    parents = []
    for _ in range(2):
        with mp.SlotLoader(ParentOf(), batch_size=4, num_workers=2, device="cpu", timeout=60) as data:
            parents.append({p for batch in data for p in batch.numpy().tolist()})
    pid = server._forkserver_pid
    assert pid is not None and parents == [{pid}, {pid}]  # one forkserver for both loaders
    ctx, then_forkserver = worker_context(None, gpu=True)
    assert ctx.get_start_method() == "forkserver" and not then_forkserver  # running: GPU workers fork too
    preload = server._preload_modules
    assert "gpushare._loader_workers" in preload and "numpy" in preload and "__main__" not in preload, preload
    with mp.SlotLoader(ParentOf(), batch_size=4, num_workers=2, device="cpu", timeout=60,
                       multiprocessing_context="spawn") as data:  # fmt: skip
        assert {p for batch in data for p in batch.numpy().tolist()} == {os.getpid()}
    with pytest.raises(ValueError, match="cannot find context for 'threads'"):
        mp.SlotLoader(ParentOf(), device="cpu", multiprocessing_context="threads")
    with pytest.raises(ValueError, match="neither a start method's name nor a multiprocessing context"):
        mp.SlotLoader(ParentOf(), device="cpu", multiprocessing_context=3)


def test_prepare_loaders_starts_the_forkserver_so_a_first_gpu_loader_forks_too() -> None:
    """gpushare.prepare_loaders() starts the forkserver at once (with the worker's module and numpy
    among what it imports; never the main script): a first loader with GPU workers then forks them
    instead of spawning, and a second call finds it running."""
    from multiprocessing import forkserver

    from gpushare._loader_workers import worker_context

    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._stop()
    assert worker_context(None, gpu=True)[0].get_start_method() == "spawn"
    assert mp.prepare_loaders() is True
    pid = server._forkserver_pid
    assert pid is not None and not all_gone([pid])
    preload = server._preload_modules
    assert "gpushare._loader_workers" in preload and "numpy" in preload and "__main__" not in preload, preload
    ctx, then_forkserver = worker_context(None, gpu=True)
    assert ctx.get_start_method() == "forkserver" and not then_forkserver
    assert mp.prepare_loaders() is True and server._forkserver_pid == pid  # the same one
    with mp.SlotLoader(ParentOf(), batch_size=4, num_workers=2, device="cpu", timeout=60) as data:
        assert {p for batch in data for p in batch.numpy().tolist()} == {pid}


def test_a_forkserver_that_cannot_start_is_a_warning_and_loaders_spawn_their_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A forkserver that fails to start (here: made to) is a warning, not an error: prepare_loaders()
    returns False, a loader left to its default spawns its workers from this process, and the
    forkserver is not tried again (one warning, whatever comes next)."""
    from multiprocessing import forkserver

    from gpushare import _loader_workers
    from gpushare._loader_workers import worker_context

    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._stop()
    monkeypatch.setattr(_loader_workers, "_forkserver_failed", [])

    def refuse() -> None:
        raise OSError("no more processes")

    monkeypatch.setattr(forkserver, "ensure_running", refuse)
    with caplog.at_level("WARNING", logger="gpushare"):
        assert mp.prepare_loaders() is False
        for _ in range(2):
            with mp.SlotLoader(ParentOf(), batch_size=4, num_workers=2, device="cpu", timeout=60) as data:
                assert {p for batch in data for p in batch.numpy().tolist()} == {os.getpid()}  # spawned
        ctx, then_forkserver = worker_context(None, gpu=True)
        assert ctx.get_start_method() == "spawn" and not then_forkserver
    warnings = [r for r in caplog.records if "could not start multiprocessing's forkserver" in r.getMessage()]
    assert len(warnings) == 1 and "no more processes" in warnings[0].getMessage()
    assert server._forkserver_pid is None


def test_pin_memory_without_a_gpu_warns_and_batches_stay_pageable() -> None:
    if _gpus() > 0:
        pytest.skip("this machine has a GPU: test_pin_memory_page_locks_the_host_slots covers it")
    data = mp.SlotLoader(Squares(8), batch_size=4, num_workers=1, device="cpu", timeout=60, pin_memory=True)
    with pytest.warns(RuntimeWarning, match="pin_memory=True, but host memory cannot be pinned"):
        batches = [labels.numpy().tolist() for _, labels, _ in data]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    data.close()


def _gpus() -> int:
    from gpushare import _cuda

    return _cuda.device_count() if _cuda.available() else 0


@pytest.mark.gpu
def test_pin_memory_page_locks_the_host_slots() -> None:
    data = mp.SlotLoader(Squares(16), batch_size=4, num_workers=2, device="cpu", timeout=60, pin_memory=True)
    seen = []
    for images, labels, _ in data:
        _, kind = _memory_type(images.ptr)
        seen.append((labels.numpy().tolist()[0], kind))
    assert seen == [(0, "host"), (4, "host"), (8, "host"), (12, "host")], seen
    assert data.stats()["pinned"]
    data.close()


@pytest.mark.gpu
def test_a_first_gpu_loader_spawns_and_later_ones_fork() -> None:
    """With no forkserver running, a loader whose workers are bound to a GPU spawns them (they make
    their context while they import) and starts the forkserver once its first batch is in; the next
    loader's workers are forked from it and still make their contexts."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._stop()
    parents = []
    for _ in range(2):
        with mp.SlotLoader(ParentOf(), batch_size=4, num_workers=2, device=0, timeout=120) as data:
            parents.append({p for batch in data for p in batch.numpy().tolist()})
    assert server._forkserver_pid is not None
    assert parents == [{os.getpid()}, {server._forkserver_pid}], parents


@pytest.mark.gpu
def test_after_prepare_loaders_a_first_gpu_loader_forks_its_workers() -> None:
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._stop()
    assert mp.prepare_loaders()
    with mp.SlotLoader(ParentOf(), batch_size=4, num_workers=2, device=0, timeout=120) as data:
        parents = {p for batch in data for p in batch.numpy().tolist()}
    assert parents == {server._forkserver_pid}, parents


def _memory_type(ptr: int) -> tuple[int, str]:
    """What the driver says ``ptr`` is: page-locked host memory reads as HOST."""
    from cuda.bindings import driver

    from gpushare import _cuda

    with _cuda.on_device(0):
        err, kind = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return int(err), "unknown"
    return 0, "host" if int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST) else str(kind)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
def test_cpu_samples_reach_a_cuda_slot_through_staging(persistent: bool) -> None:
    # NumPy samples made on the CPU, slots on the GPU: stacked into page-locked staging
    # and copied by one asynchronous copy per batch; the values must arrive intact, in
    # order, batch after batch (the two staging areas used in turn).
    data = mp.SlotLoader(Squares(400), batch_size=8, num_workers=2, slots=2, device=0, timeout=60,
                         persistent_workers=persistent)  # fmt: skip
    for epoch in range(2 if persistent else 1):
        for step, (images, labels, names) in enumerate(data):
            assert images.device == 0
            expected = np.arange(8 * step, 8 * step + 8, dtype=np.float32)
            assert (images.numpy()[:, 1, 2] == expected).all(), step
            assert labels.numpy().tolist() == expected.astype(int).tolist()
            assert names == [f"s{i}" for i in expected.astype(int)]
        if epoch == 0:  # a device worker's context is a step of its first batch
            marks = list(data.stats()["first_batch_s"])
            assert marks.index("collated") < marks.index("context") < marks.index("ring"), marks
    data.close()


class HostStaging:
    """gpushare._batch.Staging whose "device" is host memory and whose copies run late: a copy
    runs only when the staging waits for its area's event (or at drain()), so an area written
    again before its copy ran would send the wrong bytes, as a GPU would."""

    @staticmethod
    def make(chunk: int) -> Any:
        import ctypes

        from gpushare._batch import Staging

        class _Staging(Staging):
            def __init__(self) -> None:
                super().__init__(device=0, chunk=chunk)
                self.keep: list[Any] = []
                self.queued: list[tuple[int, int, int, int]] = []  # (area id, dst, src, nbytes)
                self.sizes: list[int] = []

            def _alloc(self, nbytes: int) -> int:
                buf = ctypes.create_string_buffer(nbytes)
                self.keep.append(buf)
                return ctypes.addressof(buf)

            def _free(self, ptr: int) -> None:
                pass

            def _copy(self, dst: int, src: int, nbytes: int) -> None:
                area = next(a for a in self._areas if a[0] <= src < a[0] + a[1])
                self.queued.append((id(area), dst, src, nbytes))
                self.sizes.append(nbytes)

            def _record(self, area: list[Any]) -> None:
                area[2] = "recorded"

            def _wait(self, area: list[Any]) -> None:
                self.run(lambda key: key == id(area))

            def _destroy(self, event: Any) -> None:
                pass

            def run(self, which: Any) -> None:
                for item in [q for q in self.queued if which(q[0])]:
                    ctypes.memmove(item[1], item[2], item[3])
                    self.queued.remove(item)

            def drain(self) -> None:
                self.run(lambda key: True)

        return _Staging()


def test_staging_streams_bytes_in_chunks_and_never_rewrites_an_area_before_its_copy() -> None:
    import ctypes

    chunk = 4096
    staging = HostStaging.make(chunk)
    rng = np.random.default_rng(7)
    slot = ctypes.create_string_buffer(64 * 1024)
    base = ctypes.addressof(slot)
    samples = [rng.integers(0, 256, 1000, dtype=np.uint8) for _ in range(10)]  # 10,000 bytes: 3 chunks
    labels = rng.integers(0, 256, 300, dtype=np.uint8)
    for batch in range(3):  # the areas are reused batch after batch
        at = base + batch * 16384
        for i, sample in enumerate(samples):
            staging.write(at + i * 1000, sample.ctypes.data, sample.nbytes)
        staging.write(at + 10240, labels.ctypes.data, labels.nbytes)  # elsewhere: its own copy
        staging.flush()
    staging.drain()
    got = np.frombuffer(slot, np.uint8)
    for batch in range(3):
        at = batch * 16384
        assert (got[at : at + 10000] == np.concatenate(samples)).all(), batch
        assert (got[at + 10240 : at + 10540] == labels).all(), batch
    assert max(staging.sizes) <= chunk and staging.nbytes == 2 * chunk
    assert staging.copies == 3 * 4  # per batch: 3 full or partial chunks of samples, 1 for the labels
    staging.close()
    assert staging.nbytes == 0


def test_staging_sizes_its_areas_to_small_slots_and_drops_a_failed_batch() -> None:
    import ctypes

    staging = HostStaging.make(1 << 20)
    staging.reserve(3000)  # slots smaller than a chunk: areas of the slot's size
    assert staging.nbytes == 2 * 3000
    slot = ctypes.create_string_buffer(8192)
    base = ctypes.addressof(slot)
    junk = np.full(2000, 9, np.uint8)
    staging.write(base, junk.ctypes.data, junk.nbytes)
    staging.discard()  # the batch failed half-way: those bytes go nowhere
    good = np.arange(2500, dtype=np.uint16).view(np.uint8)[:2500].copy()
    staging.write(base + 4096, good.ctypes.data, good.nbytes)
    staging.flush()
    staging.drain()
    got = np.frombuffer(slot, np.uint8)
    assert not got[:4096].any()
    assert (got[4096 : 4096 + 2500] == good).all()
    assert staging.sizes == [2500]  # one copy, of the good batch only


class BigRows:
    """Sample i: a row of 5,000 float32 (20 KB) equal to i, and i."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(5000, i, np.float32), i


def test_stacked_samples_land_whole_in_host_slots(server: mp.BufferManager) -> None:
    data = loader(BigRows(), server, batch_size=8, num_workers=2)
    for step, (rows, labels) in enumerate(data):
        expected = np.arange(8 * step, 8 * step + 8)
        assert (rows.numpy() == expected[:, None]).all(), step
        assert labels.numpy().tolist() == expected.tolist()


def half_then_fail(samples: list[tuple[np.ndarray, int]], writer: mp.SlotWriter) -> Any:
    """A collate that streams a large array through staging, then fails on batch 2."""
    rows = np.stack([row for row, _ in samples])
    out = writer.put(rows)
    labels = [label for _, label in samples]
    if 16 in labels:
        raise RuntimeError("collate failed after staging its rows")
    return out, np.array(labels)


class WideRows:
    """Sample i: 2,000,000 bytes equal to i % 251 (a batch of 8 spans four 4 MiB chunks), and i."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(2_000_000, i % 251, np.uint8), i


@pytest.mark.gpu
def test_a_batch_that_fails_after_staging_leaves_the_next_batches_intact() -> None:
    data = mp.SlotLoader(WideRows(), batch_size=8, num_workers=1, slots=2, device=0, timeout=60,
                         collate=half_then_fail)  # fmt: skip
    epoch = iter(data)
    for step in range(6):
        if step == 2:
            with pytest.raises(RuntimeError, match="after staging"):
                next(epoch)
            continue
        rows, labels = next(epoch)
        expected = np.arange(8 * step, 8 * step + 8)
        assert labels.numpy().tolist() == expected.tolist(), step
        host = rows.numpy()
        assert (host == (expected % 251)[:, None]).all(), step
    data.close()


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("raise_at", [1, 9], ids=["first-batch", "later-batch"])
def test_a_dataset_exception_reaches_the_trainer_in_order(server: mp.BufferManager, raise_at: int) -> None:
    data = loader(Squares(24, raise_at=raise_at), server)
    epoch = iter(data)
    failing = raise_at // 4
    got = [next(epoch)[1].numpy().tolist() for _ in range(failing)]
    assert got == [list(range(4 * s, 4 * s + 4)) for s in range(failing)]
    with pytest.raises(ValueError, match=f"(?s)Caught ValueError in loader worker {failing % 2} .*batch {failing}.*"
                       f"sample {raise_at} is broken"):  # fmt: skip
        next(epoch)
    rest = [labels.numpy().tolist() for _, labels, _ in epoch]  # the epoch goes on after the error
    assert rest == [list(range(4 * s, 4 * s + 4)) for s in range(failing + 1, 6)]


def test_a_batch_larger_than_its_slot_is_a_clear_error(server: mp.BufferManager) -> None:
    data = loader(Sized([100] * 4 + [5000] * 4), server, num_workers=1, slot_bytes=4096)
    epoch = iter(data)
    assert next(epoch).shape == (4, 100)
    with pytest.raises(mp.LoaderError, match="slot_bytes="):
        next(epoch)


def test_a_killed_worker_is_an_error_and_pins_nothing(server: mp.BufferManager) -> None:
    data = loader(Squares(40, kill_at=13), server, num_workers=2, slots=2)
    epoch = iter(data)
    pids = epoch.worker_pids  # type: ignore[attr-defined]
    kept = [next(epoch) for _ in range(3)]
    with pytest.raises(mp.OwnerGoneError, match=r"loader worker 1 \(pid \d+\) exited unexpectedly \(exit code -9\)"):
        for _ in range(10):
            kept.append(next(epoch))
    wait_until(lambda: all_gone(pids), timeout=15)  # the other worker is stopped too
    assert [labels.numpy().tolist()[0] for _, labels, _ in kept] == [0, 4, 8]  # still readable
    del kept
    wait_until(lambda: no_leases(server), timeout=10)


def test_breaking_out_of_the_loop_stops_the_workers(server: mp.BufferManager) -> None:
    data = loader(Squares(400), server, num_workers=2, slots=3)
    epoch = iter(data)
    pids = epoch.worker_pids  # type: ignore[attr-defined]
    for step, _ in enumerate(epoch):
        if step == 2:
            break
    del epoch, _
    wait_until(lambda: all_gone(pids), timeout=15)
    wait_until(lambda: no_leases(server), timeout=10)


TRAINER = textwrap.dedent(
    """
    import numpy as np, sys, time
    import gpushare as mp
    sys.path.insert(0, {tests!r})
    from test_loader import Squares

    if __name__ == "__main__":
        data = mp.SlotLoader(Squares(10000), batch_size=4, num_workers=2, slots=2, device="cpu", timeout=60)
        epoch = iter(data)
        batch = next(epoch)
        print("pids", *epoch.worker_pids, flush=True)
        time.sleep(120)
    """
)


def test_a_killed_trainer_leaves_no_process_behind() -> None:
    script = TRAINER.format(tests=os.path.join(ROOT, "tests"))
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=subprocess_env(),
    ) as trainer:  # fmt: skip
        try:
            assert trainer.stdout is not None
            line = trainer.stdout.readline()
            assert line.startswith("pids"), line
            pids = [int(p) for p in line.split()[1:]]
            assert len(pids) == 2  # the workers: the loader starts no server
            time.sleep(0.5)  # the workers are now blocked on full rings
            trainer.kill()
            trainer.wait(10)
            wait_until(lambda: all_gone(pids), timeout=20)
        finally:
            trainer.kill()
            trainer.wait(10)


CLOSE_AND_EXIT = textwrap.dedent(
    """
    import os, sys
    import gpushare as mp
    sys.path.insert(0, {tests!r})
    from test_loader import Wide

    if __name__ == "__main__":
        print(os.getpid(), flush=True)
        data = mp.SlotLoader(Wide(), batch_size=16, num_workers=2, slots=2, device="cpu", timeout=60)
        for images, labels in data:
            pass
        del images, labels
        data.close()  # and the script ends at once, while the loader's Owner is shutting down
    """
)


def test_a_loader_closed_just_before_exit_frees_its_memory_before_the_interpreter_ends() -> None:
    """The Owner of a closed loader shuts down on a thread (leases may come back late);
    at exit that thread gets to finish, so the loader's host segments are unlinked by
    gpushare and not left to the resource tracker (which would warn of them as leaked)."""
    script = CLOSE_AND_EXIT.format(tests=os.path.join(ROOT, "tests"))
    for _ in range(3):  # the thread was killed half-way in most runs before the exit hook waited
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=subprocess_env()
        )
        assert out.returncode == 0, out.stderr
        assert "leaked" not in out.stderr and "resource_tracker" not in out.stderr, out.stderr
        pid = out.stdout.split()[0]
        if os.path.isdir("/dev/shm"):
            assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"gpushare-{pid}-")]


# -- bad input ----------------------------------------------------------------------------


def test_bad_arguments_say_what_to_do(server: mp.BufferManager) -> None:
    with pytest.raises(ValueError, match="num_workers=0 must be an int >= 1"):
        mp.SlotLoader(Squares(), num_workers=0, device="cpu")
    with pytest.raises(ValueError, match="slots=0"):
        mp.SlotLoader(Squares(), slots=0, device="cpu")
    with pytest.raises(ValueError, match="batch_size"):
        mp.SlotLoader(Squares(), batch_size=-1, device="cpu")
    with pytest.raises(TypeError, match="map-style dataset"):
        mp.SlotLoader(iter(range(3)), device="cpu")
    with pytest.raises(ValueError, match="not a gpushare Manager"):
        mp.SlotLoader(Squares(), device="cpu", manager=object())


def test_gpushare_torch_without_torch_says_what_to_do() -> None:
    code = (
        "import sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
        "try:\n    import gpushare.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert "gpushare.torch needs PyTorch" in out.stdout and "gpushare.SlotLoader" in out.stdout


def test_worker_exceptions_come_back_as_their_type_or_a_loader_error() -> None:
    from gpushare._batch import exception_payload, rebuild_exception

    class LocalError(Exception):  # not picklable by reference
        pass

    for raised, expected in (
        (KeyError("name"), KeyError),
        (ValueError("bad"), ValueError),
        (LocalError("x"), mp.LoaderError),
    ):
        try:
            raise raised
        except Exception as exc:
            again = rebuild_exception(exception_payload(exc, 2, 7))
        assert type(again) is expected
        text = str(again)
        assert text.startswith(
            f"Caught {type(raised).__name__} in loader worker 2 (pid {os.getpid()}) building batch 7"
        )
        assert "Original traceback in the worker" in text and "raise raised" in text
