"""The JSON report (``report.json``): every median, p90, mean and minimum, skips, errors, targets.

It holds what the Markdown report is rendered from, so :func:`scenarios_from_json` can
rebuild the scenarios and ``python -m bench --render report.json`` can write
the Markdown again (after a fix to a table, say) without measuring anything.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .fmt import _floor_cell, _goal_status, _kernel_row, _peer_row, _rate, _rate_floor
from .results import Check, Goal, Scenario, Series, Table
from .settings import KERNEL_TARGET, PEER_TARGET, STREAM_ACK_EVERY, STREAM_WINDOW, Target
from .stats import Cell


def render_json(scenarios: dict[str, Scenario], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "scenarios": {key: _scenario_json(scenarios, s) for key, s in scenarios.items()}}


def _scenario_json(scenarios: dict[str, Scenario], s: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {
        "title": s.title,
        "row_label": s.row_label,
        "rows": s.rows,
        "kind": s.kind,
        "skipped": s.skipped,
        "floor": list(s.floor) if s.floor else None,
        "floor_row": s.floor_row,
        "notes": s.notes,
        "systems": {
            name: {
                "skipped": series.skipped,
                "errors": series.errors,
                "cells": {row: asdict(cell) for row, cell in series.cells.items()},
                **({"skips": series.skips} if series.skips else {}),
            }
            for name, series in s.systems.items()
        },
    }
    # How the tables are drawn (scenarios_from_json reads them back).
    if s.ratio_systems is not None:
        out["ratio_systems"] = s.ratio_systems
    if s.extra_ratios:
        out["extra_ratios"] = [list(pair) for pair in s.extra_ratios]
    if s.target_systems is not None:
        out["target_systems"] = s.target_systems
    if not s.plot:
        out["plot"] = False
    if s.system_targets:
        out["system_targets"] = {
            name: {row: [target.kind, target.limit] for row, target in own.items()}
            for name, own in s.system_targets.items()
        }
    if s.row_skips or s.row_errors:
        out["row_skips"] = s.row_skips
        out["row_errors"] = s.row_errors
    if s.targets:
        out["targets"] = {row: _target_json(scenarios, s, row, target) for row, target in s.targets.items()}
    if s.goals:
        out["goals"] = [
            {
                "system": goal.system,
                "row": goal.row,
                "text": goal.text,
                "kind": goal.target.kind,
                "limit": goal.target.limit,
                "against": list(goal.against) or (list(s.floor) if s.floor else None),
                "met": met,
                "measured": figure,
            }
            for goal in s.goals
            for met, figure in [_goal_status(scenarios, s, goal)]
        ]
    if s.checks:
        out["checks"] = [asdict(check) for check in s.checks]
    if s.tables:
        out["tables"] = [asdict(table) for table in s.tables]
    if s.details:
        out["details"] = s.details
    if s.throughput_bytes:
        out["throughput_bytes"] = s.throughput_bytes
    if s.kind == "rate":
        # The cells above are times per item (us); this is the table of the report, in items/s.
        out["window"] = STREAM_WINDOW
        out["ack_every"] = STREAM_ACK_EVERY
        out["table"] = {
            row: {
                name: {
                    "items_per_s": None if (r := _rate(cell)) is None else round(r, 1),
                    "items_per_s_p10": None if (r := _rate(cell, p90=True)) is None else round(r, 1),
                    "us_per_item": cell.median_us,
                }
                for name, series in s.systems.items()
                if (cell := series.cells.get(row)) is not None
            }
            for row in s.rows
        }
    if s.kind == "kernel":
        out["bytes_per_sum"] = s.throughput_bytes
        out["target_ratio"] = KERNEL_TARGET
        out["table"] = {row: _kernel_row(s, row) for row in s.rows if any(row in x.cells for x in s.systems.values())}
    if s.kind == "throughput":
        # The cells above are times of one copy (us); this is the table of the report, in GB/s.
        out["bytes_per_copy"] = s.throughput_bytes
        out["target_ratio"] = PEER_TARGET
        out["table"] = {row: _peer_row(s, row) for row in s.rows if any(row in x.cells for x in s.systems.values())}
    return out


def _target_json(scenarios: dict[str, Scenario], s: Scenario, row: str, target: Target) -> dict[str, Any]:
    floor = _rate_floor(s, row) if s.kind == "rate" else _floor_cell(scenarios, s, row)
    return {
        "kind": target.kind,
        "limit": target.limit,
        "text": target.text("floor"),
        "floor": None if s.floor is None else list(s.floor),
        "met": {
            name: own.met(series.cells.get(row), floor)
            for name, series in s.systems.items()
            if series.skipped is None
            and (s.target_systems is None or name in s.target_systems)
            and (own := s.target_for(name, row)) is not None
        },
        # systems judged on a goal of their own at this row (the ring's rate)
        "system_limits": {
            name: own[row].limit
            for name, own in s.system_targets.items()
            if row in own and name in s.systems and s.systems[name].skipped is None
        },
    }


def scenarios_from_json(report: dict[str, Any]) -> dict[str, Scenario]:
    """The scenarios a ``report.json`` was written from, to render them again.

    Derived fields (ratios, verdicts, rates) are recomputed by the renderers; a report
    written before a field was stored gets that field's default."""
    out: dict[str, Scenario] = {}
    for key, s in report["scenarios"].items():
        scenario = Scenario(
            key=key,
            title=s["title"],
            row_label=s["row_label"],
            rows=list(s["rows"]),
            kind=s["kind"],
            skipped=s.get("skipped"),
            floor=tuple(s["floor"]) if s.get("floor") else None,  # type: ignore[arg-type]
            floor_row=s.get("floor_row"),
            notes=list(s.get("notes", [])),
            ratio_systems=s.get("ratio_systems"),
            extra_ratios=[(a, b) for a, b in s.get("extra_ratios", [])],
            target_systems=s.get("target_systems"),
            plot=s.get("plot", True),
            throughput_bytes=s.get("throughput_bytes") or s.get("bytes_per_copy") or s.get("bytes_per_sum") or 0,
            row_skips=dict(s.get("row_skips", {})),
            row_errors=dict(s.get("row_errors", {})),
            details=dict(s.get("details", {})),
        )
        for name, series in s["systems"].items():
            scenario.systems[name] = Series(
                cells={row: Cell(**cell) for row, cell in series["cells"].items()},
                skipped=series.get("skipped"),
                errors=dict(series.get("errors", {})),
                skips=dict(series.get("skips", {})),
            )
        for row, target in s.get("targets", {}).items():
            scenario.targets[row] = Target(target["kind"], target["limit"])
            if "system_targets" not in s:  # an older report: a system's own goal had the row's kind
                for name, limit in target.get("system_limits", {}).items():
                    scenario.system_targets.setdefault(name, {})[row] = Target(target["kind"], limit)
        for name, own in s.get("system_targets", {}).items():
            scenario.system_targets[name] = {row: Target(kind, limit) for row, (kind, limit) in own.items()}
        for goal in s.get("goals", []):
            against = tuple(goal["against"] or ())
            if scenario.floor is not None and against == scenario.floor:
                against = ()  # written out as the floor it stood for
            target = Target(goal["kind"], goal["limit"])
            scenario.goals.append(Goal(goal["system"], goal["row"], target, goal["text"], against))
        scenario.checks = [Check(**check) for check in s.get("checks", [])]
        scenario.tables = [Table(**table) for table in s.get("tables", [])]
        out[key] = scenario
    return out
