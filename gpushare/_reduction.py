"""Reducers: Buffer -> descriptor bytes -> Buffer.

Pickling a buffer (through multiprocessing's ForkingPickler, plain
``pickle`` or cloudpickle: all of them consult :mod:`copyreg`'s dispatch
table, where this module registers the reducer) takes one lease at the
owner and produces ``(rebuild_buffer, (descriptor_bytes,))``. The reducer
is registered from here rather than named by ``Buffer.__reduce__`` so that
:mod:`gpushare._buffer` does not import this module, which imports it.
No pointer and no live driver object is ever pickled: the descriptor
names the memory, and :func:`rebuild_buffer` maps it again in the
receiving process (or finds it, when that process is the owner).

A pickling costs a lease and a ready event, never a new description: the
sharer keeps one descriptor template per buffer view on the Memory
(:class:`~gpushare._descriptor.Template`) and fills in only the lease id
and the event, so putting one buffer on N queues (or N times on one)
builds its descriptor once. Each pickling still takes its own lease (each
receiver holds one) and records its own ready event: gpushare cannot know
whether the producer queued more work on the stream since the last put,
and a write between two puts must be ordered before the second receiver
reads. Recording is cheap (a driver call; nothing when the stream is idle,
see ``_lifetime._ReadyEvents``); what is not repeated is the Python that
describes the buffer.

Pickling a *released* buffer raises
:class:`~gpushare._errors.BufferReleasedError` at the sender, where the
mistake is, instead of sending something the receiver cannot use.
"""

from __future__ import annotations

import copyreg
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _lifetime
from ._buffer import Buffer
from ._descriptor import Descriptor, _dtype

__all__ = ["attach_buffer", "descriptor_of", "rebuild_buffer", "reduce_buffer", "reduce_pickled", "share_bytes"]


def descriptor_of(buf: Buffer) -> Descriptor:
    """Take a lease on ``buf`` and describe it (one call per receiver)."""
    buf._check()
    memory = buf._memory
    lease_id, event = memory.source.share(memory)
    return _describe(buf, memory, lease_id, event)


def _describe(buf: Buffer, memory: Any, lease_id: int, event: bytes) -> Descriptor:
    return Descriptor(
        backend=memory.backend.name,
        owner_token=memory.owner_token,
        address=memory.address,
        alloc_id=memory.alloc_id,
        generation=memory.generation,
        lease_id=lease_id,
        alloc_nbytes=memory.alloc_nbytes,
        offset=buf._offset,
        device_uuid=memory.device_uuid,
        handle=memory.handle,
        dtype=buf.dtype.str,
        shape=buf.shape,
        event=event,
    )


def reduce_buffer(buf: Buffer) -> tuple[Any, tuple[bytes]]:
    """``(rebuild_buffer, (descriptor bytes,))`` with a new lease."""
    return (rebuild_buffer, (share_bytes(buf),))


def share_bytes(buf: Buffer) -> bytes:
    """The descriptor bytes of ``buf`` under a new lease: the hot path of every put
    (gpushare's queues send them as they are; see :mod:`gpushare._queues`)."""
    buf._check()
    memory = buf._memory
    lease_id, event = memory.source.share(memory)  # sets memory.handle on the first share
    key = (buf._offset, buf._shape, buf._dtype, memory.handle)  # the dtype hashes faster than its .str
    templates = memory.templates
    if templates is None:
        templates = memory.templates = {}
    template = templates.get(key)
    if template is None:
        template = templates[key] = _describe(buf, memory, 0, b"").template()
    return template.fill(lease_id, event)


# Ray's form of a buffer (gpushare.ray.reduce_for_ray), handed down by the facade so
# that this layer does not import the one above it.
ray_form: Callable[[Buffer], tuple[Any, tuple[Any, ...]]] | None = None


def reduce_pickled(buf: Buffer) -> tuple[Any, tuple[Any, ...]]:
    """The ``copyreg`` reducer: plain pickle and cloudpickle, which is what Ray serializes
    with. Inside a connected Ray process the buffer takes Ray's form (see
    :mod:`gpushare.ray`): readable many times, on any node. multiprocessing's
    ForkingPickler does not come here (its own table names :func:`reduce_buffer`)."""
    ray = sys.modules.get("ray")
    if ray_form is not None and ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return ray_form(buf)
    return reduce_buffer(buf)


def rebuild_buffer(data: bytes) -> Buffer:
    """Unpickling side: parse and check the descriptor, claim its lease, map it."""
    return attach_buffer(Descriptor.from_bytes(data))


def attach_buffer(desc: Descriptor) -> Buffer:
    """The Buffer a checked descriptor names, mapped in this process under its lease."""
    memory = _lifetime.attach(desc)
    return Buffer(memory, desc.offset, desc.shape, _dtype(desc.dtype))  # a cached dtype


copyreg.pickle(Buffer, reduce_pickled)  # pickle, cloudpickle (Ray), copy
ForkingPickler.register(Buffer, reduce_buffer)  # and by name for multiprocessing's own pickler
