"""``startup``: what a script meets before any buffer moves, gpushare against the stdlib.

One table, one row per thing started (the interpreter with the import, a Process, a
Manager, the first buffer to a consumer; on a GPU, a Process bound to a device and the
first device buffer), the stdlib's equivalent as the floor of each row. Everything runs
in fresh interpreters, because what is measured is what a fresh interpreter pays:

* ``import``: the bench's process times ``subprocess.run`` of ``python -c "import gpushare"``,
  ``"import multiprocessing"`` and ``"pass"``, interleaved.
* every other row: a small script, written to a temporary directory and run as its own
  interpreter, times itself with ``time.perf_counter_ns`` and prints its samples as one
  JSON line. What its processes run is defined in the script itself, so a spawned child
  re-imports the script as it re-imports a user's. A script is run in a session of its own: one that
  overruns its timeout is killed with everything it started.

A row's systems are measured in one task, their scripts run alternately, so a drift of
the machine moves every column of the row alike. The Process and Manager scripts time
several start+join (start+shutdown) pairs: each script's first pair is a row of its own
(``... first in a new interpreter``: what a short script meets), handed from the steady
row's task to the next task through ``Firsts``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..results import Scenario, Series, _bind
from ..settings import GPUSHARE, BenchError, MiB
from ..stats import Target

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("startup",)
KEY = KEYS[0]

FLOOR = "multiprocessing"  # the stdlib, spawn start method: every row's floor
BARE = "bare interpreter (pass)"  # the import row's reference: an interpreter that imports nothing
CUDA_ALONE = "CUDA context alone"  # the GPU rows' reference: what no CUDA user avoids

IMPORT = "import"
PROCESS = "Process start+join"
PROCESS_FIRST = "Process, first in a new interpreter"
MANAGER = "Manager start+shutdown"
MANAGER_FIRST = "Manager, first in a new interpreter"
FIRST_HOST = "first host buffer to one consumer"
DEVICE = 0  # the GPU rows' device
GPU_PROCESS = f"Process(device={DEVICE}) start+join"
FIRST_DEVICE = "first device buffer to one consumer"
ROWS = (IMPORT, PROCESS, PROCESS_FIRST, MANAGER, MANAGER_FIRST, FIRST_HOST, GPU_PROCESS, FIRST_DEVICE)

TARGETS = {
    IMPORT: Target("ratio_max", 1.5),
    PROCESS: Target("ratio_max", 1.25),
    MANAGER: Target("ratio_max", 1.5),
}

FIRST_BYTES = 2 * MiB  # the first buffer's size (float32)
IMPORT_TIMEOUT = 60.0  # seconds for one interpreter of the import row
SCRIPT_TIMEOUT = 300.0  # seconds for one whole script (its starts, its Manager, its consumer)
WAIT_TIMEOUT = 60.0  # seconds for one wait inside a script (a join, a consumer's answer)


@dataclass(frozen=True)
class Counts:
    """How much of each row one run measures."""

    imports: int  # interpreters of each kind for the import row
    interpreters: int  # scripts of each kind for the Process and Manager rows
    starts: int  # start+join (start+shutdown) pairs per such script; its first is the "first" rows'
    firsts: int  # scripts of each kind for the first-buffer rows (one sample each)
    warmup: int = 1  # untimed runs of each kind before a row is timed (compiles, page cache)

    def __post_init__(self) -> None:
        if self.starts < 2:
            raise ValueError(f"starts={self.starts}: a script needs its first pair and at least one more")


FULL = Counts(imports=20, interpreters=6, starts=6, firsts=8)
QUICK = Counts(imports=5, interpreters=2, starts=3, firsts=3)

HOW = (
    "`startup` times what a script meets before any buffer moves, gpushare against the stdlib's spawn "
    "start method (the floor) in the same run, each row in fresh interpreters "
    "(`sys.executable`, the run's environment with the checkout first on PYTHONPATH, in a temporary "
    "directory removed afterwards), the systems of a row alternating, after one untimed run of each. "
    "`import`: wall time of the whole interpreter, measured in the bench's process around `subprocess.run` "
    'of `python -c "import gpushare"`, `"import multiprocessing"` (the floor) and `"pass"` '
    f"(the `{BARE}` column, for reference), {FULL.imports} runs of each ({QUICK.imports} with --quick). The other rows "
    "are timed with `time.perf_counter_ns` inside a small script run as its own interpreter, which does "
    '`import gpushare as mp` or `mp = multiprocessing.get_context("spawn")` (the floor) and defines its '
    "targets at module level, so that a spawned child re-imports the script as it re-imports a user's. "
    "`Process start+join`: `p = mp.Process(target=target); p.start(); p.join()` with `def target(): pass`; "
    "`Manager start+shutdown`: `m = mp.Manager(); m.shutdown()`; "
    f"{FULL.starts} pairs per script, {FULL.interpreters} scripts of each kind ({QUICK.starts} and "
    f"{QUICK.interpreters} with --quick). Their cells hold every pair but a script's first; the first pairs "
    "are the `... first in a new interpreter` rows (a short script meets only that one; it also starts "
    "multiprocessing's resource tracker). `first host buffer to one consumer`: gpushare's script makes "
    '`m = mp.Manager()`; both start one consumer process (gpushare\'s with `device="cpu"`) and wait until '
    'it says it is ready; then one sample per script, from `buf = m.empty((524288,), "float32", '
    'device="cpu")` (2 MiB) and `work.put(buf)` on a gpushare Queue until the consumer\'s ack: it gets '
    "the buffer, reads its first element (`buf.view(shape=(1,)).numpy()[0]`), releases both and acks on a "
    "second Queue. Its floor is the notification: the stdlib's spawn-context Queues carrying a small tuple, "
    f"the consumer acking. {FULL.firsts} scripts of each kind ({QUICK.firsts} with --quick). With a GPU: "
    f"`{GPU_PROCESS}` is the Process row with `mp.Process(target=target, device={DEVICE})` (gpushare), next "
    f"to `{CUDA_ALONE}` (a stdlib spawn Process whose target imports cuda.bindings and calls cuInit, "
    "cuDeviceGet, cuDevicePrimaryCtxRetain and cuCtxSetCurrent, then returns) and the stdlib's plain "
    f"start+join (the floor); `{FIRST_DEVICE}` is gpushare's first-buffer script with `device={DEVICE}` for "
    "the buffer and the consumer (whose context exists before timing), cold: the timed span holds the "
    "producer's import of the CUDA bindings and its context creation, as a user meets them; its "
    f"`{CUDA_ALONE}` is that import and those calls, timed in a fresh interpreter. Targets (median, "
    "gpushare / floor): import <= 1.5x, Process start+join <= 1.25x, Manager start+shutdown <= 1.5x; the "
    "GPU rows have none. Every interpreter has a timeout "
    f"({IMPORT_TIMEOUT:g} s for an import, {SCRIPT_TIMEOUT:g} s for a script, killed with what it started); "
    "a row whose interpreter fails records the error and the run goes on."
)


def plan(bench: Bench) -> None:
    gpu = bench.gpu_reason is None
    systems = {FLOOR: Series(), GPUSHARE: Series(), BARE: Series()}
    if gpu:
        systems[CUDA_ALONE] = Series()
    if not bench.add(
        Scenario(
            KEY,
            "Startup: import, Process, Manager and first buffer in fresh interpreters, against multiprocessing",
            "timed",
            list(ROWS),
            systems=systems,
            floor=(KEY, FLOOR),
            ratio_systems=[GPUSHARE],
            extra_ratios=[(GPUSHARE, CUDA_ALONE)] if gpu else [],
            targets=dict(TARGETS),
            target_systems=[GPUSHARE],
            plot=False,
        )
    ):
        return
    bench.scenarios[KEY].notes.append(
        "Times in us (1,000 us = 1 ms). Each row is timed in fresh interpreters, its systems alternating; "
        "see How measured for what each row times."
    )
    counts = QUICK if bench.cfg.quick else FULL
    firsts = Firsts()
    bench.task(KEY, None, IMPORT, _bind(time_imports, counts), None)
    bench.task(KEY, None, PROCESS, _bind(time_processes, counts, firsts), None)
    bench.task(KEY, None, PROCESS_FIRST, _bind(firsts.take, PROCESS_FIRST, PROCESS), None)
    bench.task(KEY, None, MANAGER, _bind(time_managers, counts, firsts), None)
    bench.task(KEY, None, MANAGER_FIRST, _bind(firsts.take, MANAGER_FIRST, MANAGER), None)
    bench.task(KEY, None, FIRST_HOST, _bind(time_first_host_buffer, counts), None)
    bench.task(KEY, None, GPU_PROCESS, _bind(time_gpu_processes, counts), bench.gpu_reason)
    bench.task(KEY, None, FIRST_DEVICE, _bind(time_first_device_buffer, counts), bench.gpu_reason)


class Firsts:
    """The first pairs of a steady row's scripts, kept for the row of firsts that follows it."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, list[int]]] = {}

    def keep(self, row: str, samples: dict[str, list[int]]) -> None:
        self._rows[row] = samples

    def take(self, row: str, source: str) -> dict[str, list[int]]:
        samples = self._rows.pop(row, None)
        if samples is None:
            raise BenchError(
                f"no samples: they come from the scripts of the row {source!r}, which did not run or failed"
            )
        return samples


# -- the interpreters ----------------------------------------------------------------------------


def checkout_env() -> dict[str, str]:
    """The run's environment with the folder gpushare was imported from first on PYTHONPATH."""
    import gpushare

    root = str(Path(gpushare.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _tail(text: str, lines: int = 4, chars: int = 600) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    joined = " | ".join(kept)
    return joined if len(joined) <= chars else "..." + joined[-chars:]


def time_imports(counts: Counts) -> dict[str, list[int]]:
    """Wall time of whole interpreters that import gpushare, multiprocessing or nothing."""
    codes = {GPUSHARE: "import gpushare", FLOOR: "import multiprocessing", BARE: "pass"}
    samples: dict[str, list[int]] = {name: [] for name in codes}
    env = checkout_env()
    clock = time.perf_counter_ns
    with tempfile.TemporaryDirectory(prefix="gpushare-bench-startup-") as cwd:
        for i in range(counts.warmup + counts.imports):
            for name, code in codes.items():
                t0 = clock()
                try:
                    done = subprocess.run(
                        [sys.executable, "-c", code],
                        cwd=cwd,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=IMPORT_TIMEOUT,
                        check=False,
                    )
                except subprocess.TimeoutExpired:
                    raise BenchError(f"python -c {code!r} did not finish within {IMPORT_TIMEOUT:g} s") from None
                elapsed = clock() - t0
                if done.returncode != 0:
                    raise BenchError(f"python -c {code!r} exited with code {done.returncode}: {_tail(done.stderr)}")
                if i >= counts.warmup:
                    samples[name].append(elapsed)
    return samples


def run_script(path: Path, params: dict[str, Any], env: dict[str, str], timeout: float = SCRIPT_TIMEOUT) -> list[int]:
    """Run one script as its own interpreter, in a session of its own, and return the samples it
    printed (its last line of output, a JSON list of ints). A script that overruns ``timeout``
    or fails is killed with every process it started; either raises ``BenchError``."""
    proc = subprocess.Popen(
        [sys.executable, str(path), json.dumps(params)],
        cwd=path.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: one kill reaches its children too
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise BenchError(
            f"{path.name} did not finish within {timeout:g} s; it was killed with the processes it started"
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        _kill_group(proc)  # what a failed script left running (a consumer, a Manager's server)
        raise BenchError(f"{path.name} exited with code {proc.returncode}: {_tail(err) or 'no output'}")
    lines = out.strip().splitlines()
    try:
        samples = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise BenchError(f"{path.name} printed no samples: {_tail(out) or 'no output'}") from None
    if not isinstance(samples, list) or not samples or not all(isinstance(v, int) and v > 0 for v in samples):
        raise BenchError(f"{path.name} printed {lines[-1]!r}, not a list of positive ints")
    return samples


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the script's process group (the script and what it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # a pipe still held open: give up on its output
        proc.kill()
        proc.wait(timeout=10)


class Scripts:
    """A temporary directory of scripts, one per (row, system), removed on exit."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="gpushare-bench-startup-")
        self.path = Path(self._dir.name)
        self.env = checkout_env()

    def __enter__(self) -> Scripts:
        return self

    def __exit__(self, *exc: object) -> None:
        self._dir.cleanup()

    def write(self, name: str, source: str) -> Path:
        path = self.path / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        return path


def _alternate(
    scripts: Scripts, kinds: dict[str, tuple[Path, dict[str, Any]]], runs: int, warmup: int
) -> dict[str, list[list[int]]]:
    """Run each kind's script ``warmup`` times untimed, then ``runs`` times, the kinds alternating;
    per kind, the samples of each timed run."""
    out: dict[str, list[list[int]]] = {name: [] for name in kinds}
    for i in range(warmup + runs):
        for name, (path, params) in kinds.items():
            samples = run_script(path, params, scripts.env)
            if i >= warmup:
                out[name].append(samples)
    return out


def _steady_and_firsts(
    runs: dict[str, list[list[int]]], starts: int
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Split each script's samples into its first pair and the rest."""
    steady: dict[str, list[int]] = {}
    firsts: dict[str, list[int]] = {}
    for name, per_script in runs.items():
        for samples in per_script:
            if len(samples) != starts:
                raise BenchError(f"a {name} script printed {len(samples)} samples instead of {starts}")
        firsts[name] = [samples[0] for samples in per_script]
        steady[name] = [v for samples in per_script for v in samples[1:]]
    return steady, firsts


# -- the scripts ---------------------------------------------------------------------------------
# Each is a header (how ``mp`` is had), definitions at module level, and a main that reads its
# parameters from argv[1] (JSON) and prints its samples (ns) as one JSON line.

_HEADERS = {
    GPUSHARE: "import gpushare as mp\n",
    FLOOR: 'import multiprocessing\n\nmp = multiprocessing.get_context("spawn")\n',
}

_PRELUDE = "import json\nimport sys\nimport time\n\n"

_TRIVIAL_TARGET = """

def target():
    pass
"""

# The CUDA reference: the context's own creation, with cuda.bindings directly (not gpushare).
_CUDA_CONTEXT = """

def make_cuda_context(ordinal):
    from cuda.bindings import driver

    def check(call, result):
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{call} failed: {result[0]!r}")
        return result[1] if len(result) > 1 else None

    check("cuInit", driver.cuInit(0))
    device = check("cuDeviceGet", driver.cuDeviceGet(ordinal))
    context = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(device))
    check("cuCtxSetCurrent", driver.cuCtxSetCurrent(context))


def target(ordinal):
    make_cuda_context(ordinal)
"""

_STARTS_MAIN = """

def main(params):
    clock = time.perf_counter_ns
    timeout = params["timeout"]
    samples = []
    for _ in range(params["n"]):
        t0 = clock()
        p = mp.Process(target=target, args=tuple(params["args"]), **params["process_kwargs"])
        p.start()
        p.join(timeout)
        t1 = clock()
        if p.exitcode is None:
            p.kill()
            p.join(timeout)
            raise SystemExit(f"the child did not exit within {timeout} s")
        if p.exitcode != 0:
            raise SystemExit(f"the child exited with code {p.exitcode}")
        samples.append(t1 - t0)
    print(json.dumps(samples))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
"""

_MANAGER_MAIN = """

def main(params):
    clock = time.perf_counter_ns
    samples = []
    for _ in range(params["n"]):
        t0 = clock()
        m = mp.Manager()
        m.shutdown()
        samples.append(clock() - t0)
    print(json.dumps(samples))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
"""

_FIRST_BUFFER_MAIN = """

def consumer(work, acks, read, timeout):
    try:
        acks.put("ready")
        item = work.get(timeout=timeout)
        if read:  # a gpushare Buffer: read its first element, then let both go
            first = item.view(shape=(1,))
            float(first.numpy()[0])
            first.release()
            item.release()
        del item
        acks.put(1)
    except BaseException as exc:
        acks.put(("error", f"{type(exc).__name__}: {exc}"))


def answer(acks, p, timeout, what):
    try:
        message = acks.get(timeout=timeout)
    except Exception:
        raise SystemExit(f"no {what} from the consumer within {timeout} s (its exit code: {p.exitcode})")
    if isinstance(message, tuple) and message[:1] == ("error",):
        raise SystemExit(f"the consumer failed: {message[1]}")
    return message


def main(params):
    clock = time.perf_counter_ns
    timeout = params["timeout"]
    device = params["device"]  # None: the floor, a small tuple
    m = None if device is None else mp.Manager()
    work, acks = mp.Queue(), mp.Queue()
    p = mp.Process(
        target=consumer, args=(work, acks, device is not None, timeout), daemon=True, **params["process_kwargs"]
    )
    p.start()
    try:
        if answer(acks, p, timeout, "ready") != "ready":
            raise SystemExit("the consumer did not say it was ready")
        t0 = clock()
        if device is None:
            item = ("job", 0, b"x" * 16)
        else:
            item = m.empty((params["nbytes"] // 4,), "float32", device=device)
        work.put(item)
        ack = answer(acks, p, timeout, "ack")
        t1 = clock()
        if ack != 1:
            raise SystemExit(f"the consumer sent {ack!r} instead of an ack")
        if device is not None:
            item.release()
        p.join(timeout)
    finally:
        if p.is_alive():
            p.kill()
            p.join(timeout)
        if m is not None:
            m.shutdown()
    print(json.dumps([t1 - t0]))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
"""

_CONTEXT_ALONE_MAIN = """

def main(params):
    clock = time.perf_counter_ns
    t0 = clock()
    make_cuda_context(params["device"])
    t1 = clock()
    print(json.dumps([t1 - t0]))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
"""


def starts_script(system: str, cuda_target: bool = False) -> str:
    """The source of a script timing ``mp.Process(...).start(); .join()`` pairs."""
    return _PRELUDE + _HEADERS[system] + (_CUDA_CONTEXT if cuda_target else _TRIVIAL_TARGET) + _STARTS_MAIN


def manager_script(system: str) -> str:
    """The source of a script timing ``mp.Manager(); m.shutdown()`` pairs."""
    return _PRELUDE + _HEADERS[system] + _MANAGER_MAIN


def first_buffer_script(system: str) -> str:
    """The source of a script timing its first item (a buffer, or the floor's tuple) to one consumer."""
    return _PRELUDE + _HEADERS[system] + _FIRST_BUFFER_MAIN


def context_alone_script() -> str:
    """The source of a script timing a CUDA context's creation in a fresh interpreter, with cuda.bindings."""
    return _PRELUDE + _CUDA_CONTEXT + _CONTEXT_ALONE_MAIN


def _starts_params(counts: Counts, args: tuple[Any, ...] = (), **process_kwargs: Any) -> dict[str, Any]:
    return {"n": counts.starts, "timeout": WAIT_TIMEOUT, "args": list(args), "process_kwargs": process_kwargs}


# -- the rows --------------------------------------------------------------------------------------


def time_processes(counts: Counts, firsts: Firsts) -> dict[str, list[int]]:
    """``mp.Process(target=target).start(); .join()``: steady pairs here, each script's first kept."""
    with Scripts() as scripts:
        kinds = {
            name: (scripts.write(f"process_{name}", starts_script(name)), _starts_params(counts))
            for name in (GPUSHARE, FLOOR)
        }
        runs = _alternate(scripts, kinds, counts.interpreters, counts.warmup)
    steady, first = _steady_and_firsts(runs, counts.starts)
    firsts.keep(PROCESS_FIRST, first)
    return steady


def time_managers(counts: Counts, firsts: Firsts) -> dict[str, list[int]]:
    """``mp.Manager(); m.shutdown()``: steady pairs here, each script's first kept."""
    params = {"n": counts.starts}
    with Scripts() as scripts:
        kinds = {name: (scripts.write(f"manager_{name}", manager_script(name)), params) for name in (GPUSHARE, FLOOR)}
        runs = _alternate(scripts, kinds, counts.interpreters, counts.warmup)
    steady, first = _steady_and_firsts(runs, counts.starts)
    firsts.keep(MANAGER_FIRST, first)
    return steady


def _first_params(device: int | str | None) -> dict[str, Any]:
    return {
        "timeout": WAIT_TIMEOUT,
        "device": device,
        "nbytes": FIRST_BYTES,
        "process_kwargs": {} if device is None else {"device": device},
    }


def _one_each(runs: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, per_script in runs.items():
        if any(len(samples) != 1 for samples in per_script):
            raise BenchError(f"a {name} script printed more than its one sample")
        out[name] = [samples[0] for samples in per_script]
    return out


def time_first_host_buffer(counts: Counts) -> dict[str, list[int]]:
    """A 2 MiB host buffer, the first of its interpreter, to a consumer started before timing."""
    with Scripts() as scripts:
        kinds = {
            GPUSHARE: (scripts.write("first_host_gpushare", first_buffer_script(GPUSHARE)), _first_params("cpu")),
            FLOOR: (scripts.write("first_host_multiprocessing", first_buffer_script(FLOOR)), _first_params(None)),
        }
        return _one_each(_alternate(scripts, kinds, counts.firsts, counts.warmup))


def time_gpu_processes(counts: Counts) -> dict[str, list[int]]:
    """``Process(device=0)`` start+join, next to a stdlib process that creates a context, and the plain one."""
    with Scripts() as scripts:
        kinds = {
            GPUSHARE: (
                scripts.write("gpu_process_gpushare", starts_script(GPUSHARE)),
                _starts_params(counts, device=DEVICE),
            ),
            CUDA_ALONE: (
                scripts.write("gpu_process_cuda_context", starts_script(FLOOR, cuda_target=True)),
                _starts_params(counts, (DEVICE,)),
            ),
            FLOOR: (scripts.write("gpu_process_multiprocessing", starts_script(FLOOR)), _starts_params(counts)),
        }
        runs = _alternate(scripts, kinds, counts.interpreters, counts.warmup)
    return _steady_and_firsts(runs, counts.starts)[0]


def time_first_device_buffer(counts: Counts) -> dict[str, list[int]]:
    """The first device buffer of a cold producer to a consumer on the device, next to the
    context's creation alone in a fresh interpreter."""
    with Scripts() as scripts:
        kinds = {
            GPUSHARE: (scripts.write("first_device_gpushare", first_buffer_script(GPUSHARE)), _first_params(DEVICE)),
            CUDA_ALONE: (scripts.write("cuda_context_alone", context_alone_script()), {"device": DEVICE}),
        }
        return _one_each(_alternate(scripts, kinds, counts.firsts, counts.warmup))
