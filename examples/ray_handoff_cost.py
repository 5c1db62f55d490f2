"""What a same-node handoff through Ray costs: a gpushare Buffer against a NumPy array.

One Ray actor on this node reads one element of what it is given and
answers. For each size the driver measures (medians over --repeat rounds):

* ``put``: ``ray.put`` alone (a Buffer: a lease and a ~200-byte
  descriptor; an array: a copy into Ray's object store);
* ``call``: an actor call with the object as its argument, answered
  (a Buffer: the actor leases it and maps the memory, cached after the
  first time; an array: Ray's zero-copy read from its object store);
* ``put+call``: ``ray.put`` then a call with the reference.

Needs Ray. Run: python examples/ray_handoff_cost.py [--sizes-mib 1 64] [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

import gpushare as mp


@ray.remote(num_cpus=0)
class Reader:
    def read(self, x: Any) -> float:
        return float(np.asarray(x.numpy() if isinstance(x, mp.Buffer) else x).flat[0])


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # first time: mapping opened, worker warm
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _measure(reader: Any, obj: Any, repeat: int) -> tuple[float, float, float]:
    put = _median_ms(lambda: ray.put(obj), repeat)
    call = _median_ms(lambda: ray.get(reader.read.remote(obj), timeout=120), repeat)
    both = _median_ms(lambda: ray.get(reader.read.remote(ray.put(obj)), timeout=120), repeat)
    return put, call, both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        reader = Reader.remote()
        ray.get(reader.read.remote(np.zeros(1)), timeout=120)
        rows = []
        tiny = np.zeros(2, dtype=np.float32)  # Ray's own floor: an 8-byte array travels inline
        rows.append((0, "8-byte numpy array (Ray's floor)", *_measure(reader, tiny, args.repeat)))
        with mp.Manager() as manager:
            for mib in args.sizes_mib:
                array = np.ones(mib * 2**20 // 4, dtype=np.float32)
                buf = manager.from_numpy(array)
                for name, obj in (("numpy array", array), (f"gpushare Buffer ({buf.backend})", buf)):
                    rows.append((mib, name, *_measure(reader, obj, args.repeat)))
                buf.release()
        print("| size | object | ray.put | actor call with it | ray.put + call |")
        print("|---|---|---|---|---|")
        for mib, name, put, call, both in rows:
            size = f"{mib} MiB" if mib else "8 B"
            print(f"| {size} | {name} | {put:.2f} ms | {call:.2f} ms | {both:.2f} ms |")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
