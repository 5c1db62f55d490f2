"""Fan-out: one producer batch, many consumers, zero copies (the `make demo` job).

The producer allocates one batch in shared memory (on GPU 0 when there is
one, else in host shared memory) and puts the *same* buffer on a queue once
per worker. Each worker maps the producer's memory -- no copy -- computes a
statistic over its share of the batch, and sends it back. The producer
checks every answer against its own computation.

Run: python examples/fanout.py [--workers N] [--batch B]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import gpushare as mp


def _torch_on_gpu():  # type: ignore[no-untyped-def]
    """torch with CUDA initialised, or None (no torch, or a host-memory run)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.zeros(1, device="cuda")  # pay CUDA start-up before the timed handoff
    return torch


def consume(rank: int, workers: int, on_gpu: bool, jobs: mp.Queue, results: mp.Queue) -> None:
    torch = _torch_on_gpu() if on_gpu else None
    results.put("ready")
    batch = jobs.get(timeout=60)  # maps the producer's memory; nothing is copied
    lo = rank * batch.shape[0] // workers
    hi = (rank + 1) * batch.shape[0] // workers
    if batch.device == "cpu":
        values = batch.numpy()[lo:hi]  # a zero-copy NumPy view of the shared segment
        total, how = float(values.astype(np.float64).sum()), "numpy view of shared memory"
    elif torch is not None:
        tensor = torch.from_dlpack(batch)  # a view of the producer's GPU memory
        total, how = float(tensor[lo:hi].double().sum()), "torch view of the producer's GPU memory"
    else:
        total, how = float(batch.numpy()[lo:hi].astype(np.float64).sum()), "host copy (torch not installed)"
    results.put((rank, os.getpid(), lo, hi, total, how))
    batch.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    start = time.perf_counter()
    with mp.Manager() as manager:
        rng = np.random.default_rng(0)
        host = rng.standard_normal((args.batch, 3, 64, 64)).astype(np.float16)
        batch = manager.from_numpy(host)
        print(f"backend: {batch.backend} on {batch.device!r}; batch {batch.shape} {batch.dtype}, {batch.nbytes} bytes")

        jobs, results = mp.Queue(), mp.Queue()
        on_gpu = batch.device != "cpu"
        workers = [
            mp.Process(target=consume, args=(r, args.workers, on_gpu, jobs, results), device=batch.device)
            for r in range(args.workers)
        ]
        for w in workers:
            w.start()
        for _ in workers:
            assert results.get(timeout=120) == "ready"
        startup = time.perf_counter() - start
        handoff = time.perf_counter()
        for _ in workers:
            jobs.put(batch)  # one small descriptor per worker
        answers = sorted(results.get(timeout=120) for _ in workers)
        handoff = time.perf_counter() - handoff
        for w in workers:
            w.join(timeout=30)

        for rank, pid, lo, hi, total, how in answers:
            expected = float(host[lo:hi].astype(np.float64).sum())
            status = "ok" if abs(total - expected) <= 1e-6 * max(1.0, abs(expected)) else f"MISMATCH (want {expected})"
            print(f"worker {rank} (pid {pid}): rows {lo}:{hi} sum = {total:.4f} via {how} [{status}]")
            if status != "ok":
                raise SystemExit(1)
        stats = manager.stats()
        print(f"leases outstanding after the workers exited: {stats['leases']}")
    print(
        f"fan-out to {args.workers} workers, each computing and answering: {handoff * 1e3:.1f} ms "
        f"(worker start-up {startup:.2f} s, whole run {time.perf_counter() - start:.2f} s)"
    )


if __name__ == "__main__":
    main()
