"""The Queue region's put and get in C (gpushare._native): built once, found after, and one
protocol with the Python path.

The C calls take a message that fits the ring with the lock free at once; everything else
(a spill, a busy lock, a dead holder's lock) is handed to the Python path or taken over as
it does. Processes with and without the C calls share one queue. Where this machine cannot
build it (no C compiler, no Python headers) the tests that need it skip with the reason.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys

import pytest
from conftest import start, subprocess_env

import gpushare as mp
from gpushare import _native, _queues

T = 60

PROBE = """
import sys, warnings
warnings.simplefilter("always")
sys.modules.update(dict.fromkeys(sys.argv[1:]))  # these compiled modules cannot be imported
with warnings.catch_warnings(record=True) as caught:
    import gpushare as mp
    from gpushare import _native
    queues = [mp.Queue(), mp.Queue()]
    for q in queues:
        q.put(b"x" * 100)
        assert q.get(timeout=5) == b"x" * 100
print(queues[0]._region.native is not None, len([w for w in caught if w.category is _native.CompiledCoreWarning]))
print(_native.why_not)
"""


def probe(*hidden: str, **env: str) -> tuple[bool, int, str]:
    """A child's answer, with the C paths as ``env`` sets them (on, whatever this suite runs
    with) and the ``hidden`` compiled modules not installed: whether its queues use the C
    region, how many CompiledCoreWarnings it gave, and why not."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *hidden],
        env=subprocess_env(**{"GPUSHARE_NATIVE": "1", "GPUSHARE_QUEUE_NATIVE": "1", **env}),
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, why = done.stdout.strip().split("\n", 1)
    used, warned = first.split(" ")
    return used == "True", int(warned), why


def native_here() -> None:
    if _queues.Region().native is None:
        pytest.skip(f"the C region is not available here: {_native.why_not}")


def send_sizes(q, sizes, native) -> None:
    assert (q._region.native is not None) == native, _native.why_not
    for i, size in enumerate(sizes):
        q.put((i, bytes([i % 256]) * size))


def take_sizes(q, out, n, native) -> None:
    assert (q._region.native is not None) == native, _native.why_not
    got = []
    for _ in range(n):
        i, data = q.get(timeout=T)
        got.append((i, len(data), set(data)))
    out.put(got)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "amd64"),
    reason="the compiled region is used on Linux x86-64 only",
)
def test_the_compiled_region_comes_with_the_package_and_is_used() -> None:
    """Built when the package is (setup.py; ``make`` and ``pip install .``), never at run time."""
    assert probe() == (True, 0, "None")
    assert not hasattr(_native, "_build")  # no compiler is run at import or first use


def test_a_missing_compiled_module_leaves_the_python_path_warns_once_and_says_why() -> None:
    used, warned, why = probe("gpushare._core")
    assert not used and warned == 1
    assert "gpushare._core" in why and "not installed" in why
    assert probe("gpushare._core", GPUSHARE_QUEUE_NATIVE="0") == (False, 0, "GPUSHARE_QUEUE_NATIVE=0")
    assert probe(GPUSHARE_NATIVE="0") == (False, 0, "GPUSHARE_NATIVE=0")


def test_gpushare_info_names_the_path_in_use() -> None:
    from gpushare.__main__ import collect_info, format_info

    info = collect_info()
    core = info["compiled_core"]
    assert set(core) == {
        "Queue region (gpushare._core)",
        "buffer handoff (gpushare._core)",
        "driver queries (gpushare._cuda._cqueries)",
    }
    text = format_info(info)
    for module, state in core.items():
        assert (state["in_use"] and state["why_not"] is None) or (not state["in_use"] and state["why_not"])
        assert module in text


@pytest.mark.parametrize("producer_native", [False, True])
def test_c_and_python_users_of_one_queue_see_one_stream(reap, monkeypatch, producer_native) -> None:
    """A producer on one path and a consumer on the other: every message, in order, whole;
    messages that wrap the ring, larger ones, and spilled ones (over a quarter of the ring)."""
    native_here()
    sizes = [(i * 7919) % 70_000 for i in range(300)] + [300_000, 0, 600_000, 5]
    q, out = mp.Queue(), mp.Queue()
    monkeypatch.setenv("GPUSHARE_QUEUE_NATIVE", "1" if producer_native else "0")
    start(reap, send_sizes, q, sizes, producer_native)
    monkeypatch.setenv("GPUSHARE_QUEUE_NATIVE", "0" if producer_native else "1")
    start(reap, take_sizes, q, out, len(sizes), not producer_native)
    got = out.get(timeout=T)
    assert got == [(i, size, {i % 256} if size else set()) for i, size in enumerate(sizes)]


def test_the_c_calls_answer_full_no_room_and_empty_as_the_python_path() -> None:
    native_here()
    q = mp.Queue(maxsize=2)
    native = q._region.native
    assert native.get() == _native.EMPTY
    q.put(1)
    q.put(2)
    assert native.put(b"x", 0, 0, 2) == _queues.FULL
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert [q.get(timeout=5), q.get(timeout=5)] == [1, 2]
    assert q.empty()
    big = b"y" * (200 << 10)  # under a quarter of the 1 MiB ring: no spill
    answers = [native.put(big, 0, 0, 0) for _ in range(6)]
    assert answers == [0, 0, 0, 0, 0, _queues.NO_ROOM] and q.qsize() == 5
    assert native.get() == (_queues.KIND_DATA, big)


KILLED_HOLDER = """
import os, pickle, signal, time
import gpushare as mp
from gpushare._native import PYTHON

def hold(q, ready, side):
    (q._region.plock if side == "p" else q._region.clock).acquire()
    ready.put("holding")
    time.sleep(60)

def held_then_killed(q, ready, side):
    h = mp.Process(target=hold, args=(q, ready, side))
    h.start()
    assert ready.get(timeout=30) == "holding"
    return h

if __name__ == "__main__":
    q, ready = mp.Queue(), mp.Queue()
    native = q._region.native
    assert native is not None
    after = pickle.dumps("after")
    h = held_then_killed(q, ready, "p")
    assert native.put(after, 0, 0, 0) == PYTHON and q.qsize() == 0  # busy: nothing written
    os.kill(h.pid, signal.SIGKILL)
    h.join(30)
    assert native.put(after, 0, 0, 0) == 0  # the dead holder's lock taken over (EOWNERDEAD)
    h = held_then_killed(q, ready, "c")
    q.put("queued")
    assert native.get() == PYTHON and q.qsize() == 2  # busy: nothing taken
    os.kill(h.pid, signal.SIGKILL)
    h.join(30)
    kind, payload = native.get()
    assert (kind, pickle.loads(payload)) == (0, "after")
    assert q.get(timeout=5) == "queued" and q.empty()
    print("taken over")
"""


def test_the_c_calls_take_over_a_killed_holders_lock(tmp_path) -> None:
    native_here()
    script = tmp_path / "killed.py"
    script.write_text(KILLED_HOLDER)
    done = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "taken over" in done.stdout, done.stderr[-3000:]
