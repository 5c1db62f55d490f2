"""Results: a cell's statistics, one system's series, a scenario's table, a planned task.

A ``Scenario`` is one table of the report (rows, one ``Series`` per system, its floor,
targets and notes); a ``Task`` is one cell to run (or to skip, with the reason).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .settings import FLOOR_SCENARIO, FLOOR_SYSTEM, _gpushare
from .stats import Cell, Target


@dataclass
class Series:
    """One system's results in one scenario, per row."""

    cells: dict[str, Cell] = field(default_factory=dict)
    skipped: str | None = None
    errors: dict[str, str] = field(default_factory=dict)
    skips: dict[str, str] = field(default_factory=dict)  # single cells skipped (the rest of the column runs)


@dataclass(frozen=True)
class Goal:
    """A target one system is judged on at one row, beyond the row's ``targets``.

    ``target`` is ``ratio_max`` against ``against`` (the fastest of those systems at the
    same row; empty: the scenario's floor) or ``us_max``. ``text`` says it in words.
    """

    system: str
    row: str
    target: Target
    text: str
    against: tuple[str, ...] = ()


@dataclass(frozen=True)
class Check:
    """A target the scenario judged itself, on figures that are no cell (device memory, say):
    its verdict (None: it could not be judged) and the figure it was judged on, in words."""

    row: str
    text: str
    met: bool | None
    measured: str


@dataclass
class Table:
    """An extra table under a scenario's own (memory per cell, say), written out as it is."""

    caption: str
    header: list[str]
    rows: list[list[str]]


@dataclass
class Scenario:
    key: str
    title: str
    row_label: str
    rows: list[str]
    systems: dict[str, Series] = field(default_factory=dict)
    floor: tuple[str, str] | None = (FLOOR_SCENARIO, FLOOR_SYSTEM)
    floor_row: str | None = None  # None: the same row of the floor scenario
    ratio_systems: list[str] | None = None  # systems with a "/ floor" column; None: all of them
    extra_ratios: list[tuple[str, str]] = field(default_factory=list)  # (numerator, denominator) systems
    notes: list[str] = field(default_factory=list)
    plot: bool = True
    # "latency" (us per iteration), "throughput" (peer_read: GB/s per copy), "rate" (items/s, from a
    # time per item) or "kernel" (kernel_read: GB/s per x.sum())
    kind: str = "latency"
    throughput_bytes: int = 0  # bytes one copy (or one x.sum()) moves, for "throughput" and "kernel"
    skipped: str | None = None  # the whole scenario cannot run here
    row_skips: dict[str, str] = field(default_factory=dict)  # rows that fill several systems at once
    row_errors: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)  # extra facts per row, for the JSON
    targets: dict[str, Target] = field(default_factory=dict)  # per row: the goal printed next to it
    target_systems: list[str] | None = None  # systems judged against the targets; None: all of them
    # per system, per row: a goal other than the row's (the ring's rate, next to the Queue's)
    system_targets: dict[str, dict[str, Target]] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)  # further targets, several per system and row
    checks: list[Check] = field(default_factory=list)  # targets judged by the scenario itself (memory)
    tables: list[Table] = field(default_factory=list)  # extra tables under the scenario's own

    def target_for(self, system: str, row: str) -> Target | None:
        """The goal ``system`` is judged on at ``row``: its own, else the row's."""
        own = self.system_targets.get(system, {}).get(row)
        return own if own is not None else self.targets.get(row)


Samples = list[int] | dict[str, list[int]]


@dataclass
class Task:
    scenario: str
    system: str | None  # None: the run fills several systems of its row (returns a dict)
    row: str
    run: Callable[[], Samples] | None
    skip: str | None = None
    cell: bool = False  # the skip is this cell's alone (e.g. it would not fit in memory), not its column's


def _bind(fn: Callable[..., Samples], *args: Any) -> Callable[[], Samples]:
    return lambda: fn(*args)


def _unavailable(exc: BaseException) -> bool:
    """True for gpushare's BackendUnavailableError: the backend cannot run on this machine."""
    try:
        cls = getattr(_gpushare(), "BackendUnavailableError", None)
    except Exception:
        return False
    return isinstance(cls, type) and isinstance(exc, cls)
