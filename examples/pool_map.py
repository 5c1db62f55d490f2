"""Pool.map over shared buffers: the workers are gpushare processes.

Each task carries a view of one shared batch (a descriptor, not the data);
the pool's workers map it and reduce their rows.

Run: python examples/pool_map.py
"""

from __future__ import annotations

import numpy as np

import gpushare as mp


def row_norm(item: tuple[int, mp.Buffer]) -> tuple[int, float]:
    row, buf = item
    values = buf.numpy()[row].astype(np.float64)
    return row, float(np.sqrt((values * values).sum()))


def main() -> None:
    data = np.arange(16 * 1000, dtype=np.float32).reshape(16, 1000)
    with mp.Manager() as manager:
        buf = manager.from_numpy(data)
        with mp.Pool(4) as pool:
            norms = dict(pool.map(row_norm, [(row, buf) for row in range(data.shape[0])]))
        expected = np.sqrt((data.astype(np.float64) ** 2).sum(axis=1))
        assert np.allclose([norms[r] for r in range(16)], expected)
        print(
            f"backend {buf.backend}: 16 row norms computed by pool workers, first {norms[0]:.2f}, last {norms[15]:.2f}"
        )


if __name__ == "__main__":
    main()
