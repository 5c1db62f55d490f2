"""Producer/consumer pipeline with recycled buffers.

The producer fills a buffer, sends it, and the consumer sends back a
result. Buffers the consumer has released go back to the Manager's pool,
so steady state allocates nothing new and (on CUDA) opens no new handle.

Run: python examples/producer_consumer.py [--steps N]
"""

from __future__ import annotations

import argparse

import numpy as np

import gpushare as mp


def consumer(inbox: mp.Queue, outbox: mp.Queue) -> None:
    while True:
        item = inbox.get(timeout=60)
        if item is None:
            return
        step, buf = item
        with buf:  # released (lease given back) at the end of the block
            outbox.put((step, float(buf.numpy().astype(np.float64).sum())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    with mp.Manager() as manager:
        inbox, outbox = mp.Queue(), mp.Queue()
        worker = mp.Process(target=consumer, args=(inbox, outbox))
        worker.start()
        for step in range(args.steps):
            buf = manager.full((256, 1024), float(step), dtype="float32")
            inbox.put((step, buf))
            del buf  # the producer drops its reference; the lease keeps the memory alive
            got_step, total = outbox.get(timeout=60)
            assert got_step == step and total == step * 256 * 1024, (got_step, total)
        inbox.put(None)
        worker.join(timeout=30)
        stats = manager.stats()
        print(
            f"{args.steps} steps; allocations reused from the pool: {stats['reused']}; "
            f"live buffers now: {stats['live_buffers']}; pooled: {stats['pooled_buffers']}"
        )


if __name__ == "__main__":
    main()
