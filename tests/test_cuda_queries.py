"""The per-handoff queries that keep the GIL (``gpushare._cuda._queries.load``), without a GPU.

A stand-in driver library, compiled here from C, exports the four symbols
with the driver's signatures; the tests load it the way ``_cuda`` loads
``libcuda.so.1``, through the C extension (``_cuda/_queries.c``) and through
ctypes (``_Queries``), and check the answers, that nothing is loaded that was
not already, and that a call really keeps the GIL: a slow stand-in query must
stop every other Python thread of the process for as long as it runs (the
same call through ``ctypes.CDLL``, which releases the GIL, lets them run).
The GPU suite checks the same queries against cuda-bindings on a real device
(``tests/test_backends.py::test_queries_keep_the_gil_and_agree_with_the_bindings``).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import subprocess_env

from gpushare import _native
from gpushare._cuda._queries import _Queries, load

CURRENT = 0x1234  # the stand-in's current context
SLOW_STREAM = 0x77  # a stream whose query takes SLOW_S in C
SLOW_S = 0.2

_STUB = r"""
#include <time.h>
static void *current = (void *)0x1234;
static int stream_result = 0;
int cuCtxGetCurrent(void **pctx) { *pctx = current; return 0; }
int cuStreamQuery(void *stream) {
    if (stream == (void *)0x77) {
        struct timespec t = {0, 200000000};
        nanosleep(&t, 0);
    }
    return stream_result;
}
int cuEventQuery(void *event) { return (int)(long)event; }
static void *recorded_event = 0, *recorded_stream = (void *)-1;
int cuEventRecord(void *event, void *stream) {
    if (event == 0) return 400;  /* CUDA_ERROR_INVALID_HANDLE */
    recorded_event = event;
    recorded_stream = stream;
    return 0;
}
void *stub_recorded(int which) { return which ? recorded_stream : recorded_event; }
void stub_set(void *ctx, int result) { current = ctx; stream_result = result; }
"""


def _build(tmp_path: Path, name: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver library")
    src = tmp_path / "stub.c"
    src.write_text(_STUB)
    lib = tmp_path / name
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    return lib


@pytest.fixture(params=["c", "ctypes"])
def native(request: pytest.FixtureRequest) -> bool:
    """Each test runs on both implementations: the C extension's, and ctypes'."""
    if request.param == "c" and _native.queries_type() is None:
        why = _native._queries.why_not or "not Linux, or GPUSHARE_NATIVE=0"
        pytest.skip(f"the compiled queries are not in use here: {why}")
    return request.param == "c"


@pytest.fixture
def stub(tmp_path: Path, native: bool) -> tuple[ctypes.CDLL, Any]:
    """The stand-in, loaded (as cuda-bindings loads the driver), and the queries on it."""
    path = _build(tmp_path, "libstubcuda.so")
    lib = ctypes.CDLL(str(path))
    queries = load(str(path), native)
    assert queries is not None
    assert isinstance(queries, _Queries) is not native
    lib.stub_set.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib, queries


def test_answers_done_not_ready_and_leaves_the_rest_to_the_bindings(stub: tuple[Any, Any]) -> None:
    lib, q = stub
    assert q.stream_done(CURRENT, 0) is True
    lib.stub_set(CURRENT, 600)  # CUDA_ERROR_NOT_READY
    assert q.stream_done(CURRENT, 0) is False
    lib.stub_set(CURRENT, 400)  # CUDA_ERROR_INVALID_HANDLE: cuda-bindings asks again and raises
    assert q.stream_done(CURRENT, 0) is None
    assert q.event_done(CURRENT, 0) is True
    assert q.event_done(CURRENT, 600) is False
    assert q.event_done(CURRENT, 1) is None


def test_no_answer_when_the_primary_context_is_not_current(stub: tuple[Any, Any]) -> None:
    lib, q = stub
    assert q.stream_done(None, 0) is None  # this process has not entered the device yet
    assert q.stream_done(CURRENT + 8, 0) is None  # another context (torch's own, say)
    assert q.event_done(CURRENT + 8, 0) is None
    lib.stub_set(None, 0)
    assert q.stream_done(CURRENT, 0) is None  # no context on this thread


def test_records_an_event_only_in_the_primary_context(stub: tuple[Any, Any]) -> None:
    lib, q = stub
    lib.stub_recorded.restype = ctypes.c_void_p
    assert q.record(CURRENT, 0x51, 0) is True
    assert (lib.stub_recorded(0), lib.stub_recorded(1)) == (0x51, None)  # on the legacy default stream
    assert q.record(CURRENT, 0x52, 0x9000) is True
    assert (lib.stub_recorded(0), lib.stub_recorded(1)) == (0x52, 0x9000)
    # Not recorded here, so that the caller records through cuda-bindings (which sets the
    # context, or raises with the error's name): no context yet, another one, an error.
    assert q.record(None, 0x53, 0) is False
    assert q.record(CURRENT + 8, 0x53, 0) is False
    assert q.record(CURRENT, 0, 0) is False
    assert lib.stub_recorded(0) == 0x52
    lib.stub_set(None, 0)
    assert q.record(CURRENT, 0x53, 0) is False
    assert lib.stub_recorded(0) == 0x52


def test_loads_only_a_library_already_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    path = _build(tmp_path, "libnotloaded.so")
    assert load(str(path), native) is None  # RTLD_NOLOAD: never a second copy of the driver
    assert load("libgpushare-no-such-driver.so.1", native) is None
    ctypes.CDLL(str(path))
    assert load(str(path), native) is not None
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    assert load(str(path), native) is None  # the plain symbols name the legacy default stream
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0")
    assert load(str(path), native) is not None


def test_gpushare_native_0_leaves_the_ctypes_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _build(tmp_path, "libstubcuda.so")
    ctypes.CDLL(str(path))
    monkeypatch.setenv("GPUSHARE_NATIVE", "0")
    queries = load(str(path))
    assert isinstance(queries, _Queries)
    assert queries.stream_done(CURRENT, 0) is True


def test_without_the_compiled_queries_the_ctypes_path_answers_and_says_why(tmp_path: Path) -> None:
    """The compiled queries not installed: they still answer, through ctypes, and it says why."""
    path = _build(tmp_path, "libstubcuda.so")
    code = (
        "import ctypes, sys, warnings; warnings.simplefilter('ignore'); "
        "sys.modules['gpushare._cuda._cqueries'] = None; "
        "ctypes.CDLL(sys.argv[1]); from gpushare import _native; "
        "from gpushare._cuda._queries import _Queries, load; q = load(sys.argv[1]); "
        "print(isinstance(q, _Queries), q.stream_done(0x1234, 0)); print(_native._queries.why_not)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, why = done.stdout.strip().split("\n", 1)
    assert first == "True True"
    assert "not installed" in why and "gpushare._cuda._cqueries" in why


def test_a_library_without_the_driver_calls_is_refused(tmp_path: Path, native: bool) -> None:
    src = tmp_path / "other.c"
    src.write_text("int cuCtxGetCurrent(void **p) { return 0; }\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    lib = tmp_path / "libother.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    ctypes.CDLL(str(lib))
    assert load(str(lib), native) is None


def _steps_of_another_thread_during(call: Any) -> int:
    """How many loop steps another Python thread makes while ``call()`` runs."""
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while count[0] < 1000 and time.monotonic() < deadline:  # it runs
            time.sleep(0.001)
        before = count[0]
        call()
        return count[0] - before
    finally:
        stop.set()
        t.join(timeout=10)


def test_a_query_keeps_the_gil(stub: tuple[Any, Any], tmp_path: Path) -> None:
    lib, q = stub
    started = time.monotonic()
    kept = _steps_of_another_thread_during(lambda: q.stream_done(CURRENT, SLOW_STREAM))
    assert time.monotonic() - started >= SLOW_S
    # The same slow call through CDLL releases the GIL: the other thread runs meanwhile.
    released_query = lib.cuStreamQuery
    released_query.argtypes = [ctypes.c_void_p]
    released = _steps_of_another_thread_during(lambda: released_query(SLOW_STREAM))
    assert released > 1000, f"the other thread should run while a GIL-releasing call sleeps ({released} steps)"
    # Kept, the other thread runs only in the Python around the C call: at most a switch
    # interval (5 ms) on each side of it, against the whole 200 ms released.
    assert kept < released / 4, f"the other thread ran {kept} steps during a query (vs {released} released)"
