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
  and ``copyreg`` (``pickle``, cloudpickle, ``copy``): the reducers here,
  installed by :func:`register_reducers`, which the places a process's
  Buffers come from call before they make one: the Manager's allocations
  (``gpushare._manager``) and :func:`attach_buffer` here (every buffer that
  arrives). They are registered rather than named by ``Buffer.__reduce__``
  so that :mod:`gpushare._buffer` does not import this module, which imports
  it, and so that ForkingPickler and plain pickle can differ (Ray's form).
* gpushare's Queue builds the same pickle itself in ``put()``
  (:func:`~gpushare._sharing.queue_pickle`: a fixed head, the descriptor, a
  fixed tail; it imports :mod:`gpushare._sharing`, the sending side, and not
  this module, which loads the lifetime service's consumer side) and its
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

What a pickling costs (a lease and a ready event, never a new description)
is :mod:`gpushare._sharing`'s: :func:`share_bytes` and :func:`descriptor_of`
live there. Pickling a *released* buffer raises
:class:`~gpushare._errors.BufferReleasedError` at the sender.
"""

from __future__ import annotations

import copyreg
import sys
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _seams
from ._buffer import Buffer
from ._descriptor import Descriptor, _dtype
from ._lifetime import attach
from ._sharing import QUEUE_DATA_AT, QUEUE_HEAD, QUEUE_LENGTH, QUEUE_TAIL, descriptor_of, share_bytes
from ._sharing import queue_pickle as queue_pickle

__all__ = [
    "attach_buffer",
    "descriptor_of",
    "from_queue_pickle",
    "queue_pickle",
    "rebuild_buffer",
    "reduce_buffer",
    "reduce_pickled",
    "register_reducers",
    "share_bytes",
]


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


_registered = False  # register_reducers() ran in this process


def register_reducers() -> None:
    """Install how a Buffer pickles, once per process (later calls do nothing): ``copyreg``
    (pickle, cloudpickle and so Ray, ``copy``) and multiprocessing's ForkingPickler
    (Pipes, Process arguments), which looks ``Buffer`` up in its own table first.

    Called before a process makes its first Buffer, by the two places Buffers come
    from: the Manager's allocations and :func:`attach_buffer` (arrivals)."""
    global _registered
    if not _registered:
        copyreg.pickle(Buffer, reduce_pickled)
        ForkingPickler.register(Buffer, reduce_buffer)
        _registered = True


def rebuild_buffer(data: bytes) -> Buffer:
    """Unpickling side: parse and check the descriptor, claim its lease, map it."""
    return attach_buffer(Descriptor.from_bytes(data))


def attach_buffer(desc: Descriptor) -> Buffer:
    """The Buffer a checked descriptor names, mapped in this process under its lease."""
    if not _registered:  # the first buffer this process receives: it may pass it on
        register_reducers()
    return Buffer(attach(desc), desc.offset, desc.shape, _dtype(desc.dtype))  # a cached dtype


# -- the Queue's copy of the wire form (built by gpushare._sharing.queue_pickle, which names
# REBUILD: this module's rebuild_buffer) ---------------------------------------------------
def from_queue_pickle(data: bytes) -> Buffer | None:
    """The Buffer ``data`` is the :func:`~gpushare._sharing.queue_pickle` of, or None for any other pickle."""
    if data.startswith(QUEUE_HEAD) and data.endswith(QUEUE_TAIL):
        (length,) = QUEUE_LENGTH.unpack_from(data, len(QUEUE_HEAD))
        if QUEUE_DATA_AT + length + len(QUEUE_TAIL) == len(data):
            return rebuild_buffer(data[QUEUE_DATA_AT : QUEUE_DATA_AT + length])
    return None
