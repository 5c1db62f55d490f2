"""Compare benchmark runs of two trees made on one machine: a table per scenario.

    python tools/bench_compare.py BEFORE.json[,BEFORE2.json...] AFTER.json[,AFTER2.json...]

Each side may name several report.json files (runs alternated between the two trees,
so both share the machine's drift); a cell's figure on a side is the median of its
runs' medians. Every cell holds a time (microseconds per item, per copy or per sync),
so the ratio column, after / before, below 1 is faster after.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def _cells(paths: str) -> tuple[dict[tuple[str, str, str], list[float]], list[str]]:
    values: dict[tuple[str, str, str], list[float]] = {}
    order: list[str] = []
    for path in paths.split(","):
        with open(path) as f:
            report: dict[str, Any] = json.load(f)
        for key, scenario in report["scenarios"].items():
            if key not in order:
                order.append(key)
            for system, data in scenario["systems"].items():
                for row, cell in (data.get("cells") or {}).items():
                    if cell.get("median_us") is not None:
                        values.setdefault((key, system, row), []).append(float(cell["median_us"]))
    return values, order


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, order = _cells(argv[0])
    after, _ = _cells(argv[1])
    scenario = None
    for key in sorted(set(before) & set(after), key=lambda k: (order.index(k[0]), k[1], k[2])):
        if key[0] != scenario:
            scenario = key[0]
            print(f"\n### {scenario}\n\n| system | row | before | after | after / before |\n|---|---|---|---|---|")
        b, a = statistics.median(before[key]), statistics.median(after[key])
        print(f"| {key[1]} | {key[2]} | {b:.4g} | {a:.4g} | {a / b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
