"""The wire form of a Buffer: its descriptor under a new lease, and how it is rebuilt.

A buffer leaving a process -- down a Pipe, as a Process argument, through
plain ``pickle`` or cloudpickle, on a gpushare Queue -- travels in one form:
the pickle of ``(rebuild_buffer, (descriptor_bytes,))``. Pickling takes one
lease at the owner (:func:`share_bytes`); :func:`rebuild_buffer` parses and
checks the descriptor in the receiving process, claims the lease and maps
the memory (or finds it, when that process is the owner). No pointer and no
live driver object is ever pickled.

How each path produces and reads that form:

* ForkingPickler (Pipes, Process arguments, multiprocessing's own queues)
  and ``copyreg`` (``pickle``, cloudpickle, ``copy``): reducers registered
  here, at import. They are registered rather than named by ``Buffer.__reduce__``
  so that :mod:`gpushare._buffer` does not import this module, which imports it.
* gpushare's Queue builds the same pickle itself in ``put()``
  (:func:`queue_pickle`: a fixed head, the descriptor, a fixed tail) and its
  ``get()`` reads the descriptor straight out of those bytes
  (:func:`from_queue_pickle`) instead of running the unpickler, which would
  look ``rebuild_buffer`` up by name -- an import on every load, which cost
  more than the rest of unpickling a buffer (dev/performance.md; the
  `handoff_*` and `throughput` benchmark scenarios time the Queue). The bytes are still an
  ordinary pickle: any unpickler reads them.
* Ray is the one other form (:mod:`gpushare.ray`, reached through the
  ``ray_form`` seam): a Ray object may be read many times, by many processes,
  on any node, so it carries the owner's node, its Ray node and its authkey,
  and its lease stays unclaimed while readers lease through it. A descriptor
  read once by one process needs none of that.

A pickling costs a lease and a ready event, never a new description: the
sharer keeps one descriptor template per buffer view on the Memory
(:class:`~gpushare._descriptor.Template`) and fills in only the lease id and
the event. Each pickling still takes its own lease (each receiver holds one)
and records its own ready event: gpushare cannot know whether the producer
queued more work on the stream since the last put, and a write between two
puts must be ordered before the second receiver reads.

Pickling a *released* buffer raises :class:`~gpushare._errors.BufferReleasedError`
at the sender, where the mistake is, instead of sending something the
receiver cannot use.
"""

from __future__ import annotations

import copyreg
import struct
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _seams
from ._buffer import Buffer, byte_offset, memory_of
from ._descriptor import Descriptor, _dtype

__all__ = [
    "attach_buffer",
    "descriptor_of",
    "from_queue_pickle",
    "queue_pickle",
    "rebuild_buffer",
    "reduce_buffer",
    "reduce_pickled",
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


def reduce_buffer(buf: Buffer) -> tuple[Any, tuple[bytes]]:
    """``(rebuild_buffer, (descriptor bytes,))`` with a new lease."""
    return (rebuild_buffer, (share_bytes(buf),))


def reduce_pickled(buf: Buffer) -> tuple[Any, tuple[Any, ...]]:
    """The ``copyreg`` reducer: plain pickle and cloudpickle, which is what Ray serializes
    with. Inside a connected Ray process the buffer takes Ray's form (see the module
    docstring). multiprocessing's ForkingPickler does not come here (its own table names
    :func:`reduce_buffer`)."""
    ray = sys.modules.get("ray")
    ray_form = _seams.ray_form()
    if ray_form is not None and ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return ray_form(buf)
    return reduce_buffer(buf)


def rebuild_buffer(data: bytes) -> Buffer:
    """Unpickling side: parse and check the descriptor, claim its lease, map it."""
    return attach_buffer(Descriptor.from_bytes(data))


_attach: Callable[[Descriptor], Any] | None = None  # _lifetime.attach, imported on first use


def attach_buffer(desc: Descriptor) -> Buffer:
    """The Buffer a checked descriptor names, mapped in this process under its lease."""
    global _attach
    attach = _attach
    if attach is None:  # the lifetime service loads with the first buffer that arrives
        from ._lifetime import attach as loaded

        attach = _attach = loaded
    return Buffer(attach(desc), desc.offset, desc.shape, _dtype(desc.dtype))  # a cached dtype


# -- the Queue's copy of the wire form ------------------------------------------------------
# Protocol 5 (PROTO), the global rebuild_buffer (two SHORT_BINUNICODE, STACK_GLOBAL), the
# descriptor (BINBYTES, 4-byte length), then TUPLE1, REDUCE, STOP. No frame, no memo:
# both are optional to every unpickler.
_NAME = (__name__.encode(), b"rebuild_buffer")
_QUEUE_HEAD = b"\x80\x05" + b"".join(b"\x8c" + bytes([len(part)]) + part for part in _NAME) + b"\x93B"
_QUEUE_TAIL = b"\x85R."
_LENGTH = struct.Struct("<I")
_DATA_AT = len(_QUEUE_HEAD) + _LENGTH.size


def queue_pickle(buf: Buffer) -> bytes:
    """The pickle of ``reduce_buffer(buf)``, built directly (a new lease, like any pickling)."""
    data = share_bytes(buf)
    return _QUEUE_HEAD + _LENGTH.pack(len(data)) + data + _QUEUE_TAIL


def from_queue_pickle(data: bytes) -> Buffer | None:
    """The Buffer ``data`` is the :func:`queue_pickle` of, or None for any other pickle."""
    if data.startswith(_QUEUE_HEAD) and data.endswith(_QUEUE_TAIL):
        (length,) = _LENGTH.unpack_from(data, len(_QUEUE_HEAD))
        if _DATA_AT + length + len(_QUEUE_TAIL) == len(data):
            return rebuild_buffer(data[_DATA_AT : _DATA_AT + length])
    return None


copyreg.pickle(Buffer, reduce_pickled)  # pickle, cloudpickle (Ray), copy
ForkingPickler.register(Buffer, reduce_buffer)  # and by name for multiprocessing's own pickler
