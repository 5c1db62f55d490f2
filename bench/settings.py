"""Constants of every scenario, the run's configuration, targets and the bench's error.

One place for the numbers a report prints (sizes, counts, timeouts, targets), so the
scenario modules, the consumers and the report writers agree on them.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .stats import Target

#: Where the reports go, relative to the checkout (the bench is a tool of the repository,
#: not part of the library's wheel): the full report and its data for the developers, the
#: plot where the user docs show it. Run folders go under ``REPORT_DIR/runs/`` (``--out``).
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT_DIR = os.path.join("dev", "benchmarks")
PLOT_PATH = os.path.join("docs", "assets", "benchmarks.png")
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
PLOT_NAME = "benchmarks.png"  # the plot's name next to the reports, when --out is given

MiB = 1 << 20
GiB = 1 << 30
HANDOFF_BYTES = 1 * MiB
HANDOFF_SHAPE = (HANDOFF_BYTES // 4,)  # float32
HOST_BYTES = 64 * MiB
HOST_SHAPE = (HOST_BYTES // 4,)
CONSUMERS = (1, 2, 4, 8)
HOST_CONSUMERS = (1, 2, 4)
READY_TIMEOUT = 180.0  # seconds for N spawned consumers to import and set up (torch is slow)
ACK_TIMEOUT = 60.0  # seconds for one ack; only a stuck or dead consumer takes this long
JOIN_TIMEOUT = 10.0
SETTLE_TIMEOUT = 10.0

#: The CUDA backends measured by default, in column order; any other CUDA backend the
#: library lists in ``gpushare._backends.BACKENDS`` is added after them.
CUDA_BACKENDS = ("cuda_ipc", "cuda_vmm", "cuda_pool")
HOST_BACKEND = "host"

PEER_SHAPE = (256 << 20,)  # float32: 1 GiB
PEER_HOME = 0  # the GPU the producer allocates on
PEER_DEVICE = 1  # the consumer's GPU, which reads the memory over the peer link
PEER_ITERS = 20
PEER_ITERS_QUICK = 5
PEER_WARMUP = 3
PEER_WARMUP_QUICK = 2
PEER_TARGET = 0.90  # the mapped buffer's peer-read rate, as a fraction of a plain tensor's
PEER_TIMEOUT = 300.0  # seconds for the consumer's whole measurement (maps 1 GiB, allocates 3 GiB, copies)
PEER_PEER_MAPPED = "peer read, mapped buffer"
PEER_PEER_PLAIN = "peer read, plain tensor"
PEER_LOCAL_MAPPED = "local copy, mapped buffer"
PEER_LOCAL_PLAIN = "local copy, plain tensor"
PEER_SYSTEMS = (PEER_PEER_MAPPED, PEER_PEER_PLAIN, PEER_LOCAL_MAPPED, PEER_LOCAL_PLAIN)

FLOOR_SCENARIO = "floors"
FLOOR_SYSTEM = "mp.Queue"
GPUSHARE = "gpushare"
TORCH = "torch.multiprocessing"
CUDA_CORE = "cuda.core IPC pool"
PIPE_FLOOR_SYSTEM = "mp.Pipe"


# ring: fan-out of one ring slot to N consumers, against the Pipe floor
RING_SLOTS = 4
RING_GET_TIMEOUT = 1.0  # seconds a consumer's get() waits before it checks for a stop request
FIRST_SHARE_TARGET = Target("ratio_max", 2.0)  # 2 MiB, to the raw driver sequence (issue 9)
RAW_DRIVER = "raw driver"  # the legacy IPC sequence: first_share's floor
RAW_VMM = "raw driver, VMM fd"  # cuda_vmm's own bare sequence, shown next to it
RAW_POOL = "raw driver, IPC pool"  # cuda_pool's
RING_TARGETS = {"1": Target("ratio_max", 1.0), "4": Target("us_max", 60.0), "8": Target("us_max", 100.0)}  # issue 9
RING_SPIN = 0.005  # seconds: the spin= of the ring's "spin" columns (both ends busy-wait that long)

# throughput: pipelined handoffs to one consumer, the producer never waiting for each ack
STREAM_SIZES = (1 * MiB, 64 * MiB)
STREAM_WINDOW = 8  # queue systems: at most this many items put and not yet acked
STREAM_ACK_EVERY = 4  # queue systems: the consumer acks every this many items (with its count so far)
STREAM_COUNT = 2000  # items per timed repeat
STREAM_COUNT_QUICK = 1000
STREAM_WARMUP = 200
STREAM_WARMUP_QUICK = 100
STREAM_REPEATS = 5
STREAM_REPEATS_QUICK = 3
STREAM_TARGET = Target("rate_min", 30_000.0)  # gpushare's Queue, 1 MiB
STREAM_RING_TARGET = Target("rate_min", 100_000.0)  # gpushare's ring, 1 MiB
STREAM_TARGET_ROW = "1 MiB"
STREAM_FLOOR = "mp.Queue (small tuple)"
STREAM_TORCH = "torch.multiprocessing Queue"

# kernel_read: a reduction over a mapped 1 GiB buffer against one over a local tensor
KERNEL_SHAPE = (256 << 20,)  # float32: 1 GiB
KERNEL_DEVICE = 0
KERNEL_ITERS = 10
KERNEL_ITERS_QUICK = 5
KERNEL_WARMUP = 3
KERNEL_WARMUP_QUICK = 2
KERNEL_TARGET = 0.97  # the mapped buffer's read bandwidth, as a fraction of the local tensor's
KERNEL_TIMEOUT = 300.0  # seconds for the consumer's whole measurement
KERNEL_MAPPED = "x.sum() on the mapped buffer"
KERNEL_LOCAL = "x.sum() on a local tensor"
KERNEL_SYSTEMS = (KERNEL_MAPPED, KERNEL_LOCAL)


class BenchError(RuntimeError):
    """A consumer failed, died or did not answer in time."""


@dataclass
class Config:
    out: str
    quick: bool
    backend: str  # "cuda" or "host"
    iters: int
    warmup: int
    heavy_iters: int
    heavy_warmup: int
    consumers: tuple[int, ...]
    host_consumers: tuple[int, ...]
    only: frozenset[str] | None
    backends: tuple[str, ...] = CUDA_BACKENDS  # gpushare CUDA backends, one column each
    peer_iters: int = PEER_ITERS
    peer_warmup: int = PEER_WARMUP
    stream_count: int = STREAM_COUNT
    stream_warmup: int = STREAM_WARMUP
    stream_repeats: int = STREAM_REPEATS
    kernel_iters: int = KERNEL_ITERS
    kernel_warmup: int = KERNEL_WARMUP
    rounds: int = 1  # every task runs once per round; a cell pools its rounds' samples
    max_seconds: float | None = None  # no round is started that would end past this
    render: list[str] | None = None  # report.json files to render again into ``out``; nothing is measured
    plot: str | None = None  # the plot's path; None: PLOT_NAME in ``out``


def _cuda_core() -> Any:
    """cuda.core's memory-IPC names: top level (1.x) or ``experimental`` (0.x)."""
    names = ("Device", "DeviceMemoryResource", "DeviceMemoryResourceOptions")
    errors = []
    for module_name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = importlib.import_module(module_name)
            return SimpleNamespace(**{name: getattr(module, name) for name in names}, module=module)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
    raise ImportError("; ".join(errors))


def _gpushare() -> Any:
    """The public facade (its multiprocessing names are set at import, which mypy cannot see)."""
    return importlib.import_module("gpushare")


def _version_of(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "not installed"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


#: The note under tables with one gpushare column per backend.
GS_NOTE = (
    "gpushare columns: one per backend, chosen per allocation (`Manager.empty(..., backend=name)`); "
    "each is measured in this run, next to the peers."
)
