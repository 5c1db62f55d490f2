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

Pickling a *released* buffer raises
:class:`~gpushare._errors.BufferReleasedError` at the sender, where the
mistake is, instead of sending something the receiver cannot use.
"""

from __future__ import annotations

import copyreg
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from . import _lifetime
from ._buffer import Buffer
from ._descriptor import Descriptor

__all__ = ["descriptor_of", "rebuild_buffer", "reduce_buffer"]


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


def rebuild_buffer(data: bytes) -> Buffer:
    """Unpickling side: parse and check the descriptor, claim its lease, map it."""
    desc = Descriptor.from_bytes(data)
    memory = _lifetime.attach(desc)
    return Buffer(memory, desc.offset, desc.shape, np.dtype(desc.dtype))


copyreg.pickle(Buffer, reduce_buffer)  # pickle, cloudpickle, copy
ForkingPickler.register(Buffer, reduce_buffer)  # and by name for multiprocessing's own pickler
