"""A Ray pipeline over gpushare buffers: no Ray-specific code for the buffers.

The driver owns a Manager and produces batches. Each batch goes to a Ray
actor as a plain argument; on this node the actor receives a Buffer over the
*same* memory (no copy), normalises it in place and returns it; the driver
gets its own buffer back. Then one ``ray.put`` of the batch fans out to a
few Ray tasks that each check a slice. On a node other than the owner's,
the same code would receive a copy of the batch through Ray's object store
(``gpushare.ray.NodeCopy``).

Needs Ray: from a checkout, pip install '.[ray]' (gpushare is not on PyPI yet).
Run: python examples/ray_pipeline.py [--batches N] [--rows R]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np

try:
    import ray
except ImportError:
    sys.exit("examples/ray_pipeline.py needs Ray, which is not installed here: pip install '.[ray]' from the checkout")

import gpushare as mp


@ray.remote(num_cpus=0)
class Normalizer:
    def normalize(self, batch: mp.Buffer) -> mp.Buffer:
        rows = batch.numpy()  # host memory: a zero-copy view of the driver's segment
        rows -= rows.mean(axis=1, keepdims=True)
        if batch.device != "cpu":  # a CUDA buffer's numpy() is a host copy: write it back
            batch.copy_from(rows)
        return batch  # travels back as a descriptor; the driver finds its own buffer


@ray.remote(num_cpus=0)
def slice_max_abs_mean(batch: mp.Buffer, lo: int, hi: int) -> tuple[str, float]:
    with batch:
        rows = batch.numpy()[lo:hi]
        return type(batch).__name__, float(np.abs(rows.mean(axis=1)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tasks", type=int, default=2)
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter()
    try:
        with mp.Manager() as manager:
            normalizer = Normalizer.remote()
            rng = np.random.default_rng(0)
            for i in range(args.batches):
                host = rng.standard_normal((args.rows, 1024)).astype(np.float32) + i
                batch = manager.from_numpy(host)
                back = ray.get(normalizer.normalize.remote(batch), timeout=120)
                same = back.ptr == batch.ptr
                expected = host - host.mean(axis=1, keepdims=True)
                ok = same and np.allclose(batch.numpy(), expected, atol=1e-5)
                print(
                    f"batch {i}: {batch.backend} {batch.shape}, returned as {type(back).__name__}, "
                    f"same memory: {same} [{'ok' if ok else 'MISMATCH'}]"
                )
                if not ok:
                    raise SystemExit(1)
                back.release()

                ref = ray.put(batch)  # read by several tasks: one pinned lease, one lease per reader
                bounds = np.linspace(0, args.rows, args.tasks + 1, dtype=int)
                answers = ray.get(
                    [slice_max_abs_mean.remote(ref, int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)],
                    timeout=120,
                )
                worst = max(value for _, value in answers)
                kinds = sorted({kind for kind, _ in answers})
                print(f"  fan-out to {args.tasks} tasks via ray.put: received as {kinds}, max |row mean| {worst:.2e}")
                if worst > 1e-4:
                    raise SystemExit(1)
                del ref
                batch.release()
            ray.kill(normalizer)
    finally:
        ray.shutdown()
    print(f"done in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
