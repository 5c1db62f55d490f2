"""Descriptors: the bytes that travel for a buffer, and what a bad one does.

In one process: round trip, and every kind of corruption is a
DescriptorError (unit and property-based tests). Then descriptors that
reach a worker, each a clear error there: truncated, corrupted, pointed at
another Manager, naming a lease never taken or a view past its allocation
(and the Manager intact afterwards, :func:`conftest.assert_intact`: the
counts are what they were, and it still allocates, shares with a real
worker and recycles); unpickled a second time; of a Manager that was shut
down.
"""

from __future__ import annotations

import io
import pickle
import time

import pytest
from conftest import assert_intact, recv, run_guarded, start, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st
from workers import unpickle_bytes, w_unpickle_and_sum

import gpushare as mp
from gpushare._memory import Descriptor


def make(**over: object) -> Descriptor:
    fields: dict[str, object] = dict(
        backend="cuda_ipc",
        owner_token=bytes(range(16)),
        address="/tmp/gpushare-x/owner.sock",
        alloc_id=7,
        generation=3,
        lease_id=42,
        alloc_nbytes=2 << 20,
        offset=0,
        device_uuid=bytes(range(100, 116)),
        handle=bytes(range(64)),
        dtype="<f2",
        shape=(64, 3, 8),
        event=bytes(range(64, 128)),
    )
    fields.update(over)
    return Descriptor(**fields)  # type: ignore[arg-type]


def test_round_trip() -> None:
    desc = make()
    assert Descriptor.from_bytes(desc.to_bytes()) == desc
    assert len(desc.to_bytes()) < 320  # small: it is what travels per handoff


def test_host_descriptor_round_trip() -> None:
    desc = make(backend="host", device_uuid=b"", handle=b"/gpushare-1-ab-3", shape=(), dtype="|b1", event=b"")
    assert Descriptor.from_bytes(desc.to_bytes()) == desc


@pytest.mark.parametrize("event", [b"", bytes(range(64, 128))])
def test_template_fills_in_exactly_what_to_bytes_writes(event: bytes) -> None:
    template = make(lease_id=0, event=b"").template()
    for lease_id in (1, 42, 2**63 + 5):
        assert template.fill(lease_id, event) == make(lease_id=lease_id, event=event).to_bytes()


def test_known_descriptor_parses_with_its_own_lease_and_still_checks_its_checksum() -> None:
    """The receiver's parse cache: same buffer, new lease id each time."""
    first = Descriptor.from_bytes(make(lease_id=1000).to_bytes())
    assert first.lease_id == 1000
    for lease_id in (1001, 1002):
        again = Descriptor.from_bytes(make(lease_id=lease_id).to_bytes())
        assert again == make(lease_id=lease_id) and type(again) is Descriptor
    data = bytearray(make(lease_id=1003).to_bytes())
    data[-10] ^= 0x5A  # a byte of the shape: the key misses, the full parse catches it
    with pytest.raises(mp.DescriptorError, match="checksum"):
        Descriptor.from_bytes(bytes(data))
    data = bytearray(make(lease_id=1004).to_bytes())
    data[36] ^= 0x01  # a bit of the lease id: the key hits, the checksum does not match
    with pytest.raises(mp.DescriptorError, match="checksum"):
        Descriptor.from_bytes(bytes(data))


@pytest.mark.parametrize("cut", [0, 1, 4, 20, 60, 100])
def test_truncated(cut: int) -> None:
    with pytest.raises(mp.DescriptorError):
        Descriptor.from_bytes(make().to_bytes()[:cut])


def test_every_flipped_byte_is_caught() -> None:
    data = make().to_bytes()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        with pytest.raises(mp.DescriptorError):
            Descriptor.from_bytes(bytes(bad))


def test_not_bytes() -> None:
    with pytest.raises(mp.DescriptorError, match="bytes"):
        Descriptor.from_bytes("GPSH")


def test_view_past_the_allocation_is_refused() -> None:
    with pytest.raises(mp.DescriptorError, match="allocation"):
        Descriptor.from_bytes(make(offset=2 << 20).to_bytes())


def test_rebuild_with_corrupt_bytes_through_pickle_is_a_descriptor_error() -> None:
    from gpushare._buffer import rebuild_buffer

    payload = pickle.dumps((rebuild_buffer, b"\x00" * 10))
    func, arg = pickle.loads(payload)
    with pytest.raises(mp.DescriptorError):
        func(arg)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    try:
        Descriptor.from_bytes(data)
    except mp.DescriptorError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(0, 1000), max_size=6).map(tuple),
    dtype=st.sampled_from(["<f4", "<f2", "<i8", "|u1", "|b1", "<c8"]),
    lease=st.integers(0, 2**63),
    address=st.text(max_size=100),
)
def test_round_trip_property(shape: tuple[int, ...], dtype: str, lease: int, address: str) -> None:
    # The largest shape drawn (1000**6 elements of 8 bytes) needs 8e18 bytes: an allocation of
    # 2**63 holds every drawn view, so each one is valid and must come back equal.
    desc = make(shape=shape, dtype=dtype, lease_id=lease, address=address, alloc_nbytes=1 << 63)
    assert Descriptor.from_bytes(desc.to_bytes()) == desc


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_descriptors_are_rejected_or_equal(data: st.DataObject) -> None:
    raw = bytearray(make().to_bytes())
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] = data.draw(st.integers(0, 255))
    try:
        parsed = Descriptor.from_bytes(bytes(raw))
    except mp.DescriptorError:
        return
    assert parsed == make()  # only a no-op mutation may parse


# -- descriptors that reach a worker: each a clear error, the Manager intact -----------


def tampered(data: bytes, **changes: object) -> bytes:
    """A pickled buffer with descriptor fields changed and its checksum made valid again."""
    rebuild, (raw,) = _reduce_of(data)
    desc = Descriptor.from_bytes(raw)._replace(**changes)
    return pickle.dumps(_Rebuild(rebuild, desc.to_bytes()))


class _Rebuild:
    def __init__(self, fn, raw) -> None:
        self.fn, self.raw = fn, raw

    def __reduce__(self):
        return (self.fn, (self.raw,))


def _reduce_of(data: bytes):
    """(rebuild function, (descriptor bytes,)) from a pickled buffer, without unpickling it."""
    captured = {}

    class Catch(pickle.Unpickler):
        def find_class(self, module, name):
            fn = super().find_class(module, name)
            if name == "rebuild_buffer":

                def catch(raw):
                    captured["raw"] = raw
                    return None

                captured["fn"] = fn
                return catch
            return fn

    Catch(io.BytesIO(data)).load()
    return captured["fn"], (captured["raw"],)


def unpickle_twice_and_touch(data, results) -> None:
    first = pickle.loads(data)  # claims the lease and maps the allocation
    try:
        pickle.loads(data)
    except mp.DescriptorError as exc:
        results.put(("same process", str(exc), float(first.numpy().sum())))
    first.release()
    time.sleep(0.5)  # the release reaches the owner; the mapping stays cached here
    stale = pickle.loads(data)  # mapping cached: claimed asynchronously, refused by the owner
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            stale.numpy()
        except mp.DescriptorError as exc:
            results.put(("refused", str(exc), None))
            return
        time.sleep(0.01)
    results.put(("accepted", None, None))


@pytest.mark.parametrize("cut", [1, 50, 200])
def test_truncated_descriptor_in_a_worker(manager, reap, cut) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    data = pickle.dumps(buf)
    _, (raw,) = _reduce_of(data)
    bad = pickle.dumps(_Rebuild(_reduce_of(data)[0], raw[:-cut]))
    kind, message = recv(run_guarded(reap, w_unpickle_and_sum, bad))
    assert kind == "DescriptorError" and ("truncated" in message or "corrupt" in message)
    assert_intact(manager, reap)


@pytest.mark.parametrize("where", [0, 10, 40, -5])
def test_corrupted_descriptor_in_a_worker(manager, reap, where) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    fn, (raw,) = _reduce_of(pickle.dumps(buf))
    flipped = bytearray(raw)
    flipped[where] ^= 0x5A
    kind, message = recv(run_guarded(reap, w_unpickle_and_sum, pickle.dumps(_Rebuild(fn, bytes(flipped)))))
    assert kind == "DescriptorError"
    assert "corrupt" in message or "magic" in message
    assert_intact(manager, reap)


def test_descriptor_naming_another_manager(manager, reap) -> None:
    with mp.Manager() as other:
        theirs = other.full((16,), 1.0, "float32", device="cpu")
        mine = manager.full((16,), 3.0, "float32", device="cpu")
        # Our descriptor, pointed at the other Manager's socket (checksum made valid again).
        bad = tampered(pickle.dumps(mine), address=other._owner.address)
        kind, message = recv(run_guarded(reap, w_unpickle_and_sum, bad))
        assert kind == "DescriptorError" and "another Manager" in message
        assert_intact(other, reap)
        theirs.release()
    assert_intact(manager, reap)


def test_descriptor_for_a_lease_that_was_never_taken(manager, reap) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    data = pickle.dumps(buf)
    _, (raw,) = _reduce_of(data)
    lease = Descriptor.from_bytes(raw).lease_id
    kind, message = recv(run_guarded(reap, w_unpickle_and_sum, tampered(data, lease_id=lease + 1000)))
    assert kind == "DescriptorError" and "unknown" in message
    assert recv(run_guarded(reap, w_unpickle_and_sum, data)) == ("ok", 16.0)  # the real one still works
    assert_intact(manager, reap)


def test_descriptor_with_a_view_past_its_allocation(manager, reap) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    data = tampered(pickle.dumps(buf), offset=mp.GRANULARITY - 8)
    kind, message = recv(run_guarded(reap, w_unpickle_and_sum, data))
    assert kind == "DescriptorError" and "of a 2097152-byte allocation" in message
    assert_intact(manager, reap)


def test_descriptor_unpickled_twice_is_refused(manager, reap) -> None:
    buf = manager.full((4,), 1.0, device="cpu")
    data = pickle.dumps(buf)
    results = mp.Queue()
    start(reap, unpickle_bytes, data, results)
    assert results.get(timeout=30) == ("ok", 4.0)
    start(reap, unpickle_bytes, data, results)
    kind, message = results.get(timeout=30)
    assert kind == "DescriptorError" and "unpickled once" in message


def test_a_descriptor_unpickled_twice_in_one_process(manager, reap) -> None:
    buf = manager.full((4,), 1.0, device="cpu")
    results = mp.Queue()
    start(reap, unpickle_twice_and_touch, pickle.dumps(buf), results)
    kind, message, first_sum = results.get(timeout=30)
    assert kind == "same process" and "unpickled once" in message
    assert first_sum == 4.0  # the legitimate copy is unaffected
    kind, message, _ = results.get(timeout=30)
    assert kind == "refused" and "unknown" in message
    wait_until(lambda: manager.stats()["leases"] == 0)


def test_descriptor_from_a_closed_manager(reap) -> None:
    with mp.Manager(release_timeout=0.2) as m:
        data = pickle.dumps(m.zeros((4,), device="cpu"))
        with pytest.warns(mp.LeakWarning):
            m.shutdown()
    results = mp.Queue()
    start(reap, unpickle_bytes, data, results)
    kind, message = results.get(timeout=30)
    assert kind == "OwnerGoneError" and "exited or shut" in message
