"""`make compat`: CPython's own multiprocessing tests, run against gpushare.

Usage: ``python tests/compat/run.py [--types processes,manager] [--target gpushare|multiprocessing] [-k SUBSTRING]``

The interpreter that runs this script is the one tested: its
``test._test_multiprocessing`` (CPython's suite for that version) is built
by ``mp_suite.py`` against gpushare's namespace, with the spawn start
method, for the "processes" and "manager" types. Where that interpreter has
no ``test`` package (some distributions ship it separately), the check says
so and exits 0.

How a verdict is reached, per type:

1. One child interpreter runs the whole suite against gpushare and writes
   one JSON line per test outcome as it goes (so a hang loses nothing
   already run; the test running at the time-out is reported as timed out).
2. Every test that did not pass -- failed, errored or skipped -- runs again,
   in fresh children: once more against gpushare (a timing-sensitive test
   may fail once under load) and once against multiprocessing itself.
3. A test is a *difference* when it did not pass against gpushare, twice,
   while it passes against the stdlib. A difference named, with its reason,
   in the "Intended differences" table of ``docs/multiprocessing.md`` is reported
   and allowed; any other fails the check (exit 1). Tests that fail or skip
   with the stdlib too are not gpushare's differences: they are listed.

The last line of the output is the count, alone: ``N passed, N failed, N skipped``:
failed = unintended differences; skipped = skipped or failing with the stdlib
too (not judged); intended differences are counted on the line before.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
COMPAT_DOC = os.path.join(ROOT, "docs", "multiprocessing.md")
TYPES = ("processes", "manager")
FULL_RUN_TIMEOUT = float(os.environ.get("GPUSHARE_COMPAT_TIMEOUT", "1500"))  # seconds, one type's whole suite
RERUN_TIMEOUT = 600.0  # seconds, the re-runs of one type's tests that did not pass
PASSED = ("passed", "expected failure")


# -- the child: run tests, write outcomes ------------------------------------------------


class _JsonLinesResult(unittest.TestResult):
    """Writes ``{"id", "outcome", "detail"}`` per test to a file, flushed at once."""

    def __init__(self, out) -> None:
        super().__init__()
        self._out = out
        self._began = time.monotonic()

    def _write(self, test, outcome: str, detail: str = "") -> None:
        test_id = test.id().split(".", 1)[1] if test.id().startswith("mp_suite.") else test.id()
        if outcome == "started":
            self._began = time.monotonic()
        seconds = round(time.monotonic() - self._began, 3)
        record = {"id": test_id, "outcome": outcome, "detail": detail, "seconds": seconds}
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    def startTest(self, test) -> None:
        super().startTest(test)
        self._write(test, "started")
        print(".", end="", file=sys.stderr, flush=True)

    def addSuccess(self, test) -> None:
        self._write(test, "passed")

    def addFailure(self, test, err) -> None:
        super().addFailure(test, err)
        self._write(test, "failed", self.failures[-1][1])

    def addError(self, test, err) -> None:
        super().addError(test, err)
        self._write(test, "error", self.errors[-1][1])

    def addSkip(self, test, reason: str) -> None:
        self._write(test, "skipped", reason)

    def addExpectedFailure(self, test, err) -> None:
        self._write(test, "expected failure")

    def addUnexpectedSuccess(self, test) -> None:
        self._write(test, "unexpected success")


def _iter_tests(suite: unittest.TestSuite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _iter_tests(item)
        else:
            yield item


def child(out_path: str, ids: list[str]) -> int:
    import faulthandler

    import mp_suite

    faulthandler.dump_traceback_later(RERUN_TIMEOUT, exit=False)  # a hung test shows where
    loaded = unittest.TestLoader().loadTestsFromModule(mp_suite)
    if ids:
        wanted = set(ids)
        loaded = unittest.TestSuite(t for t in _iter_tests(loaded) if t.id().split(".", 1)[1] in wanted)
    with open(out_path, "a", encoding="utf-8") as out:
        loaded.run(_JsonLinesResult(out))
    print(file=sys.stderr)
    return 0


# -- the parent: run children, compare, report ---------------------------------------------


@dataclass
class Run:
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)
    seconds: float = 0.0
    timed_out: str | None = None
    returncode: int | None = None


def run_child(target: str, type_: str, ids: list[str] | None, timeout: float) -> Run:
    env = dict(os.environ, GPUSHARE_COMPAT_TARGET=target, GPUSHARE_COMPAT_TYPE=type_)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    with tempfile.NamedTemporaryFile("w+", suffix=".jsonl", delete=False) as tmp:
        out_path = tmp.name
    ids_file = None
    cmd = [sys.executable, os.path.abspath(__file__), "--child", out_path]
    if ids is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
            f.write("\n".join(ids))
            ids_file = f.name
        cmd += ["--ids", ids_file]
    run = Run()
    began = time.monotonic()
    # Its own session, so that a time-out ends the child and everything it started.
    proc = subprocess.Popen(cmd, env=env, cwd=HERE, start_new_session=True)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        run.timed_out = f"after {timeout:.0f} s"
    run.seconds = time.monotonic() - began
    run.returncode = proc.returncode
    last_started = None
    with open(out_path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["outcome"] == "started":
                last_started = record["id"]
                continue
            run.outcomes[record["id"]] = (record["outcome"], record["detail"])
            last_started = None
    if last_started is not None:
        why = run.timed_out or f"the test runner exited with status {proc.returncode}"
        run.outcomes[last_started] = ("error", f"did not finish: {why}")
    if ids is not None:  # a test that never started (runner gone) did not pass either
        for test_id in ids:
            run.outcomes.setdefault(test_id, ("error", "did not run (the test runner ended before it)"))
    for path in (out_path, ids_file):
        if path:
            os.unlink(path)
    return run


def intended_differences(path: str = COMPAT_DOC) -> dict[str, str]:
    """The ``| `WithXTestY.test_z` | reason |`` rows of the doc's "Intended differences" table."""
    found: dict[str, str] = {}
    row = re.compile(r"^\|\s*`(With\w+\.test_\w+)`\s*\|\s*(.+?)\s*\|\s*$")
    with open(path, encoding="utf-8") as f:
        for line in f:
            match = row.match(line)
            if match:
                found[match.group(1)] = match.group(2)
    return found


@dataclass
class Verdict:
    passed: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # unintended differences, with detail
    intended: list[str] = field(default_factory=list)
    flaky: list[str] = field(default_factory=list)
    stdlib_too: list[str] = field(default_factory=list)


def check_type(type_: str, intended: dict[str, str], select: str | None, target: str = "gpushare") -> Verdict:
    first = run_child(target, type_, None, FULL_RUN_TIMEOUT)
    outcomes = {k: v for k, v in first.outcomes.items() if select is None or select in k}
    not_passed = sorted(k for k, (outcome, _) in outcomes.items() if outcome not in PASSED)
    print(
        f"[{type_}] {target}: {len(outcomes)} tests in {first.seconds:.0f} s"
        + (f" (stopped {first.timed_out})" if first.timed_out else "")
        + f"; {len(not_passed)} did not pass: re-running them against gpushare and against multiprocessing",
        flush=True,
    )
    verdict = Verdict()
    if not first.outcomes or (first.returncode != 0 and not first.timed_out):
        # The runner itself broke (an import error, a crash): that is a failure, never a pass by default.
        verdict.failed.append((f"{type_} suite", f"the test runner exited with status {first.returncode}; see above"))
    again = stdlib = Run()
    if not_passed:
        again = run_child(target, type_, not_passed, RERUN_TIMEOUT)
        stdlib = run_child("multiprocessing", type_, not_passed, RERUN_TIMEOUT)
    for test_id, (outcome, _) in sorted(outcomes.items()):
        if outcome in PASSED:
            verdict.passed += 1
            continue
        retry, retry_detail = again.outcomes.get(test_id, ("error", "no result"))
        std, _ = stdlib.outcomes.get(test_id, ("error", "no result"))
        if retry in PASSED:
            verdict.passed += 1
            verdict.flaky.append(f"{test_id} ({outcome} once, passed on the re-run)")
        elif std in PASSED:
            if test_id in intended:
                verdict.intended.append(test_id)
            else:
                verdict.failed.append(
                    (test_id, f"{retry} with gpushare (twice), passes with the stdlib:\n{retry_detail}")
                )
        else:  # the stdlib does not pass it here either: not judged
            verdict.skipped += 1
            if not (retry == std == "skipped"):
                verdict.stdlib_too.append(f"{test_id} (gpushare: {retry}; stdlib: {std})")
    stale = sorted(k for k in intended if k.startswith(f"With{type_.capitalize()}") and k not in verdict.intended)
    for test_id in stale:
        print(f"[{type_}] note: {test_id} is listed as an intended difference but did not differ", flush=True)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated: processes, manager")
    parser.add_argument(
        "--target",
        default="gpushare",
        choices=("gpushare", "multiprocessing"),
        help="the namespace under test; 'multiprocessing' is the baseline (to time it, or see this machine's results)",
    )
    parser.add_argument("-k", dest="select", default=None, help="judge only tests whose id contains this")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--ids", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        ids = open(args.ids, encoding="utf-8").read().split() if args.ids else []
        return child(args.child, ids)

    # Bad arguments are an error whatever this interpreter has.
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        parser.error(f"unknown type(s) {unknown}; valid: {', '.join(TYPES)}")
    version = f"Python {sys.version.split()[0]} ({sys.executable})"
    try:
        found = importlib.util.find_spec("test._test_multiprocessing") is not None
    except ImportError:
        found = False
    if not found:
        print(
            f"compat: SKIPPED: {version} has no test._test_multiprocessing (CPython's own test package is not "
            "installed; on Debian/Ubuntu it is the libpython3.X-testsuite package). Nothing was checked.",
        )
        return 0
    intended = intended_differences()
    print(f"compat: CPython's multiprocessing tests ({version}), spawn, against {args.target}", flush=True)
    began = time.monotonic()
    total = Verdict()
    for type_ in types:
        verdict = check_type(type_, intended, args.select, args.target)
        print(
            f"[{type_}] {verdict.passed} passed, {len(verdict.failed)} failed, {verdict.skipped} skipped; "
            f"{len(verdict.intended)} intended difference(s)",
            flush=True,
        )
        for label, items in (
            ("intended difference (docs/multiprocessing.md)", verdict.intended),
            ("passed on the re-run", verdict.flaky),
            ("does not pass with the stdlib either", verdict.stdlib_too),
        ):
            for item in items:
                print(f"[{type_}]   {label}: {item}")
        for test_id, detail in verdict.failed:
            print(f"[{type_}] FAILED {test_id}: {detail}")
        total.passed += verdict.passed
        total.skipped += verdict.skipped
        total.failed += verdict.failed
        total.intended += verdict.intended
    print(
        f"compat: {time.monotonic() - began:.0f} s; {len(total.intended)} intended difference(s) "
        f"(docs/multiprocessing.md); {len(total.failed)} unintended",
        flush=True,
    )
    print(f"{total.passed} passed, {len(total.failed)} failed, {total.skipped} skipped")
    return 1 if total.failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
