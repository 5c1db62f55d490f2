"""The plot (``benchmarks.png``): latency against consumers, one panel per fan-out scenario.

By default it goes to ``docs/assets/``, where the user docs show it; the report links it by
its path relative to the report. Optional: without matplotlib the report says so instead of the picture.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .fmt import _floor_cell, _target_us
from .results import Scenario


def render_plot(scenarios: dict[str, Scenario], meta: dict[str, Any], path: str, link: str | None = None) -> str:
    """Latency against consumers, one panel per fan-out scenario, saved at ``path``; returns a line
    for the report, which links the picture as ``link`` (default: its file name, next to the report)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"No plot: matplotlib does not import here ({type(exc).__name__}: {exc})."
    panels = [s for s in scenarios.values() if s.plot and s.row_label == "consumers"]
    if not panels:
        return "No plot: no scenario with a consumer axis was run."
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax, scenario in zip(axes.flat, panels, strict=False):
        if scenario.floor is not None:
            xs = [int(r) for r in scenario.rows if _floor_cell(scenarios, scenario, r) is not None]
            ys = [c.median_us for r in scenario.rows if (c := _floor_cell(scenarios, scenario, r)) is not None]
            if xs:
                ax.plot(xs, ys, "k--", marker="o", label=f"floor ({scenario.floor[1]}, small tuple)")
        for name, series in scenario.systems.items():
            points = [(int(r), series.cells[r].median_us) for r in scenario.rows if r in series.cells]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        goals = [(int(r), us) for r, t in scenario.targets.items() if (us := _target_us(scenarios, scenario, r, t))]
        if goals:
            ax.plot([x for x, _ in goals], [y for _, y in goals], "rv", linestyle="none", label="target (at most)")
        ax.set_title(scenario.title, fontsize=9)
        ax.set_xlabel("consumers")
        ax.set_ylabel("median latency per iteration (us)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([int(r) for r in scenario.rows])
        ax.set_xticklabels(scenario.rows)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"gpushare benchmarks: {meta['device']}, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"![median latency against the number of consumers]({link or os.path.basename(path)})"
