"""Fault injection: every failure has a defined, tested outcome, on every backend.

Each case kills, starves or abandons a real process and asserts two
things: what the user sees (which error, how soon) and what is left (leases,
pooled memory, server processes, socket directories). The host backend
runs everywhere, CI included; the CUDA backends run on a GPU machine
(``--require-gpu``). docs/reliability.md maps each case to its test.

Here: dead and hung consumers, dead producers (their Manager's server and
socket directories go too), leases never claimed (expiry), and shutdown
with leases outstanding (leaks, named). Related cases live with their
concept: a queue whose creator exited in test_queues.py, a dead ring peer in
test_ring.py, a killed loader worker in test_loader.py, bad descriptors in
test_descriptor.py.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import signal
import time

import pytest
from conftest import BACKENDS, assert_prompt, device_for, guarded, kill_quietly, recv, start_guarded, wait_until
from workers import total, w_hold_until_told, w_touch_when_told

import gpushare as mp
from gpushare._service import process_alive

T = 60  # seconds any single wait in a worker may take
N = 1024  # float32 elements per test buffer


# -- workers (module level: spawn imports this module) ----------------------------------


def w_hold_forever(out, jobs, n) -> None:
    held = [jobs.get(timeout=T) for _ in range(n)]
    out.put(("holding", [total(b) for b in held]))
    time.sleep(T)


def w_map_release_and_wait(out, jobs, control) -> None:
    buf = jobs.get(timeout=T)
    held = total(buf)
    buf.release()  # the lease goes back; the mapping stays cached in this process
    out.put(("released", held))
    control.get(timeout=T)


def w_get_again_when_told(out, jobs, control) -> None:
    """Get a buffer and let it go (its mapping stays cached here), then, when told, the next one."""
    from gpushare import _native

    first = jobs.get(timeout=T)
    out.put(("first", total(first)))
    first.release()
    control.get(timeout=T)
    try:
        late = jobs.get(timeout=T)
    except mp.DescriptorError as exc:
        out.put(("DescriptorError", str(exc), _native.handoff_why_not()))
    else:
        out.put(("got", total(late), _native.handoff_why_not()))


def w_hold_and_return(out, jobs) -> None:
    buf = jobs.get(timeout=T)
    out.put(("holding", total(buf)))
    # returns without releasing: the exit must give the lease back


def w_relay(out, jobs, forward) -> None:
    buf = jobs.get(timeout=T)
    forward.put(buf)  # B re-shares what it got from A, then lets go of its own lease
    buf.release()
    out.put(("relayed",))


def w_unpickle(out, data) -> None:
    try:
        buf = pickle.loads(data)
    except mp.GpushareError as exc:
        out.put((type(exc).__name__, str(exc)))
    else:
        out.put(("ok", total(buf)))


def w_unpickle_refused(out, data) -> None:
    """First arrival of an allocation here, under a lease another process claimed."""
    from gpushare import _lifetime

    def mapped() -> tuple[int, int]:
        # (cached mappings, host segments still mapped in this process: a mapping
        # closed unused leaves none)
        with open("/proc/self/maps") as f:
            segments = sum("/dev/shm/gpushare-" in line for line in f)
        return _lifetime.link_stats()["open_mappings"], segments

    try:
        pickle.loads(data)
    except mp.GpushareError as exc:
        kind, message = type(exc).__name__, str(exc)
    else:
        kind, message = "ok", ""
    gc.collect()  # the traceback's frames went with the except block; a host mmap goes when unused
    out.put((kind, message, mapped()))


def w_orphaned_consumer(out, work, ready) -> None:
    """Child of the producer: holds a buffer, then blocks on the producer's queue."""
    buf = work.get(timeout=T)
    held = total(buf)
    ready.put("holding")
    started = time.monotonic()
    try:
        item = work.get(timeout=T)
    except mp.OwnerGoneError as exc:
        out.put(("queue", "OwnerGoneError", time.monotonic() - started, str(exc)))
    except queue.Empty:
        out.put(("queue", "Empty", time.monotonic() - started, ""))
    else:
        out.put(("queue", f"got {item!r}", 0.0, ""))
    deadline = time.monotonic() + 15  # an owner still shutting down answers until it is gone
    while True:
        try:
            total(buf)
        except mp.OwnerGoneError as exc:
            out.put(("touch", "OwnerGoneError", held, str(exc)))
            return
        if time.monotonic() > deadline:
            out.put(("touch", "no error", held, ""))
            return
        time.sleep(0.02)


def w_producer(out, consumer_out, backend, how) -> None:
    """Makes a Manager, hands a buffer to its own consumer, then dies (``how``).

    It reports on ``out``, its consumer on ``consumer_out``: a process killed
    just after a put may die holding its queue's write lock."""
    device = device_for(backend)
    m = mp.Manager(release_timeout=0.5)
    buf = m.full((N,), 5.0, "float32", device=device, backend=backend)
    work, ready = mp.Queue(), mp.Queue()
    consumer = mp.Process(target=guarded, args=(w_orphaned_consumer, consumer_out, work, ready), device=device)
    consumer.start()
    work.put(buf)
    ready.get(timeout=T)
    address = m._owner.address
    out.put(("pids", consumer.pid, m._process.pid, os.path.dirname(address)))
    if how == "sigkill":
        time.sleep(T)  # the test kills this process
    # "return": exit with the Manager still open and the consumer still holding the buffer


def w_server_producer(out, weights, backend, how, told) -> None:
    """owner="server": allocates the weights, hands them on, then is killed or, once told,
    returns with the Manager still open (its exit must neither wait for the consumer nor
    stop the server)."""
    m = mp.Manager(owner="server")
    buf = m.full((N,), 7.0, "float32", device=device_for(backend), backend=backend)
    weights.put(buf)
    out.put(("server", m._process.pid))
    if how == "sigkill":
        time.sleep(T)
    else:
        told.get(timeout=T)


# -- helpers ------------------------------------------------------------------------------


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (SIGSTOP took effect)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(state in "tT" for state in states)


# -- consumer faults ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_consumer_sigkilled_while_holding_buffers(manager, reap, backend) -> None:
    device = device_for(backend)
    a = manager.full((N,), 1.0, "float32", device=device, backend=backend)
    b = manager.full((N,), 2.0, "float32", device=device, backend=backend)
    # The victim gets queues of its own: a process killed while its feeder thread
    # still holds a queue's write lock (just after sending) would block that queue.
    victim_jobs, victim_out = mp.Queue(), mp.Queue()
    survivor_jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
    victim = start_guarded(reap, w_hold_forever, victim_out, victim_jobs, 2, device=device)
    start_guarded(reap, w_hold_until_told, out, survivor_jobs, control, device=device)
    victim_jobs.put(a)
    victim_jobs.put(b)
    survivor_jobs.put(a)
    assert recv(victim_out, waiting_for="the victim") == ("holding", [1024.0, 2048.0])
    assert recv(out, waiting_for="the survivor") == ("holding", 1024.0)
    assert manager.stats()["leases"] == 3

    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: manager.stats()["leases"] == 1, timeout=30, interval=0.005)
    assert_prompt(time.monotonic() - killed, 1.0, "taking back a killed consumer's leases")

    control.put("go")  # the other consumer is unaffected
    assert recv(out, waiting_for="the survivor's read after the kill") == ("after", 1024.0)
    assert recv(out, waiting_for="the survivor's release") == ("released",)
    wait_until(lambda: manager.stats()["leases"] == 0)

    a.release()
    b.release()
    gc.collect()
    stats = manager.stats()
    assert stats["pooled_buffers"] == 2 and stats["leaked_buffers"] == 0
    again = manager.full((N,), 3.0, "float32", device=device, backend=backend)  # the memory is reusable
    assert manager.stats()["reused"] == stats["reused"] + 1
    assert total(again) == 3.0 * N


@pytest.mark.parametrize("backend", BACKENDS)
def test_consumer_exits_without_releasing(manager, reap, backend) -> None:
    device = device_for(backend)
    buf = manager.full((N,), 1.0, "float32", device=device, backend=backend)
    jobs, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, w_hold_and_return, out, jobs, device=device)
    jobs.put(buf)
    assert recv(out) == ("holding", 1024.0)
    proc.join(timeout=T)
    assert proc.exitcode == 0
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=2.0)
    assert manager.stats()["consumers"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_first_arrival_maps_nothing(manager, reap, backend) -> None:
    # The first arrival maps while its claim is answered: a refused claim must close
    # that mapping unused (nothing cached, nothing the owner would have to unmap).
    device = device_for(backend)
    buf = manager.full((N,), 2.0, "float32", device=device, backend=backend)
    data = pickle.dumps(buf)
    out = mp.Queue()
    start_guarded(reap, w_unpickle, out, data, device=device)
    assert recv(out) == ("ok", 2.0 * N)
    start_guarded(reap, w_unpickle_refused, out, data, device=device)
    kind, message, mapped = recv(out)
    assert kind == "DescriptorError" and ("unknown" in message or "already claimed" in message)
    assert mapped == (0, 0)
    wait_until(lambda: manager.stats()["leases"] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unclaimed_lease_expires_with_a_warning(reap, backend) -> None:
    device = device_for(backend)
    with mp.Manager(lease_timeout=0.3) as m:
        buf = m.full((N,), 1.0, "float32", device=device, backend=backend)
        data = pickle.dumps(buf)  # a message that is never delivered
        assert m.stats()["unclaimed_leases"] == 1
        with pytest.warns(mp.LeaseExpiredWarning, match="never claimed"):
            deadline = time.monotonic() + 5
            while m.stats()["leases"] and time.monotonic() < deadline:
                time.sleep(0.05)
        assert m.stats()["leases"] == 0
        buf.release()
        assert m.stats()["pooled_buffers"] == 1  # the expired lease no longer pins the memory
        out = mp.Queue()
        start_guarded(reap, w_unpickle, out, data, device=device)
        kind, message = recv(out)
        assert kind == "DescriptorError" and "unknown" in message


@pytest.mark.parametrize("handoff_c", [True, False], ids=["c-arrival", "python-arrival"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lease_expired_in_flight_is_refused_not_read_after_its_memory_is_reused(
    reap, backend, handoff_c, monkeypatch
) -> None:
    """A consumer that maps the allocation claims a lease by a journal record, with no round
    trip: when that lease expired while its message waited, and the owner gave the same
    allocation to a new buffer, the get raises DescriptorError; it never returns the new
    buffer's values under the old message."""
    if not handoff_c:
        monkeypatch.setenv("GPUSHARE_HANDOFF_NATIVE", "0")  # the worker's arrivals take the Python path
    device = device_for(backend)
    jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
    with mp.Manager(lease_timeout=1.0) as m:
        start_guarded(reap, w_get_again_when_told, out, jobs, control, device=device)
        first = m.full((N,), 1.0, "float32", device=device, backend=backend)
        ptr = first.ptr
        jobs.put(first)
        first.release()
        assert recv(out) == ("first", 1024.0)
        wait_until(lambda: m.stats()["leases"] == 0)
        late = m.full((N,), 2.0, "float32", device=device, backend=backend)
        assert late.ptr == ptr  # the pooled allocation, which the consumer maps
        with pytest.warns(mp.LeaseExpiredWarning, match="never claimed"):
            jobs.put(late)
            late.release()
            wait_until(lambda: m.stats()["leases"] == 0, timeout=10.0)
        reused = m.full((N,), 3.0, "float32", device=device, backend=backend)
        assert reused.ptr == ptr
        control.put("go")
        kind, what, why_not = recv(out)
        path = "the C arrival" if why_not is None else f"the Python arrival ({why_not})"
        assert kind == "DescriptorError", f"through {path}, the expired message arrived holding the reused {what}"
        assert "unknown" in what
        reused.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_relay_a_to_b_to_c_keeps_the_accounting(manager, reap, backend) -> None:
    device = device_for(backend)
    buf = manager.full((N,), 2.0, "float32", device=device, backend=backend)
    jobs, forward, control, out = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    start_guarded(reap, w_relay, out, jobs, forward, device=device)
    start_guarded(reap, w_hold_until_told, out, forward, control, device=device)
    jobs.put(buf)
    assert sorted([recv(out), recv(out)], key=str) == [("holding", 2048.0), ("relayed",)]
    wait_until(lambda: manager.stats()["leases"] == 1)  # B's lease went back; C holds its own
    buf.fill(3.0)  # the memory is shared, not copied, all the way to C
    control.put("go")
    assert recv(out) == ("after", 3072.0)
    assert recv(out) == ("released",)
    wait_until(lambda: manager.stats()["leases"] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_with_outstanding_leases_is_bounded_and_names_them(reap, backend) -> None:
    device = device_for(backend)
    jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
    proc = start_guarded(reap, w_touch_when_told, out, jobs, control, device=device)
    m = mp.Manager(release_timeout=0.3)
    jobs.put(m.full((N,), 1.0, "float32", device=device, backend=backend))
    assert recv(out) == ("holding", 1024.0)
    label = rf"allocation 1 \(\({N},\) float32 on {'cpu' if device == 'cpu' else 'cuda:0'}\)"
    started = time.monotonic()
    with pytest.warns(mp.LeakWarning, match=rf"{label}, held by pid {proc.pid}"):
        m.shutdown()
    assert_prompt(time.monotonic() - started, 3.0, "a shutdown with release_timeout=0.3", cap=4.5)  # not 5 s
    control.put("go")
    kind, message = recv(out)
    assert kind == "OwnerGoneError" and "shut down" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hung_mapper_makes_the_owner_leak_rather_than_free(manager, reap, backend) -> None:
    device = device_for(backend)
    buf = manager.full((N,), 5.0, "float32", device=device, backend=backend)
    jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
    proc = start_guarded(reap, w_map_release_and_wait, out, jobs, control, device=device)
    jobs.put(buf)
    assert recv(out) == ("released", 5.0 * N)
    buf.release()
    wait_until(lambda: manager.stats()["pooled_buffers"] == 1)
    os.kill(proc.pid, signal.SIGSTOP)  # it still maps the memory and cannot answer "unmap"
    try:
        # The signal stops its threads a moment after kill() returns; an "unmap" that
        # reached its reader thread before then is answered (and the memory rightly freed).
        wait_until(lambda: stopped(proc.pid))
        manager._owner.unmapper.timeout = 0.5
        with pytest.warns(mp.LeakWarning, match=rf"still mapped by process\(es\) \[{proc.pid}\]"):
            assert manager.trim() == 0  # nothing freed under a process that may still reach it
        stats = manager.stats()
        assert stats["leaked_buffers"] == 1 and stats["pooled_buffers"] == 0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    control.put("go")
    proc.join(timeout=T)
    assert proc.exitcode == 0


# -- producer faults --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigkill", "return"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_producer_dies_first(reap, backend, how) -> None:
    producer_out, out = mp.Queue(), mp.Queue()
    producer = start_guarded(reap, w_producer, producer_out, out, backend, how, device=device_for(backend))
    _, consumer_pid, server_pid, socket_dir = recv(producer_out, waiting_for="the producer's pids")
    try:
        assert os.path.isdir(socket_dir)
        died = time.monotonic()
        if how == "sigkill":
            os.kill(producer.pid, signal.SIGKILL)
        producer.join(timeout=T)
        # The consumer blocked on the dead producer's queue hears of it, within a bound ...
        where, what, _, message = recv(out, waiting_for="the consumer's get() to end")
        assert (where, what) == ("queue", "OwnerGoneError"), message
        assert time.monotonic() - died < 5.0
        assert f"pid {producer.pid}" in message
        # ... and the buffer it held refuses to be touched instead of reaching freed memory.
        where, what, held, message = recv(out, waiting_for="the consumer's touch")
        assert (where, what, held) == ("touch", "OwnerGoneError", 5.0 * N), message
        # Nothing is left: not the manager's server process, not the owner's socket directory.
        wait_until(lambda: not process_alive(server_pid, sentinel=False), timeout=5.0)
        wait_until(lambda: not os.path.exists(socket_dir), timeout=5.0)
    finally:
        kill_quietly(consumer_pid)
        kill_quietly(server_pid)


@pytest.mark.parametrize("how", ["sigkill", "return"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_server_owned_buffers_outlive_their_producer(reap, backend, how) -> None:
    device = device_for(backend)
    weights, producer_out, out, control, told = mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue(), mp.Queue()
    producer = start_guarded(reap, w_server_producer, producer_out, weights, backend, how, told, device=device)
    _, server_pid = recv(producer_out, waiting_for="the producer")
    try:
        start_guarded(reap, w_hold_until_told, out, weights, control, device=device)
        assert recv(out) == ("holding", 7.0 * N)
        ended = time.monotonic()
        if how == "sigkill":
            os.kill(producer.pid, signal.SIGKILL)
        else:
            told.put("return")
        producer.join(timeout=T)
        ended = time.monotonic() - ended
        assert producer.exitcode == (-signal.SIGKILL if how == "sigkill" else 0)
        # A returning producer neither waits out release_timeout (5 s) for the consumer's
        # lease nor stops the server that owns the memory.
        assert_prompt(ended, 2.5, "the producer's end", cap=4.5)  # not release_timeout's 5 s
        time.sleep(0.5)
        assert process_alive(server_pid, sentinel=False)  # the memory's owner outlives the process that asked for it
        control.put("go")
        assert recv(out) == ("after", 7.0 * N)  # still mapped, still the producer's values
        assert recv(out) == ("released",)
        # The last lease gone, the server goes.
        wait_until(lambda: not process_alive(server_pid, sentinel=False), timeout=5.0)
    finally:
        kill_quietly(server_pid)


def w_listen(out, tempdir) -> None:
    """Listen on a gpushare socket in ``tempdir``, say where, and wait to be killed."""
    import tempfile

    from gpushare import _service

    tempfile.tempdir = tempdir
    listener = _service.UnixListener("owner", lambda sock: sock.close())
    out.put(("listening", os.path.dirname(listener.address)))
    time.sleep(120)


def w_sweep(out, tempdir) -> None:
    import tempfile

    from gpushare import _service

    tempfile.tempdir = tempdir
    first = _service.sweep_dead()
    out.put(("swept", first, _service.sweep_dead()))


def test_the_next_process_sweeps_what_a_killed_process_left(reap, tmp_path) -> None:
    """A SIGKILLed process cannot remove its socket directory; the first listener of any later
    gpushare process removes it (its pid gone, its socket silent), and keeps a live process's."""
    out = mp.Queue()
    killed = start_guarded(reap, w_listen, out, str(tmp_path))
    dead_dir = recv(out, killed)[1]
    alive = start_guarded(reap, w_listen, out, str(tmp_path))
    live_dir = recv(out, alive)[1]
    os.kill(killed.pid, signal.SIGKILL)
    killed.join(T)
    assert os.path.isdir(dead_dir) and os.path.isdir(live_dir)  # nobody else cleans up after it
    sweeper = start_guarded(reap, w_sweep, out, str(tmp_path))
    _, first, second = recv(out, sweeper)
    sweeper.join(T)
    assert first == [dead_dir] and second == []  # once per process
    assert not os.path.exists(dead_dir) and os.path.isdir(live_dir)


def test_a_dead_owners_socket_directory_is_removed_only_when_stale(tmp_path, monkeypatch) -> None:
    from gpushare import _service

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / "gpushare-owner-424242-abc"
    stale.mkdir()
    (stale / "owner.sock").touch()  # nothing listens: stale
    foreign = tmp_path / "gpushare-owner-424242-def"
    foreign.mkdir()
    (foreign / "notes.txt").touch()  # not only sockets: not ours to remove
    other = tmp_path / "gpushare-owner-434343-abc"
    other.mkdir()
    assert _service.remove_stale_sockets(424242) == [str(stale)]
    assert not stale.exists() and foreign.exists() and other.exists()
    listener = _service.UnixListener("owner", lambda sock: sock.close())
    try:
        assert os.path.dirname(listener.address).startswith(str(tmp_path / f"gpushare-owner-{os.getpid()}-"))
        assert _service.remove_stale_sockets(os.getpid()) == []  # it answers: alive, kept
        assert os.path.exists(listener.address)
    finally:
        listener.close()
