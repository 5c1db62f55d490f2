"""The sending side of a Buffer's wire form: its descriptor under a new lease.

Every pickling of a buffer comes here (:mod:`gpushare._reduction` explains the
form and how each path reads it): :func:`share_bytes` takes one lease at the
owner and fills the buffer's descriptor template with it, and
:func:`queue_pickle` wraps those bytes in the pickle gpushare's Queue writes.
This module names neither the lifetime service nor the reducers, so a process
that only puts buffers on a queue (or only plain items: the Queue imports this
module) loads no more than the Buffer and its descriptor.

A pickling costs a lease and a ready event, never a new description: the
sharer keeps one descriptor template per buffer view on the Memory
(:class:`~gpushare._descriptor.Template`) and fills in only the lease id and
the event. Each pickling still takes its own lease (each receiver holds one)
and records its own ready event: gpushare cannot know whether the producer
queued more work on the stream since the last put, and a write between two
puts must be ordered before the second receiver reads.

Sharing a *released* buffer raises :class:`~gpushare._errors.BufferReleasedError`
at the sender, where the mistake is, instead of sending something the
receiver cannot use.
"""

from __future__ import annotations

import struct

from ._buffer import Buffer, byte_offset, memory_of
from ._descriptor import Descriptor

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "QUEUE_DATA_AT",
    "QUEUE_HEAD",
    "QUEUE_LENGTH",
    "QUEUE_TAIL",
    "REBUILD",
    "descriptor_of",
    "queue_pickle",
    "share_bytes",
]


def descriptor_of(buf: Buffer) -> Descriptor:
    """Take a lease on ``buf`` and describe it (one call per receiver)."""
    buf._check()
    memory = memory_of(buf)
    lease_id, event, handle = memory.source.share(memory)
    return _describe(buf, memory, lease_id, event, handle)


def _describe(buf: Buffer, memory: Any, lease_id: int, event: bytes, handle: bytes) -> Descriptor:
    return Descriptor(
        backend=memory.backend.name,
        owner_token=memory.owner_token,
        address=memory.address,
        alloc_id=memory.alloc_id,
        generation=memory.generation,
        lease_id=lease_id,
        alloc_nbytes=memory.alloc_nbytes,
        offset=byte_offset(buf),
        device_uuid=memory.device_uuid,
        handle=handle,
        dtype=buf.dtype.str,
        shape=buf.shape,
        event=event,
    )


def share_bytes(buf: Buffer) -> bytes:
    """The descriptor bytes of ``buf`` under a new lease: the hot path of every put."""
    buf._check()
    memory = memory_of(buf)
    lease_id, event, handle = memory.source.share(memory)
    # The dtype object hashes faster than its .str; the handle is in the key because a
    # host allocation's stays, but a CUDA one is exported at the first share.
    key = (byte_offset(buf), buf.shape, buf.dtype, handle)
    templates = memory.templates
    if templates is None:
        templates = memory.templates = {}
    template = templates.get(key)
    if template is None:
        template = templates[key] = _describe(buf, memory, 0, b"", handle).template()
    return template.fill(lease_id, event)


# -- the Queue's copy of the wire form ------------------------------------------------------
#: The function a buffer's pickle names: gpushare._reduction.rebuild_buffer (that module checks it).
REBUILD = ("gpushare._reduction", "rebuild_buffer")
# Protocol 5 (PROTO), the global REBUILD (two SHORT_BINUNICODE, STACK_GLOBAL), the
# descriptor (BINBYTES, 4-byte length), then TUPLE1, REDUCE, STOP. No frame, no memo:
# both are optional to every unpickler. gpushare._reduction reads it back (from_queue_pickle).
QUEUE_HEAD = b"\x80\x05" + b"".join(b"\x8c" + bytes([len(p)]) + p for p in (n.encode() for n in REBUILD)) + b"\x93B"
QUEUE_TAIL = b"\x85R."
QUEUE_LENGTH = struct.Struct("<I")
QUEUE_DATA_AT = len(QUEUE_HEAD) + QUEUE_LENGTH.size


def queue_pickle(buf: Buffer) -> bytes:
    """The pickle of ``reduce_buffer(buf)``, built directly (a new lease, like any pickling)."""
    data = share_bytes(buf)
    return QUEUE_HEAD + QUEUE_LENGTH.pack(len(data)) + data + QUEUE_TAIL
