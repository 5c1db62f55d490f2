"""Tensor sets (weight sync): a trainer publishes versions, engines in other processes take them.

The host backend runs everywhere (NumPy; torch CPU where installed); the
``gpu`` and ``multigpu`` tests run the same patterns on CUDA. Engines are
spawned gpushare Processes; every wait has a timeout and ``reap`` kills
survivors.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest
from conftest import (
    GPU_TIMEOUT,
    assert_prompt,
    clean_up_after,
    fill_behind_a_running_kernel,
    recv,
    require,
    run_guarded,
    start,
    start_guarded,
    wait_until,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import gpushare as mp
from gpushare._fanout import ALIGN, Layout, make_layout

T = 60  # seconds any single wait in a worker may take
LAYOUT = {"w": ((64, 32), "float32"), "b": ((17,), "bfloat16"), "i": ((5, 3), "int64")}


# -- what a version holds, and its checksum ----------------------------------------------


def ts_weights(version: int) -> dict[str, np.ndarray]:
    """The tensors of ``version``: every one depends on it (b is bfloat16's bits, as uint16)."""
    return {
        "w": np.full((64, 32), version * 0.5, "float32"),
        "b": np.full((17,), version, "uint16"),
        "i": np.arange(15, dtype="int64").reshape(5, 3) + version,
    }


def ts_checksum(tensors) -> float:
    return sum(float(np.asarray(tensors[name]).astype(np.float64).sum()) for name in sorted(LAYOUT))


def ts_empty() -> dict[str, np.ndarray]:
    return {
        name: np.zeros(shape, "uint16" if dtype == "bfloat16" else dtype) for name, (shape, dtype) in LAYOUT.items()
    }


# -- engines (module level: spawn imports them by name) ----------------------------------


def ts_follow(out, reader, last, mode) -> None:
    """Take every version it can (latest wins) up to ``last``; report (version, checksum) of each."""
    version, seen = 0, []
    while version < last:
        with reader.wait(newer_than=version, timeout=T) as snap:
            if mode == "copy":
                mine = ts_empty()
                snap.copy_to(mine)
                total = ts_checksum(mine)
            else:
                total = ts_checksum({name: snap[name].numpy() for name in snap})
            seen.append((snap.version, total))
            version = snap.version
    out.put(("seen", os.getpid(), seen))
    reader.close()


def ts_take_when_told(out, reader, control) -> None:
    with reader.latest(timeout=T) as snap:
        out.put(("first", snap.version))
    control.get(timeout=T)
    with reader.wait(newer_than=1, timeout=T) as snap:
        out.put(("then", snap.version, ts_checksum({name: snap[name].numpy() for name in snap})))


def ts_hold(out, reader, control, how) -> None:
    """Hold versions as told: "one" (a snapshot), "two" (the newest two), "array" (only a NumPy
    array made from a view: the snapshot and its views dropped)."""
    held = [reader.latest(timeout=T)]
    if how == "two":
        held.append(reader.wait(newer_than=held[0].version, timeout=T))
    if how == "array":
        array = held[0]["w"].numpy()
        held.clear()
        gc.collect()
        out.put(("holding", [], float(array[0, 0])))
    else:
        out.put(("holding", [s.version for s in held], 0.0))
    control.get(timeout=T)
    held.clear()
    if how == "array":
        del array
    out.put(("let go",))
    control.get(timeout=T)


def ts_syncs(out, reader, count, control) -> None:
    """Syncs in copy mode up to version ``count``; report fds and threads after the first 50 and at
    the end, then stay registered until told to go."""
    mine = ts_empty()
    version = 0
    marks = []
    while version < count:  # latest wins: fewer takes than versions when the trainer runs ahead
        with reader.wait(newer_than=version, timeout=T) as snap:
            snap.copy_to(mine)
            version = snap.version
        assert int(mine["b"][0]) == version % 65536
        for due in (not marks and version >= 50, version == count):
            if due:
                gc.collect()
                marks.append((len(os.listdir("/proc/self/fd")), threading.active_count()))
    out.put(("done", version, marks))
    control.get(timeout=T)


def ts_from_queue(out, sets) -> None:
    reader = sets.get(timeout=T)
    with reader.latest(timeout=T) as snap:
        out.put(("got", type(reader).__name__, snap.version, ts_checksum({n: snap[n].numpy() for n in snap})))


def ts_trainer_then_die(sets, results, control, owner) -> None:
    """A trainer in a child: make a set, publish version 1, hand the set on, wait to be killed."""
    with mp.Manager(owner=owner) as m:
        ts = m.tensor_set(LAYOUT, device="cpu")
        dirs = [os.path.dirname(ts._core.address)]
        if owner == "process":
            dirs.append(os.path.dirname(m._owner.address))
        results.put(("left behind", m._process.pid, dirs))
        ts.publish(ts_weights(1))
        sets.put(ts)
        results.put(("published", os.getpid()))
        control.get(timeout=T)  # killed here


def ts_engine_outlives(out, sets, owner) -> None:
    reader = sets.get(timeout=T)
    snap = reader.latest(timeout=T)
    mine = ts_empty()
    snap.copy_to(mine)
    out.put(("copied", snap.version, ts_checksum(mine)))
    started = time.monotonic()
    try:
        reader.wait(newer_than=snap.version, timeout=T)
    except mp.GpushareError as exc:
        waited = time.monotonic() - started
        out.put(("wait", type(exc).__name__, str(exc), waited))
    deadline = time.monotonic() + (10 if owner == "process" else 0)
    while True:  # the memory owner's death reaches this process's lifetime link in its own time
        try:
            held: tuple[str, object] = ("views", ts_checksum({n: snap[n].numpy() for n in snap}))
        except mp.GpushareError as exc:
            held = ("views", type(exc).__name__)
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out.put(("after", ts_checksum(mine), held))
    snap.release()


# -- the layout ------------------------------------------------------------------------------

_DTYPES = st.sampled_from(["float32", "float16", "int8", "int64", "uint8", "bool", "complex64", "bfloat16"])
_SHAPES = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.tuples(_SHAPES, _DTYPES), min_size=1, max_size=12))
def test_layout_packs_every_tensor_aligned_in_order_without_overlap(spec) -> None:
    layout = make_layout(spec)
    assert list(layout) == list(spec)
    end = 0
    for name, (shape, dtype) in spec.items():
        s = layout[name]
        itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        assert s.offset % ALIGN == 0 and s.offset >= end
        assert s.offset - end < ALIGN  # packed: no more padding than the alignment needs
        assert s.shape == shape and s.nbytes == int(np.prod(shape, dtype=np.int64)) * itemsize
        assert (s.tag, s.dtype) == (
            ("bfloat16", np.dtype("uint16")) if dtype == "bfloat16" else (None, np.dtype(dtype))
        )
        end = s.offset + s.nbytes
    assert layout.nbytes == end
    assert Layout.from_wire(pickle.loads(pickle.dumps(layout.to_wire()))) == layout


def test_layout_accepts_arrays_and_tags_and_says_what_is_wrong() -> None:
    layout = make_layout(
        {"a": np.zeros((3, 2), "float64"), "t": ((4,), "uint16", "bfloat16"), "f8": ((2,), "uint8", "myfp8")}
    )
    assert [(s.shape, s.dtype.name, s.tag) for s in layout.values()] == [
        ((3, 2), "float64", None),
        ((4,), "uint16", "bfloat16"),
        ((2,), "uint8", "myfp8"),
    ]
    cases = [
        ({}, "empty"),
        ([("a", (1, "f4"))], "mapping"),
        ({"a": ((2,), "float32", "bfloat16")}, "unsigned int"),
        ({"a": ((2,), "uint8", "bfloat16")}, "store it as uint16"),
        ({"a": ((2,), "object")}, "cannot be shared"),
        ({"a": "nonsense"}, "does not describe a tensor"),
        ({"a": ((-1,), "float32")}, "negative"),
        ({"": ((1,), "float32")}, "non-empty strings"),
    ]
    for spec, message in cases:
        with pytest.raises(mp.LayoutError, match=message):
            make_layout(spec)
    assert issubclass(mp.LayoutError, ValueError) and issubclass(mp.TensorSetClosedError, EOFError)


# -- in one process: the API's edges -----------------------------------------------------------


def test_publish_take_draft_and_the_api_edges_in_one_process(manager) -> None:
    with pytest.raises(mp.LayoutError, match="versions"):
        manager.tensor_set(LAYOUT, versions=0, device="cpu")
    with manager.tensor_set(LAYOUT, versions=2, device="cpu") as ts:
        assert (ts.versions, ts.version, ts.device, ts.backend, ts.names) == (2, 0, "cpu", "host", ("w", "b", "i"))
        assert ts.nbytes == ts.layout["i"].offset + 15 * 8 and ts.layout["b"].tag == "bfloat16"
        reader = pickle.loads(pickle.dumps(ts))  # a reader, here in the trainer's own process
        assert (reader.names, reader.nbytes, reader.versions) == (ts.names, ts.nbytes, 2)
        with pytest.raises(mp.WaitTimeoutError, match="no version newer than 0"):
            reader.latest(timeout=0.05)
        with pytest.raises(mp.LayoutError, match="1 missing: 'i'"):
            ts.publish({k: v for k, v in ts_weights(1).items() if k != "i"})
        with pytest.raises(mp.LayoutError, match=r"name no tensor.*'x'"):
            ts.publish({**ts_weights(1), "x": np.zeros(1)})
        with pytest.raises(mp.LayoutError, match=r"'w' has shape \(2, 2\)"):
            ts.publish({**ts_weights(1), "w": np.zeros((2, 2), "float32")})
        with pytest.raises(mp.LayoutError, match=r"'w' has dtype float64.*no casting"):
            ts.publish({**ts_weights(1), "w": np.zeros((64, 32))})
        assert ts.stats()["free"] == 2 and ts.version == 0  # nothing was taken by the failures

        assert ts.publish(ts_weights(1)) == 1
        snap = reader.latest(timeout=1)
        assert (snap.version, list(snap), len(snap), "w" in snap, "x" in snap) == (1, ["w", "b", "i"], 3, True, False)
        assert snap["b"].tag == "bfloat16" and snap["b"].dtype == np.dtype("uint16") and snap["w"].tag is None
        assert snap["w"] is snap["w"]  # one view per name per snapshot
        assert ts_checksum({n: snap[n].numpy() for n in snap}) == ts_checksum(ts_weights(1))
        with pytest.raises(KeyError):
            snap["x"]
        assert ts.stats()["held"] == {1: [os.getpid()]}

        draft = ts.draft(timeout=1)  # the version nobody holds
        assert not draft.released and list(draft) == ["w", "b", "i"]
        for name, value in ts_weights(2).items():
            draft[name].numpy()[...] = value
        view = draft["w"]
        assert ts.publish(draft) == 2
        assert draft.released
        with pytest.raises(mp.BufferReleasedError):
            view.numpy()
        with pytest.raises(mp.BufferReleasedError, match="already published"):
            ts.publish(draft)
        with pytest.raises(mp.BufferReleasedError, match="already published"):
            draft["w"]

        again = reader.latest(timeout=1)
        assert again.version == 2
        same = reader.latest(timeout=1)  # a version held here is granted again: one hold, two snapshots
        assert ts.stats()["held"] == {1: [os.getpid()], 2: [os.getpid()]}
        with pytest.raises(mp.WaitTimeoutError, match=r"version 1 held by pid \d+; version 2 held by pid"):
            ts.draft(timeout=0.1)
        again.release()
        assert ts.stats()["held"][2] == [os.getpid()]  # still held by `same`
        with pytest.raises(mp.BufferReleasedError, match="was released"):
            again["w"]
        del same
        snap.release()
        assert ts.stats()["held"] == {} and ts.stats()["free"] == 2

        unpublished = ts.draft(timeout=1)
        assert ts.stats()["writing"] == 1
        unpublished.release()  # given back at once
        assert ts.stats()["writing"] == 0
        kept = ts.draft(timeout=1)["w"]  # the draft dropped, a view alive: still being written
        assert ts.stats()["writing"] == 1
        del kept
        assert ts.stats()["writing"] == 0
        assert reader.stats()["version"] == 2
        reader.close()
        wait_until(lambda: ts.stats()["readers"] == 0)  # the trainer's thread for it sees the socket close
        with pytest.raises(mp.TensorSetClosedError, match="closed in this process"):
            reader.latest(timeout=1)
    assert ts.closed
    with pytest.raises(mp.TensorSetClosedError):
        ts.publish(ts_weights(3))
    with pytest.raises(mp.TensorSetClosedError):
        pickle.dumps(ts)


@pytest.mark.parametrize("how", ["release", "publish", "drop"])
def test_a_draft_keeps_its_versions_memory_past_close_until_it_goes(manager, how) -> None:
    """A draft holds a count on its version's memory, not only the version: the set closed
    under it, the draft stays writable, and its memory goes once the draft does (released,
    published into the closed set, or dropped with its last view)."""
    ts = manager.tensor_set(LAYOUT, versions=2, device="cpu")
    version_bytes = manager.stats()["bytes_in_use"] // 2
    draft = ts.draft(timeout=1)
    view = draft["w"]
    ts.close()
    assert manager.stats()["bytes_in_use"] == version_bytes  # the other version went with the set
    view.numpy()[...] = 7.0  # still mapped: the draft's count holds it
    if how == "release":
        draft.release()
    elif how == "publish":
        with pytest.raises(mp.TensorSetClosedError):
            ts.publish(draft)
        assert draft.released
    else:
        del draft
        assert manager.stats()["bytes_in_use"] == version_bytes  # the view still holds the draft
    del view
    assert manager.stats()["bytes_in_use"] == 0


def test_a_rewrite_of_the_latest_makes_readers_wait_for_the_new_one(manager) -> None:
    """With every other version held, publish takes the latest one's place; readers asking
    meanwhile wait until the new version lands."""
    with manager.tensor_set(LAYOUT, versions=2, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        ts.publish(ts_weights(1))
        held = reader.latest(timeout=1)
        ts.publish(ts_weights(2))
        draft = ts.draft(timeout=1)  # version 1 is held: the latest (2) is rewritten
        assert not ts.stats()["latest_available"]
        with pytest.raises(mp.WaitTimeoutError):
            reader.latest(timeout=0.1)
        answer = []
        taker = threading.Thread(target=lambda: answer.append(reader.latest(timeout=10).version))
        taker.start()
        for name, value in ts_weights(3).items():
            draft[name].numpy()[...] = value
        ts.publish(draft)
        taker.join(10)
        assert answer == [3]
        held.release()
        reader.close()


def test_copy_to_numpy_checks_every_target(manager) -> None:
    with manager.tensor_set(LAYOUT, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        ts.publish(ts_weights(5))
        with reader.latest(timeout=1) as snap:
            mine = ts_empty()
            snap.copy_to(mine)
            assert ts_checksum(mine) == ts_checksum(ts_weights(5))
            part = {"w": np.zeros((64, 32), "float32")}
            snap.copy_to(part)  # a subset of the names
            assert float(part["w"][3, 3]) == 2.5
            wrong = [
                ({"w": np.zeros((64, 32), "float64")}, "has dtype float64"),
                ({"w": np.zeros((32, 64), "float32")}, "has shape"),
                ({"w": np.zeros((32, 64), "float32").T}, "not C-contiguous"),
                ({"x": np.zeros(1)}, "name no tensor"),
                ({"w": [0.0] * 10}, "is a list"),
                ({"b": np.zeros(17, "float16")}, "has dtype float16"),
            ]
            readonly = np.zeros((64, 32), "float32")
            readonly.flags.writeable = False
            wrong.append(({"w": readonly}, "read-only"))
            for targets, message in wrong:
                with pytest.raises(mp.LayoutError, match=message):
                    snap.copy_to(targets)
        with pytest.raises(mp.BufferReleasedError):
            snap.copy_to(mine)
        reader.close()


def test_copy_to_torch_cpu_tensors_and_publish_from_them(manager) -> None:
    torch = require("torch")
    with manager.tensor_set({"w": ((8, 4), "float32"), "h": ((6,), "bfloat16")}, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        source = {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4), "h": torch.full((6,), 1.5).bfloat16()}
        ts.publish(source)
        with reader.latest(timeout=1) as snap:
            mine = {"w": torch.zeros(8, 4), "h": torch.zeros(6, dtype=torch.bfloat16)}
            snap.copy_to(mine)
            assert torch.equal(mine["w"], source["w"]) and torch.equal(mine["h"], source["h"])
            with pytest.raises(mp.LayoutError, match="has dtype float16"):
                snap.copy_to({"h": torch.zeros(6, dtype=torch.float16)})
            with pytest.raises(mp.LayoutError, match="not contiguous"):
                snap.copy_to({"w": torch.zeros(4, 8).t()})
            raw = {"h": torch.zeros(6, dtype=torch.uint16)}  # a tag's storage dtype: its raw bits
            snap.copy_to(raw)
            assert torch.equal(raw["h"].view(torch.bfloat16), source["h"])
        reader.close()


def test_explicit_release_wins_over_views_and_arrays(manager) -> None:
    with manager.tensor_set(LAYOUT, versions=1, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        ts.publish(ts_weights(1))
        snap = reader.latest(timeout=1)
        view = snap["w"]
        derived = view.view(shape=(-1,))
        array = np.asarray(view)
        assert array.base is view
        snap.release()
        for touched in (view, derived):
            with pytest.raises(mp.BufferReleasedError):
                touched.numpy()
        assert ts.stats()["held"] == {}  # the array does not hold the version any more
        assert ts.publish(ts_weights(2), timeout=1) == 2
        del array
        reader.close()


def test_views_and_arrays_made_from_them_hold_the_version_until_collected(manager) -> None:
    with manager.tensor_set(LAYOUT, versions=1, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        ts.publish(ts_weights(1))
        array = reader.latest(timeout=1)["i"].numpy()  # the snapshot and its view are gone at once
        derived = reader.latest(timeout=1)["w"].view("uint8")
        assert ts.stats()["held"] == {1: [os.getpid()]}
        with pytest.raises(mp.WaitTimeoutError, match="version 1 held by pid"):
            ts.publish(ts_weights(2), timeout=0.1)
        del array
        assert ts.stats()["held"] == {1: [os.getpid()]}  # the derived view still holds it
        del derived
        assert ts.stats()["held"] == {}
        assert ts.publish(ts_weights(2), timeout=1) == 2
        reader.close()


# -- across processes ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["copy", "zero-copy"])
def test_engines_in_processes_see_increasing_versions_with_the_right_contents(manager, reap, mode) -> None:
    last = 60
    with manager.tensor_set(LAYOUT, versions=2, device="cpu") as ts:
        out = mp.Queue()
        procs = [start_guarded(reap, ts_follow, out, ts, last, mode) for _ in range(3)]
        wait_until(lambda: ts.stats()["readers"] == 3, timeout=30)
        for version in range(1, last + 1):
            assert ts.publish(ts_weights(version), timeout=T) == version
        reports = [recv(out, *procs, timeout=T) for _ in procs]
    assert sorted(pid for _, pid, _ in reports) == sorted(p.pid for p in procs)
    for _, _, seen in reports:
        versions = [v for v, _ in seen]
        assert versions == sorted(set(versions)) and versions[-1] == last  # increasing, ending at the last
        for version, total in seen:
            assert total == ts_checksum(ts_weights(version)), version
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)


def test_latest_wins_a_slow_engine_skips_versions(manager, reap) -> None:
    with manager.tensor_set(LAYOUT, versions=2, device="cpu") as ts:
        out, control = mp.Queue(), mp.Queue()
        proc = start_guarded(reap, ts_take_when_told, out, ts, control)
        ts.publish(ts_weights(1))
        assert recv(out, proc) == ("first", 1)
        wait_until(lambda: ts.stats()["held"] == {})
        for version in (2, 3, 4):
            ts.publish(ts_weights(version), timeout=T)
        control.put("go")
        assert recv(out, proc) == ("then", 4, ts_checksum(ts_weights(4)))


@pytest.mark.parametrize("how", ["two", "array"])
def test_publish_waits_only_while_every_version_is_held_and_names_the_holders(manager, reap, how) -> None:
    versions = 2 if how == "two" else 1
    with manager.tensor_set(LAYOUT, versions=versions, device="cpu") as ts:
        out, control = mp.Queue(), mp.Queue()
        proc = start_guarded(reap, ts_hold, out, ts, control, how)
        ts.publish(ts_weights(1))
        if how == "two":
            wait_until(lambda: ts.stats()["held"] == {1: [proc.pid]})
            ts.publish(ts_weights(2), timeout=1)  # another version is free: no wait
        tag, held, value = recv(out, proc)
        assert tag == "holding" and held == ([1, 2] if how == "two" else [])
        if how == "array":
            assert value == 0.5  # the engine reads version 1 through its array
        expect = f"version 1 held by pid {proc.pid}" + (f"; version 2 held by pid {proc.pid}" if how == "two" else "")
        started = time.monotonic()
        with pytest.raises(mp.WaitTimeoutError, match=expect):
            ts.publish(ts_weights(3), timeout=0.3)
        assert 0.25 < time.monotonic() - started < 2
        control.put("let go")
        assert recv(out, proc) == ("let go",)
        assert ts.publish(ts_weights(3), timeout=5) == versions + 1  # the engine's release wakes the publish
        control.put("exit")


def test_a_sigkilled_engine_gives_its_version_back_within_a_second(manager, reap) -> None:
    with manager.tensor_set(LAYOUT, versions=1, device="cpu") as ts:
        out, control = mp.Queue(), mp.Queue()
        victim = start_guarded(reap, ts_hold, out, ts, control, "one")
        ts.publish(ts_weights(1))
        assert recv(out, victim)[:2] == ("holding", [1])
        with pytest.raises(mp.WaitTimeoutError, match=str(victim.pid)):
            ts.publish(ts_weights(2), timeout=0.1)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert ts.publish(ts_weights(2), timeout=30) == 2
        assert_prompt(time.monotonic() - killed, 1.0, "publishing past a killed reader")
        assert ts.stats()["readers"] == 0


@pytest.mark.parametrize("owner", ["process", "server"])
def test_trainer_death_is_owner_gone_and_copied_weights_stay(reap, owner) -> None:
    sets, results, control, out = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    trainer = start(reap, ts_trainer_then_die, sets, results, control, owner)
    kind, server_pid, dirs = results.get(timeout=T)
    assert kind == "left behind"
    try:
        engine = start_guarded(reap, ts_engine_outlives, out, sets, owner)
        expected = ts_checksum(ts_weights(1))
        assert recv(out, engine) == ("copied", 1, expected)
        assert results.get(timeout=T) == ("published", trainer.pid)
        os.kill(trainer.pid, signal.SIGKILL)
        tag, name, message, waited = recv(out, engine)
        assert (tag, name) == ("wait", "OwnerGoneError"), message
        assert "exited without closing the tensor set" in message and waited < 5
        tag, copied, held = recv(out, engine)
        assert tag == "after" and copied == expected
        # Server-owned memory outlives the trainer; the trainer's own memory does not.
        assert held == (("views", expected) if owner == "server" else ("views", "OwnerGoneError"))
    finally:
        trainer.kill()
        trainer.join(timeout=10)
        clean_up_after(trainer.pid, server_pid, dirs)
        clean_up_after(server_pid, server_pid, [])


def test_a_thousand_syncs_grow_nothing(manager, reap) -> None:
    count = 1000
    with manager.tensor_set(LAYOUT, versions=2, device="cpu") as ts:
        control = mp.Queue()
        out = run_guarded(reap, ts_syncs, ts, count, control)
        wait_until(lambda: ts.stats()["readers"] == 1, timeout=30)
        marks = []

        def mark() -> None:
            gc.collect()
            stats = manager.stats()
            fds = len(os.listdir("/proc/self/fd"))
            marks.append((fds, threading.active_count(), stats["leases"], stats["live_buffers"]))

        for version in range(1, count + 1):
            ts.publish(ts_weights(version), timeout=T)
            if version == 50:
                mark()
        tag, last, engine_marks = recv(out, timeout=T)
        mark()  # the engine is still registered (it waits to be told to go)
        control.put("go")
    assert (tag, last) == ("done", count)
    # The trainer: fds and threads (garbage of earlier tests may still go), leases and buffers.
    (fds, threads, *counts), (fds_end, threads_end, *counts_end) = marks
    assert fds_end <= fds and threads_end <= threads and counts_end == counts, marks
    assert engine_marks[0] == engine_marks[1], engine_marks  # the engine: fds, threads


def test_a_set_travels_through_a_queue(manager, reap) -> None:
    with manager.tensor_set(LAYOUT, device="cpu") as ts:
        ts.publish(ts_weights(7))
        sets = mp.Queue()
        out = run_guarded(reap, ts_from_queue, sets)
        sets.put(ts)
        assert recv(out) == ("got", "TensorSetReader", 1, ts_checksum(ts_weights(7)))
        wait_until(lambda: ts.stats()["readers"] == 0, timeout=10)


def test_after_close_readers_take_the_last_version_then_closed(manager) -> None:
    ts = manager.tensor_set(LAYOUT, device="cpu")
    reader = pickle.loads(pickle.dumps(ts))
    ts.publish(ts_weights(1))
    ts.publish(ts_weights(2))
    ts.close()
    with reader.wait(newer_than=0, timeout=1) as snap:  # the last version can still be taken...
        assert snap.version == 2 and snap["w"].numpy()[0, 0] == 1.0
    with pytest.raises(mp.TensorSetClosedError, match=r"closed by its trainer.*last version was 2"):
        reader.wait(newer_than=2, timeout=1)  # ...and then nothing
    assert reader.closed
    reader.close()
    wait_until(lambda: manager.stats()["leases"] == 0)


def ts_wait_for_more(out, reader) -> None:
    with reader.latest(timeout=T) as snap:
        out.put(("took", snap.version))
    try:
        reader.wait(newer_than=1, timeout=T)
    except mp.TensorSetClosedError as exc:
        out.put(("closed", str(exc)))


def test_manager_shutdown_closes_its_sets_and_readers_let_go(reap) -> None:
    with mp.Manager(release_timeout=10) as m:
        ts = m.tensor_set(LAYOUT, device="cpu")
        out = run_guarded(reap, ts_wait_for_more, ts)
        ts.publish(ts_weights(1))
        assert recv(out) == ("took", 1)
        started = time.monotonic()
    # No ts.close(): the shutdown closed the set first, so the waiting reader gave its
    # leases back at once (no wait for release_timeout, and no LeakWarning).
    assert time.monotonic() - started < 5
    tag, message = recv(out)
    assert tag == "closed" and "its Manager was shut down" in message
    assert ts.closed


# -- GPU -------------------------------------------------------------------------------------------


def ts_gpu_engine(out, reader, last, mode) -> None:
    """A CUDA engine: bf16 torch tensors of its own (copy) or the snapshot's views (zero-copy)."""
    import torch

    from gpushare.torch import as_tensors

    mine = {"w": torch.zeros(64, 32, device="cuda"), "h": torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")}
    version, seen = 0, []
    while version < last:
        with reader.wait(newer_than=version, timeout=T) as snap:
            if mode == "copy":
                snap.copy_to(mine)  # queued on the default stream; torch's reads below come after
                values = mine
            else:
                values = as_tensors(snap)
            seen.append((snap.version, float(values["w"].sum()), float(values["h"].float().mean())))
            version = snap.version
            del values
    out.put(("seen", seen))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["copy", "zero-copy"])
def test_gpu_engines_copy_or_use_each_version(manager, reap, mode) -> None:
    torch = require("torch")
    layout = {"w": ((64, 32), "float32"), "h": ((1 << 20,), "bfloat16")}
    with manager.tensor_set(layout, versions=2, device=0) as ts:
        out = mp.Queue()
        procs = [start_guarded(reap, ts_gpu_engine, out, ts, 20, mode, device=0) for _ in range(2)]
        wait_until(lambda: ts.stats()["readers"] == 2, timeout=GPU_TIMEOUT)
        src = {"w": torch.zeros(64, 32, device="cuda"), "h": torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")}
        for version in range(1, 21):
            src["w"].fill_(version)
            src["h"].fill_(version)
            assert ts.publish(src, timeout=T) == version  # the copies follow the fills on the default stream
        for _ in procs:
            (_, seen) = recv(out, *procs, timeout=120)
            assert seen[-1][0] == 20
            for version, total, mean in seen:
                assert (total, mean) == (version * 64 * 32, version), version


def ts_gpu_read_after_kernel(out, reader) -> None:
    import torch

    torch.zeros(1, device="cuda")
    out.put(("ready",))
    with reader.latest(timeout=T) as snap:
        mine = {"x": torch.zeros(1 << 22, device="cuda")}
        snap.copy_to(mine)
        out.put(("seen", float(mine["x"].min()), float(mine["x"].max())))


@pytest.mark.gpu
def test_gpu_publish_copies_after_the_trainers_kernel_still_running(manager, reap) -> None:
    """No host synchronize: the batched copy waits for the trainer's stream, the engine's copy
    for the version's event."""
    torch = require("torch")
    with manager.tensor_set({"x": ((1 << 22,), "float32")}, versions=2, device=0) as ts:
        out = run_guarded(reap, ts_gpu_read_after_kernel, ts, device=0)
        assert recv(out, timeout=120) == ("ready",)
        src = torch.zeros(1 << 22, device="cuda")
        fill_behind_a_running_kernel(torch, src, 7.0)  # still running at publish()
        ts.publish({"x": src})
        src.fill_(3.0)  # queued after the copy on the default stream: the version keeps 7
        assert recv(out, timeout=120) == ("seen", 7.0, 7.0)


def ts_gpu_slow_reader(out, reader) -> None:
    import torch

    torch.zeros(1, device="cuda")
    for attempt in range(4):
        snap = reader.latest(timeout=T)
        src = torch.from_dlpack(snap["x"])
        torch.cuda._sleep(3_000_000_000 << attempt)  # a long kernel on the default stream...
        copy = src.clone()  # ...and our read of the version queued behind it
        del src
        version = snap.version
        snap.release()  # records our release event; nothing waits here
        running = not torch.cuda.current_stream().query()
        out.put(("released", version, running))
        torch.cuda.synchronize()
        out.put(("copied", float(copy.min()), float(copy.max()), running))
        if running:
            return


@pytest.mark.gpu
def test_gpu_trainer_write_waits_for_an_engine_read_still_running_at_release(manager, reap) -> None:
    torch = require("torch")
    with manager.tensor_set({"x": ((1 << 22,), "float32")}, versions=1, device=0) as ts:
        out = run_guarded(reap, ts_gpu_slow_reader, ts, device=0)
        for _ in range(4):
            ts.publish({"x": torch.full((1 << 22,), 1.0, device="cuda")}, timeout=T)
            tag, _, _ = recv(out, timeout=120)
            assert tag == "released"
            draft = ts.draft(timeout=T)  # the only version: the default stream waits for the engine's read
            torch.from_dlpack(draft["x"]).fill_(2.0)
            tag, low, high, running = recv(out, timeout=120)
            draft.release()
            assert tag == "copied"
            assert (low, high) == (1.0, 1.0), "the trainer overwrote a version under the engine's read"
            if running:
                break
        else:
            pytest.fail("could not keep an engine kernel running long enough to test anything")


@pytest.mark.gpu
def test_gpu_reader_in_the_trainers_own_process(manager) -> None:
    torch = require("torch")
    with manager.tensor_set({"x": ((4096,), "float32"), "h": ((8,), "bfloat16")}, device=0) as ts:
        reader = pickle.loads(pickle.dumps(ts))
        for version in range(1, 6):
            ts.publish({"x": torch.full((4096,), float(version), device="cuda"), "h": torch.ones(8).bfloat16().cuda()})
            with reader.latest(timeout=10) as snap:
                assert snap.version == version and float(snap["x"].numpy()[0]) == version
                mine = {"x": torch.zeros(4096, device="cuda"), "h": torch.zeros(8, dtype=torch.bfloat16, device="cuda")}
                snap.copy_to(mine)
                assert float(mine["x"].sum()) == version * 4096 and float(mine["h"].float().sum()) == 8
        reader.close()


def ts_gpu_syncs(out, reader, count) -> None:
    import torch

    from gpushare import _cuda

    mine = {"x": torch.zeros(1 << 20, device="cuda")}
    version = 0
    marked = False
    while version < count:
        with reader.wait(newer_than=version, timeout=T) as snap:
            snap.copy_to(mine)
            version = snap.version
        if version >= 50 and not marked:
            marked = True
            torch.cuda.synchronize()
            out.put(("mark", _cuda.mem_info(0)[0]))
    torch.cuda.synchronize()
    out.put(("done", version, float(mine["x"][0])))


@pytest.mark.gpu
def test_gpu_a_thousand_syncs_keep_device_memory_flat(manager, reap) -> None:
    torch = require("torch")
    from gpushare import _cuda

    count = 1000
    with manager.tensor_set({"x": ((1 << 20,), "float32")}, versions=2, device=0) as ts:
        out = run_guarded(reap, ts_gpu_syncs, ts, count, device=0)
        src = torch.zeros(1 << 20, device="cuda")
        for version in range(1, count + 1):
            src.fill_(version)
            ts.publish({"x": src}, timeout=T)
            if version == 50:
                tag, _ = recv(out, timeout=120)
                assert tag == "mark"
                torch.cuda.synchronize()
                free_at_50 = _cuda.mem_info(0)[0]
        tag, last, value = recv(out, timeout=120)
        torch.cuda.synchronize()
        free_at_end = _cuda.mem_info(0)[0]
    assert (tag, last, value) == ("done", count, float(count))
    assert abs(free_at_end - free_at_50) <= 4 << 20, (free_at_50, free_at_end)  # within 4 MiB


def ts_peer_engine(out, reader) -> None:
    import torch

    with reader.latest(timeout=T) as snap:
        mine = {"x": torch.zeros(1 << 20, device="cuda:1")}
        snap.copy_to(mine)  # the version lives on GPU 0; this engine's tensors on GPU 1
        torch.cuda.synchronize(1)
        out.put(("copied", str(mine["x"].device), float(mine["x"].min()), float(mine["x"].max())))


@pytest.mark.multigpu
def test_engine_on_another_gpu_copies_a_version_from_the_trainers(manager, reap) -> None:
    torch = require("torch")
    with manager.tensor_set({"x": ((1 << 20,), "float32")}, device=0) as ts:
        ts.publish({"x": torch.full((1 << 20,), 5.0, device="cuda:0")})
        out = run_guarded(reap, ts_peer_engine, ts, device=1)
        assert recv(out, *reap, timeout=120) == ("copied", "cuda:1", 5.0, 5.0)  # a crash shows its exit code
