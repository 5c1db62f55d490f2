"""Descriptor bytes: round trip, and every kind of corruption is a DescriptorError."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpushare as mp
from gpushare._descriptor import Descriptor


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
    from gpushare._reduction import rebuild_buffer

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
