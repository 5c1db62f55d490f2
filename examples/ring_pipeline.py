"""Ring pipeline: one producer, three consumers, slots shared once and reused.

The producer owns a ring of pre-shared slots (on GPU 0 when there is one,
else in host shared memory). Each step it acquires a free slot, fills it
with that step's value and publishes it to every consumer; each consumer
reduces the slot (a sum), checks it against the value it expects, and
releases it, so that the producer can reuse the slot once all three have.
Every consumer mapped each slot once, when it received the ring: a step
moves only a slot index. When every slot is busy the producer waits.

Run: python examples/ring_pipeline.py [--consumers N] [--steps S] [--slots K]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import gpushare as mp

COLUMNS = 1024


def value_of(step: int) -> float:
    return float(step % 251 + 1)  # small integers: every sum is exact in float32 and float64


def _torch_on_gpu():  # type: ignore[no-untyped-def]
    """torch with CUDA initialised, or None (no torch, or a host-memory run)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.zeros(1, device="cuda")  # pay CUDA start-up before the timed part
    return torch


def consume(rank: int, ring, on_gpu: bool, results) -> None:  # type: ignore[no-untyped-def]
    torch = _torch_on_gpu() if on_gpu else None
    results.put(("ready", rank))
    count, wrong, first, last = 0, 0, None, None
    addresses: set[tuple[int, int]] = set()
    how = "numpy view of shared memory"
    for item in ring.items(timeout=120):  # each item is released when the loop moves on
        if item.device == "cpu":
            total = float(item.numpy().sum(dtype=np.float64))  # zero-copy view of the slot
        elif torch is not None:
            total = float(torch.from_dlpack(item).sum(dtype=torch.float64))  # the producer's GPU memory
            how = "torch view of the producer's GPU memory"
        else:
            total = float(item.numpy().astype(np.float64).sum())
            how = "host copy (torch not installed)"
        wrong += total != value_of(item.sequence) * item.size
        addresses.add((item.slot, item.ptr))  # the same mapped memory every time a slot comes round
        count += 1
        first = item.sequence if first is None else first
        last = item.sequence
    results.put(("done", rank, os.getpid(), count, wrong, first, last, how, len(addresses)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()

    with mp.Manager() as manager:
        with manager.ring((args.rows, COLUMNS), "float32", slots=args.slots, consumers=args.consumers) as ring:
            nbytes = args.rows * COLUMNS * 4
            print(
                f"backend: {ring.backend} on {ring.device!r}; {ring.slots} slots of {ring.shape} "
                f"{ring.dtype} ({nbytes} bytes each), {args.consumers} consumers"
            )
            results = mp.Queue()
            on_gpu = ring.device != "cpu"
            workers = [
                mp.Process(target=consume, args=(rank, ring, on_gpu, results), device=ring.device)
                for rank in range(args.consumers)
            ]
            for w in workers:
                w.start()  # each worker registers with the ring as it unpickles it
            for _ in workers:
                assert results.get(timeout=120)[0] == "ready"

            started = time.perf_counter()
            for step in range(args.steps):
                buf = ring.acquire(timeout=60)  # waits while every slot is still being read
                buf.fill(value_of(step))
                ring.publish(buf, timeout=60)  # to every consumer; the slot is theirs until all release it
            ring.close()  # consumers get every step, then their loops end
            reports = sorted(results.get(timeout=120) for _ in workers)
            elapsed = time.perf_counter() - started
            stats = ring.stats()
            for w in workers:
                w.join(timeout=30)

        ok = True
        for _, rank, pid, count, wrong, first, last, how, places in reports:
            good = count == args.steps and wrong == 0 and (first, last) == (0, args.steps - 1) and places == ring.slots
            ok &= good
            status = "ok" if good else f"MISMATCH ({wrong} wrong sums)"
            print(
                f"consumer {rank} (pid {pid}): {count} steps {first}..{last} summed via {how}, "
                f"in {places} distinct slot mappings [{status}]"
            )
        print(f"published {stats['published']} steps through {ring.slots} slots, each mapped once per consumer")
    handoffs = args.steps * args.consumers
    print(
        f"{args.steps} steps in {elapsed:.2f} s: {args.steps / elapsed:,.0f} steps/s, "
        f"{handoffs / elapsed:,.0f} handoffs/s ({elapsed / args.steps * 1e6:.0f} us per step: fill + fan-out + sums)"
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
