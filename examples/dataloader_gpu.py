"""A DataLoader whose workers make batches on the GPU and hand them over with no copy.

Each of 4 workers builds its samples on the GPU (a stand-in for GPU decoding or
augmentation) and stacks every batch straight into one of its pre-shared slots;
the training loop gets CUDA tensors viewing those slots. A slot goes back to its
worker when the loop drops the batch, so memory stays at workers x slots batches
however long the loop runs.

Runs with torch on a GPU. With torch but no GPU (or GPUSHARE_BACKEND=host) the
slots are host shared memory and the tensors CPU tensors; without torch it says
so and runs the same pipeline with gpushare.SlotLoader and NumPy.

    python examples/dataloader_gpu.py
"""

from __future__ import annotations

import os
import time

import numpy as np

import gpushare

BATCHES = 200
BATCH_SIZE = 16
SAMPLE_FLOATS = 64 * 1024  # 256 KiB per sample, 4 MiB per batch


class GpuAugmented:
    """Sample i: SAMPLE_FLOATS float32 values computed from i on ``device``, and the label i."""

    def __init__(self, n: int, device: str) -> None:
        self.n, self.device = n, device

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        import torch

        x = torch.full((SAMPLE_FLOATS,), float(i), device=self.device)
        return x.mul_(2).sub_(i), i  # "augmented" on the device; every value is i


class HostSamples:
    """The same samples with NumPy, for machines without torch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full(SAMPLE_FLOATS, i, np.float32), i


def with_torch(torch) -> None:  # type: ignore[no-untyped-def]
    from gpushare.torch import DataLoader

    gpu = torch.cuda.is_available() and os.environ.get("GPUSHARE_BACKEND", "").lower() != "host"
    device = "cuda" if gpu else "cpu"
    print(f"torch {torch.__version__}; slots on {'cuda:0' if gpu else 'host shared memory (no GPU used)'}")
    loader = DataLoader(
        GpuAugmented(BATCHES * BATCH_SIZE, device),
        batch_size=BATCH_SIZE,
        num_workers=4,
        slots=4,
        device=0 if gpu else "cpu",
        timeout=120,
    )
    pointers = set()
    start = time.perf_counter()
    for step, (values, labels) in enumerate(loader):
        if step == 0:
            start = time.perf_counter()  # the first batch includes starting the workers
        pointers.add(values.data_ptr())
        if step % 50 == 0:  # a host check syncs the device; only now and then
            assert torch.equal(values[:, 0], labels.float()), "a batch arrived corrupted"
            assert int(labels[0]) == step * BATCH_SIZE, "batches arrived out of order"
    elapsed = time.perf_counter() - start
    print(f"[ok] {step + 1} batches of {values.shape[0]} x {values.shape[1]} float32 on {values.device}")
    print(f"[ok] {step / elapsed:.0f} batches/s after the first")
    print(f"[ok] every batch viewed one of {len(pointers)} slots (4 workers x 4 slots): no copy, bounded memory")


def without_torch() -> None:
    print("torch is not installed: running the same pipeline with gpushare.SlotLoader and NumPy on host memory")
    loader = gpushare.SlotLoader(
        HostSamples(BATCHES * BATCH_SIZE), batch_size=BATCH_SIZE, num_workers=4, slots=4, device="cpu", timeout=120
    )
    pointers = set()
    count = 0
    for values, labels in loader:
        pointers.add(values.ptr)
        array = values.numpy()  # a view of the slot
        assert (array[:, 0] == labels.numpy()).all(), "a batch arrived corrupted"
        count += 1
    print(f"[ok] {count} batches of {array.shape[0]} x {array.shape[1]} float32")
    print(f"[ok] every batch viewed one of {len(pointers)} slots (4 workers x 4 slots): no copy, bounded memory")


def main() -> None:
    try:
        import torch
    except ImportError:
        without_torch()
    else:
        with_torch(torch)


if __name__ == "__main__":
    main()
