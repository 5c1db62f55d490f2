"""Does an IPC memory pool keep device memory after its importers are SIGKILLed? (raw driver, no gpushare)

    python tests/driver_repro/cuda_pool_killed_importers.py --importers 50 --mode kill --json kill.json
    python tests/driver_repro/cuda_pool_killed_importers.py --matrix --max-seconds 400 --json matrix.json

The open finding (docs/reliability.md, "Chaos testing"): after about 50
importers of gpushare's ``cuda_pool`` backend were SIGKILLed, the owner's
device had 32-64 MiB less free memory (``cuMemGetInfo``) than at the start,
though every allocation was freed and the pool trimmed to 0. This script
does the same with ``cuda.bindings.driver`` alone, so that a shortfall here
is the driver's and no shortfall here points back at gpushare.

One run (a *variant*), on one device (``--device``, default 0):

1. Context: retain the primary context and make it current; a warm-up
   (an IPC pool created and exported, one buffer allocated and exported, one
   importer that imports it, frees its import and exits, the buffer freed,
   the pool trimmed and destroyed, its fd closed) so that the context's own
   one-time growth is done. Then the **baseline**: free bytes.
2. Owner: an IPC-enabled pool (PINNED, POSIX-fd handles, on the device,
   release threshold UINT64_MAX as gpushare sets it), exported to an fd
   *before* any pointer is exported (the driver refuses pointer exports
   before that).
3. Rounds (``--importers`` of them): allocate ``--buffers`` buffers of
   ``--size`` bytes (``cuMemAllocFromPoolAsync``), fill them, export each
   pointer (64 bytes), start an importer (``spawn``), hand it the pool fd by
   SCM_RIGHTS. The importer imports the pool and the pointers, checks it sees
   the owner's bytes, writes its own (``cuMemsetD8``, synchronised) and says
   "ready". The owner checks it sees the importer's bytes, then ``--mode
   kill`` SIGKILLs it, or ``--mode exit`` tells it to exit (after freeing its
   imports with ``cuMemFreeAsync`` under ``--importer-frees``); it reaps it,
   frees the buffers (``cuMemFreeAsync`` + ``cuStreamSynchronize``) and, with
   ``--trim every-round``, trims the pool to 0. Free memory is recorded at
   every step of the round, and after a short settle (``--settle``: a killed
   process's context may go back a little late), with the pool's reserved
   and used bytes. ``--reuse``: the buffers are allocated and exported once
   and every importer imports the same ones (gpushare recycles allocations);
   the owner frees them after the last round.
4. End phases, each measured: after the last round; after
   ``cuMemPoolTrimTo(pool, 0)`` (not with ``--trim never``); after
   ``cuMemPoolDestroy``; after closing the exported fd; after
   ``cuCtxSynchronize`` and ``--end-sleep`` seconds; with ``--recreate``,
   after a fresh pool was created, used once and destroyed.

Deltas are free bytes minus the baseline (negative: less free). The device
reports free memory in 2 MiB steps at best, so a difference of one 2 MiB
granule or less is never judged: "short" means more than one granule less.

``--matrix`` runs the useful variants one after another, each in its own
process (kill vs exit with and without the importer freeing, trim every
round vs at the end, ``--sizes`` 2 MiB and 32 MiB) in priority order until
``--max-seconds`` would be exceeded; between variants a fresh process
measures free memory (``--probe``), which shows memory missing even after
the owner exited. It prints one table and writes every measurement to
``--json``.

Exit status: 0 when everything was measured (a shortfall is a finding, not
a failure); 1 on an error of this script, the driver or an importer (every
message names the driver call and its ``CUDA_ERROR_*``); 2 on bad
arguments; 3 when there is no usable driver or GPU.

Only the standard library is imported at module level; ``cuda.bindings``
and numpy are imported where the GPU is used, so the pure parts (argument
parsing, the matrix plan, the report and the table) run anywhere.
``CUDA_POOL_REPRO_DRIVER=module`` replaces ``cuda.bindings.driver`` with
another module of the same shape (tests use ``fake_driver.py`` to run the
process orchestration on a CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing import reduction
from typing import Any

MiB = 1 << 20
GRANULE = 2 * MiB  # cuMemGetInfo's free bytes move in 2 MiB steps at best
EXPORT_BYTES = 64  # CUmemPoolPtrExportData
SAMPLE = 64 * 1024  # bytes checked at each end of a buffer
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, as a bit of MEMPOOL_SUPPORTED_HANDLE_TYPES
UINT64_MAX = 0xFFFFFFFFFFFFFFFF

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
DRIVER_ENV = "CUDA_POOL_REPRO_DRIVER"
SCHEMA = "gpushare.driver_repro.cuda_pool_killed_importers/1"

MODES = ("kill", "exit")
TRIMS = ("every-round", "end", "never")
#: End phases in the order they are measured.
PHASES = ("after_last_round", "after_trim", "after_destroy", "after_fd_close", "after_sync_sleep", "after_recreate")
PHASE_TITLES = {
    "after_last_round": "last round",
    "after_trim": "trim",
    "after_destroy": "destroy",
    "after_fd_close": "fd close",
    "after_sync_sleep": "sync+sleep",
    "after_recreate": "recreate",
}
#: What it means when free memory is first back (within a granule) at a phase.
BACK_AT = {
    "after_last_round": "no shortfall left after the last round",
    "after_trim": "given back by the final cuMemPoolTrimTo(pool, 0)",
    "after_destroy": "kept until the pool was destroyed (cuMemPoolDestroy)",
    "after_fd_close": "kept until the exported pool fd was closed",
    "after_sync_sleep": "kept until cuCtxSynchronize and a sleep (released late)",
    "after_recreate": "kept until a new pool was created and destroyed",
}
GRANULE_NOTE = (
    "cuMemGetInfo reports free memory in 2 MiB steps at best: a difference of one 2 MiB granule "
    "or less is noise and is not judged; 'short' means more than one granule less free than the baseline."
)


class ReproError(Exception):
    """An error of this script, the driver or an importer: exit status 1."""


class NoDriverError(ReproError):
    """No driver library, no cuda-bindings or no GPU: exit status 3."""


class CudaCallError(ReproError):
    def __init__(self, call: str, name: str, code: int) -> None:
        super().__init__(f"{call} failed with {name} ({code})")
        self.call, self.name, self.code = call, name, code


class ChildError(ReproError):
    """An importer failed, died before reporting, or did not answer in time."""


# -- sizes, arguments, the matrix plan (pure) -------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": MiB, "mib": MiB, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'2MiB', '32M', '512KiB', '2097152' -> bytes (binary units); ValueError otherwise."""
    raw = text.strip().lower().replace(" ", "")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a number with KiB, MiB or GiB, e.g. 2MiB)")
    try:
        value = float(digits)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use bytes or a number with KiB, MiB or GiB, e.g. 2MiB)")
    nbytes = value * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes < 1 or nbytes != int(nbytes):
        raise ValueError(f"not a whole positive number of bytes: {text!r}")
    return int(nbytes)


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def _sizes_arg(text: str) -> list[int]:
    sizes = [_size_arg(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cuda_pool_killed_importers.py",
        description=(
            "Measure whether an IPC-enabled CUDA memory pool keeps device memory after importer "
            "processes holding its pointers are SIGKILLed (cuda.bindings.driver only, no gpushare). " + GRANULE_NOTE
        ),
        epilog="Exit status: 0 measured (a shortfall is a finding), 1 error, 2 bad arguments, 3 no driver/GPU.",
    )
    run = parser.add_argument_group("one variant")
    run.add_argument("--importers", type=_positive_int, default=50, help="importer processes, one per round (50)")
    run.add_argument("--buffers", type=_positive_int, default=4, help="buffers allocated and exported per round (4)")
    run.add_argument("--size", type=_size_arg, default=2 * MiB, help="bytes per buffer, e.g. 2MiB, 32MiB (2MiB)")
    run.add_argument("--mode", choices=MODES, default="kill", help="SIGKILL the importer, or let it exit (kill)")
    run.add_argument(
        "--trim",
        choices=TRIMS,
        default="every-round",
        help="cuMemPoolTrimTo(pool, 0) after every round's frees, only at the end, or never (every-round)",
    )
    run.add_argument(
        "--importer-frees",
        action="store_true",
        help="with --mode exit: the importer frees its imported pointers (cuMemFreeAsync) before exiting",
    )
    run.add_argument(
        "--reuse",
        action="store_true",
        help="allocate and export the buffers once; every importer imports the same ones (gpushare recycles "
        "its allocations); the owner frees them after the last round",
    )
    run.add_argument("--recreate", action="store_true", help="at the end, create, use and destroy a fresh pool")
    run.add_argument("--device", type=int, default=0, help="device ordinal (0)")
    run.add_argument("--child-timeout", type=_seconds, default=60.0, help="seconds an importer may take (60)")
    run.add_argument("--settle", type=_seconds, default=0.5, help="seconds to wait for memory after a round (0.5)")
    run.add_argument("--end-sleep", type=_seconds, default=2.0, help="seconds slept before the last phase (2)")
    run.add_argument("--no-smi", action="store_true", help="do not record nvidia-smi's list of compute processes")
    run.add_argument(
        "--no-warmup-importer",
        action="store_true",
        help="warm up without an importer (by default one importer frees and exits before the baseline)",
    )
    both = parser.add_argument_group("both")
    both.add_argument(
        "--max-seconds",
        type=_seconds,
        default=420.0,
        help="time budget (420): a variant stops starting rounds in time to finish; the matrix skips variants",
    )
    both.add_argument("--json", metavar="PATH", help="write every measurement here (JSON)")
    matrix = parser.add_argument_group("matrix")
    matrix.add_argument("--matrix", action="store_true", help="run the useful variants, each in its own process")
    matrix.add_argument("--sizes", type=_sizes_arg, default=[2 * MiB, 32 * MiB], help="matrix sizes (2MiB,32MiB)")
    matrix.add_argument("--only", metavar="NAMES", help="matrix: run only these comma-separated variant names")
    parser.add_argument("--probe", action="store_true", help="print this device's free and total bytes as JSON")
    parser.add_argument("--in-matrix", action="store_true", help=argparse.SUPPRESS)  # set by --matrix: no table
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.importer_frees and args.mode != "exit" and not args.matrix:
        parser.error("--importer-frees needs --mode exit (a killed importer cannot free anything)")
    if args.device < 0:
        parser.error(f"--device must be >= 0, got {args.device}")
    if args.matrix and args.probe:
        parser.error("--matrix and --probe exclude each other")
    if args.only and not args.matrix:
        parser.error("--only selects matrix variants; it needs --matrix")
    if args.matrix and args.only:
        names = {v.name for v in matrix_plan(args)}
        unknown = [n for n in _split_names(args.only) if n not in names]
        if unknown:
            parser.error(f"--only: unknown variant(s) {unknown}; the matrix has {sorted(names)}")
    return args


def _split_names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


@dataclass(frozen=True)
class Variant:
    mode: str
    trim: str
    importer_frees: bool
    size: int
    buffers: int
    importers: int
    reuse: bool = False

    @property
    def name(self) -> str:
        mode = self.mode + ("+frees" if self.importer_frees else "")
        return f"{mode}/{self.trim}/{format_size(self.size)}" + ("/reuse" if self.reuse else "")

    def argv(self) -> list[str]:
        out = ["--mode", self.mode, "--trim", self.trim, "--size", str(self.size)]
        out += ["--buffers", str(self.buffers), "--importers", str(self.importers)]
        return out + (["--importer-frees"] if self.importer_frees else []) + (["--reuse"] if self.reuse else [])


def matrix_plan(args: argparse.Namespace) -> list[Variant]:
    """The matrix's variants, most informative first (the time budget may cut the tail).

    First gpushare's own set-up (kill, trim every round) against its clean
    control (the importer frees, then exits); the same buffers imported by
    every importer (``reuse``, as gpushare recycles allocations); an importer
    that exits without freeing; then trimming only at the end; then the other
    sizes; then the remaining combinations.
    """
    sizes = list(dict.fromkeys(args.sizes))
    first, rest = sizes[0], sizes[1:]
    modes = [("kill", False), ("exit", True), ("exit", False)]

    def v(mode: tuple[str, bool], trim: str, size: int, reuse: bool = False) -> Variant:
        return Variant(mode[0], trim, mode[1], size, args.buffers, args.importers, reuse)

    kill, clean, bare = modes
    order = [v(kill, "every-round", first), v(clean, "every-round", first), v(kill, "every-round", first, True)]
    order += [v(bare, "every-round", first), v(kill, "end", first)]
    for size in rest:
        order += [v(kill, "every-round", size), v(clean, "every-round", size)]
    for size in rest:
        order += [v(kill, "end", size)]
    order += [v(clean, "end", first), v(bare, "end", first)]
    order += [v(clean, "every-round", first, True)]
    for size in rest:
        order += [v(kill, "every-round", size, True), v(bare, "every-round", size), v(clean, "end", size)]
        order += [v(bare, "end", size)]
    plan = list(dict.fromkeys(order))
    if args.only:
        wanted = set(_split_names(args.only))
        plan = [p for p in plan if p.name in wanted]
    return plan


def estimate_seconds(variant: Variant, durations: dict[str, float]) -> float:
    """How long a variant is expected to take: the slowest one run so far, else a guess."""
    if durations:
        return max(durations.values())
    return 1.5 * variant.importers + 30.0


# -- the report (pure) ----------------------------------------------------------------------------


def delta_mib(delta_bytes: int | None) -> float | None:
    return None if delta_bytes is None else round(delta_bytes / MiB, 3)


def is_short(delta_bytes: int | None) -> bool:
    """More than one granule less free than the baseline (never judged below that)."""
    return delta_bytes is not None and delta_bytes < -GRANULE


def judged_phases(trim: str, reuse: bool = False) -> list[str]:
    # With the trim at the end (or never), or the reused buffers freed only after the last
    # round, the pool still holds freed memory after the last round: expected, not judged.
    expected = trim != "every-round" or reuse
    return [p for p in PHASES if not (p == "after_last_round" and expected)]


def finalize(report: dict[str, Any]) -> dict[str, Any]:
    """Fill in deltas against the baseline and the summary (verdict) from the raw free bytes."""
    base = report.get("baseline_free")
    for rnd in report.get("rounds", []):
        end = rnd.get("free_end")
        # A round's delta counts what the owner is expected to hold (its pool's reserve with the
        # trim at the end, or the reused buffers) as given back; the raw figure is kept too.
        rnd["raw_delta_bytes"] = None if base is None or end is None else end - base
        raw = rnd["raw_delta_bytes"]
        rnd["delta_bytes"] = None if raw is None else raw + rnd.get("expected_bytes", 0)
        rnd["delta_mib"] = delta_mib(rnd["delta_bytes"])
    phases = report.setdefault("phases", {})
    for name in PHASES:
        entry = phases.setdefault(name, {"free": None})
        free = entry.get("free")
        entry["delta_bytes"] = None if base is None or free is None else free - base
        entry["delta_mib"] = delta_mib(entry["delta_bytes"])
    report["summary"] = summarize(report)
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    rounds = report.get("rounds", [])
    deltas = [r["delta_bytes"] for r in rounds if r.get("delta_bytes") is not None]
    short_rounds = [r["round"] for r in rounds if is_short(r.get("delta_bytes"))]
    variant = report.get("variant", {})
    phases = report.get("phases", {})
    judged = judged_phases(variant.get("trim", "every-round"), bool(variant.get("reuse")))
    measured = [p for p in judged if phases.get(p, {}).get("delta_bytes") is not None]
    short = {p: is_short(phases[p]["delta_bytes"]) for p in measured}
    summary: dict[str, Any] = {
        "rounds_done": len(rounds),
        "worst_round_delta_mib": delta_mib(min(deltas)) if deltas else None,
        "first_short_round": short_rounds[0] if short_rounds else None,
        "short_rounds": len(short_rounds),
        "judged_phases": measured,
        "pool_reserved_after_trim_mib": delta_mib((report.get("pool_after_trim") or {}).get("reserved")),
    }
    if not measured:
        summary.update(code="unmeasured", verdict="no end phase was measured")
        return summary
    last_short = max((i for i, p in enumerate(measured) if short[p]), default=None)
    if last_short is None:
        summary.update(code="none", verdict="no shortfall: every phase within one 2 MiB granule of the baseline")
    elif last_short == len(measured) - 1:
        worst = min(phases[p]["delta_bytes"] for p in measured)
        summary.update(
            code="kept",
            verdict=f"kept for the owner's life: still {-phases[measured[-1]]['delta_bytes'] / MiB:.0f} MiB short "
            f"at '{PHASE_TITLES[measured[-1]]}' (worst {-worst / MiB:.0f} MiB)",
        )
    else:
        back = measured[last_short + 1]
        summary.update(code=f"back-at-{back}", verdict=BACK_AT[back])
    if last_short is not None and any(not short[p] for p in measured[:last_short]):
        summary["verdict"] += " (intermittent: back within a granule at an earlier phase)"
    gained = [p for p in measured if (phases[p]["delta_bytes"] or 0) > GRANULE]
    if gained:
        summary["note"] = f"more free than the baseline at {gained}: something else on the device freed memory"
    return summary


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.0f}" if abs(value) > GRANULE / MiB else "0"


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """One row per matrix entry (a dict with 'name' and 'report' or 'skipped'/'error')."""
    rows = []
    for res in results:
        rep = res.get("report") or {}
        summ = rep.get("summary") or {}
        phases = rep.get("phases") or {}
        var = rep.get("variant") or {}
        if res.get("skipped"):
            rows.append([res["name"], "skipped: " + res["skipped"]])
            continue
        done = summ.get("rounds_done")
        rounds = "-" if done is None else f"{done}/{var.get('importers', '?')}"
        row = [res["name"], rounds, _cell(summ.get("worst_round_delta_mib"))]
        row += [_cell((phases.get(p) or {}).get("delta_mib")) for p in PHASES]
        exit_delta = res.get("owner_exit_delta_mib")
        row += [_cell(exit_delta), _cell(summ.get("pool_reserved_after_trim_mib")).lstrip("+")]
        verdict = summ.get("verdict", "")
        if res.get("error"):
            verdict = f"ERROR: {res['error'].splitlines()[0][:100]}" + (f"; {verdict}" if verdict else "")
        rows.append([*row, verdict])
    return rows


TABLE_HEADER = ["variant", "rounds", "worst round", *(PHASE_TITLES[p] for p in PHASES), "owner exit", "pool res."]


def format_table(results: list[dict[str, Any]]) -> str:
    """The summary table: deltas in MiB against the baseline ('0': within one 2 MiB granule)."""
    rows = table_rows(results)
    full = [r for r in rows if len(r) == len(TABLE_HEADER) + 1]
    widths = [max(len(r[i]) for r in [TABLE_HEADER, *full]) for i in range(len(TABLE_HEADER))]
    widths[0] = max([widths[0]] + [len(r[0]) for r in rows])

    def line(cells: list[str], last: str) -> str:
        padded = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join([*padded, last])

    lines = [
        "free device memory minus the baseline, MiB (negative: less free; '0': within one 2 MiB granule, "
        "not judged; 'worst round': counting what the pool is expected to hold as given back; 'owner exit': "
        "a fresh process's reading after the variant's process exited, against the one before it started; "
        "'pool res.': the pool's reserved MiB just before its destruction, after the final trim)",
        line(TABLE_HEADER, "verdict"),
    ]
    for row in rows:
        if len(row) == len(TABLE_HEADER) + 1:
            lines.append(line(row[:-1], row[-1]))
        else:
            lines.append(f"{row[0].ljust(widths[0])}  {' '.join(row[1:])}")
    return "\n".join(lines)


UNJUDGED = (None, "unmeasured")


def interpret(results: list[dict[str, Any]]) -> list[str]:
    """What the matrix's verdicts together say about the open finding."""

    def group(mode: str, frees: bool) -> list[dict[str, Any]]:
        out = []
        for res in results:
            rep = res.get("report") or {}
            var, code = rep.get("variant") or {}, (rep.get("summary") or {}).get("code")
            if var.get("mode") == mode and bool(var.get("importer_frees")) == frees and code not in UNJUDGED:
                out.append(res)
        return out

    def short(group_: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in group_ if r["report"]["summary"]["code"] != "none"]

    def names(group_: list[dict[str, Any]]) -> str:
        return ", ".join(f"{r['name']} ({r['report']['summary']['code']})" for r in group_) or "none"

    kill, clean, bare = group("kill", False), group("exit", True), group("exit", False)
    lines = []
    if not kill:
        return ["No kill variant was measured: nothing to conclude about killed importers."]
    if short(kill) and not clean:
        lines.append(
            f"Killed importers leave a shortfall ({names(short(kill))}), but no clean control (exit+frees) was "
            "measured, so nothing tells it apart from the pool's own behaviour: rerun with --only including one."
        )
    elif short(kill) and not short(clean):
        lines.append(
            f"REPRODUCED without gpushare: after SIGKILLed importers the device keeps memory "
            f"({names(short(kill))}), while importers that free and exit give everything back "
            f"({names(clean)}). The shortfall is the driver's, not gpushare's."
        )
    elif short(kill) and short(clean):
        lines.append(
            f"Memory is kept even when importers free their imports and exit ({names(short(clean))}); "
            f"killed: {names(short(kill))}. Not specific to killed importers: the IPC pool itself keeps memory."
        )
    else:
        lines.append(
            f"NOT reproduced on the raw driver: {len(kill)} kill variant(s) gave every byte back within a granule. "
            "The raw pattern (one importer at a time, killed while idle) is clean, so look at what gpushare does "
            "differently (several importers at once, the same pointer imported by many, IPC events, kills in the "
            "middle of an import or a free, the Manager's processes), or rerun: the chaos shortfall was intermittent."
        )
    codes = {r["report"]["summary"]["code"] for r in short(kill)}
    if codes and codes <= {"back-at-after_destroy", "back-at-after_fd_close"}:
        lines.append(
            "It comes back when the pool is destroyed or its exported fd closed: gpushare could replace its pool "
            "once importers have died."
        )
    elif "kept" in codes:
        lines.append(
            "For at least one kill variant it stays for the owner process's life (destroy/fd close do not help)."
        )
    if bare and short(bare) and not short(clean):
        lines.append(
            f"Importers that exit without freeing also leave memory behind ({names(short(bare))}): the pool needs "
            "each importer's cuMemFreeAsync, which a killed importer never makes."
        )
    lost = [r for r in results if (r.get("owner_exit_delta_mib") or 0) < -GRANULE / MiB]
    if lost:
        lines.append(
            "Memory was still missing after the owner process itself exited ("
            + ", ".join(f"{r['name']} {r['owner_exit_delta_mib']:+.0f} MiB" for r in lost)
            + "): a device-wide leak, beyond any one process."
        )
    return lines


def write_json(path: str, obj: Any) -> None:
    """Write atomically (a temporary file renamed), so a reader never sees half a report."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".repro-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def say(*parts: Any) -> None:
    print(*parts, flush=True)


# -- the driver --------------------------------------------------------------------------------------


class Driver:
    """``cuda.bindings.driver`` (or a stand-in named by CUDA_POOL_REPRO_DRIVER): every call checked."""

    def __init__(self, module: Any) -> None:
        self.d = module
        self.success = module.CUresult.CUDA_SUCCESS

    def error_name(self, err: Any) -> str:
        try:
            res, name = self.d.cuGetErrorName(err)
            if res == self.success and name:
                return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            pass
        return f"CUresult {err!r}"

    def __call__(self, name: str, *args: Any) -> Any:
        result = getattr(self.d, name)(*args)
        if not isinstance(result, tuple):
            result = (result,)
        err = result[0]
        if err != self.success:
            try:
                code = int(err)
            except (TypeError, ValueError):
                code = -1
            raise CudaCallError(name, self.error_name(err), code)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]


def load_driver() -> Driver:
    """Import the driver module and run cuInit, or raise NoDriverError saying what is missing."""
    name = os.environ.get(DRIVER_ENV) or "cuda.bindings.driver"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise NoDriverError(f"cannot import {name} ({exc}): install cuda-bindings ('pip install cuda-bindings')")
    try:
        result = module.cuInit(0)
    except RuntimeError as exc:  # cuda.pathfinder: libcuda.so not found
        raise NoDriverError(f"no NVIDIA driver library was found ({exc}); run this on a machine with a GPU")
    drv = Driver(module)
    if result[0] != drv.success:
        raise NoDriverError(f"cuInit failed with {drv.error_name(result[0])}: the driver sees no usable GPU")
    return drv


def open_device(drv: Driver, ordinal: int) -> tuple[Any, Any]:
    """(device, primary context), the context retained and current on this thread."""
    count = int(drv("cuDeviceGetCount"))
    if count < 1:
        raise NoDriverError("the driver sees no GPU (cuDeviceGetCount is 0)")
    if not 0 <= ordinal < count:
        raise ReproError(f"device {ordinal} does not exist: this process sees {count} device(s)")
    dev = drv("cuDeviceGet", ordinal)
    ctx = drv("cuDevicePrimaryCtxRetain", dev)
    drv("cuCtxSetCurrent", ctx)
    return dev, ctx


def check_pool_support(drv: Driver, dev: Any, ordinal: int) -> None:
    attrs = drv.d.CUdevice_attribute
    if not int(drv("cuDeviceGetAttribute", attrs.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev)):
        raise NoDriverError(f"device {ordinal} does not support memory pools")
    types = int(drv("cuDeviceGetAttribute", attrs.CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, dev))
    if not types & POSIX_FD:
        raise NoDriverError(f"device {ordinal}'s memory pools cannot be exported as POSIX fds (types {types})")


def mem_free(drv: Driver) -> int:
    free, _total = drv("cuMemGetInfo")
    return int(free)


def _posix_fd(drv: Driver) -> Any:
    return drv.d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _stream(drv: Driver) -> Any:
    return drv.d.CUstream(0)


def create_pool(drv: Driver, ordinal: int) -> tuple[Any, int]:
    """An IPC-enabled pool as gpushare makes it, exported to an fd before any pointer: (pool, fd)."""
    d = drv.d
    props = d.CUmemPoolProps()
    props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.handleTypes = _posix_fd(drv)
    loc = d.CUmemLocation()
    loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    props.location = loc
    pool = drv("cuMemPoolCreate", props)
    try:
        attr = d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        drv("cuMemPoolSetAttribute", pool, attr, d.cuuint64_t(UINT64_MAX))
        fd = int(drv("cuMemPoolExportToShareableHandle", pool, _posix_fd(drv), 0))
    except BaseException:
        d.cuMemPoolDestroy(pool)
        raise
    return pool, fd


def pool_attrs(drv: Driver, pool: Any) -> dict[str, int]:
    a = drv.d.CUmemPool_attribute
    names = {
        "reserved": a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        "used": a.CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        "reserved_high": a.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        "used_high": a.CU_MEMPOOL_ATTR_USED_MEM_HIGH,
    }
    return {key: _as_int(drv("cuMemPoolGetAttribute", pool, attr)) for key, attr in names.items()}


def _as_int(value: Any) -> int:
    """A cuuint64_t (or an int) as an int, whichever way this cuda-bindings release allows."""
    try:
        return int(value)
    except TypeError:
        return int(ctypes.c_uint64.from_address(value.getPtr()).value)


def alloc(drv: Driver, pool: Any, size: int) -> Any:
    ptr = drv("cuMemAllocFromPoolAsync", size, pool, _stream(drv))
    drv("cuStreamSynchronize", _stream(drv))
    return ptr


def free_now(drv: Driver, ptr: Any) -> None:
    drv("cuMemFreeAsync", ptr, _stream(drv))
    drv("cuStreamSynchronize", _stream(drv))


def export_pointer(drv: Driver, ptr: Any) -> bytes:
    data = drv("cuMemPoolExportPointer", ptr)
    return ctypes.string_at(data.getPtr(), EXPORT_BYTES)


def import_pointer(drv: Driver, pool: Any, data: bytes) -> Any:
    if len(data) != EXPORT_BYTES:
        raise ReproError(f"pointer export data must be {EXPORT_BYTES} bytes, got {len(data)}")
    export = drv.d.CUmemPoolPtrExportData()
    ctypes.memmove(export.getPtr(), data, EXPORT_BYTES)
    return drv("cuMemPoolImportPointer", pool, export)


def fill(drv: Driver, ptr: Any, value: int, size: int) -> None:
    drv("cuMemsetD8", ptr, value, size)
    drv("cuCtxSynchronize")


def check_bytes(drv: Driver, ptr: Any, size: int, value: int, who: str) -> None:
    """The first and last SAMPLE bytes of a buffer all hold ``value`` (the import maps the same memory)."""
    import numpy as np

    n = min(size, SAMPLE)
    host = np.empty(n, dtype=np.uint8)
    for offset in sorted({0, size - n}):
        host.fill(value ^ 0xFF)
        drv("cuMemcpyDtoH", host.ctypes.data, int(ptr) + offset, n)
        if not (host == value).all():
            wrong = int(np.count_nonzero(host != value))
            raise ReproError(
                f"{who}: {wrong} of {n} bytes at offset {offset} of buffer {int(ptr):#x} are not {value} "
                f"(first: {int(host[host != value][0])}): the import does not see the same memory"
            )


# -- the importer (a spawned child) ----------------------------------------------------------------


def importer_main(conn: Any, job: dict[str, Any]) -> None:
    """Import the pool (fd by SCM_RIGHTS) and the pointers, touch them, say "ready", then wait.

    Kill mode: the owner SIGKILLs it while it waits. Exit mode: on "exit" it
    frees its imports (with importer_frees) and returns. Any error goes back
    to the owner as a traceback. SIGALRM ends it if the owner forgets it.
    """
    signal.alarm(int(job["max_life_s"]))
    try:
        fd = reduction.recv_handle(conn)
        t0 = time.perf_counter()
        drv = load_driver()
        open_device(drv, job["device"])
        t1 = time.perf_counter()
        pool = drv("cuMemPoolImportFromShareableHandle", fd, _posix_fd(drv), 0)
        os.close(fd)
        t2 = time.perf_counter()
        ptrs = [import_pointer(drv, pool, data) for data in job["exports"]]
        t3 = time.perf_counter()
        for ptr in ptrs:
            check_bytes(drv, ptr, job["size"], job["owner_value"], f"importer {os.getpid()}")
            fill(drv, ptr, job["importer_value"], job["size"])
        conn.send(("ready", {"init_s": t1 - t0, "import_pool_s": t2 - t1, "import_pointers_s": t3 - t2}))
        while True:
            if conn.poll(1.0):
                msg = conn.recv()
                break
        if msg != "exit":
            raise ReproError(f"unexpected message from the owner: {msg!r}")
        if job["importer_frees"]:
            for ptr in ptrs:
                free_now(drv, ptr)
        conn.send(("done", {"freed": len(ptrs) if job["importer_frees"] else 0}))
    except EOFError:
        sys.exit(4)  # the owner is gone: nothing to report to
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        sys.exit(1)


def wait_message(conn: Any, proc: Any, timeout: float, expect: str) -> Any:
    """The importer's next message, which must be ``expect``; its errors, death or silence raise ChildError."""
    deadline = time.monotonic() + timeout
    while True:
        if conn.poll(0.05):
            try:
                kind, payload = conn.recv()
            except EOFError:
                proc.join(5)
                raise ChildError(
                    f"importer {proc.pid} closed its pipe (exit code {proc.exitcode}) before saying '{expect}'"
                )
            if kind == "error":
                raise ChildError(f"importer {proc.pid} failed:\n{payload.rstrip()}")
            if kind != expect:
                raise ChildError(f"importer {proc.pid} said {kind!r}, expected {expect!r}")
            return payload
        if not proc.is_alive() and not conn.poll(0):
            raise ChildError(f"importer {proc.pid} exited with code {proc.exitcode} before saying '{expect}'")
        if time.monotonic() > deadline:
            raise ChildError(f"importer {proc.pid} did not say '{expect}' within {timeout:.0f} s (timed out)")


def reap(proc: Any, timeout: float) -> int:
    proc.join(timeout)
    if proc.exitcode is None:
        raise ChildError(f"importer {proc.pid} was not gone {timeout:.0f} s after SIGKILL")
    return int(proc.exitcode)


def kill_all(procs: list[Any]) -> None:
    """Kill and reap every importer still running (used on every way out)."""
    for proc in procs:
        try:
            if proc.exitcode is None:
                proc.kill()
                proc.join(10)
                if proc.exitcode is None:
                    print(f"warning: importer {proc.pid} survives SIGKILL", file=sys.stderr, flush=True)
        except Exception as exc:  # keep going: the others must be reaped too
            print(f"warning: could not reap importer {getattr(proc, 'pid', '?')}: {exc}", file=sys.stderr, flush=True)


# -- the owner: one variant ---------------------------------------------------------------------------


def nvidia_smi() -> dict[str, Any]:
    """nvidia-smi's compute processes, to see whether a killed importer is still listed (best effort)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    cmd = [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return {"rc": done.returncode, "lines": done.stdout.strip().splitlines(), "stderr": done.stderr.strip()[-500:]}


def _bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("cuda-bindings")
    except Exception:
        return "unknown"


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    variant = Variant(args.mode, args.trim, args.importer_frees, args.size, args.buffers, args.importers, args.reuse)
    return {
        "schema": SCHEMA,
        "kind": "variant",
        "variant": {**asdict(variant), "name": variant.name, "recreate": bool(args.recreate)},
        "settings": {
            "device": args.device,
            "child_timeout": args.child_timeout,
            "settle": args.settle,
            "end_sleep": args.end_sleep,
            "max_seconds": args.max_seconds,
        },
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "pid": os.getpid(),
            "driver_module": os.environ.get(DRIVER_ENV) or "cuda.bindings.driver",
            "bindings_version": _bindings_version(),
        },
        "granule_bytes": GRANULE,
        "granule_note": GRANULE_NOTE,
        "free_after_context": None,
        "baseline_free": None,
        "rounds": [],
        "phases": {p: {"free": None} for p in PHASES},
        "pool_after_trim": None,
        "stopped_early": None,
        "children": [],
        "error": None,
    }


class Owner:
    """One variant's run: the owner's pool, its rounds and its end phases (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, report: dict[str, Any]) -> None:
        self.args = args
        self.report = report
        self.tag = f"[{report['variant']['name']}]"
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.max_seconds
        self.drv: Driver | None = None
        self.pool: Any = None
        self.fd: int | None = None
        self.ptrs: list[Any] = []  # the owner's live buffers
        self.exports: list[bytes] = []  # their pointer export data
        self.live: list[Any] = []  # importers not reaped yet

    def phase(self, name: str, **extra: Any) -> int:
        assert self.drv is not None
        free = mem_free(self.drv)
        self.report["phases"][name] = {"free": free, "t": round(time.monotonic() - self.t0, 3), **extra}
        delta = free - self.report["baseline_free"]
        say(f"{self.tag} {name}: free {free / MiB:.0f} MiB, {delta / MiB:+.0f} MiB against the baseline")
        return free

    def run(self) -> None:
        args = self.args
        drv = self.drv = load_driver()
        dev, _ctx = open_device(drv, args.device)
        check_pool_support(drv, dev, args.device)
        env = self.report["environment"]
        env["driver_version"] = int(drv("cuDriverGetVersion"))
        name = drv("cuDeviceGetName", 256, dev)
        env["device_name"] = name.split(b"\0")[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
        env["total_bytes"] = int(drv("cuMemGetInfo")[1])
        self.report["free_after_context"] = mem_free(drv)
        self.warm_up()
        if not args.no_smi:
            self.report["nvidia_smi_start"] = nvidia_smi()
        time.sleep(0.2)
        self.report["baseline_free"] = base = mem_free(drv)
        say(
            f"{self.tag} {env['device_name']}, driver {env['driver_version']}, cuda-bindings "
            f"{env['bindings_version']}: baseline free {base / MiB:.0f} MiB of {env['total_bytes'] / MiB:.0f} MiB "
            f"(context + warm-up took {(self.report['free_after_context'] - base) / MiB:+.0f} MiB more). {GRANULE_NOTE}"
        )
        self.pool, self.fd = create_pool(drv, args.device)
        self.report["free_after_pool_create"] = mem_free(drv)
        self.rounds()
        self.end()

    def warm_up(self) -> None:
        """One pool's whole life, with one importer that frees and exits (unless --no-warmup-importer)."""
        drv = self.drv
        assert drv is not None
        self.pool, self.fd = create_pool(drv, self.args.device)
        if self.args.no_warmup_importer:
            ptr = alloc(drv, self.pool, self.args.size)
            self.ptrs.append(ptr)
            export_pointer(drv, ptr)
            fill(drv, ptr, 1, self.args.size)
            self.free_buffers()
            drv("cuMemPoolTrimTo", self.pool, 0)
        else:
            clean = argparse.Namespace(**vars(self.args))
            clean.mode, clean.importer_frees, clean.buffers, clean.reuse, clean.trim = "exit", True, 1, False, "end"
            self.report["warmup_round"] = self.one_round(0, clean)
            drv("cuMemPoolTrimTo", self.pool, 0)
        pool, self.pool = self.pool, None
        drv("cuMemPoolDestroy", pool)
        fd, self.fd = self.fd, None
        os.close(fd)
        drv("cuCtxSynchronize")

    def rounds(self) -> None:
        args = self.args
        round_s: list[float] = []
        self.report["stopped_early"] = False
        for i in range(1, args.importers + 1):
            reserve = args.end_sleep + 10.0 + 2 * max(round_s, default=5.0)
            if i > 1 and time.monotonic() + reserve > self.deadline:
                self.report["stopped_early"] = True
                self.report["stop_reason"] = f"time budget (--max-seconds {args.max_seconds:g}) after {i - 1} rounds"
                say(f"{self.tag} stopping after {i - 1} rounds: {self.report['stop_reason']}")
                break
            started = time.monotonic()
            rnd = self.one_round(i, args)
            round_s.append(time.monotonic() - started)
            rnd["round_s"] = round(round_s[-1], 3)
            self.report["rounds"].append(rnd)
            delta = rnd["free_end"] - self.report["baseline_free"] + rnd["expected_bytes"]
            expected = (
                f" (the pool's {rnd['expected_bytes'] / MiB:.0f} MiB counted back)" if rnd["expected_bytes"] else ""
            )
            say(
                f"{self.tag} round {i}/{args.importers}: importer {rnd['pid']} "
                f"{'killed' if args.mode == 'kill' else 'exited'} ({rnd['exitcode']}), free "
                f"{delta / MiB:+.0f} MiB against the baseline{expected}, "
                f"pool reserved {rnd['pool_reserved'] / MiB:.0f} MiB"
                f"{'' if rnd['settled'] else ' (not back within --settle)'}, {round_s[-1]:.2f} s"
            )

    def one_round(self, i: int, args: argparse.Namespace) -> dict[str, Any]:
        drv = self.drv
        assert drv is not None and self.fd is not None
        owner_value, importer_value = 1 + i % 120, 130 + i % 120
        rnd: dict[str, Any] = {"round": i}
        reserved_start = pool_attrs(drv, self.pool)["reserved"]
        rnd["free_start"] = free_start = mem_free(drv)
        if not (args.reuse and self.ptrs):
            for _ in range(args.buffers):
                self.ptrs.append(alloc(drv, self.pool, args.size))
                self.exports.append(export_pointer(drv, self.ptrs[-1]))
        for ptr in self.ptrs:
            fill(drv, ptr, owner_value, args.size)
        exports = list(self.exports)
        rnd["free_allocated"] = mem_free(drv)
        job = {
            "device": args.device,
            "exports": exports,
            "size": args.size,
            "owner_value": owner_value,
            "importer_value": importer_value,
            "importer_frees": args.importer_frees,
            "max_life_s": 3 * args.child_timeout + 60,
        }
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        t = time.monotonic()
        try:
            proc = ctx.Process(target=importer_main, args=(child_conn, job), name=f"importer-{i}", daemon=True)
            proc.start()
            self.live.append(proc)
            rnd["pid"] = proc.pid
            self.report["children"].append(proc.pid)
            child_conn.close()
            try:
                reduction.send_handle(conn, self.fd, proc.pid)
            except OSError as exc:
                proc.join(5)
                raise ChildError(
                    f"could not pass the pool fd to importer {proc.pid} (exit code {proc.exitcode}): {exc}"
                )
            rnd["importer"] = wait_message(conn, proc, args.child_timeout, "ready")
            rnd["ready_s"] = round(time.monotonic() - t, 3)
            for ptr in self.ptrs:
                check_bytes(drv, ptr, args.size, importer_value, "owner")
            rnd["free_child_ready"] = mem_free(drv)
            if args.mode == "kill":
                os.kill(proc.pid, signal.SIGKILL)
                rnd["exitcode"] = reap(proc, 30.0)
                if rnd["exitcode"] != -signal.SIGKILL:
                    raise ChildError(f"importer {proc.pid} ended with {rnd['exitcode']} instead of being killed")
            else:
                conn.send("exit")
                rnd["importer_done"] = wait_message(conn, proc, args.child_timeout, "done")
                proc.join(args.child_timeout)
                if proc.exitcode is None:
                    raise ChildError(f"importer {proc.pid} did not exit within {args.child_timeout:.0f} s")
                rnd["exitcode"] = int(proc.exitcode)
                if proc.exitcode != 0:
                    raise ChildError(f"importer {proc.pid} exited with code {proc.exitcode}")
            self.live.remove(proc)
            proc.close()
        finally:
            child_conn.close()
            conn.close()
        rnd["free_child_gone"] = mem_free(drv)
        if not args.reuse:
            self.free_buffers()
        if args.trim == "every-round":
            drv("cuMemPoolTrimTo", self.pool, 0)
        rnd["free_after_free"] = free = mem_free(drv)
        attrs = pool_attrs(drv, self.pool)
        # Back where the round started, less what the pool itself kept (trim at the end or never).
        target = free_start - max(0, attrs["reserved"] - reserved_start) - GRANULE
        t = time.monotonic()
        while free < target and time.monotonic() - t < args.settle:
            time.sleep(0.02)
            free = mem_free(drv)
        rnd["settle_s"] = round(time.monotonic() - t, 3)
        rnd["settled"] = free >= target
        rnd["free_end"] = free
        rnd["pool_reserved"], rnd["pool_used"] = attrs["reserved"], attrs["used"]
        rnd["expected_bytes"] = attrs["reserved"] if args.reuse or args.trim != "every-round" else 0
        return rnd

    def free_buffers(self) -> None:
        assert self.drv is not None
        while self.ptrs:
            free_now(self.drv, self.ptrs[-1])
            self.ptrs.pop()
        self.exports.clear()

    def end(self) -> None:
        args, drv = self.args, self.drv
        assert drv is not None and self.fd is not None
        self.free_buffers()  # with --reuse, the buffers every importer imported
        self.phase("after_last_round", pool=pool_attrs(drv, self.pool))
        if args.trim != "never":
            drv("cuMemPoolTrimTo", self.pool, 0)
            self.phase("after_trim")
        self.report["pool_after_trim"] = pool_attrs(drv, self.pool)
        pool, self.pool = self.pool, None
        drv("cuMemPoolDestroy", pool)
        self.phase("after_destroy")
        fd, self.fd = self.fd, None
        os.close(fd)
        self.phase("after_fd_close")
        drv("cuCtxSynchronize")
        time.sleep(args.end_sleep)
        self.phase("after_sync_sleep", slept_s=args.end_sleep)
        if args.recreate:
            pool, fd = create_pool(drv, args.device)
            try:
                ptrs = [alloc(drv, pool, args.size) for _ in range(args.buffers)]
                for ptr in ptrs:
                    free_now(drv, ptr)
                drv("cuMemPoolTrimTo", pool, 0)
            finally:
                drv("cuMemPoolDestroy", pool)
                os.close(fd)
            drv("cuCtxSynchronize")
            self.phase("after_recreate")
        if not args.no_smi:
            self.report["nvidia_smi_end"] = nvidia_smi()

    def cleanup(self) -> None:
        """On every way out: importers killed and reaped; on an error, the owner's memory let go (best effort)."""
        kill_all(self.live)
        self.live.clear()
        drv = self.drv
        if drv is None:
            return
        for ptr in self.ptrs:
            drv.d.cuMemFreeAsync(ptr, _stream(drv))
        self.ptrs.clear()
        if self.pool is not None:
            drv.d.cuStreamSynchronize(_stream(drv))
            drv.d.cuMemPoolDestroy(self.pool)
            self.pool = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def run_variant(args: argparse.Namespace) -> int:
    report = new_report(args)
    owner = Owner(args, report)
    status = EXIT_OK
    try:
        owner.run()
    except NoDriverError as exc:
        report["error"] = f"no usable GPU: {exc}"
        status = EXIT_NO_GPU
    except ReproError as exc:
        report["error"] = str(exc)
        status = EXIT_ERROR
    except KeyboardInterrupt:
        report["error"] = "interrupted"
        status = 130
    except Exception:
        report["error"] = traceback.format_exc()
        status = EXIT_ERROR
    finally:
        try:
            owner.cleanup()
        except Exception as exc:
            print(f"warning: cleanup: {exc}", file=sys.stderr, flush=True)
    report["elapsed_s"] = round(time.monotonic() - owner.t0, 3)
    finalize(report)
    if args.json:
        write_json(args.json, report)
    if status != EXIT_OK:
        print(f"error: {owner.tag} {report['error']}", file=sys.stderr, flush=True)
        return status
    if not args.in_matrix:
        say(format_table([{"name": report["variant"]["name"], "report": report}]))
    say(f"{owner.tag} verdict: {report['summary']['verdict']} ({report['elapsed_s']:.0f} s)")
    return EXIT_OK


# -- a fresh process's reading, and the matrix ----------------------------------------------------


def run_probe(args: argparse.Namespace) -> int:
    try:
        drv = load_driver()
        open_device(drv, args.device)
        free, total = drv("cuMemGetInfo")
    except NoDriverError as exc:
        print(f"error: no usable GPU: {exc}", file=sys.stderr, flush=True)
        return EXIT_NO_GPU
    except ReproError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    print(json.dumps({"free": int(free), "total": int(total)}), flush=True)
    return EXIT_OK


def probe(args: argparse.Namespace, timeout: float) -> tuple[int | None, str]:
    """(free bytes seen by a fresh process, or None; what went wrong). Never raises on its failure."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", "--device", str(args.device)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        return None, f"the probe did not answer within {timeout:.0f} s"
    if done.returncode != 0:
        return None, (done.stderr.strip() or f"the probe exited with {done.returncode}").splitlines()[-1]
    try:
        return int(json.loads(done.stdout.strip().splitlines()[-1])["free"]), ""
    except (ValueError, KeyError, IndexError, TypeError):
        return None, f"the probe printed no reading: {done.stdout[-200:]!r}"


def run_child_variant(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Run one variant's process (its output passes through); kill and reap it past ``timeout``."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait(timeout=max(timeout, 1.0)), ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, f"killed after {timeout:.0f} s (matrix time budget)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_matrix(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    deadline = t0 + args.max_seconds
    plan = matrix_plan(args)
    say(
        f"matrix: {len(plan)} variant(s), {args.importers} importers x {args.buffers} buffers, "
        f"sizes {[format_size(s) for s in args.sizes]}, budget {args.max_seconds:g} s. {GRANULE_NOTE}"
    )
    before, why = probe(args, min(60.0, args.max_seconds))
    if before is None:
        print(f"error: matrix: cannot read the device's free memory: {why}", file=sys.stderr, flush=True)
        return EXIT_NO_GPU if "no usable GPU" in why else EXIT_ERROR
    results: list[dict[str, Any]] = []
    durations: dict[str, float] = {}
    common = ["--device", str(args.device), "--child-timeout", str(args.child_timeout), "--recreate", "--in-matrix"]
    common += ["--settle", str(args.settle), "--end-sleep", str(args.end_sleep)]
    common += (["--no-smi"] if args.no_smi else []) + (["--no-warmup-importer"] if args.no_warmup_importer else [])
    with tempfile.TemporaryDirectory(prefix="cuda-pool-repro-") as tmp:
        for n, variant in enumerate(plan):
            remaining = deadline - time.monotonic()
            need = estimate_seconds(variant, durations)
            res: dict[str, Any] = {"name": variant.name, "variant": asdict(variant)}
            if remaining < need:
                res["skipped"] = f"time budget ({remaining:.0f} s left, about {need:.0f} s needed)"
                say(f"matrix: skipping {variant.name}: {res['skipped']}")
                results.append(res)
                continue
            path = os.path.join(tmp, f"variant-{n}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *variant.argv(), *common, "--json", path]
            cmd += ["--max-seconds", f"{max(remaining - 10.0, 1.0):.0f}"]
            say(f"matrix: variant {n + 1}/{len(plan)}: {variant.name} ({remaining:.0f} s left)")
            started = time.monotonic()
            rc, why = run_child_variant(cmd, remaining)
            res["elapsed_s"] = durations[variant.name] = round(time.monotonic() - started, 3)
            res["returncode"] = rc
            if os.path.exists(path):
                with open(path) as f:
                    res["report"] = json.load(f)
            if rc != 0:
                res["error"] = why or (res.get("report") or {}).get("error") or f"exited with {rc}"
            elif "report" not in res:
                res["error"] = "exited with 0 but wrote no report"
            after, why = probe(args, min(60.0, max(deadline - time.monotonic(), 5.0)))
            res["probe_before"], res["probe_after"] = before, after
            if after is not None:
                res["owner_exit_delta_mib"] = delta_mib(after - before)
                before = after
            else:
                res["probe_error"] = why
            results.append(res)
            if rc == EXIT_NO_GPU:
                break
    table, lines = format_table(results), interpret(results)
    matrix = {
        "schema": SCHEMA,
        "kind": "matrix",
        "granule_bytes": GRANULE,
        "granule_note": GRANULE_NOTE,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "results": results,
        "interpretation": lines,
        "table": table,
        "elapsed_s": round(time.monotonic() - t0, 3),
    }
    if args.json:
        write_json(args.json, matrix)
    say("\n" + table)
    for line in lines:
        say("* " + line)
    failed = [r for r in results if r.get("error")]
    for res in failed:
        print(f"error: {res['name']}: {res['error']}", file=sys.stderr, flush=True)
    if any(r.get("returncode") == EXIT_NO_GPU for r in results):
        return EXIT_NO_GPU
    if not any("report" in r for r in results):
        print(f"error: matrix: no variant fit in --max-seconds {args.max_seconds:g}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    return EXIT_ERROR if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return run_probe(args)
    if args.matrix:
        return run_matrix(args)
    return run_variant(args)


if __name__ == "__main__":
    sys.exit(main())
