"""Formatting shared by the progress lines and the report writers."""

from __future__ import annotations

from typing import Any

from .results import Goal, Scenario
from .settings import (
    GPUSHARE,
    KERNEL_LOCAL,
    KERNEL_MAPPED,
    KERNEL_TARGET,
    PEER_LOCAL_MAPPED,
    PEER_LOCAL_PLAIN,
    PEER_PEER_MAPPED,
    PEER_PEER_PLAIN,
    PEER_TARGET,
    STREAM_FLOOR,
    GiB,
    MiB,
    Target,
)
from .stats import Cell


def _gs_label(backend: str) -> str:
    return f"{GPUSHARE} {backend}"


def _size_label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def _fmt_us(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _fmt_cell(cell: Cell | None) -> str:
    return "-" if cell is None else f"{_fmt_us(cell.median_us)} ({_fmt_us(cell.p90_us)})"


def _ratio(num: Cell | None, den: Cell | None) -> str:
    if num is None or den is None or den.median_us <= 0:
        return "-"
    ratio = num.median_us / den.median_us
    return f"{ratio:.0f}" if ratio >= 100 else f"{ratio:.1f}" if ratio >= 10 else f"{ratio:.2f}"


def _gbps(scenario: Scenario, cell: Cell | None) -> float | None:
    """Bytes copied once per second, in GB/s (10^9), from a cell of copy times."""
    if cell is None or cell.median_us <= 0 or scenario.throughput_bytes <= 0:
        return None
    return scenario.throughput_bytes / cell.median_us / 1e3


def _fmt_gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _floor_cell(bench_scenarios: dict[str, Scenario], scenario: Scenario, row: str) -> Cell | None:
    if scenario.floor is None:
        return None
    floor_scenario = bench_scenarios.get(scenario.floor[0])
    if floor_scenario is None:
        return None
    series = floor_scenario.systems.get(scenario.floor[1])
    return None if series is None else series.cells.get(scenario.floor_row or row)


def _met_text(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "not met"


def _rate(cell: Cell | None, p90: bool = False) -> float | None:
    """Items per second from a cell of times per item (the p90 time gives the 10th-percentile rate)."""
    if cell is None:
        return None
    us = cell.p90_us if p90 else cell.median_us
    return None if us <= 0 else 1e6 / us


def _fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _rate_floor(scenario: Scenario, row: str) -> Cell | None:
    series = scenario.systems.get(STREAM_FLOOR)
    return None if series is None else series.cells.get(row)


def _peer_row(scenario: Scenario, row: str) -> dict[str, Any]:
    """One backend's peer_read numbers (GB/s), the mapped/plain ratio and whether it meets the target."""

    def rate(system: str) -> float | None:
        series = scenario.systems.get(system)
        return _gbps(scenario, series.cells.get(row) if series else None)

    mapped, plain = rate(PEER_PEER_MAPPED), rate(PEER_PEER_PLAIN)
    ratio = None if mapped is None or not plain else mapped / plain
    return {
        "peer_read_mapped_gb_s": None if mapped is None else round(mapped, 1),
        "peer_read_plain_gb_s": None if plain is None else round(plain, 1),
        "ratio": None if ratio is None else round(ratio, 3),
        "meets_target": None if ratio is None else ratio >= PEER_TARGET,
        "local_copy_mapped_gb_s": None if (v := rate(PEER_LOCAL_MAPPED)) is None else round(v, 1),
        "local_copy_plain_gb_s": None if (v := rate(PEER_LOCAL_PLAIN)) is None else round(v, 1),
    }


def _kernel_row(scenario: Scenario, row: str) -> dict[str, Any]:
    """One backend's kernel_read numbers (GB/s), the mapped/local ratio and whether it meets the target."""

    def rate(system: str) -> float | None:
        series = scenario.systems.get(system)
        return _gbps(scenario, series.cells.get(row) if series else None)

    mapped, local = rate(KERNEL_MAPPED), rate(KERNEL_LOCAL)
    ratio = None if mapped is None or not local else mapped / local
    return {
        "mapped_gb_s": None if mapped is None else round(mapped, 1),
        "local_gb_s": None if local is None else round(local, 1),
        "ratio": None if ratio is None else round(ratio, 3),
        "meets_target": None if ratio is None else ratio >= KERNEL_TARGET,
    }


def _target_us(scenarios: dict[str, Scenario], scenario: Scenario, row: str, target: Target) -> float | None:
    """A latency target as a time (us) to plot, or None."""
    if target.kind == "us_max":
        return target.limit
    if target.kind == "ratio_max":
        floor = _floor_cell(scenarios, scenario, row)
        return None if floor is None else target.limit * floor.median_us
    return None


def _goal_status(bench_scenarios: dict[str, Scenario], scenario: Scenario, goal: Goal) -> tuple[bool | None, str]:
    """Whether ``goal`` is met (None: cannot be judged) and the measured figure it was judged on."""
    series = scenario.systems.get(goal.system)
    cell = None if series is None else series.cells.get(goal.row)
    if goal.target.kind == "us_max":
        return goal.target.met(cell), "-" if cell is None else f"{_fmt_us(cell.median_us)} us"
    if goal.against:
        found = [scenario.systems[n].cells.get(goal.row) for n in goal.against if n in scenario.systems]
        measured = [c for c in found if c is not None and c.median_us > 0]
        reference = min(measured, key=lambda c: c.median_us) if measured else None
    else:
        reference = _floor_cell(bench_scenarios, scenario, goal.row)
    ratio = _ratio(cell, reference)
    if ratio != "-" and goal.target.limit < 1 and cell is not None and cell.median_us > 0:
        # A "faster than" goal: say the speed-up (the reference's time over this one's) with the ratio.
        assert reference is not None
        return goal.target.met(cell, reference), f"{ratio}x, {_ratio(reference, cell)}x faster"
    return goal.target.met(cell, reference), ratio if ratio == "-" else f"{ratio}x"
