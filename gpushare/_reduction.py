"""Reducers: Buffer -> descriptor bytes -> Buffer.

Pickling a buffer (through multiprocessing's ForkingPickler, plain
``pickle`` or cloudpickle: all of them honour ``__reduce__``) takes one
lease at the owner and produces ``(rebuild_buffer, (descriptor_bytes,))``.
No pointer and no live driver object is ever pickled: the descriptor
names the memory, and :func:`rebuild_buffer` maps it again in the
receiving process (or finds it, when that process is the owner).

Pickling a *released* buffer raises
:class:`~gpushare._errors.BufferReleasedError` at the sender, where the
mistake is, instead of sending something the receiver cannot use.
"""

from __future__ import annotations

import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _lifetime
from ._buffer import Buffer
from ._descriptor import Descriptor

__all__ = ["descriptor_of", "rebuild_buffer", "reduce_buffer", "reduce_pickled"]


def descriptor_of(buf: Buffer) -> Descriptor:
    """Take a lease on ``buf`` and describe it (one call per receiver)."""
    buf._check()
    memory = buf._memory
    lease_id, event = memory.source.share(memory)
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
    return (rebuild_buffer, (descriptor_of(buf).to_bytes(),))


def reduce_pickled(buf: Buffer) -> tuple[Any, tuple[Any, ...]]:
    """``Buffer.__reduce__``: plain pickle and cloudpickle, which is what Ray serializes
    with. Inside a connected Ray process the buffer takes Ray's form (see
    :mod:`gpushare.ray`): readable many times, on any node. multiprocessing's
    ForkingPickler does not come here (its dispatch table calls :func:`reduce_buffer`)."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        from .ray import reduce_for_ray

        return reduce_for_ray(buf)
    return reduce_buffer(buf)


def rebuild_buffer(data: bytes) -> Buffer:
    """Unpickling side: parse and check the descriptor, claim its lease, map it."""
    return _lifetime.attach(Descriptor.from_bytes(data))


ForkingPickler.register(Buffer, reduce_buffer)
