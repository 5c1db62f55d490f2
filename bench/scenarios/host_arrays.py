"""``host``: a 64 MiB array on the host backend (always runs) against a pickled NumPy array."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..patterns import queue_fanout
from ..results import Scenario, _bind
from ..settings import HOST_SHAPE, _gpushare

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("host",)


def plan(bench: Bench) -> None:
    host_rows = [str(n) for n in bench.cfg.host_consumers]
    if not bench.add(
        Scenario(
            "host",
            "64 MiB float32 array to N consumers on the host: gpushare host backend vs a pickled array",
            "consumers",
            host_rows,
            ratio_systems=["gpushare (in place)"],
            extra_ratios=[("mp.Queue (pickled array)", "gpushare (in place)")],
        )
    ):
        return
    for n in bench.cfg.host_consumers:
        bench.task("host", "gpushare (in place)", str(n), _bind(host_gpushare, bench, n, False), None)
        bench.task("host", "gpushare (copy_from)", str(n), _bind(host_gpushare, bench, n, True), None)
        bench.task("host", "mp.Queue (pickled array)", str(n), _bind(host_pickled, bench, n), None)


def host_gpushare(bench: Bench, n: int, copy: bool) -> list[int]:
    gpushare = _gpushare()

    m = bench.manager()
    src = np.arange(HOST_SHAPE[0], dtype=np.float32)
    buf = m.from_numpy(src, device="cpu")
    view = buf.numpy()  # zero-copy on the host backend

    def produce(i: int) -> Any:
        if copy:
            buf.copy_from(src)
        else:
            view[0] = i  # the producer writes in place
        return buf

    try:
        return queue_fanout(
            bench,
            gpushare.get_context("spawn"),
            n,
            "gpushare_host",
            produce,
            process_kwargs={"device": "cpu"},
            heavy=True,
        )
    finally:
        buf.release()


def host_pickled(bench: Bench, n: int) -> list[int]:
    import multiprocessing

    src = np.arange(HOST_SHAPE[0], dtype=np.float32)

    def produce(i: int) -> Any:
        src[0] = i
        return src

    return queue_fanout(bench, multiprocessing.get_context("spawn"), n, "numpy", produce, heavy=True)
