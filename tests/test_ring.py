"""The ring: pre-shared slots, producer -> N consumers, across real processes (host backend).

Every worker is a spawned gpushare Process; every get, acquire and join has
a timeout, and the ``reap`` fixture kills survivors.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time

import numpy as np
import pytest
from conftest import (
    assert_prompt,
    clean_up_after,
    fill_behind_a_running_kernel,
    recv,
    require,
    start,
    start_guarded,
    wait_until,
)

import gpushare as mp
from gpushare import _backends
from gpushare._fanout._channel import ENTRY, INLINE_META, RECORDED, SLOT_RECORDED, Channel
from gpushare._fanout._wire import SPIN_AUTO, SPIN_DEFAULT
from gpushare._spin import SpinPolicy

SHAPE = (32, 16)

# -- workers (module level: spawn pickles them by reference) -------------------------


def consume_all(ring, results, tag) -> None:
    """Iterate until the ring closes; report what arrived, where it was mapped, and the opens."""
    seen = []
    ptrs: dict[int, set[int]] = {}
    for item in ring.items(timeout=30):
        values = item.numpy()
        seen.append(
            (item.sequence, item.slot, float(values.flat[0]), bool((values == values.flat[0]).all()), item.meta)
        )
        ptrs.setdefault(item.slot, set()).add(item.ptr)
    results.put((tag, os.getpid(), seen, {slot: len(p) for slot, p in ptrs.items()}, _backends.get("host").opens))


def hold_until_told(ring, results, control) -> None:
    held = [ring.get(timeout=30) for _ in range(ring.slots)]
    results.put(("holding", [item.sequence for item in held]))
    control.get(timeout=60)
    for item in held:
        ring.release(item)
    count = sum(1 for _ in ring.items(timeout=30))
    results.put(("rest", count))


def hold_everything(ring, results) -> None:
    held = []
    while True:
        held.append(ring.get(timeout=60))
        results.put(("held", len(held)))


def announce_then_take_one(ring, up, results) -> None:
    """Say "up" once unpickling the ring registered this consumer; report the first item's meta."""
    up.send("up")
    with ring.get(timeout=30) as item:
        results.put(item.meta)
    ring.close()


def report_end(ring, results) -> None:
    count = 0
    with ring.get(timeout=30) as first:  # released at exit
        count += 1
        value = float(first.numpy()[0, 0])
    count += sum(1 for _ in ring)
    try:
        ring.get(timeout=5)
    except mp.RingClosedError as exc:
        results.put(("ended", count, value, str(exc)))


def produce_then_wait(rings, results, control, spin=False) -> None:
    with mp.Manager() as m:
        ring = m.ring(SHAPE, "float32", device="cpu", slots=2, consumers=1, spin=spin)
        results.put(
            ("left behind", m._process.pid, [os.path.dirname(m._owner.address), os.path.dirname(ring._core.address)])
        )
        rings.put(ring)
        buf = ring.acquire(timeout=30)
        buf.fill(7)
        ring.publish(buf, timeout=30)
        results.put(("published", os.getpid()))
        control.get(timeout=60)  # killed here


def consume_until_error(rings, results) -> None:
    ring = rings.get(timeout=30)
    with ring.get(timeout=30) as item:
        results.put(("got", float(item.numpy()[0, 0])))
    started = time.monotonic()
    try:
        ring.get(timeout=30)
    except Exception as exc:
        results.put((type(exc).__name__, str(exc), time.monotonic() - started))
    else:
        results.put(("no error", "", 0.0))


# -- helpers -------------------------------------------------------------------------


def produce(ring, steps, first=0, timeout=30) -> None:
    """Write ``step * 1.5`` into a slot per step and publish it with its step as meta."""
    for step in range(first, first + steps):
        buf = ring.acquire(timeout=timeout)
        buf.fill(step * 1.5)
        ring.publish(buf, {"step": step}, timeout=timeout)


def check_in_order(seen, steps) -> None:
    assert [seq for seq, *_ in seen] == list(steps)
    for seq, _, value, uniform, meta in seen:
        assert meta == {"step": seq} and value == seq * 1.5 and uniform


# -- across processes -------------------------------------------------------------------


def test_every_consumer_sees_every_step_in_order(manager, reap) -> None:
    results = mp.Queue()
    with manager.ring(SHAPE, "float32", device="cpu", slots=3, consumers=2) as ring:
        for tag in ("a", "b"):
            start(reap, consume_all, ring, results, tag)
        produce(ring, 40)
    reports = [results.get(timeout=30) for _ in range(2)]
    assert sorted(tag for tag, *_ in reports) == ["a", "b"]
    for _, _, seen, _, _ in reports:
        check_in_order(seen, range(40))
    wait_until(lambda: manager.stats()["leases"] == 0)


def test_slots_are_mapped_once_and_reused(manager, reap) -> None:
    results = mp.Queue()
    with manager.ring(SHAPE, "float32", device="cpu", slots=3, consumers=1) as ring:
        start(reap, consume_all, ring, results, "only")
        produce(ring, 30)
        assert ring.stats()["published"] == 30
    _, _, seen, ptrs_per_slot, opens = results.get(timeout=30)
    check_in_order(seen, range(30))
    assert ptrs_per_slot == {0: 1, 1: 1, 2: 1}  # each slot: the same memory every round
    # The slots are windows of one allocation, mapped once at registration; handoffs open nothing.
    assert opens == 1
    assert manager.stats()["bytes_allocated"] == mp.GRANULARITY


def test_producer_blocks_while_every_slot_is_held(manager, reap) -> None:
    results, control = mp.Queue(), mp.Queue()
    with manager.ring(SHAPE, "float32", device="cpu", slots=2, consumers=1) as ring:
        proc = start(reap, hold_until_told, ring, results, control)
        produce(ring, 2)
        assert results.get(timeout=30) == ("holding", [0, 1])
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"all 2 slots .* busy .*pid\(s\) {proc.pid}"):
            ring.acquire(timeout=0.3)
        assert 0.25 < time.monotonic() - started < 2
        assert ring.stats()["busy"] == 2
        control.put("go")
        produce(ring, 3, first=2, timeout=10)  # released: the producer goes on
    assert results.get(timeout=30) == ("rest", 3)


def test_fan_out_to_four_consumers(manager, reap) -> None:
    results = mp.Queue()
    with manager.ring(SHAPE, "float32", device="cpu", slots=4, consumers=4) as ring:
        procs = [start(reap, consume_all, ring, results, i) for i in range(4)]
        produce(ring, 25)
        stats = ring.stats()
        assert stats["registered"] == 4 and stats["consumer_pids"] == sorted(p.pid for p in procs)
    reports = [results.get(timeout=30) for _ in range(4)]
    assert sorted(tag for tag, *_ in reports) == [0, 1, 2, 3]
    for _, _, seen, _, opens in reports:
        check_in_order(seen, range(25))
        assert opens == 1  # the ring's one allocation, mapped once by each consumer


def test_dead_consumer_frees_its_slots(manager, reap) -> None:
    results, victim_results = mp.Queue(), mp.Queue()  # a killed process may die holding its queue's lock
    with manager.ring(SHAPE, "float32", device="cpu", slots=3, consumers=2) as ring:
        victim = start(reap, hold_everything, ring, victim_results)
        start(reap, consume_all, ring, results, "survivor")
        produce(ring, 3)
        for n in (1, 2, 3):
            assert victim_results.get(timeout=30) == ("held", n)
        with pytest.raises(TimeoutError, match=str(victim.pid)):
            ring.acquire(timeout=0.2)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        acquired = [ring.acquire(timeout=30) for _ in range(3)]  # every slot, the victim's included
        assert_prompt(time.monotonic() - killed_at, 1.0, "taking back a killed consumer's slots")
        assert ring.stats()["consumers"] == 1
        for step, buf in enumerate(acquired, start=3):
            buf.fill(step * 1.5)
            ring.publish(buf, {"step": step}, timeout=10)
        produce(ring, 5, first=6)
    _, _, seen, _, _ = results.get(timeout=30)
    check_in_order(seen, range(11))  # the survivor never missed a step
    victim.join(timeout=10)
    assert victim.exitcode == -signal.SIGKILL


def test_close_ends_iteration_and_gives_slots_back(manager, reap) -> None:
    results = mp.Queue()
    ring = manager.ring(SHAPE, "float32", device="cpu", slots=2, consumers=1)
    proc = start(reap, report_end, ring, results)
    produce(ring, 5)
    ring.close()
    ring.close()  # idempotent
    kind, count, first, message = results.get(timeout=30)
    assert (kind, count, first) == ("ended", 5, 0.0)
    assert "the producer called close()" in message
    with pytest.raises(mp.RingClosedError, match="closed"):
        ring.acquire(timeout=1)
    with pytest.raises(mp.RingClosedError, match="pickle"):
        pickle.dumps(ring)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    wait_until(lambda: manager.stats()["leases"] == 0)
    del ring
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1)  # the slots' allocation is ordinary pooled memory again


def test_manager_shutdown_closes_its_rings(reap) -> None:
    results = mp.Queue()
    started = None
    with mp.Manager(release_timeout=10) as m:
        ring = m.ring(SHAPE, "float32", device="cpu", slots=2, consumers=1)
        proc = start(reap, report_end, ring, results)
        produce(ring, 3)
        started = time.monotonic()
    # No ring.close(): shutdown closed the ring first, so the consumer gave its slot
    # leases back at once (no wait for release_timeout, and no LeakWarning).
    assert time.monotonic() - started < 5
    kind, count, _, _ = results.get(timeout=30)
    assert (kind, count) == ("ended", 3)
    proc.join(timeout=30)
    assert proc.exitcode == 0


def test_late_consumer_receives_only_later_items(manager, reap) -> None:
    results = mp.Queue()
    with manager.ring(SHAPE, "float32", device="cpu", slots=2, consumers=1) as ring:
        start(reap, consume_all, ring, results, "early")
        produce(ring, 3)
        start(reap, consume_all, ring, results, "late")
        wait_until(lambda: ring.stats()["registered"] == 2, timeout=30)
        produce(ring, 3, first=3)
    reports = dict((tag, seen) for tag, _, seen, _, _ in (results.get(timeout=30) for _ in range(2)))
    check_in_order(reports["early"], range(6))
    check_in_order(reports["late"], range(3, 6))


def test_a_publish_after_registration_reaches_the_new_consumer(manager, reap) -> None:
    """Once a consumer's unpickling returned, the producer's next publish reaches it: the
    producer publishes the moment it hears from the consumer, three consumers in turn."""
    results = mp.Queue()
    with manager.ring(SHAPE, "float32", device="cpu", slots=2, consumers=0) as ring:
        for k in range(3):
            mine, theirs = mp.Pipe()
            start(reap, announce_then_take_one, ring, theirs, results)
            assert mine.poll(60), "the consumer did not register"
            assert mine.recv() == "up"
            ring.publish(ring.acquire(timeout=30), k, timeout=30)
            assert results.get(timeout=30) == k


def test_producer_death_is_an_error_not_a_hang(reap) -> None:
    rings, results, control, consumer_results = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    producer = start(reap, produce_then_wait, rings, results, control)
    kind, server_pid, dirs = results.get(timeout=30)
    assert kind == "left behind"
    try:
        start(reap, consume_until_error, rings, consumer_results)
        assert consumer_results.get(timeout=30) == ("got", 7.0)
        assert results.get(timeout=30) == ("published", producer.pid)
        os.kill(producer.pid, signal.SIGKILL)
        kind, message, waited = consumer_results.get(timeout=30)
        assert kind == "OwnerGoneError", message
        assert "exited without closing the ring" in message
        assert waited < 5
    finally:
        producer.kill()
        producer.join(timeout=10)
        clean_up_after(producer.pid, server_pid, dirs)


# -- in this process: the API's edges ---------------------------------------------------


def test_ring_api_edges_in_one_process(manager) -> None:
    with pytest.raises(ValueError, match="slots"):
        manager.ring(SHAPE, device="cpu", slots=0)
    with pytest.raises(ValueError, match="consumers"):
        manager.ring(SHAPE, device="cpu", consumers=-1)

    with manager.ring(SHAPE, "int32", device="cpu", slots=2, consumers=1) as ring:
        assert (ring.slots, ring.shape, ring.dtype, ring.device) == (2, SHAPE, np.dtype("int32"), "cpu")
        with pytest.raises(TypeError, match=r"producer end.*unpickling"):
            ring.get(timeout=1)
        with pytest.raises(TimeoutError, match=r"1 consumer.*register"):
            ring.publish(ring.acquire(timeout=1), timeout=0.1)
        assert ring.stats()["free"] == 2  # the unpublished buffer was dropped: its slot is free again
        with pytest.raises(ValueError, match="acquire"):
            ring.publish(manager.zeros(SHAPE, "int32", device="cpu"))

        consumer = pickle.loads(pickle.dumps(ring))  # a consumer end, here in the producer's process
        assert ring.stats()["consumers"] == 1
        buf = ring.acquire(timeout=1)
        buf.fill(3)
        assert ring.publish(buf, meta="first") == 0
        with pytest.raises(mp.BufferReleasedError):
            buf.numpy()  # published: the producer's view is gone
        with pytest.raises(ValueError, match="already published"):
            ring.publish(buf)
        with consumer.get(timeout=1) as item:
            assert (item.sequence, item.meta) == (0, "first") and item.slot in (0, 1)
            assert int(item.numpy().sum()) == 3 * item.size
        with pytest.raises(mp.BufferReleasedError):
            item.numpy()  # released to the ring: the slot may be rewritten
        with pytest.raises(TimeoutError, match="no ring item"):
            consumer.get(timeout=0.05)
        assert consumer.stats() == {"slots": 2, "received": 1, "held": 0, "closed": False}
        consumer.close()
        assert ring.stats()["consumers"] == 0
        with pytest.raises(mp.RingClosedError, match="this consumer was closed"):
            consumer.get(timeout=1)
        assert ring.publish(ring.acquire(timeout=1)) == 1  # nobody registered now: free again at once
        assert ring.stats()["free"] == 2
    assert ring.closed
    with pytest.raises(mp.RingClosedError):
        ring.acquire(timeout=1)


def test_consumers_zero_and_consumer_gc_releases(manager) -> None:
    with manager.ring((4,), device="cpu", slots=2, consumers=0) as ring:
        consumer = pickle.loads(pickle.dumps(ring))
        for _ in range(2):
            ring.publish(ring.acquire(timeout=1))
        item = consumer.get(timeout=1)
        consumer.get(timeout=1)  # dropped at once: garbage collection releases it
        assert ring.stats()["busy"] == 1
        del item
        assert ring.stats()["busy"] == 0 and ring.stats()["free"] == 2


def test_an_item_still_out_keeps_its_slot_after_either_end_closes(manager) -> None:
    """Ring items take no count on their memory: each end keeps a slot's own Buffer while
    that slot's item is out, and lets it go with the item (released or collected)."""
    ring = manager.ring(SHAPE, "int32", device="cpu", slots=3, consumers=1)
    consumer = pickle.loads(pickle.dumps(ring))
    for value in (7, 8):
        buf = ring.acquire(timeout=5)
        buf.fill(value)
        ring.publish(buf, timeout=5)
    first, second = consumer.get(timeout=5), consumer.get(timeout=5)
    kept = ring.acquire(timeout=5)  # acquired, never published
    kept.fill(9)

    consumer.close()
    ends = consumer._end.orphans
    consumer._shut()  # a second ending (e.g. the close met in another thread's get) keeps them
    assert consumer._end.orphans is ends
    assert [b.released for b in ends] == [slot not in (first.slot, second.slot) for slot in range(3)]
    assert (int(first.numpy()[0, 0]), int(second.numpy()[-1, -1])) == (7, 8)
    first.release()
    assert ends[first.slot].released and not ends[second.slot].released
    with pytest.raises(mp.BufferReleasedError):
        first.numpy()
    del second  # collected: the same as a release
    assert all(b.released for b in ends)

    ring.close()
    slots = ring._core.buffers
    assert [b.released for b in slots] == [slot != kept.slot for slot in range(3)]
    assert int(kept.numpy()[0, 0]) == 9
    with pytest.raises(mp.RingClosedError):
        ring.publish(kept)
    del kept
    assert all(b.released for b in slots)


# -- shared-memory signalling and spin mode -----------------------------------------------


def test_handoffs_send_nothing_on_the_socket(manager) -> None:
    """Items and releases travel through the shared channel; only a meta too long to go
    inline (and the end of the ring) uses the consumer's socket."""
    with manager.ring(SHAPE, "int32", device="cpu", slots=2, consumers=1) as ring:
        consumer = pickle.loads(pickle.dumps(ring))
        fd = consumer._end.conn.fileno()
        for step in range(6):
            buf = ring.acquire(timeout=5)
            buf.fill(step)
            ring.publish(buf, {"step": step}, timeout=5)
            assert select.select([fd], [], [], 0)[0] == []  # nothing on the socket
            with consumer.get(timeout=5) as item:
                assert item.meta == {"step": step} and int(item.numpy()[0, 0]) == step
        assert ring.stats()["free"] == 2  # releases came back through the release words
        big = "x" * (INLINE_META + 1)
        ring.publish(ring.acquire(timeout=5), big, timeout=5)
        assert select.select([fd], [], [], 0)[0] == [fd]  # this meta went on the socket
        with consumer.get(timeout=5) as item:
            assert item.meta == big
        consumer.close()


def test_long_and_short_metas_keep_their_order(manager, reap) -> None:
    results = mp.Queue()
    long_meta = {"pad": "y" * (INLINE_META * 3)}
    with manager.ring(SHAPE, "float32", device="cpu", slots=2, consumers=1) as ring:
        start(reap, consume_all, ring, results, "metas")
        for step in range(12):
            buf = ring.acquire(timeout=30)
            buf.fill(step * 1.5)
            ring.publish(buf, {"step": step, **(long_meta if step % 3 == 0 else {})}, timeout=30)
    _, _, seen, _, _ = results.get(timeout=30)
    assert [seq for seq, *_ in seen] == list(range(12))
    for seq, _, value, uniform, meta in seen:
        assert value == seq * 1.5 and uniform and meta["step"] == seq
        assert ("pad" in meta) == (seq % 3 == 0)


def test_spin_mode_delivers_every_item_in_order(manager, reap) -> None:
    results = mp.Queue()
    # One slot: the producer's acquire() waits (spinning, then sleeping) for both
    # consumers' releases every step, and each consumer's get() for every publish.
    with manager.ring(SHAPE, "float32", device="cpu", slots=1, consumers=2, spin=0.002) as ring:
        assert ring.spin == 0.002
        for tag in ("a", "b"):
            start(reap, consume_all, ring, results, tag)
        produce(ring, 30)
    for _, _, seen, _, _ in (results.get(timeout=30) for _ in range(2)):
        check_in_order(seen, range(30))


def test_spin_settings_and_the_adaptive_policy(manager) -> None:
    """The default is "auto"; both ends report the ring's setting; "auto" spins only
    after a quick wait (SpinPolicy), a fixed setting every time."""
    for spin, setting in (("auto", "auto"), (True, SPIN_DEFAULT), (False, 0.0), (0, 0.0), (0.25, 0.25)):
        with manager.ring(SHAPE, device="cpu", slots=1, consumers=0, spin=spin) as ring:
            consumer = pickle.loads(pickle.dumps(ring))
            assert ring.spin == setting and consumer.spin == setting
            consumer.close()
    with manager.ring(SHAPE, device="cpu", slots=1, consumers=0) as ring:
        assert ring.spin == "auto"
    for bad in ("fast", -1, 11, [1]):
        with pytest.raises(ValueError, match='"auto", True, False or seconds'):
            manager.ring(SHAPE, device="cpu", spin=bad)

    auto = SpinPolicy(SPIN_AUTO, adaptive=True)
    assert auto.budget() == SPIN_AUTO  # the first wait spins
    auto.waited(0.010)  # a long wait: the next one sleeps at once
    assert auto.budget() == 0.0
    auto.waited(0.010)
    assert auto.budget() == 0.0
    auto.waited(SPIN_AUTO / 5)  # woken quickly: spin again
    assert auto.budget() == SPIN_AUTO
    for _ in range(20):  # long waits in a row: each one sleeps at once
        auto.waited(0.010)
        assert auto.budget() == 0.0
    fixed = SpinPolicy(0.002, adaptive=False)
    fixed.waited(1.0)
    assert fixed.budget() == 0.002


def test_auto_spin_learns_from_each_wait_in_both_ends(manager) -> None:
    """Both ends of an "auto" ring stop spinning after a wait longer than SPIN_AUTO
    (here 50 ms) and go on delivering in order."""
    import threading

    with manager.ring(SHAPE, "int32", device="cpu", slots=1, consumers=1) as ring:
        consumer = pickle.loads(pickle.dumps(ring))

        def later(fn, delay):
            timer = threading.Timer(delay, fn)
            timer.start()
            return timer

        # The consumer waits 50 ms for an item: its next wait sleeps at once.
        buf = ring.acquire(timeout=5)
        buf.fill(1)
        timer = later(lambda: ring.publish(buf, timeout=5), 0.05)
        item = consumer.get(timeout=5)
        timer.join()
        assert int(item.numpy()[0, 0]) == 1 and consumer._spin.budget() == 0.0
        # The producer waits 50 ms for the only slot: its next wait sleeps at once.
        timer = later(item.release, 0.05)
        buf = ring.acquire(timeout=5)
        timer.join()
        assert ring._core.spin.budget() == 0.0
        buf.fill(2)
        ring.publish(buf, timeout=5)
        with consumer.get(timeout=5) as item:  # already there: no wait, nothing learnt
            assert int(item.numpy()[0, 0]) == 2
        assert consumer._spin.budget() == 0.0
        consumer.close()


@pytest.mark.parametrize("spin", [True, "auto"])
def test_spinning_consumer_notices_producer_death(reap, spin) -> None:
    """A consumer that spins, then sleeps, still wakes on its socket's EOF."""
    rings, results, control, consumer_results = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    producer = start(reap, produce_then_wait, rings, results, control, spin)
    kind, server_pid, dirs = results.get(timeout=30)
    try:
        start(reap, consume_until_error, rings, consumer_results)
        assert consumer_results.get(timeout=30) == ("got", 7.0)
        assert results.get(timeout=30) == ("published", producer.pid)
        os.kill(producer.pid, signal.SIGKILL)
        kind, message, waited = consumer_results.get(timeout=30)
        assert kind == "OwnerGoneError" and "exited without closing the ring" in message
        assert waited < 5
    finally:
        producer.kill()
        producer.join(timeout=10)
        clean_up_after(producer.pid, server_pid, dirs)


def test_channel_entries_check_their_index_and_contents() -> None:
    """An entry not yet written, torn, or left from the previous lap is not taken."""
    producer = Channel.create(3)
    consumer = Channel(os.dup(producer.fd), 3)
    try:
        assert consumer.take(0) is None  # never written
        producer.put(0, 2, 40, b"meta")
        assert consumer.take(0) == (2, 40, b"meta")
        assert consumer.take(3) is None  # entry 0's place, one lap later: not written yet
        producer.put(1, 1, 41, None)
        assert consumer.take(1) == (1, 41, None)  # its meta follows on the socket
        producer.put(2, 0, 42, b"abc")
        at = consumer._entries + 2 * ENTRY + 24
        consumer.mm[at : at + 1] = b"X"  # a byte of the body not yet visible: the checksum fails
        assert consumer.take(2) is None
        producer.put(2, 0, 42, b"abc")
        assert consumer.take(2) == (0, 42, b"abc")
        assert not producer.released(1, 41)
        consumer.release(1, 41)
        assert producer.released(1, 41) and not producer.released(1, 45)
        assert not producer.released(1, 41) & RECORDED
    finally:
        consumer.close()
        producer.close()


def test_channel_carries_whether_each_side_recorded_its_event() -> None:
    """The producer marks an entry whose ready event it recorded, the consumer a release
    whose release event it recorded; an unmarked side is waited for by nobody."""
    producer = Channel.create(2)
    consumer = Channel(os.dup(producer.fd), 2)
    try:
        producer.put(0, 1, 7, None, recorded=True)
        producer.put(1, 1, 8, None)
        assert consumer.take(0) == (1 | SLOT_RECORDED, 7, None)
        assert consumer.take(1) == (1, 8, None)
        consumer.release(1, 7, recorded=True)
        word = producer.released(1, 7)
        assert word and word & RECORDED
        assert not producer.released(1, 8)  # the word names publication 7, flag or not
        consumer.release(1, 8)
        word = producer.released(1, 8)
        assert word and not word & RECORDED
    finally:
        consumer.close()
        producer.close()


# -- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_ring_on_gpu_in_order(manager, reap) -> None:
    results = mp.Queue()
    with manager.ring(SHAPE, "float32", device=0, slots=3, consumers=1) as ring:
        assert ring.device == 0
        start(reap, consume_all, ring, results, "gpu", device=0)
        produce(ring, 20)
    _, _, seen, ptrs_per_slot, _ = results.get(timeout=60)
    check_in_order(seen, range(20))
    assert ptrs_per_slot == {0: 1, 1: 1, 2: 1}


def _gpu_read_published(results, ring, how) -> None:
    import torch

    torch.zeros(1, device="cuda")
    results.put(("ready",))
    with ring.get(timeout=60) as item:
        if how == "numpy":
            values = item.numpy()  # waits on the host for the slot's ready event
        else:
            values = torch.from_dlpack(item).cpu().numpy()  # torch's stream waits on it
        results.put(("seen", float(values.min()), float(values.max())))


def _gpu_slow_reader(results, ring) -> None:
    import torch

    torch.zeros(1, device="cuda")
    for attempt in range(4):
        item = ring.get(timeout=60)
        src = torch.from_dlpack(item)
        torch.cuda._sleep(3_000_000_000 << attempt)  # a long kernel on the default stream...
        copy = src.clone()  # ...and our read of the slot queued behind it
        del src
        item.release()  # records our release event; nothing waits here
        running = not torch.cuda.current_stream().query()
        results.put(("released", running))
        torch.cuda.synchronize()
        results.put(("copied", float(copy.min()), float(copy.max()), running))
        if running:
            return


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["numpy", "torch_dlpack"])
def test_ring_consumer_waits_for_a_producer_kernel_still_running_at_publish(manager, reap, how) -> None:
    """Per-slot events: publish records the slot's event, the consumer orders after it
    (no device-wide synchronize anywhere)."""
    torch = require("torch")
    results = mp.Queue()
    with manager.ring((1 << 22,), "float32", device=0, slots=1, consumers=1) as ring:
        start_guarded(reap, _gpu_read_published, results, ring, how, device=0)
        assert recv(results, timeout=120) == ("ready",)
        buf = ring.acquire(timeout=30)
        t = torch.from_dlpack(buf)
        fill_behind_a_running_kernel(torch, t, 7.0)  # still running at publish()
        del t
        ring.publish(buf, timeout=30)
        assert recv(results, timeout=60) == ("seen", 7.0, 7.0), "consumer read before the producer's kernel finished"


@pytest.mark.gpu
def test_ring_producer_write_waits_for_a_consumer_read_still_running_at_release(manager, reap) -> None:
    """The consumer's release event: the producer's next write of the slot (default
    stream) runs after the consumer's queued read, though neither side synchronized."""
    torch = require("torch")
    results = mp.Queue()
    with manager.ring((1 << 22,), "float32", device=0, slots=1, consumers=1) as ring:
        start_guarded(reap, _gpu_slow_reader, results, ring, device=0)
        for _ in range(4):
            buf = ring.acquire(timeout=60)
            torch.from_dlpack(buf).fill_(1.0)
            ring.publish(buf, timeout=60)
            assert recv(results, timeout=120)[0] == "released"
            again = ring.acquire(timeout=60)  # the same slot: our stream waits on the consumer's release event
            torch.from_dlpack(again).fill_(2.0)
            tag, low, high, running = recv(results, timeout=120)
            again.release()  # not published: free again
            assert tag == "copied"
            assert (low, high) == (1.0, 1.0), "the producer overwrote the slot under the consumer's read"
            if running:
                break
        else:
            pytest.fail("could not keep a consumer kernel running long enough to test anything")


@pytest.mark.gpu
def test_cuda_ring_consumer_in_the_producers_own_process(manager) -> None:
    """No interprocess events there (the driver refuses to open them in their own process)."""
    with manager.ring(SHAPE, "float32", device=0, slots=2, consumers=1) as ring:
        consumer = pickle.loads(pickle.dumps(ring))
        for step in range(4):
            buf = ring.acquire(timeout=10)
            buf.fill(step + 0.5)
            ring.publish(buf, step, timeout=10)
            with consumer.get(timeout=10) as item:
                assert item.meta == step and float(item.numpy()[0, 0]) == step + 0.5
        consumer.close()
