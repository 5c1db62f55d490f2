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

PROBE = (
    "import gpushare as mp; from gpushare import _native; q = mp.Queue(); q.put(b'x' * 100); "
    "assert q.get(timeout=5) == b'x' * 100; print(q._region.native is not None, _native.why_not)"
)


def probe(cache, **env: str) -> tuple[bool, str]:
    """A child's answer with the C paths as ``env`` sets them (on, whatever this suite runs with)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=subprocess_env(GPUSHARE_CACHE=str(cache), **{"GPUSHARE_NATIVE": "1", "GPUSHARE_QUEUE_NATIVE": "1", **env}),
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    used, why = done.stdout.strip().split(" ", 1)
    return used == "True", why


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


def test_the_c_region_is_built_once_then_found(tmp_path) -> None:
    used, why = probe(tmp_path)
    if not used:
        pytest.skip(f"the C region cannot be built here: {why}")
    [built] = [p for p in tmp_path.iterdir() if p.suffix == ".so"]
    assert built.stat().st_mode & 0o777 == 0o700
    stamp = built.stat().st_mtime_ns
    assert probe(tmp_path) == (True, "None")
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary file left beside it
    assert built.stat().st_mtime_ns == stamp  # found, not built again


def test_a_failed_build_leaves_the_python_path_and_says_why(tmp_path) -> None:
    used, why = probe(tmp_path, CC="false")
    assert not used
    assert "could not be built" in why and "false" in why
    assert list(tmp_path.iterdir()) == []
    assert probe(tmp_path / "off", GPUSHARE_QUEUE_NATIVE="0") == (False, "GPUSHARE_QUEUE_NATIVE=0")
    assert probe(tmp_path / "off", GPUSHARE_NATIVE="0") == (False, "GPUSHARE_NATIVE=0")
    assert not (tmp_path / "off").exists()


def test_a_folder_others_may_write_to_is_never_used(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    used, why = probe(shared)
    assert not used and "another user" in why
    assert list(shared.iterdir()) == []


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


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GPUSHARE_CACHE", str(tmp_path))
    assert _native._cache_dirs() == [str(tmp_path)]
    monkeypatch.delenv("GPUSHARE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _native._cache_dirs()[0] == os.path.join(str(tmp_path / "xdg"), "gpushare")
