"""The scenario registry: one module per scenario family, run and reported in this order.

A scenario module defines ``KEYS`` (the scenario keys it adds, ``--only``'s choices),
``plan(bench)`` (add its ``Scenario`` with ``bench.add`` and one ``bench.task`` per cell)
and the functions its tasks run; optionally ``HOW``, a paragraph for the report's
"How measured". Registering it is one line in ``MODULES``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Module names under this package, in the order their scenarios are planned and reported.
MODULES = (
    "floors",
    "startup",
    "handoff",
    "ring",
    "throughput",
    "queue",
    "first_share",
    "peer_read",
    "kernel_read",
    "host_arrays",
    "dataloader",
    "dataloader_gpu",
    "dataloader_cpu",
    "weight_sync",
    "torch_mp",
    "ray_transport",
)


def scenario_modules() -> list[ModuleType]:
    """The registered scenario modules, imported, in ``MODULES`` order."""
    return [importlib.import_module(f"{__name__}.{name}") for name in MODULES]
