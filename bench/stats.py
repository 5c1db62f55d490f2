"""A cell's statistics (``Cell``: median, p90, mean, minimum of its samples) and a row's goal (``Target``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Cell:
    median_us: float
    p90_us: float
    mean_us: float
    min_us: float
    n: int

    @classmethod
    def of(cls, samples_ns: list[int]) -> Cell:
        us = np.asarray(samples_ns, dtype=np.float64) / 1000.0
        return cls(
            median_us=round(float(np.median(us)), 2),
            p90_us=round(float(np.percentile(us, 90)), 2),
            mean_us=round(float(us.mean()), 2),
            min_us=round(float(us.min()), 2),
            n=len(samples_ns),
        )


@dataclass(frozen=True)
class Target:
    """A goal printed next to a row: ``ratio_max`` (median / floor <= limit), ``us_max``
    (median <= limit us) or ``rate_min`` (items per second >= limit, from a time per item)."""

    kind: str
    limit: float

    def text(self, floor: str = "the floor") -> str:
        if self.kind == "ratio_max":
            return f"<= {self.limit:g}x {floor}"
        if self.kind == "us_max":
            return f"<= {self.limit:g} us"
        return f">= {self.limit:,.0f}/s"

    def met(self, cell: Cell | None, floor: Cell | None = None) -> bool | None:
        """Whether ``cell`` meets it; None when it cannot be judged (no cell, no floor)."""
        if cell is None or cell.median_us <= 0:
            return None
        if self.kind == "ratio_max":
            if floor is None or floor.median_us <= 0:
                return None
            return cell.median_us / floor.median_us <= self.limit
        if self.kind == "us_max":
            return cell.median_us <= self.limit
        return 1e6 / cell.median_us >= self.limit
