"""The lease journal: the record format in one process, then real consumers
that overflow it, and the socket fallback when a link has no journal."""

from __future__ import annotations

import os
import pickle
import struct
import time

import pytest
from conftest import wait_until

import gpushare as mp
from gpushare import _lifetime
from gpushare._lifetime import _protocol

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")


def pair() -> tuple[_protocol.JournalWriter, _protocol.JournalReader]:
    writer = _protocol.JournalWriter()
    assert writer.fd is not None
    reader = _protocol.JournalReader(os.dup(writer.fd))
    writer.close_fd()
    return writer, reader


def test_records_come_back_in_order_across_many_laps() -> None:
    writer, reader = pair()
    expected: list[tuple[int, int]] = []
    got: list[tuple[int, int]] = []
    lease = 1
    for burst in (1, 7, _protocol.CAPACITY - 1, _protocol.CAPACITY, 3, _protocol.CAPACITY, 1000):
        for _ in range(burst):
            kind = lease % 2
            assert writer.unconsumed() < _protocol.CAPACITY
            writer.append(kind, lease)
            expected.append((kind, lease))
            lease += 1
        got.extend(reader.read())
        assert writer.unconsumed() == 0
    assert got == expected
    assert reader.read() == []
    writer.close()
    reader.close()


def test_a_full_journal_says_so_and_frees_room_as_it_is_read() -> None:
    writer, reader = pair()
    for i in range(_protocol.CAPACITY):
        assert not writer.full()
        writer.append(_protocol.CLAIM, i + 1)
    assert writer.unconsumed() == _protocol.CAPACITY
    assert writer.full() and writer.full()  # still full: the owner has read nothing
    assert len(reader.read()) == _protocol.CAPACITY
    assert writer.unconsumed() == 0
    assert not writer.full()  # the owner's new tail is read once the known room is used up
    writer.close()
    reader.close()


def test_an_incomplete_record_is_not_consumed_until_it_is_whole() -> None:
    writer, reader = pair()
    writer.append(_protocol.CLAIM, 5)
    writer.append(_protocol.RELEASE, 5)
    # Damage the second record's check, as if its write had not landed yet.
    mm = writer._mm
    offset = 64 + 16 * 1 + 8
    good = mm[offset : offset + 8]
    mm[offset : offset + 8] = b"\0" * 8
    assert reader.read() == [(_protocol.CLAIM, 5)]
    assert reader.read() == []
    mm[offset : offset + 8] = good
    assert reader.read() == [(_protocol.RELEASE, 5)]
    writer.close()
    reader.close()


def test_a_stale_record_from_the_previous_lap_is_not_consumed() -> None:
    writer, reader = pair()
    writer.append(_protocol.CLAIM, 9)
    assert reader.read() == [(_protocol.CLAIM, 9)]
    # Record 0 is still in slot 0; read as record CAPACITY it must not match.
    struct.pack_into("<Q", writer._mm, 0, _protocol.CAPACITY)
    reader._tail = _protocol.CAPACITY
    assert reader.read() == []
    writer.close()
    reader.close()


def test_the_stamp_bounds_the_module_docstring_relies_on() -> None:
    # Subtracting CAPACITY * K modulo 2**64 adds a number in [2**60, 2**61): a value
    # torn from its check must then differ from the old one by at least 2**60.
    step = (1 << 64) - (_protocol.CAPACITY * _protocol._K) % (1 << 64)
    assert 1 << 60 <= step < 1 << 61
    # No stamp of the first lap is small: zeros, or a new value beside a zero check, never pass.
    assert min(_protocol.stamp(n) for n in range(_protocol.CAPACITY)) >= 1 << 49


def test_a_new_value_beside_the_previous_laps_check_is_not_consumed() -> None:
    writer, reader = pair()
    for lease in range(1, _protocol.CAPACITY + 1):
        writer.append(_protocol.CLAIM, lease)
    assert len(reader.read()) == _protocol.CAPACITY
    # Record CAPACITY goes in slot 0: its value lands, its check not yet (the old one stays).
    struct.pack_into("<Q", writer._mm, 64, _protocol.RELEASE | 1 << 1)
    assert reader.read() == []
    # The old value beside the new check passes only if both values are equal.
    writer.append(_protocol.RELEASE, 1)
    assert reader.read() == [(_protocol.RELEASE, 1)]
    writer.close()
    reader.close()


def test_reads_cross_the_end_of_the_ring_and_chunks_in_one_call() -> None:
    writer, reader = pair()
    for lease in range(1, _protocol.CAPACITY - 100):
        writer.append(_protocol.CLAIM, lease)
    assert len(reader.read()) == _protocol.CAPACITY - 101
    expected = [(lease % 2, lease) for lease in range(1, 1001)]  # 1000 records: past the end, several chunks
    for kind, lease in expected:
        writer.append(kind, lease)
    assert reader.read() == expected
    writer.close()
    reader.close()


def test_the_owner_refuses_a_journal_of_the_wrong_size() -> None:
    fd = os.memfd_create("not-a-journal")
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError, match="wrong size"):
        _protocol.JournalReader(fd)


# -- real consumers --------------------------------------------------------------------


def claim_all_then_release(data, results, journal) -> None:
    _protocol.JOURNAL_ENABLED = journal
    bufs = [pickle.loads(d) for d in data]  # every one a claim record
    total = sum(float(b.numpy()[0]) for b in bufs)
    results.put(("claimed", len(bufs), total))
    for b in bufs:
        b.release()  # every one a release record
    link = _lifetime.links()[0]
    results.put(("journal", link.recorder.has_journal))
    deadline = time.monotonic() + 30
    while link.recorder.backlog() and time.monotonic() < deadline:  # the writer thread empties what did not fit
        time.sleep(0.01)
    results.put(("backlog", link.recorder.backlog()))


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "messages"])
def test_more_records_than_the_journal_holds_all_arrive(manager, reap, journal) -> None:
    # 5000 claims then 5000 releases: more than CAPACITY records between two owner
    # reads, so the consumer must nudge the owner and hold records back in order.
    n = 5000 if journal else 500
    buf = manager.full((16,), 3.0, "float32", device="cpu")
    data = [pickle.dumps(buf) for _ in range(n)]
    assert manager.stats()["unclaimed_leases"] == n
    results = mp.Queue()
    proc = mp.Process(target=claim_all_then_release, args=(data, results, journal))
    proc.start()
    reap.append(proc)
    assert results.get(timeout=60) == ("claimed", n, 3.0 * n)
    assert results.get(timeout=30) == ("journal", journal)
    assert results.get(timeout=60) == ("backlog", 0)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    assert manager.stats()["unclaimed_leases"] == 0
    proc.join(timeout=30)
    assert proc.exitcode == 0
    buf.release()


def drop_inherited(held) -> None:
    held.clear()  # the inherited Buffer's last reference, in the forked child


def hold_then_fork(q, results, control) -> None:
    import multiprocessing

    held = [q.get(timeout=30)]
    child = multiprocessing.get_context("fork").Process(target=drop_inherited, args=(held,))
    child.start()
    child.join(30)
    results.put(("forked", child.exitcode))
    assert control.get(timeout=30) == "counted"  # the owner read every journal meanwhile
    results.put(("read", float(held[0].numpy()[0])))
    held[0].release()
    results.put(("released", 0))


def test_a_forked_child_dropping_an_inherited_buffer_leaves_its_parents_lease(manager, reap) -> None:
    """The journal's memory is shared across fork: a child that recorded the release of a
    buffer it inherited would give back the lease its parent still holds."""
    buf = manager.full((16,), 4.0, "float32", device="cpu")
    q, answers, control = mp.Queue(), mp.Queue(), mp.Queue()
    proc = mp.Process(target=hold_then_fork, args=(q, answers, control))
    proc.start()
    reap.append(proc)
    q.put(buf)
    assert answers.get(timeout=30) == ("forked", 0)
    time.sleep(0.5)
    assert manager.stats()["leases"] == 1  # stats() reads the journals first
    control.put("counted")
    assert answers.get(timeout=30) == ("read", 4.0)
    assert answers.get(timeout=30) == ("released", 0)
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    buf.release()


def claim_and_die(data, results) -> None:
    bufs = [pickle.loads(d) for d in data]
    results.put(len(bufs))
    results.close()
    results.join_thread()  # the answer is out before the kill
    os.kill(os.getpid(), 9)


def test_claims_in_the_journal_of_a_killed_consumer_are_counted_then_reclaimed(manager, reap) -> None:
    buf = manager.zeros((16,), "float32", device="cpu")
    first = pickle.dumps(buf)
    data = [first] + [pickle.dumps(buf) for _ in range(20)]
    results = mp.Queue()
    proc = mp.Process(target=claim_and_die, args=(data, results))
    proc.start()
    reap.append(proc)
    assert results.get(timeout=30) == 21
    proc.join(timeout=30)
    # The claims were journal records only: the owner reads them when the connection
    # drops, so no lease is left unclaimed (to expire with a warning later).
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=5)
    assert manager.stats()["unclaimed_leases"] == 0
    buf.release()


@pytest.mark.parametrize("via", ["journal", "message"])
def test_a_foreign_leases_part_stays_as_the_anchor_however_its_release_arrives(via) -> None:
    """The last lease on foreign memory (a torch segment) leaves its part as the record's
    anchor, which keeps the segment allocated while receivers may still map it; a sharer
    that still uses that memory keeps the record open, with no housekeeping round."""
    from gpushare._backends import Allocation
    from gpushare._backends.cuda_ipc import FOREIGN_IPC
    from gpushare._lifetime._records import AllocationPool, AllocRecord, LeaseTable, OwnerState

    state = OwnerState()
    pool = AllocationPool(state, None)
    kicks: list[int] = []
    pool.kick = lambda: kicks.append(1)
    leases = LeaseTable(state, pool, 60.0)
    allocation = Allocation("cuda_ipc", 1 << 21, 1 << 21, 0, b"u" * 16, handle=b"h" * 64)
    record = AllocRecord(1, allocation, FOREIGN_IPC)
    record.transient = True
    record.held = lambda anchor: anchor is not None  # the sharer still uses the anchor's memory
    state.records[record.alloc_id] = record
    part = object()  # what keeps the leased part allocated (a torch storage)
    lease_id, _, _ = leases.take(record, 0, record_event=False, keep=part)
    writer, reader = pair()
    holder = 7
    with state.lock:
        leases.add_journal_locked(holder, reader)
        if via == "journal":
            writer.append(_protocol.CLAIM, lease_id)
            writer.append(_protocol.RELEASE, lease_id)
            leases.read_journal_locked(holder)
        else:
            leases.claim_locked(lease_id, record.alloc_id, holder)
            leases.release_locked(lease_id, holder)
    assert not record.leases
    assert record.allocation.native is part
    assert pool.idle(record) and not kicks
    writer.close()
    reader.close()


def _owner_table(timeout: float) -> tuple[object, object, object]:
    """A LeaseTable over one host allocation, with no service around it: (table, record, state)."""
    from gpushare._backends import Allocation
    from gpushare._lifetime._records import AllocationPool, AllocRecord, LeaseTable, OwnerState

    state = OwnerState()
    pool = AllocationPool(state, None)
    pool.kick = lambda: None
    leases = LeaseTable(state, pool, timeout)
    from gpushare import _backends

    record = AllocRecord(1, Allocation("host", 0, 1 << 21, None, b""), _backends.get("host"))
    state.records[record.alloc_id] = record
    return leases, record, state


def test_a_due_lease_is_announced_first_and_a_claim_written_after_that_keeps_it() -> None:
    """Expiry in two steps: a lease unclaimed for half the timeout is announced in every
    journal (``dropped``); a claim recorded after that, even unread at the next pass, is read
    before the lease could go; a lease nobody claims goes once due and announced long enough."""
    leases, record, state = _owner_table(0.4)
    claimed, ignored = (leases.take(record, 0, record_event=False)[0] for _ in range(2))
    writer, reader = pair()
    with state.lock:
        leases.add_journal_locked(9, reader)
    assert writer.dropped() == 0
    deadline = time.monotonic() + 5
    while writer.dropped() < ignored and time.monotonic() < deadline:
        with state.lock:
            assert leases.expire_locked() == []  # announced, not yet dropped
        time.sleep(0.02)
    assert writer.dropped() == ignored
    writer.append(_protocol.CLAIM, claimed)  # the consumer's claim, after the announcement
    expired: list[object] = []
    while not expired and time.monotonic() < deadline:
        with state.lock:
            expired = leases.expire_locked()
        time.sleep(0.02)
    assert [lease.lease_id for lease in expired] == [ignored]
    assert len(leases) == 1  # the claimed one stays
    writer.close()
    reader.close()


def test_a_relayed_lease_is_its_relays_at_once_and_a_read_through_one_stays_unclaimed() -> None:
    """LeaseVia from a process re-sharing what it received claims the lease it came under,
    though its claim record is unread (nothing drops that lease as an unclaimed one); a read
    through an unclaimed lease (a Ray object's) leaves it unclaimed and quiet."""
    leases, record, state = _owner_table(60.0)
    relayed, read_through = (leases.take(record, 0, record_event=False)[0] for _ in range(2))
    writer, reader = pair()
    with state.lock:
        leases.add_journal_locked(9, reader)
    writer.append(_protocol.CLAIM, relayed)  # written, not read yet
    leases.lease_via(record.alloc_id, 0, relayed, 9, claims=True)
    leases.lease_via(record.alloc_id, 0, read_through, 9)
    with state.lock:
        relay_lease, ray_lease = leases._leases[relayed], leases._leases[read_through]
        assert (relay_lease.holder, relay_lease.quiet) == (9, False)
        assert (ray_lease.holder, ray_lease.quiet) == (None, True)
        leases.read_journal_locked(9)  # the claim record, now read, is the same holder's: no refusal
        leases.stop_sharing_locked()
    assert leases.refusals() == []
    assert relayed in leases._leases and read_through not in leases._leases
    writer.close()
    reader.close()
