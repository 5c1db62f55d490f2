"""gpushare.torch.DataLoader, and torch's own DataLoader with gpushare's workers.

Skipped where torch is not installed. The unmarked tests run on the host
backend (CPU tensors viewing shared memory) wherever torch is; the
``gpu`` ones need CUDA.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import all_gone, no_leases, subprocess_env, wait_until

torch = pytest.importorskip("torch")

import gpushare as mp  # noqa: E402
from gpushare.torch import DataLoader  # noqa: E402

# -- datasets (module level: spawn pickles them by reference) --------------------------------


class Ramp(torch.utils.data.Dataset):  # type: ignore[misc]
    """Sample i: a float32 tensor of ``width`` values all i (made on ``device``), the int i, a name."""

    def __init__(self, n: int = 64, width: int = 8, device: str = "cpu", kill_at: int | None = None) -> None:
        self.n, self.width, self.device, self.kill_at = n, width, device, kill_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, str]:
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((self.width,), float(i), device=self.device), i, f"n{i}"


class Mixed(torch.utils.data.Dataset):  # type: ignore[misc]
    """Dicts of a bfloat16 tensor, a float, a bool, and the id of the worker that built it."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, object]:
        info = torch.utils.data.get_worker_info()
        return {
            "half": torch.full((2, 2), i / 2, dtype=torch.bfloat16),
            "x": float(i),
            "odd": bool(i % 2),
            "worker": info.id if info is not None else -1,
        }


def sum_collate(samples: list[tuple[torch.Tensor, int, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]).sum(dim=1), torch.tensor([s[1] for s in samples])


# -- host backend (wherever torch is) --------------------------------------------------------


def test_batches_are_cpu_tensors_viewing_the_slots(server: mp.BufferManager) -> None:
    loader = DataLoader(Ramp(64), batch_size=4, num_workers=2, slots=2, device="cpu", timeout=60, manager=server)
    pointers = set()
    for step, (values, labels, names) in enumerate(loader):
        assert values.shape == (4, 8) and values.dtype == torch.float32 and values.device.type == "cpu"
        assert labels.dtype == torch.int64 and labels.tolist() == list(range(4 * step, 4 * step + 4))
        assert torch.equal(values[:, 0], labels.float()) and names == [f"n{i}" for i in labels.tolist()]
        pointers.add(values.data_ptr())
    assert step == 15
    assert len(pointers) <= 4  # 2 workers x 2 slots, reused
    del values, labels
    wait_until(lambda: no_leases(server), timeout=10)


def test_dicts_numbers_bfloat16_and_worker_info(server: mp.BufferManager) -> None:
    loader = DataLoader(Mixed(), batch_size=4, num_workers=2, device="cpu", timeout=60, manager=server)
    batches = list(loader)
    assert len(batches) == 4
    for step, batch in enumerate(batches):
        assert batch["half"].dtype == torch.bfloat16
        assert batch["half"][:, 0, 0].tolist() == [i / 2 for i in range(4 * step, 4 * step + 4)]
        assert batch["x"].dtype == torch.float64 and batch["odd"].dtype == torch.bool
        assert batch["worker"].tolist() == [step % 2] * 4


def test_a_collate_fn_result_is_copied_into_the_slot(server: mp.BufferManager) -> None:
    loader = DataLoader(
        Ramp(12, width=3), batch_size=4, num_workers=1, collate_fn=sum_collate, device="cpu", timeout=60,
        manager=server,
    )  # fmt: skip
    sums = [(s.tolist(), labels.tolist()) for s, labels in loader]
    assert sums == [([3.0 * i for i in range(b, b + 4)], list(range(b, b + 4))) for b in (0, 4, 8)]


def test_shuffle_with_a_generator_is_reproducible(server: mp.BufferManager) -> None:
    def order(seed: int) -> list[int]:
        loader = DataLoader(
            Ramp(20), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(seed), num_workers=2,
            device="cpu", timeout=60, manager=server,
        )  # fmt: skip
        return [int(v) for _, labels, _ in loader for v in labels]

    first = order(3)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert order(3) == first


def test_torch_options_it_cannot_honour_are_refused() -> None:
    with pytest.raises(ValueError, match="unbatched"):
        DataLoader(Ramp(), batch_size=None, device="cpu")
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(Ramp(), batch_sampler=[[0, 1]], batch_size=4, device="cpu")
    with pytest.raises(ValueError, match="num_workers=0"):
        DataLoader(Ramp(), num_workers=0, device="cpu")


def test_slots_follow_prefetch_factor_as_torch_counts_batches_in_flight(server: mp.BufferManager) -> None:
    """A worker builds prefetch_factor batches ahead (torch's default 2) while the trainer
    holds one: slots default to prefetch_factor + 1, so memory matches torch's batches in
    flight; and with 3 slots a worker still keeps 2 batches ahead of a trainer that holds one."""
    loader = DataLoader(Ramp(64), batch_size=4, num_workers=2, device="cpu", timeout=60, manager=server)
    assert (loader.slots, loader.prefetch) == (3, 2)
    more = DataLoader(Ramp(), batch_size=4, prefetch_factor=4, device="cpu")
    assert (more.slots, more.prefetch) == (5, 4)
    chosen = DataLoader(Ramp(), batch_size=4, prefetch_factor=1, slots=6, device="cpu")
    assert (chosen.slots, chosen.prefetch) == (6, 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch_factor"):
            DataLoader(Ramp(), batch_size=4, prefetch_factor=bad, device="cpu")  # type: ignore[arg-type]
    held = []
    for step, (values, labels, _) in enumerate(loader):
        assert labels.tolist() == list(range(4 * step, 4 * step + 4))
        held = [values]  # the trainer keeps the last batch while it asks for the next
    assert step == 15 and loader.stats()["slots"] == 0  # the epoch's workers and rings are gone
    del held, values, labels
    wait_until(lambda: no_leases(server), timeout=10)


def test_torch_dataloader_runs_with_gpushare_workers() -> None:
    loader = torch.utils.data.DataLoader(
        Ramp(32), batch_size=4, num_workers=2, multiprocessing_context=mp.get_context(), timeout=60
    )
    labels = [int(v) for _, batch, _ in loader for v in batch]
    assert labels == list(range(32))


# -- CUDA ---------------------------------------------------------------------------------------


def test_persistent_workers_and_pin_memory_are_torchs_options() -> None:
    loader = DataLoader(Ramp(32), batch_size=4, num_workers=2, device="cpu", timeout=60, persistent_workers=True)
    first = iter(loader)
    pids = first.worker_pids  # type: ignore[attr-defined]
    assert [int(labels[0]) for _, labels, _ in first] == list(range(0, 32, 4))
    second = iter(loader)
    assert second.worker_pids == pids  # type: ignore[attr-defined]
    assert [int(labels[0]) for _, labels, _ in second] == list(range(0, 32, 4))
    loader.close()
    wait_until(lambda: all_gone(pids), timeout=15)
    assert DataLoader(Ramp(8), batch_size=4, num_workers=1, device="cpu").persistent_workers is False


class Images(torch.utils.data.Dataset):  # type: ignore[misc]
    """Sample i: a 3x32x32 image made on the CPU (as a decoder makes it), every value i % 251."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        self.n, self.dtype = n, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 32, 32), i % 251, dtype=self.dtype), i


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["uint8", "float32", "bfloat16"])
def test_cpu_images_arrive_in_cuda_slots_through_page_locked_staging(dtype: str) -> None:
    # The common case: samples decoded on the CPU, batches wanted on the GPU. The worker
    # stacks into page-locked staging and copies asynchronously; the trainer's tensors
    # are CUDA tensors holding exactly what the dataset made, in order, for many batches.
    kind = getattr(torch, dtype)
    loader = DataLoader(Images(64 * 40, kind), batch_size=64, num_workers=2, slots=2, device="cuda:0", timeout=60)
    for step, (images, labels) in enumerate(loader):
        assert images.is_cuda and images.dtype == kind and images.shape == (64, 3, 32, 32)
        expected = torch.arange(64 * step, 64 * step + 64) % 251
        got = images[:, 0, 0, 0].float().cpu()
        assert torch.equal(got, expected.to(kind).float()), step
        assert torch.equal(labels.cpu(), torch.arange(64 * step, 64 * step + 64))
        assert float(images.float().sum()) == float(expected.to(kind).float().sum()) * 3 * 32 * 32
        if step == 0:  # while the epoch's rings are there
            stats = loader.stats()
            assert stats["slot_bytes"] >= images.nbytes  # the batch, under the 4 MiB of an area
            assert stats["staging_bytes_per_worker"] == 2 * stats["slot_bytes"]  # areas no larger than a slot
    loader.close()


class LargeImages(torch.utils.data.Dataset):
    """ImageNet-sized samples made on the CPU: 3x224x224, every pixel of sample i equal to
    i % 251 plus its channel, so a chunk copied to the wrong place shows."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        self.n, self.dtype = n, dtype

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = torch.full((3, 224, 224), i % 251, dtype=self.dtype)
        image[1] += 1
        image[2] += 2
        return image, i


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_batches_larger_than_the_staging_arrive_whole(dtype: str) -> None:
    # 64 images of 3x224x224: 9.6 MB (uint8) or 38.5 MB (float32) a batch, through two
    # page-locked areas of 4 MiB per worker, many copies per batch, areas reused in turn.
    kind = getattr(torch, dtype)
    loader = DataLoader(LargeImages(64 * 6, kind), batch_size=64, num_workers=2, slots=2, device="cuda:0",
                        timeout=120)  # fmt: skip
    for step, (images, labels) in enumerate(loader):
        first = torch.arange(64 * step, 64 * step + 64) % 251
        want = torch.stack([first, first + 1, first + 2], dim=1).to(kind).cuda()  # (64, 3)
        assert torch.equal(images.amin(dim=(2, 3)), want), step
        assert torch.equal(images.amax(dim=(2, 3)), want), step
        assert torch.equal(labels.cpu(), torch.arange(64 * step, 64 * step + 64))
        if step == 0:  # while the epoch's rings are there: two 4 MiB areas, whatever the batch
            assert loader.stats()["staging_bytes_per_worker"] == 2 * (4 << 20)
    assert step == 5
    loader.close()


@pytest.mark.gpu
def test_pin_memory_gives_pinned_cpu_batches() -> None:
    loader = DataLoader(Images(16, torch.uint8), batch_size=4, num_workers=1, device="cpu", timeout=60,
                        pin_memory=True)  # fmt: skip
    for images, labels in loader:
        assert images.device.type == "cpu" and images.is_pinned()
        moved = images.cuda(non_blocking=True)
        assert int(moved[0, 0, 0, 0]) == int(labels[0]) % 251
    loader.close()


@pytest.mark.gpu
def test_gpu_batches_are_cuda_tensors_written_in_place_by_the_workers(server: mp.BufferManager) -> None:
    loader = DataLoader(Ramp(96, width=1024, device="cuda"), batch_size=8, num_workers=3, slots=2, device=0,
                        timeout=60, manager=server)  # fmt: skip
    pointers = set()
    for step, (values, labels, _) in enumerate(loader):
        assert values.is_cuda and values.shape == (8, 1024) and labels.is_cuda
        expected = torch.arange(8 * step, 8 * step + 8, device="cuda")
        assert torch.equal(labels, expected)
        assert torch.equal(values, expected.float()[:, None].expand(8, 1024))
        pointers.add(values.data_ptr())
    assert step == 11
    assert len(pointers) <= 6
    del values, labels
    wait_until(lambda: no_leases(server), timeout=10)


@pytest.mark.gpu
def test_torch_dataloader_with_gpushare_workers_returns_cuda_tensors() -> None:
    loader = torch.utils.data.DataLoader(
        Ramp(32, device="cuda"), batch_size=4, num_workers=2, multiprocessing_context=mp.get_context(), timeout=60
    )
    total = []
    for values, labels, _ in loader:
        assert values.is_cuda
        assert torch.equal(values[:, 0].cpu(), labels.float())
        total += labels.tolist()
    assert total == list(range(32))


@pytest.mark.gpu
def test_ten_thousand_batches_keep_device_memory_and_slots_flat(server: mp.BufferManager) -> None:
    loader = DataLoader(Ramp(40000, width=256, device="cuda"), batch_size=4, num_workers=4, slots=4, device=0,
                        timeout=60, manager=server)  # fmt: skip
    epoch = iter(loader)
    start = time.monotonic()
    pointers = set()
    for step, (values, labels, _) in enumerate(epoch):
        if step % 1000 == 0:  # a host check syncs the device: only now and then
            assert int(labels[0]) == 4 * step and float(values[3, 0]) == 4 * step + 3
        pointers.add(values.data_ptr())
        if step == 500:
            free_then = torch.cuda.mem_get_info()[0]
            allocated_then = server.stats()["bytes_allocated"]
            torch_then = torch.cuda.memory_allocated()
        elif step == 9999:  # still inside the epoch: its workers (and their CUDA contexts) are alive
            free_now = torch.cuda.mem_get_info()[0]
    assert step == 9999
    elapsed = time.monotonic() - start
    assert abs(free_now - free_then) <= 64 << 20, (free_then, free_now)
    # Nothing allocated per batch: the memory can only fall (the scratch memory of the
    # workers' first batches is freed within a housekeeping round, maybe after step 500).
    assert server.stats()["bytes_allocated"] <= allocated_then
    assert torch.cuda.memory_allocated() == torch_then
    assert len(pointers) <= 16  # 4 workers x 4 slots, reused for 10,000 batches
    assert all(ring.stats()["held"] <= 1 for ring in epoch._rings)  # type: ignore[attr-defined]
    assert elapsed < 60, f"10,000 batches took {elapsed:.1f} s"
    del values, labels, epoch
    wait_until(lambda: no_leases(server), timeout=10)


@pytest.mark.gpu
def test_gpu_worker_killed_keeps_received_batches_and_pins_nothing(server: mp.BufferManager) -> None:
    loader = DataLoader(Ramp(64, device="cuda", kill_at=13), batch_size=4, num_workers=2, slots=2, device=0,
                        timeout=60, manager=server)  # fmt: skip
    epoch = iter(loader)
    pids = epoch.worker_pids
    kept = [next(epoch) for _ in range(3)]
    with pytest.raises(mp.OwnerGoneError, match=r"loader worker 1 \(pid \d+\) exited unexpectedly"):
        for _ in range(10):
            kept.append(next(epoch))
    wait_until(lambda: all_gone(pids), timeout=15)
    assert [int(labels[0]) for _, labels, _ in kept] == [0, 4, 8]
    assert float(kept[0][0][:, 0].sum()) == 6.0 and float(kept[2][0][0, 0]) == 8.0
    del kept
    wait_until(lambda: no_leases(server), timeout=10)


@pytest.mark.gpu
def test_gpu_trainer_stopping_early_stops_the_workers(server: mp.BufferManager) -> None:
    loader = DataLoader(Ramp(4000, device="cuda"), batch_size=4, num_workers=4, device=0, timeout=60, manager=server)
    epoch = iter(loader)
    pids = epoch.worker_pids
    first = next(epoch)
    for step, _ in enumerate(epoch):
        if step == 5:
            break
    del epoch, _
    wait_until(lambda: all_gone(pids), timeout=15)
    assert torch.equal(first[1].cpu(), torch.arange(4))  # still valid after the workers left
    del first
    wait_until(lambda: no_leases(server), timeout=10)


# A torch tensor viewing gpushare memory, kept in a global of __main__, is freed during the
# interpreter's teardown, after gpushare's own modules are cleared: its DLPack deleter must
# still work then (it crashed with SIGSEGV or SIGILL when the exporter's structs went first).
_GLOBAL_TENSORS = """
import torch
import gpushare as mp
from gpushare.torch import DataLoader


class Ramp(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((8,), float(i), device="cuda")


if __name__ == "__main__":  # still module level: what it binds are globals of __main__
    manager = mp.Manager()
    buf = manager.full((1024,), 1.5, "float32", device=0)
    view = torch.from_dlpack(buf)  # a global that outlives gpushare's modules
    for batch in DataLoader(Ramp(), batch_size=4, num_workers=2, device="cuda:0"):
        pass  # `batch`, the last batch, stays a global too
    print("sum", float(view.sum()), float(batch.sum()))
"""


@pytest.mark.gpu
def test_tensors_left_in_globals_of_main_are_freed_at_exit_without_a_crash(tmp_path) -> None:
    script = tmp_path / "globals.py"
    script.write_text(_GLOBAL_TENSORS)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=subprocess_env()
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    assert "sum 1536.0 432.0" in out.stdout, out.stdout
