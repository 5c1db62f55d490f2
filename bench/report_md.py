"""The markdown report (``report.md``): the machine, how it was measured, one table per scenario.

Latency scenarios share one table layout (floor, systems, ratios, targets); the ``rate``,
``throughput`` (peer_read) and ``kernel`` kinds have their own. Below each table: skipped
columns, errors and notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .fmt import (
    _floor_cell,
    _fmt_cell,
    _fmt_gbps,
    _fmt_rate,
    _goal_status,
    _kernel_row,
    _met_text,
    _peer_row,
    _rate,
    _rate_floor,
    _ratio,
)
from .results import Scenario
from .scenarios import scenario_modules
from .settings import KERNEL_LOCAL, KERNEL_MAPPED, KERNEL_TARGET, PEER_TARGET, STREAM_FLOOR


def render_markdown(scenarios: dict[str, Scenario], meta: dict[str, Any], plot_note: str) -> str:
    lines = [
        "# gpushare benchmarks",
        "",
        f"Written by `python -m bench` on {meta['date']}; run it again rather than editing this file.",
        "",
        "| | |",
        "|---|---|",
    ]
    for label, key in (
        ("device", "device"),
        ("driver", "driver"),
        ("CUDA (driver API)", "cuda_driver_api"),
        ("cuda-bindings", "cuda_bindings"),
        ("python", "python"),
        ("gpushare", "gpushare"),
        ("torch", "torch"),
        ("cuda-core", "cuda_core"),
        ("numpy", "numpy"),
        ("gpushare backend", "backend"),
        ("gpushare CUDA backends", "backends"),
        ("GPUs", "gpus"),
        ("gpushare's copy kernel", "copy_kernel"),
        ("CPUs", "cpus"),
        ("platform", "platform"),
    ):
        if key == "copy_kernel" and key not in meta:
            continue  # runs before the kernel (2026-11-26) or on the host
        lines.append(f"| {label} | {meta.get(key)} |")
    lines.append(
        f"| iterations | {meta['iters']} timed after {meta['warmup']} warm-up "
        f"({meta['heavy_iters']} for first shares and host arrays of 64 MiB or more)"
        f"{'; --quick' if meta['quick'] else ''} |"
    )
    rounds, run = meta.get("rounds", 1), meta.get("rounds_run", 1)
    if rounds > 1 or run > 1:
        lines.append(
            f"| rounds | {run} of {rounds} run: every cell once per round, in the same order; a cell's median "
            "and p90 are over its samples of all rounds |"
        )
    if meta.get("partial"):
        lines.append(f"| cut short | written after {meta['partial']}: the cells after it were not measured |")
    runs = meta.get("runs") or []
    if len(runs) > 1:
        lines += [
            "",
            f"This report joins {len(runs)} runs (`python -m bench --render A.json --render B.json ...`); "
            "the table above is the first run's. Each scenario comes from the run that lists it:",
            "",
            "| run | device | torch | scenarios |",
            "|---|---|---|---|",
        ]
        for run in runs:
            quick = ", --quick" if run.get("quick") else ""
            names = ", ".join(f"`{key}`" for key in run["scenarios"])
            lines.append(f"| {run['date']}{quick} | {run['device']} | {run['torch']} | {names} |")
    lines += [
        "",
        "## How measured",
        "",
        "One producer process and N consumer processes, all started with spawn. Consumers are started once "
        "per cell (scenario, system, N), warmed up, then reused for every timed iteration. One iteration is: "
        "produce the item (or reuse it), put it on the transport once per consumer, and wait until every "
        "consumer has acknowledged it; each consumer gets the item, touches it (device pointer, first "
        "element) and lets it go before acking. The iteration is timed with `time.perf_counter_ns` with the "
        "producer's garbage collector off. Cells show the median and, in parentheses, the 90th percentile, "
        "in microseconds; ratio columns divide medians by the floor: the same pattern carrying a small "
        "tuple through `multiprocessing.Queue` (the first table), which no handoff can beat.",
        "",
        "gpushare has one column per backend (`--backends`; `Manager.empty(..., backend=name)` picks it per "
        "allocation), measured in the same run as the peers, each with its own ratio to the floor. A backend this "
        "machine cannot run (`BackendUnavailableError`) is listed as a skipped column with the reason.",
        "",
    ]
    # Each scenario module may explain itself (its HOW), in the registry's order.
    for module in scenario_modules():
        how = getattr(module, "HOW", "")
        if how:
            lines += [how, ""]
    lines += [
        "**Absolute times mean something only on a GPU machine** (and only on one like the one named above): "
        "CPU count, scheduler noise and the host-only backend change them a lot. Compare ratios to the floor, "
        "which were measured in the same run and the same pattern.",
        "",
    ]
    for scenario in scenarios.values():
        try:
            lines += _render_scenario(scenarios, scenario)
        except Exception as exc:  # one table's bug must not cost the others
            lines += [
                f"## {scenario.title}",
                "",
                f"`{scenario.key}`: this table failed to render ({type(exc).__name__}: {exc}); its figures are in "
                "report.json, and `python -m bench --render report.json` renders it again.",
                "",
            ]
    lines += ["## Plot", "", plot_note, ""]
    return "\n".join(lines)


def _render_scenario(scenarios: dict[str, Scenario], scenario: Scenario) -> list[str]:
    if scenario.skipped is not None:
        return [f"## {scenario.title}", "", f"`{scenario.key}`: skipped: {scenario.skipped}", ""]
    if scenario.kind == "throughput":
        return [f"## {scenario.title}", "", *_render_peer_read(scenario)]
    if scenario.kind == "kernel":
        return [f"## {scenario.title}", "", *_render_kernel_read(scenario)]
    if scenario.kind == "rate":
        return [f"## {scenario.title}", "", *_render_rate(scenario)]
    systems = [name for name, s in scenario.systems.items() if s.skipped is None]
    if scenario.floor is not None and scenario.floor[0] == scenario.key:
        systems = [name for name in systems if name != scenario.floor[1]]  # shown once, as the floor
    wanted = scenario.ratio_systems
    ratio_systems = [n for n in systems if scenario.floor is not None and (wanted is None or n in wanted)]
    judged = _judged(scenario, systems)
    header = [scenario.row_label]
    if scenario.floor is not None:
        header.append(f"floor ({scenario.floor[1]})")
    header += systems
    header += [f"{name} / floor" for name in ratio_systems]
    header += [f"{a} / {b}" for a, b in scenario.extra_ratios]
    if scenario.targets:
        header.append("target")
        header += [f"{name}: target" for name in judged]
    out = [f"## {scenario.title}", "", f"`{scenario.key}`: median us (p90 us)", ""]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for row in scenario.rows:
        floor = _floor_cell(scenarios, scenario, row)
        cells = [row]
        if scenario.floor is not None:
            cells.append(_fmt_cell(floor))
        cells += [_fmt_cell(scenario.systems[name].cells.get(row)) for name in systems]
        cells += [_ratio(scenario.systems[name].cells.get(row), floor) for name in ratio_systems]
        for a, b in scenario.extra_ratios:
            sa, sb = scenario.systems.get(a), scenario.systems.get(b)
            cells.append(_ratio(sa.cells.get(row) if sa else None, sb.cells.get(row) if sb else None))
        if scenario.targets:
            target = scenario.targets.get(row)
            cells.append("-" if target is None else target.text("floor"))
            for name in judged:
                met = None if target is None else target.met(scenario.systems[name].cells.get(row), floor)
                cells.append(_met_text(met))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    if scenario.targets and scenario.floor is not None:
        goals = "; ".join(
            f"{scenario.row_label} {row}: {target.text(f'the {scenario.floor[1]} floor')}"
            for row, target in scenario.targets.items()
        )
        out.append(f"- Targets (median): {goals}.")
    for goal in scenario.goals:
        met, figure = _goal_status(scenarios, scenario, goal)
        out.append(f"- Target, {scenario.row_label} {goal.row}: {goal.text}: {_met_text(met)} ({figure}).")
    for check in scenario.checks:
        out.append(
            f"- Target, {scenario.row_label} {check.row}: {check.text}: {_met_text(check.met)} ({check.measured})."
        )
    out += _render_memory(scenario)
    out += _render_tables(scenario)
    return _with_trailer(out, scenario)


def _render_memory(scenario: Scenario) -> list[str]:
    """A scenario's device memory per cell (``details["memory"]``: row -> system -> figures), as a table."""
    memory = scenario.details.get("memory")
    if not memory:
        return []
    systems = [name for name in scenario.systems if any(name in memory.get(row, {}) for row in scenario.rows)]
    out = [
        "",
        f"`{scenario.key}` device memory, MiB: in use by the trainer and the engines once set up "
        "(growth over the timed syncs)",
        "",
        "| " + " | ".join([scenario.row_label, *systems]) + " |",
        "|" + "|".join("---" for _ in range(len(systems) + 1)) + "|",
    ]
    for row in scenario.rows:
        cells = [row]
        for name in systems:
            figures = memory.get(row, {}).get(name)
            cells.append("-" if figures is None else f"{figures['used_mib']:,} ({figures['growth_mib']:+,})")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    return out


def _render_tables(scenario: Scenario) -> list[str]:
    """A scenario's extra tables (``scenario.tables``), each under its caption."""
    out: list[str] = []
    for table in scenario.tables:
        out += ([] if out else [""]) + [table.caption, "", "| " + " | ".join(table.header) + " |"]
        out.append("|" + "|".join("---" for _ in table.header) + "|")
        out += ["| " + " | ".join(cells) + " |" for cells in table.rows]
        out.append("")
    return out


def _with_trailer(out: list[str], scenario: Scenario) -> list[str]:
    """``out`` followed by the skipped columns, errors and notes, ending with a blank line."""
    out = list(out)
    for name, series in scenario.systems.items():
        if series.skipped is not None:
            out.append(f"- {name}: skipped: {series.skipped}")
        for row, reason in series.skips.items():
            out.append(f"- {name}, {scenario.row_label} {row}: skipped: {reason}")
        for row, error in series.errors.items():
            out.append(f"- {name}, {scenario.row_label} {row}: error: {error}")
    for row, reason in scenario.row_skips.items():
        out.append(f"- {scenario.row_label} {row}: skipped: {reason}")
    for row, error in scenario.row_errors.items():
        out.append(f"- {scenario.row_label} {row}: error: {error}")
    for note in scenario.notes:
        out.append(f"- {note}")
    if not out or out[-1] != "":
        out.append("")
    return out


def _judged(scenario: Scenario, systems: Sequence[str]) -> list[str]:
    """The systems (among ``systems``) judged against the scenario's targets."""
    if not scenario.targets:
        return []
    wanted = scenario.target_systems
    return [name for name in systems if wanted is None or name in wanted]


def _render_rate(scenario: Scenario) -> list[str]:
    """One row per system (the sizes are columns: the systems are many, the sizes few)."""
    systems = [name for name, s in scenario.systems.items() if s.skipped is None]
    has_floor = STREAM_FLOOR in systems
    judged = _judged(scenario, systems)
    goals = [(row, target) for row, target in scenario.targets.items() if row in scenario.rows]
    out = [
        f"`{scenario.key}`: items per second, median over the timed repeats (10th percentile)"
        + (f"; `/ floor`: that rate over the {STREAM_FLOOR} rate of the same size" if has_floor else ""),
        "",
    ]
    header = ["system", *(f"{row} (items/s)" for row in scenario.rows)]
    if has_floor:
        header += [f"{row} / floor" for row in scenario.rows]
    header += [f"target at {row}" for row, _ in goals]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for name in systems:
        series = scenario.systems[name]
        cells = [f"{name} (floor)" if name == STREAM_FLOOR else name]
        for row in scenario.rows:
            cell = series.cells.get(row)
            cells.append("-" if cell is None else f"{_fmt_rate(_rate(cell))} ({_fmt_rate(_rate(cell, p90=True))})")
        if has_floor:
            for row in scenario.rows:
                rate, floor = _rate(series.cells.get(row)), _rate(_rate_floor(scenario, row))
                cells.append("-" if rate is None or not floor else f"{rate / floor:.2f}")
        for row, _ in goals:
            own = scenario.target_for(name, row)
            met = None if own is None else own.met(series.cells.get(row))
            cells.append(f"{own.text()}: {_met_text(met)}" if name in judged and own is not None else "-")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    return _with_trailer(out, scenario)


def _render_peer_read(scenario: Scenario) -> list[str]:
    out = [
        f"`{scenario.key}`: GB/s (bytes copied once / median time of one copy); "
        f"target: mapped / plain >= {PEER_TARGET:.2f}",
        "",
    ]
    header = [
        scenario.row_label,
        "peer read of the mapped buffer (GB/s)",
        "peer read of a plain tensor (GB/s)",
        "mapped / plain",
        "local copy of the mapped buffer (GB/s)",
        "local copy of a plain tensor (GB/s)",
    ]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    below = []
    for row in scenario.rows:
        values = _peer_row(scenario, row)
        ratio = values["ratio"]
        if ratio is None:
            ratio_text = "-"
        else:
            ratio_text = f"{ratio:.2f}" + ("" if values["meets_target"] else " (below target)")
            if not values["meets_target"]:
                below.append(row)
        out.append(
            "| "
            + " | ".join(
                [
                    row,
                    _fmt_gbps(values["peer_read_mapped_gb_s"]),
                    _fmt_gbps(values["peer_read_plain_gb_s"]),
                    ratio_text,
                    _fmt_gbps(values["local_copy_mapped_gb_s"]),
                    _fmt_gbps(values["local_copy_plain_gb_s"]),
                ]
            )
            + " |"
        )
    out.append("")
    for row, reason in scenario.row_skips.items():
        out.append(f"- {row}: skipped: {reason}")
    for row, error in scenario.row_errors.items():
        out.append(f"- {row}: error: {error}")
    for name, series in scenario.systems.items():
        for row, error in series.errors.items():
            out.append(f"- {name}, {row}: error: {error}")
    if below:
        out.append(f"- Below the {PEER_TARGET:.2f} target: {', '.join(below)}.")
    for row, info in scenario.details.items():
        access = info.get("torch_peer_access")
        if access is False:
            out.append(f"- {row}: torch reports no peer access from {info.get('destination')} to {info.get('source')}.")
    for note in scenario.notes:
        out.append(f"- {note}")
    if out[-1] != "":
        out.append("")
    return out


def _render_kernel_read(scenario: Scenario) -> list[str]:
    out = [
        f"`{scenario.key}`: GB/s (bytes read once / median time of one `x.sum()`); "
        f"target: mapped / local >= {KERNEL_TARGET:.2f}",
        "",
    ]
    header = [scenario.row_label, f"{KERNEL_MAPPED} (GB/s)", f"{KERNEL_LOCAL} (GB/s)", "mapped / local", "target"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for row in scenario.rows:
        values = _kernel_row(scenario, row)
        ratio = values["ratio"]
        out.append(
            "| "
            + " | ".join(
                [
                    row,
                    _fmt_gbps(values["mapped_gb_s"]),
                    _fmt_gbps(values["local_gb_s"]),
                    "-" if ratio is None else f"{ratio:.3f}",
                    _met_text(values["meets_target"]),
                ]
            )
            + " |"
        )
    out.append("")
    return _with_trailer(out, scenario)
