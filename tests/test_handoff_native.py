"""A buffer's handoff through a Queue in one C call at each end (gpushare._handoff.c): the
C share writes the bytes and takes the lease the Python path would, the C arrival makes the
Buffer, the claim and the counts the Python path would, and everything else is handed to
the Python path, which raises its own errors. Processes with and without the C calls share
one queue. Where this machine cannot build the module, the tests that need it skip with the
reason.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
from conftest import BACKENDS, device_for, no_leases, recv, run_guarded, start_guarded, wait_until

import gpushare as mp
from gpushare import _buffer, _native
from gpushare._buffer import QUEUE_DATA_AT, from_queue_pickle, memory_of, queue_pickle
from gpushare._errors import BufferReleasedError, DescriptorError, ManagerClosedError, OwnerGoneError
from gpushare._memory import Descriptor

T = 60
SHAPE = (64, 1024)


def handoff_here() -> None:
    if _native.handoff_module() is None:
        pytest.skip(f"the C handoff is not available here: {_native.handoff_why_not()}")


def parse(message: bytes) -> Descriptor:
    return Descriptor.from_bytes(message[QUEUE_DATA_AT:-3])


def table_of(m: mp.BufferManager):  # type: ignore[no-untyped-def]
    return m._owner.leases  # type: ignore[attr-defined]


# -- the sending end --------------------------------------------------------------------------


def test_the_c_share_writes_and_leases_what_the_python_path_does(manager) -> None:
    handoff_here()
    buf = manager.zeros(SHAPE, "float32", device="cpu")
    view = buf.view(shape=(SHAPE[0] * SHAPE[1],))
    table = table_of(manager)
    first = queue_pickle(buf)  # the Python path, which leaves the plan
    assert _buffer._share is not None, _buffer.handoff_why_not
    before = time.monotonic()
    second = _buffer._shares.share(buf)  # the C call itself: not handed back
    third = queue_pickle(buf)
    assert second is not None
    py, c, c2 = parse(first), parse(second), parse(third)
    assert c._replace(lease_id=0) == py._replace(lease_id=0) == c2._replace(lease_id=0)
    assert (c.lease_id, c2.lease_id) == (py.lease_id + 1, py.lease_id + 2)
    leases = table._leases  # type: ignore[attr-defined]
    made, taken = leases[py.lease_id], leases[c.lease_id]
    assert type(taken) is type(made)
    for slot in ("record", "generation", "holder", "keep", "quiet"):
        assert getattr(taken, slot) == getattr(made, slot), slot
    assert before <= taken.created <= time.monotonic()
    record = memory_of(buf).source.record  # type: ignore[attr-defined]
    assert {py.lease_id, c.lease_id, c2.lease_id} <= record.leases
    # Another view of the same memory has a plan of its own, after its first share.
    v1, v2 = parse(queue_pickle(view)), parse(queue_pickle(view))
    assert v2._replace(lease_id=0) == v1._replace(lease_id=0) and v1.shape == (SHAPE[0] * SHAPE[1],)
    for message in (first, second, third):  # each unpickles once in this process, then lets go
        from_queue_pickle(message).release()
    wait_until(lambda: c.lease_id not in leases and py.lease_id not in leases)


def test_the_c_share_hands_back_what_it_does_not_take(manager) -> None:
    handoff_here()
    buf = manager.zeros(SHAPE, "float32", device="cpu")
    messages = [queue_pickle(buf)]
    shares = _buffer._shares
    assert shares, _buffer.handoff_why_not
    table = table_of(manager)
    count = len(table)
    ran = []
    table._pending.put((ran.append, ("deferred",)))  # type: ignore[attr-defined]
    assert shares.share(buf) is None and len(table) == count  # deferred work first: nothing taken
    messages.append(queue_pickle(buf))  # the Python path runs it, then leases
    assert ran == ["deferred"] and len(table) == count + 1
    other = manager.zeros(SHAPE, "float32", device="cpu")
    messages.append(queue_pickle(other))
    for message in messages:  # unpickled here and let go: no lease left out
        from_queue_pickle(message).release()
    other.release()
    assert shares.share(other) is None
    with pytest.raises(BufferReleasedError):
        queue_pickle(other)
    wait_until(lambda: no_leases(manager))
    manager.shutdown()
    assert shares.share(buf) is None
    with pytest.raises(ManagerClosedError):
        queue_pickle(buf)


# -- the receiving end ------------------------------------------------------------------------

ARRIVAL_SLOTS = _buffer.HANDOFF_SLOTS[0]


def w_compare_arrivals(out, q, n) -> None:  # type: ignore[no-untyped-def]
    """Take n buffers: the first by the Python path, the rest by the C arrival; compare."""
    from gpushare._lifetime import links

    first = q.get(timeout=T)
    arrive = _buffer._arrive
    assert arrive is not None, _buffer.handoff_why_not
    served = []

    def counted(data: bytes):  # type: ignore[no-untyped-def]
        buf = arrive(data)
        served.append(buf is not None)
        return buf

    _buffer._arrive = counted
    rest = [q.get(timeout=T) for _ in range(n - 1)]
    assert served == [True] * (n - 1)  # every later one arrived by the C call
    m0 = memory_of(first)
    [link] = links()
    mapping = link._mappings[m0.alloc_id]
    report = {"refs": mapping.refs, "held": len(link._held)}
    for buf in rest:
        m = memory_of(buf)
        assert type(buf) is type(first) and type(m) is type(m0)
        for slot in ARRIVAL_SLOTS:
            if slot not in ("source", "_refs", "event", "pending"):  # the event: the sender's stream's state
                assert getattr(m, slot) == getattr(m0, slot), slot
        assert m.pending == (m.event is not None)
        assert m._refs == [True] and m.source.link is link and type(m.source) is type(m0.source)
        assert m.source.lease_id in link._held
        assert (buf._offset, buf._shape, buf._dtype, buf._export) == (
            first._offset, first._shape, first._dtype, first._export
        )  # fmt: skip
        assert buf._finalizer.alive and type(buf._finalizer) is type(first._finalizer)
        assert float(buf.numpy()[0, 0]) == 7.0
        view = buf.view(shape=(SHAPE[0] * SHAPE[1],))  # a view takes its own count
        buf.release()
        assert float(view.numpy()[1]) == 7.0 and m.source.lease_id in link._held
        view.release()
        assert m.source.lease_id not in link._held
    first.release()
    report.update(after_refs=mapping.refs, after_held=len(link._held))
    out.put(("ok", report))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_c_arrival_makes_the_buffer_the_python_path_makes(manager, reap, backend) -> None:
    handoff_here()
    n = 40
    device = device_for(backend)
    buf = manager.full(SHAPE, 7.0, "float32", device=device, backend=backend)
    q = mp.Queue()
    for _ in range(n):
        q.put(buf)
    out = run_guarded(reap, w_compare_arrivals, q, n, device=device)
    _, report = recv(out)
    assert report == {"refs": n, "held": n, "after_refs": 0, "after_held": 0}
    wait_until(lambda: no_leases(manager))


def w_errors(out, q) -> None:  # type: ignore[no-untyped-def]
    """Raw messages from the queue, each unpickled here by hand: the Python path's errors."""
    region = q._region

    def raw() -> bytes:
        deadline = time.monotonic() + T
        while True:
            got = region.try_get()
            if got is not None:
                return got[1]
            assert time.monotonic() < deadline, "nothing came"
            time.sleep(0.001)

    from_queue_pickle(raw()).release()  # the Python path: an entry for the C arrival
    assert _buffer._arrive is not None, _buffer.handoff_why_not
    message = raw()
    held = from_queue_pickle(message)
    with pytest.raises(DescriptorError, match="already held"):
        from_queue_pickle(message)  # the same message twice
    held.release()
    message = bytearray(raw())
    message[QUEUE_DATA_AT + 60] ^= 0xFF
    with pytest.raises(DescriptorError, match="checksum"):
        from_queue_pickle(bytes(message))
    kept = from_queue_pickle(raw())
    out.put(("ready", 0))
    message = raw()  # put before the owner shut down
    deadline = time.monotonic() + T
    while memory_of(kept).source.link.gone is None:
        assert time.monotonic() < deadline, "the owner's end was not seen"
        time.sleep(0.01)
    with pytest.raises((OwnerGoneError, DescriptorError)):
        from_queue_pickle(message)
    out.put(("ok", 0))


def test_the_c_arrival_hands_the_python_path_its_errors(reap) -> None:
    handoff_here()
    m = mp.Manager(release_timeout=2.0)
    buf = m.full(SHAPE, 1.0, "float32", device="cpu")
    q = mp.Queue()
    for _ in range(5):
        q.put(buf)
    out = run_guarded(reap, w_errors, q)
    assert recv(out) == ("ready", 0)
    q.put(buf)
    m.shutdown()
    assert recv(out) == ("ok", 0)


def w_take_and_check(out, q, acks, n) -> None:  # type: ignore[no-untyped-def]
    for i in range(n):
        buf = q.get(timeout=T)
        value = float(buf.numpy()[0, 0])
        buf.release()
        acks.put((i, value))
    out.put(("ok", _buffer._arrive is not None))


@pytest.mark.parametrize("sender_c", [True, False], ids=["sender-c", "sender-python"])
@pytest.mark.parametrize("receiver_c", [True, False], ids=["receiver-c", "receiver-python"])
def test_processes_with_and_without_the_c_calls_share_buffers(manager, reap, monkeypatch, sender_c, receiver_c) -> None:
    """Every value the sender writes before a put is the one its receiver reads, on one
    shared buffer, whichever end uses the C calls; no lease is left."""
    handoff_here()
    if not sender_c:
        monkeypatch.setattr(_buffer, "_shares", False)
        monkeypatch.setattr(_buffer, "_share", None)
    n = 200
    q, acks = mp.Queue(), mp.Queue()
    out = mp.Queue()
    start_guarded(reap, w_take_and_check, out, q, acks, n, env={"GPUSHARE_NATIVE": "1" if receiver_c else "0"})
    buf = manager.zeros(SHAPE, "float32", device="cpu")
    for i in range(n):
        buf.numpy()[0, 0] = i
        q.put(buf)
        assert acks.get(timeout=T) == (i, float(i))
    assert recv(out) == ("ok", receiver_c)
    assert (_buffer._share is not None) == sender_c
    del buf
    gc.collect()
    wait_until(lambda: no_leases(manager))


class _WiderMemory(_buffer.Memory):
    __slots__ = ("added",)  # a slot the C arrival does not know


def test_a_class_with_a_slot_the_c_calls_do_not_set_turns_them_off(monkeypatch) -> None:
    handoff_here()
    monkeypatch.setattr(_buffer, "Memory", _WiderMemory)
    monkeypatch.setattr(_buffer, "_handoff", None)
    monkeypatch.setattr(_buffer, "_arrivals", None)
    monkeypatch.setattr(_buffer, "_arrive", None)
    monkeypatch.setattr(_buffer, "handoff_why_not", None)
    from gpushare._lifetime import CLAIM, NUDGE, RELEASE, arrival_source, journal_layout
    from gpushare._memory import descriptor_layout

    memory_slots, buffer_slots, drop_slots, source_slots, _ = _buffer.HANDOFF_SLOTS
    made = _buffer._new_handoff(
        "Arrivals", _buffer.Memory, memory_slots, _buffer.Buffer, buffer_slots, _buffer._Drop, drop_slots,
        arrival_source(), source_slots, _buffer.QUEUE_HEAD, _buffer.QUEUE_TAIL, *descriptor_layout(),
        *journal_layout(), CLAIM, RELEASE, NUDGE,
    )  # fmt: skip
    assert made is False
    assert "does not fit" in (_buffer.handoff_why_not or "") and "'added'" in (_buffer.handoff_why_not or "")
    assert _buffer._arrive is None  # nothing kept: every arrival takes the Python path


def w_forked_child_takes(q, n, done) -> None:  # type: ignore[no-untyped-def]
    from gpushare._lifetime import links

    assert _buffer._arrive is None  # the parent's entries are not this process's
    for _ in range(n):
        buf = q.get(timeout=T)
        assert float(buf.numpy()[0, 0]) == 3.0
        buf.release()
    [link] = links()
    done.put(("ok", os.getpid(), id(link)))


def w_receive_then_fork(out, q, n) -> None:  # type: ignore[no-untyped-def]
    import multiprocessing

    from gpushare._lifetime import links

    for _ in range(n):
        q.get(timeout=T).release()
    assert _buffer._arrive is not None, _buffer.handoff_why_not
    [mine] = links()
    done = multiprocessing.get_context("fork").SimpleQueue()
    child = multiprocessing.get_context("fork").Process(target=w_forked_child_takes, args=(q, n, done))
    child.start()
    child.join(T)
    assert child.exitcode == 0, child.exitcode
    status, pid, _ = done.get()
    assert status == "ok" and pid == child.pid
    for _ in range(n):  # and this process goes on with its own entries
        buf = q.get(timeout=T)
        assert memory_of(buf).source.link is mine
        buf.release()
    out.put(("ok", 0))


def test_a_forked_child_makes_its_own_arrival_entries(manager, reap) -> None:
    handoff_here()
    n = 4
    buf = manager.full(SHAPE, 3.0, "float32", device="cpu")
    q = mp.Queue()
    for _ in range(3 * n):
        q.put(buf)
    out = run_guarded(reap, w_receive_then_fork, q, n)
    assert recv(out) == ("ok", 0)
    wait_until(lambda: no_leases(manager))


class _FakeReady:
    """Stands in for a CUDA sharer's ReadyEvents in a plan: what the C share does with an event."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, object]] = []

    def record(self, device: object, stream: object) -> bytes:
        self.calls.append((device, stream))
        return bytes(range(64))  # an event handle's size


def test_the_c_share_writes_a_ready_event_as_the_template_does(manager) -> None:
    """On a GPU a busy stream gives each share an event; here a stand-in gives one, so the
    C share's event framing is checked against the template's on any machine."""
    handoff_here()
    buf = manager.zeros(SHAPE, "float32", device="cpu")
    first = queue_pickle(buf)
    memory = memory_of(buf)
    key = (buf._offset, buf._shape, buf._dtype)  # type: ignore[attr-defined]
    plan = memory.templates[key]
    ready = _FakeReady()
    memory.templates[key] = (*plan[:9], ready, 3, *plan[11:])  # the ready events and the device
    message = _buffer._shares.share(buf)
    assert message is not None and ready.calls == [(3, 0)]
    desc = parse(message)
    assert desc.event == bytes(range(64))
    template = memory.templates[(*key, memory.handle)]
    body = template.fill(desc.lease_id, desc.event)
    assert message == _buffer.QUEUE_HEAD + _buffer.QUEUE_LENGTH.pack(len(body)) + body + _buffer.QUEUE_TAIL
    memory.templates[key] = plan
    for sent in (first, message):  # unpickled in the owner's process: no event is opened here
        from_queue_pickle(sent).release()
    wait_until(lambda: no_leases(manager))
