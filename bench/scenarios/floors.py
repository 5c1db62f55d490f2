"""``floors``: a small tuple to N consumers through a Pipe each, or through one Queue.

Every other table is read as a ratio to these (``ring``: to the Pipe floor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..peers import pipe_floor, queue_floor
from ..results import Scenario, _bind
from ..settings import FLOOR_SCENARIO

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = (FLOOR_SCENARIO,)


def plan(bench: Bench) -> None:
    if bench.add(
        Scenario(
            FLOOR_SCENARIO,
            "Handoff floors: a small tuple to N consumers, wait for every ack",
            "consumers",
            bench.rows(),
            floor=None,
            extra_ratios=[("mp.Queue", "mp.Pipe")],
        )
    ):
        for n in bench.cfg.consumers:
            bench.task(FLOOR_SCENARIO, "mp.Pipe", str(n), _bind(pipe_floor, bench, n), None)
            bench.task(FLOOR_SCENARIO, "mp.Queue", str(n), _bind(queue_floor, bench, n), None)
