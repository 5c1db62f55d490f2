"""Memory and its descriptor: this process's reference to one allocation, and the bytes that name a view of it.

* :class:`Memory` -- this process's one reference to one allocation incarnation. The
  lifetime service (:mod:`gpushare._lifetime`) makes one for each reference it hands out
  (the owner's own, a lease claimed from the owner, or a lease the owner holds for itself);
  :class:`~gpushare._buffer.Buffer` objects view it, each taking a count, and when the
  last goes the Memory gives the reference back through its *source*. It knows the
  allocation's address *in this process*, the backend that maps it, and, for CUDA memory
  that arrived from another process, the producer's ready event.
* :class:`Descriptor` -- the small immutable value a shared buffer travels as: it names
  memory, never carries it. :meth:`Descriptor.from_bytes` checks every field and raises
  DescriptorError (fields: dev/design-notes.md, "Descriptors").
* :class:`Template` -- a descriptor's bytes with the lease id and the ready event left
  open, kept per buffer view in ``Memory.templates``: each pickling patches only those two.

Descriptor wire form::

    magic "GPSH" | version u8 | backend u8 | flags u16
    owner token (16 bytes) | alloc id u64 | generation u32 | lease id u64
    alloc size u64 | offset u64 | device uuid (16 bytes)
    length-prefixed: owner address, backend handle, dtype string, ready event (64 bytes or empty)
    ndim u8, shape i64 * ndim | crc32 of everything before it, u32

This module sits below both the buffers and the lifetime service, so neither imports the
other's layer the wrong way, and it imports nothing of gpushare but the errors: waiting on
a ready event goes through the Memory's backend (a CUDA backend), so host memory never
loads the CUDA layer.
"""

from __future__ import annotations

import math
import struct
import zlib
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ._errors import DescriptorError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BACKEND_CODES", "Descriptor", "Memory", "Source", "Template", "descriptor_key", "descriptor_layout"]


class Source(Protocol):
    """What a Memory's kind of reference means (owner's, leased, ...)."""

    def drop(self, memory: Memory) -> None: ...

    def share(self, memory: Memory) -> tuple[int, bytes, bytes]:
        """A new lease for one receiver: (lease id, ready event, handle)."""
        ...

    def check(self, memory: Memory) -> None: ...

    @property
    def authkey(self) -> bytes:
        """The owner's authkey (a Ray object carries it to readers outside the process tree)."""
        ...


class Memory:
    """This process's one reference to one allocation incarnation."""

    __slots__ = (
        "_refs",
        "address",
        "alloc_id",
        "alloc_nbytes",
        "backend",
        "base",
        "device",
        "device_uuid",
        "event",
        "exit_release",
        "generation",
        "handle",
        "native",
        "owner_token",
        "pending",
        "source",
        "templates",
    )

    # Every caller passes the arguments by position, in this order: a consumer makes one
    # Memory per arriving buffer, and a keyword call costs more (dev/performance.md,
    # "Hot-path choices").
    def __init__(
        self,
        backend: Any,
        base: int,
        alloc_nbytes: int,
        device: int | None,
        device_uuid: bytes,
        owner_token: bytes,
        address: str,
        alloc_id: int,
        generation: int,
        handle: bytes,
        native: Any,
        source: Source,
        event: Any = None,
        exit_release: bool = True,
    ) -> None:
        self.backend = backend
        self.base = base
        self.alloc_nbytes = alloc_nbytes
        self.device = device
        self.device_uuid = device_uuid
        self.owner_token = owner_token
        self.address = address
        self.alloc_id = alloc_id
        self.generation = generation
        self.handle = handle
        self.native = native  # host: the mmap, kept alive while any Buffer or NumPy view uses it
        self.source = source
        # Consumer side of CUDA buffers: the producer's ready event (opened once per
        # process) and whether this arrival has not been waited for on the host yet.
        self.event = event
        self.pending = event is not None
        # Sharer side: descriptor templates per (offset, shape, dtype, handle) view,
        # filled with a lease id and a ready event at each pickling (_buffer.share_bytes),
        # and per (offset, shape, dtype) the C share's plan (_buffer._plan_share).
        self.templates: dict[tuple[Any, ...], Any] | None = None
        # Whether Buffers of this memory must also be released by the interpreter's exit
        # hook (see gpushare._buffer): false for a lease claimed over a link.
        self.exit_release = exit_release
        # The count of Buffers, kept as a list (one entry per Buffer, the first True):
        # Buffers are dropped inside the garbage collector, on any thread, where a lock
        # could deadlock; list.append and list.pop are each one atomic step under the
        # GIL, so exactly one drop -- the one that pops the first entry -- is the last.
        # It is also cheaper than a lock and an int (dev/performance.md, "Hot-path choices").
        self._refs: list[bool] = []

    def arm(self, event: Any, pending: bool) -> None:
        """Wait on ``event`` before the next use (``pending``), or on nothing: a ring slot
        arriving again, with its publication's event (the ring reuses one Memory per slot)."""
        self.event = event
        self.pending = pending

    def ready(self) -> None:
        """Block until the producer's work queued before it shared this buffer is done."""
        if self.pending:
            assert self.device is not None  # events exist only for CUDA memory
            self.backend.event_synchronize(self.event, self.device)
            self.pending = False

    def order_stream(self, stream: int) -> None:
        """Make ``stream`` (an int handle in this process) wait for the producer's work."""
        if self.pending:
            assert self.device is not None
            self.backend.stream_wait_event(stream, self.event, self.device)

    def acquire(self) -> None:
        """Count one more Buffer. Made while another Buffer still holds a count (the
        first by whoever made this Memory), so the list is empty only for the first."""
        refs = self._refs
        refs.append(not refs)

    def drop_one(self) -> None:
        if self._refs.pop():
            self.source.drop(self)


# -- descriptors: how a view of a Memory is named to another process ------------------------------

MAGIC = b"GPSH"
VERSION = 1
BACKEND_CODES = {"host": 1, "cuda_ipc": 2, "cuda_vmm": 3, "cuda_pool": 4}
_BACKEND_NAMES = {code: name for name, code in BACKEND_CODES.items()}
_HEAD = struct.Struct("<4sBBH16sQIQQQ16s")
_CRC = struct.Struct("<I")
_LENGTH = struct.Struct("<H")
_LEASE = struct.Struct("<Q")
_LEASE_AT = struct.calcsize("<4sBBH16sQI")  # where the lease id sits in the head
_MIN_SIZE = _HEAD.size + 4 * _LENGTH.size + 1 + _CRC.size
_PARSED_MAX = 256
_MAX_NDIM = 32
_MAX_FIELD = 4096


#: The dtypes NumPy lacks that torch and JAX share, by name, with their DLPack type codes. NumPy
#: knows them once ml_dtypes (the package JAX uses) is imported; gpushare imports it when one is
#: asked for. A descriptor names them by name (their ``dtype.str`` is an opaque ``'<V2'``).
EXTENSION_DTYPES = {
    "bfloat16": 4,
    "float8_e4m3fn": 10,
    "float8_e4m3fnuz": 11,
    "float8_e5m2": 12,
    "float8_e5m2fnuz": 13,
    "float8_e8m0fnu": 14,
}


def _extension_dtype(dtype: object) -> np.dtype[Any] | None:
    """The ml_dtypes dtype ``dtype`` names (a name, or an ml_dtypes type), None if it names none
    of EXTENSION_DTYPES; a ValueError naming the fix where ml_dtypes is not installed."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None)
    if name not in EXTENSION_DTYPES:
        return None
    try:
        import ml_dtypes
    except ImportError:
        raise ValueError(
            f"dtype {name!r} needs the ml_dtypes package, which gives NumPy the dtypes torch and JAX share "
            "(bfloat16, the float8 kinds): pip install ml_dtypes"
        ) from None
    import numpy as np

    return np.dtype(getattr(ml_dtypes, name))


@lru_cache(maxsize=64)  # once per dtype: a pickled buffer asks, and dtype.name is built at each call
def dtype_text(dt: np.dtype[Any]) -> str:
    """How a descriptor names ``dt``: its ``str``, or its name for an ml_dtypes dtype."""
    return dt.name if dt.name in EXTENSION_DTYPES else dt.str


@lru_cache(maxsize=64)  # every arriving buffer asks; np.dtype(text) is slow (dev/performance.md, "Hot-path choices")
def _dtype(text: str) -> np.dtype[Any]:
    import numpy as np  # on the first descriptor of each dtype only (cached)

    try:
        return np.dtype(text)
    except TypeError:  # bfloat16 and friends, by name: NumPy knows them once ml_dtypes is imported
        try:
            dt = _extension_dtype(text)
        except ValueError as exc:
            raise TypeError(str(exc)) from None
        if dt is None:
            raise
        return dt


class Descriptor(NamedTuple):
    """What names one shared buffer; immutable, and cheap to build on the hot path."""

    backend: str
    owner_token: bytes
    address: str
    alloc_id: int
    generation: int
    lease_id: int
    alloc_nbytes: int
    offset: int
    device_uuid: bytes
    handle: bytes
    dtype: str
    shape: tuple[int, ...]
    event: bytes = b""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize

    def to_bytes(self) -> bytes:
        body = b"".join(self._parts())
        return body + _CRC.pack(zlib.crc32(body))

    def template(self) -> Template:
        """This descriptor's bytes with the lease id and the ready event left open: what
        a sharer keeps per buffer view, so each pickling only patches those two."""
        parts = self._parts()
        head, event_length, event = parts[0], parts[7], parts[8]
        assert event_length == _LENGTH.pack(len(event))
        return Template(head[:_LEASE_AT], head[_LEASE_AT + _LEASE.size :] + b"".join(parts[1:7]), b"".join(parts[9:]))

    def _parts(self) -> list[bytes]:
        address = self.address.encode()
        dtype = self.dtype.encode()
        parts = [
            _HEAD.pack(
                MAGIC,
                VERSION,
                BACKEND_CODES[self.backend],
                0,
                self.owner_token,
                self.alloc_id,
                self.generation,
                self.lease_id,
                self.alloc_nbytes,
                self.offset,
                self.device_uuid.ljust(16, b"\0"),
            )
        ]
        for field in (address, self.handle, dtype, self.event):
            parts.append(_LENGTH.pack(len(field)))
            parts.append(field)
        parts.append(struct.pack(f"<B{len(self.shape)}q", len(self.shape), *self.shape))
        return parts

    @classmethod
    def from_bytes(cls, data: object) -> Descriptor:
        """Parse and check ``data``. A receiver sees the same descriptor again and again
        with only the lease id (and the checksum) changed: those it parses once and
        keeps (bounded), checking only the checksum of later arrivals."""
        if type(data) is bytes and len(data) >= _MIN_SIZE:
            key = descriptor_key(data)
            known = _parsed.get(key)
            if known is not None and zlib.crc32(data[: -_CRC.size]) == _CRC.unpack_from(data, len(data) - 4)[0]:
                head, tail = known  # the fields before and after the lease id
                return tuple.__new__(cls, head + _LEASE.unpack_from(data, _LEASE_AT) + tail)
            desc = cls._parse(data)
            if len(_parsed) >= _PARSED_MAX:
                _parsed.clear()
            _parsed[key] = (desc[:5], desc[6:])
            return desc
        return cls._parse(data)

    @classmethod
    def _parse(cls, data: object) -> Descriptor:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DescriptorError(f"a buffer descriptor is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEAD.size + _CRC.size:
            raise DescriptorError(
                f"buffer descriptor truncated: {len(data)} bytes, a valid one has at least "
                f"{_HEAD.size + _CRC.size}; pass the whole pickled buffer"
            )
        if data[:4] != MAGIC:
            raise DescriptorError(
                "not a gpushare buffer descriptor (bad magic); the bytes were corrupted or are not ours"
            )
        body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
        if zlib.crc32(body) != crc:
            raise DescriptorError(
                "buffer descriptor is corrupt (checksum mismatch); it was altered in transit, send the buffer again"
            )
        (_, version, code, _flags, token, alloc_id, generation, lease_id, alloc_nbytes, offset, uuid) = (
            _HEAD.unpack_from(body)
        )
        if version != VERSION:
            raise DescriptorError(
                f"buffer descriptor version {version}, this gpushare reads version {VERSION}; "
                "run the same gpushare version in every process"
            )
        backend = _BACKEND_NAMES.get(code)
        if backend is None:
            raise DescriptorError(f"buffer descriptor names unknown backend code {code}")
        pos = _HEAD.size
        fields = []
        try:
            for _ in range(4):
                (length,) = _LENGTH.unpack_from(body, pos)
                pos += 2
                if length > _MAX_FIELD or pos + length > len(body):
                    raise DescriptorError("buffer descriptor has a field running past its end")
                fields.append(body[pos : pos + length])
                pos += length
            (ndim,) = struct.unpack_from("<B", body, pos)
            pos += 1
            if ndim > _MAX_NDIM:
                raise DescriptorError(f"buffer descriptor has {ndim} dimensions, at most {_MAX_NDIM} are valid")
            shape = struct.unpack_from(f"<{ndim}q", body, pos)
            pos += 8 * ndim
        except struct.error as exc:
            raise DescriptorError(f"buffer descriptor truncated ({exc})") from exc
        if pos != len(body):
            raise DescriptorError(f"buffer descriptor has {len(body) - pos} unexpected trailing bytes")
        try:
            address = fields[0].decode()
            dtype = _dtype(fields[2].decode())
        except (UnicodeDecodeError, TypeError) as exc:
            raise DescriptorError(f"buffer descriptor has an invalid field: {exc}") from exc
        if any(dim < 0 for dim in shape):
            raise DescriptorError(f"buffer descriptor has a negative dimension in shape {shape}")
        desc = cls(
            backend,
            token,
            address,
            alloc_id,
            generation,
            lease_id,
            alloc_nbytes,
            offset,
            uuid if backend != "host" else b"",
            fields[1],
            dtype_text(dtype),
            tuple(shape),
            fields[3],
        )
        if desc.offset + desc.nbytes > desc.alloc_nbytes:
            raise DescriptorError(
                f"buffer descriptor describes bytes {desc.offset}..{desc.offset + desc.nbytes} "
                f"of a {desc.alloc_nbytes}-byte allocation"
            )
        return desc


def descriptor_key(data: bytes) -> bytes:
    """A descriptor's bytes less its lease id and checksum: the same for every sharing of
    one view of one allocation (with one ready event)."""
    return data[:_LEASE_AT] + data[_LEASE_AT + _LEASE.size : -_CRC.size]


def descriptor_layout() -> tuple[int, int]:
    """Where the lease id sits in a descriptor, and a descriptor's least size (for the C arrival)."""
    return _LEASE_AT, _MIN_SIZE


# See Descriptor.from_bytes: per descriptor less its lease id, the fields around the lease id.
_parsed: dict[bytes, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}


class Template:
    """A descriptor's bytes with two holes: the lease id and the ready event.

    :meth:`fill` gives exactly what :meth:`Descriptor.to_bytes` would for
    the same descriptor with that lease id and event, for a join and a CRC
    instead of rebuilding every field.
    """

    __slots__ = ("_mid", "_no_event", "_post", "_pre")

    def __init__(self, pre: bytes, mid: bytes, post: bytes) -> None:
        self._pre = pre  # the head up to the lease id
        self._mid = mid  # the rest of the head, owner address, handle, dtype
        self._post = post  # the shape
        # From the lease id on, with no event: host memory, and CUDA memory whose stream was idle.
        self._no_event = mid + _LENGTH.pack(0) + post

    def parts(self) -> tuple[bytes, bytes, bytes, bytes]:
        """``(pre, mid, post, no_event)``: what :meth:`fill` joins (the C share joins them too)."""
        return self._pre, self._mid, self._post, self._no_event

    def fill(self, lease_id: int, event: bytes) -> bytes:
        if event:
            rest = b"".join((self._mid, _LENGTH.pack(len(event)), event, self._post))
        else:
            rest = self._no_event
        body = self._pre + _LEASE.pack(lease_id) + rest
        return body + _CRC.pack(zlib.crc32(body))
