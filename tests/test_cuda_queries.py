"""The per-handoff queries that keep the GIL (``gpushare._cuda._queries._Queries``), without a GPU.

A stand-in driver library, compiled here from C, exports the four symbols
with the driver's signatures; the tests load it the way ``_cuda`` loads
``libcuda.so.1`` and check the answers, that nothing is loaded that was not
already, and that a call really keeps the GIL: a slow stand-in query must
stop every other Python thread of the process for as long as it runs (the
same call through ``ctypes.CDLL``, which releases the GIL, lets them run).
The GPU suite checks the same queries against cuda-bindings on a real device
(``tests/test_backends.py::test_queries_keep_the_gil_and_agree_with_the_bindings``).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpushare._cuda._queries import _Queries

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


@pytest.fixture
def stub(tmp_path: Path) -> tuple[ctypes.CDLL, _Queries]:
    """The stand-in, loaded (as cuda-bindings loads the driver), and the queries on it."""
    path = _build(tmp_path, "libstubcuda.so")
    lib = ctypes.CDLL(str(path))
    queries = _Queries.load(str(path))
    assert queries is not None
    lib.stub_set.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib, queries


def test_answers_done_not_ready_and_leaves_the_rest_to_the_bindings(stub: tuple[Any, _Queries]) -> None:
    lib, q = stub
    assert q.done(CURRENT, q.stream, 0) is True
    lib.stub_set(CURRENT, 600)  # CUDA_ERROR_NOT_READY
    assert q.done(CURRENT, q.stream, 0) is False
    lib.stub_set(CURRENT, 400)  # CUDA_ERROR_INVALID_HANDLE: cuda-bindings asks again and raises
    assert q.done(CURRENT, q.stream, 0) is None
    assert q.done(CURRENT, q.event, 0) is True
    assert q.done(CURRENT, q.event, 600) is False
    assert q.done(CURRENT, q.event, 1) is None


def test_no_answer_when_the_primary_context_is_not_current(stub: tuple[Any, _Queries]) -> None:
    lib, q = stub
    assert q.done(None, q.stream, 0) is None  # this process has not entered the device yet
    assert q.done(CURRENT + 8, q.stream, 0) is None  # another context (torch's own, say)
    lib.stub_set(None, 0)
    assert q.done(CURRENT, q.stream, 0) is None  # no context on this thread


def test_records_an_event_only_in_the_primary_context(stub: tuple[Any, _Queries]) -> None:
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


def test_loads_only_a_library_already_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _build(tmp_path, "libnotloaded.so")
    assert _Queries.load(str(path)) is None  # RTLD_NOLOAD: never a second copy of the driver
    assert _Queries.load("libgpushare-no-such-driver.so.1") is None
    ctypes.CDLL(str(path))
    assert _Queries.load(str(path)) is not None
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    assert _Queries.load(str(path)) is None  # the plain symbols name the legacy default stream
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0")
    assert _Queries.load(str(path)) is not None


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


def test_a_query_keeps_the_gil(stub: tuple[Any, _Queries], tmp_path: Path) -> None:
    lib, q = stub
    started = time.monotonic()
    kept = _steps_of_another_thread_during(lambda: q.done(CURRENT, q.stream, SLOW_STREAM))
    assert time.monotonic() - started >= SLOW_S
    # The same slow call through CDLL releases the GIL: the other thread runs meanwhile.
    released_query = lib.cuStreamQuery
    released_query.argtypes = [ctypes.c_void_p]
    released = _steps_of_another_thread_during(lambda: released_query(SLOW_STREAM))
    assert released > 1000, f"the other thread should run while a GIL-releasing call sleeps ({released} steps)"
    # Kept, the other thread runs only in the Python around the C call: at most a switch
    # interval (5 ms) on each side of it, against the whole 200 ms released.
    assert kept < released / 4, f"the other thread ran {kept} steps during a query (vs {released} released)"
