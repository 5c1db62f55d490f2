"""The command line: ``python -m bench`` parses, plans, runs and writes the three reports.

Where they go: ``report.md`` and ``report.json`` into ``--out`` (default ``dev/benchmarks``
of the checkout), the plot to ``--plot`` (default ``docs/assets/benchmarks.png``, where the
user docs show it, when ``--out`` is left out; ``benchmarks.png`` in ``--out`` otherwise, so a
run folder or a scratch run never replaces the docs' plot). The report links the plot by
its path relative to the report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

from .report_json import render_json, scenarios_from_json
from .report_md import render_markdown
from .report_plot import render_plot
from .results import Scenario
from .runner import Bench
from .scenarios import scenario_modules
from .settings import (
    CHECKOUT,
    CONSUMERS,
    CUDA_BACKENDS,
    FLOOR_SCENARIO,
    HOST_BACKEND,
    HOST_CONSUMERS,
    KERNEL_ITERS,
    KERNEL_ITERS_QUICK,
    KERNEL_WARMUP,
    KERNEL_WARMUP_QUICK,
    PEER_ITERS,
    PEER_ITERS_QUICK,
    PEER_WARMUP,
    PEER_WARMUP_QUICK,
    PLOT_NAME,
    PLOT_PATH,
    REPORT_DIR,
    REPORT_JSON,
    REPORT_MD,
    STREAM_COUNT,
    STREAM_COUNT_QUICK,
    STREAM_REPEATS,
    STREAM_REPEATS_QUICK,
    STREAM_WARMUP,
    STREAM_WARMUP_QUICK,
    Config,
    _progress,
)

#: --only's choices: every registered scenario's keys, in the registry's order.
SCENARIO_KEYS = tuple(key for module in scenario_modules() for key in module.KEYS)


def _known_cuda_backends() -> tuple[str, ...]:
    """CUDA_BACKENDS, then any other CUDA backend the library lists (never fails)."""
    names = list(CUDA_BACKENDS)
    try:
        from gpushare._backends import BACKENDS

        names += [name for name in BACKENDS if name != HOST_BACKEND and name not in names]
    except Exception:
        pass
    return tuple(names)


def _backend_list(text: str) -> tuple[str, ...]:
    known = _known_cuda_backends()
    names: list[str] = []
    for name in (v.strip() for v in text.split(",")):
        if name and name not in names:
            names.append(name)
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one backend ({', '.join(known)})")
    if HOST_BACKEND in names:
        raise argparse.ArgumentTypeError(
            "--backends lists CUDA backends; the host backend is measured with --backend host"
        )
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown CUDA backend(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    return tuple(names)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: consumer counts are ints >= 1")
    return values


def _parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure gpushare's buffer handoff (one column per backend) against multiprocessing floors, "
        "torch.multiprocessing and cuda.core, its ring's fan-out and pipelined throughput, and the bandwidth of "
        "kernels reading mapped memory (same GPU; peer GPU with two), and its start-up (import, Process, Manager, "
        "first buffer) against the stdlib's, and gpushare.torch.multiprocessing against torch.multiprocessing; "
        "write report.md, report.json and the plot benchmarks.png.",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help=f"directory for report.md and report.json (default: {REPORT_DIR} of the checkout; "
        f"a run kept on its own goes in a folder of {os.path.join(REPORT_DIR, 'runs')})",
    )
    parser.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help=f"path of the plot (default: {PLOT_PATH} of the checkout, which the user docs show; "
        f"with --out: {PLOT_NAME} in that directory)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer iterations, for smoke and CI runs")
    parser.add_argument(
        "--render",
        metavar="JSON",
        action="append",
        default=None,
        help="measure nothing: write report.md (and the plot) again from this report.json (or a run "
        "folder's benchmarks.json); given more than once, one report of every run's scenarios (a later run's "
        "scenario replaces an earlier run's of the same name), with a table of the runs, and its report.json",
    )
    parser.add_argument(
        "--backend",
        choices=("host", "cuda"),
        default=None,
        help="gpushare backend for the handoff scenarios (default: cuda when a GPU is usable, else host)",
    )
    parser.add_argument(
        "--backends",
        type=_backend_list,
        default=None,
        help="gpushare CUDA backends to measure, one column each, comma-separated (default: every CUDA "
        f"backend: {','.join(CUDA_BACKENDS)}); ignored with --backend host",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per cell (default 300; 100 quick)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every cell this many times, interleaved (all cells, then all again), and pool each "
        "cell's samples, so the floors and the systems share the machine's drift (default 1)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no round that would end past this many seconds at the pace of the rounds so far; "
        "the reports are rewritten after every round, so the finished rounds count",
    )
    parser.add_argument(
        "--consumers", type=_counts, default=CONSUMERS, help="consumer counts, comma-separated (default 1,2,4,8)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=f"run only these scenarios, comma-separated: {', '.join(SCENARIO_KEYS)} "
        "(the floors always run: every ratio is taken to them)",
    )
    args = parser.parse_args(argv)
    backend = args.backend
    if backend is None:
        from gpushare import _cuda

        backend = "cuda" if _cuda.available() else "host"
    iters = args.iters if args.iters is not None else (100 if args.quick else 300)
    if iters < 1:
        parser.error("--iters must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error("--max-seconds must be positive")
    only = None
    if args.only:
        only = frozenset(k.strip() for k in args.only.split(",") if k.strip())
        unknown = sorted(only - set(SCENARIO_KEYS))
        if unknown:
            parser.error(f"unknown scenario(s) {', '.join(unknown)}; valid: {', '.join(SCENARIO_KEYS)}")
        only |= {FLOOR_SCENARIO}
    host_consumers = tuple(n for n in args.consumers if n <= max(HOST_CONSUMERS)) or (1,)
    out, plot = args.out, args.plot
    if out is None:
        out = os.path.join(CHECKOUT, REPORT_DIR)
        plot = plot or os.path.join(CHECKOUT, PLOT_PATH)
    return Config(
        out=out,
        quick=args.quick,
        backend=backend,
        iters=iters,
        warmup=10 if args.quick else 20,
        heavy_iters=max(20, iters // 5),
        heavy_warmup=2 if args.quick else 3,
        consumers=args.consumers,
        host_consumers=host_consumers,
        only=only,
        backends=args.backends or _known_cuda_backends(),
        peer_iters=PEER_ITERS_QUICK if args.quick else PEER_ITERS,
        peer_warmup=PEER_WARMUP_QUICK if args.quick else PEER_WARMUP,
        stream_count=STREAM_COUNT_QUICK if args.quick else STREAM_COUNT,
        stream_warmup=STREAM_WARMUP_QUICK if args.quick else STREAM_WARMUP,
        stream_repeats=STREAM_REPEATS_QUICK if args.quick else STREAM_REPEATS,
        kernel_iters=KERNEL_ITERS_QUICK if args.quick else KERNEL_ITERS,
        kernel_warmup=KERNEL_WARMUP_QUICK if args.quick else KERNEL_WARMUP,
        rounds=args.rounds,
        max_seconds=args.max_seconds,
        render=args.render,
        plot=plot or os.path.join(out, PLOT_NAME),
    )


def main(argv: list[str] | None = None) -> int:
    cfg = _parse(argv)
    if cfg.render is not None:
        return render_again(cfg.render, cfg.out, cfg.plot)
    bench = Bench(cfg)
    bench.probe()
    bench.plan()
    rounds = f", {cfg.rounds} rounds" if cfg.rounds > 1 else ""
    _progress(
        f"bench: backend {cfg.backend} ({', '.join(cfg.backends)}), {len(bench.tasks)} cells{rounds}, "
        f"{cfg.iters} iterations each "
        f"({cfg.heavy_iters} for first shares and host arrays of 64 MiB or more); reports go to {cfg.out}/"
    )
    started = time.monotonic()
    plot_note = ""

    def write(done: int) -> None:
        nonlocal plot_note
        bench.meta["elapsed_s"] = round(time.monotonic() - started, 1)
        plot_note = write_reports(bench, cfg.out, cfg.plot)
        if done < cfg.rounds:
            _progress(f"bench: round {done} of {cfg.rounds} done; reports written to {cfg.out}/")

    def partial(done: int, total: int) -> None:  # a run cut short keeps the cells it measured
        bench.meta["partial"] = f"{done} of {total} cells of the first round"
        bench.meta["elapsed_s"] = round(time.monotonic() - started, 1)
        write_reports(bench, cfg.out, cfg.plot, plot=False)
        bench.meta.pop("partial", None)

    bench.run(after_round=write, after_cell=partial)  # the first round always runs, so the reports are written
    _progress(f"bench: done in {bench.meta['elapsed_s']} s; wrote {cfg.out}/{REPORT_MD}, {REPORT_JSON}")
    _progress(plot_note)
    return 0


def render_again(paths: list[str], out: str, png: str | None = None) -> int:
    """Write report.md into ``out`` and the plot to ``png`` (default: benchmarks.png in ``out``)
    from the measurements in the JSON reports ``paths``.

    With one path, the report of that run again. With several, one report of all their
    scenarios, in the order the runs are given (a later run's scenario replaces an earlier
    one of the same key); the first run's meta heads it and ``meta["runs"]`` lists each
    run's date, device and scenarios, so every table can be traced to the run that measured
    it. The merged report.json is written too."""
    scenarios: dict[str, Scenario] = {}
    origin: dict[str, str] = {}  # scenario key -> the JSON it came from
    runs: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
            these, run_meta = scenarios_from_json(report), report["meta"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _progress(f"bench: cannot render {path}: {type(exc).__name__}: {exc}")
            return 2
        meta = meta or dict(run_meta)
        taken = _replaceable(scenarios, these)
        for earlier in run_meta.get("runs") or [run_meta]:  # a merged report merges again
            keys = [k for k in earlier.get("scenarios") or list(these) if k in taken]
            runs.append(_run_entry(earlier, keys, path))
        for key in taken:
            scenarios[key] = these[key]
            origin[key] = path
    for s in scenarios.values():
        floor_key = s.floor[0] if s.floor else s.key
        if floor_key != s.key and origin.get(floor_key) != origin[s.key]:
            _progress(
                f"bench: cannot join: `{s.key}` of {origin[s.key]} is measured against `{floor_key}` of "
                f"{origin.get(floor_key)}, another run; render {origin[s.key]} on its own, or join it after the run "
                "with the floors it was measured against"
            )
            return 2
    if len(paths) > 1:
        meta["runs"] = _latest_owner(runs)
    os.makedirs(out, exist_ok=True)
    png = png or os.path.join(out, PLOT_NAME)
    drawn = os.path.exists(png)
    try:
        plot_note = _draw(scenarios, meta, out, png)
    except Exception as exc:
        plot_note = f"No plot: drawing it failed ({type(exc).__name__}: {exc})."
    if plot_note.startswith("No plot: matplotlib") and drawn:  # the run's own plot, kept
        plot_note = f"![median latency against the number of consumers]({_link(out, png)})"
    if len(paths) > 1:
        with open(os.path.join(out, REPORT_JSON), "w", encoding="utf-8") as f:
            json.dump(render_json(scenarios, meta), f, indent=1)
            f.write("\n")
    with open(os.path.join(out, REPORT_MD), "w", encoding="utf-8") as f:
        f.write(render_markdown(scenarios, meta, plot_note))
    _progress(f"bench: rendered {', '.join(paths)} into {out}/{REPORT_MD}")
    return 0


def _replaceable(kept: dict[str, Scenario], new: dict[str, Scenario]) -> list[str]:
    """The keys of ``new`` that go into the joined report: all but a floor scenario (such as
    ``floors``) that a kept scenario of an earlier run is measured against and ``new`` does not replace."""
    staying = [s for key, s in kept.items() if key not in new]
    used = {s.floor[0] for s in staying if s.floor and s.floor[0] != s.key}
    return [key for key in new if key not in used]


def _run_entry(meta: dict[str, Any], keys: list[str], path: str) -> dict[str, Any]:
    """One row of a merged report's table of runs."""
    return {
        "date": meta.get("date"),
        "device": meta.get("device"),
        "torch": meta.get("torch"),
        "quick": meta.get("quick"),
        "source": meta.get("source") or path,
        "scenarios": list(keys),
    }


def _latest_owner(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each scenario listed only under the last run that measured it; runs left with none are dropped."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for run in reversed(runs):
        keys = [k for k in run["scenarios"] if k not in seen]
        seen.update(keys)
        if keys:
            out.append({**run, "scenarios": keys})
    return out[::-1]


def _link(out: str, png: str) -> str:
    """The plot's path as the report in ``out`` links it."""
    return os.path.relpath(os.path.abspath(png), os.path.abspath(out)).replace(os.sep, "/")


def _draw(scenarios: dict[str, Scenario], meta: dict[str, Any], out: str, png: str) -> str:
    """Draw the plot at ``png`` (making its folder); return the report's line for it."""
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    return render_plot(scenarios, meta, png, _link(out, png))


def write_reports(bench: Bench, out: str, png: str | None = None, *, plot: bool = True) -> str:
    """Write report.json and report.md into ``out`` and the plot to ``png`` (default:
    benchmarks.png in ``out``) from what ``bench`` has so far; return the plot's note.
    ``plot=False`` (after each cell) leaves the plot for the end of the round.

    A report that fails to render must not lose the measurements: the JSON falls back to
    the raw results, and the Markdown to a pointer at the JSON."""
    os.makedirs(out, exist_ok=True)
    plot_note = "No plot yet: the run has not finished its first round."
    if plot:
        try:
            plot_note = _draw(bench.scenarios, bench.meta, out, png or os.path.join(out, PLOT_NAME))
        except Exception as exc:  # a plot must never cost the measurements
            plot_note = f"No plot: drawing it failed ({type(exc).__name__}: {exc})."
    try:
        report = render_json(bench.scenarios, bench.meta)
    except Exception as exc:
        report = {
            "meta": bench.meta,
            "render_error": f"{type(exc).__name__}: {exc}",
            "scenarios": {key: asdict(s) for key, s in bench.scenarios.items()},
        }
    with open(os.path.join(out, REPORT_JSON), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    try:
        markdown = render_markdown(bench.scenarios, bench.meta, plot_note)
    except Exception as exc:
        markdown = (
            f"# gpushare benchmarks\n\nThe report failed to render ({type(exc).__name__}: {exc}); "
            f"every measurement is in {REPORT_JSON}.\n"
        )
    with open(os.path.join(out, REPORT_MD), "w", encoding="utf-8") as f:
        f.write(markdown)
    return plot_note
