"""The layout of a batch in a slot: the worker's SlotWriter, the trainer's SlotArray.

A worker's ``collate(samples, writer)`` places each array of a batch at the
next ``ALIGN``-byte boundary of the slot (:meth:`SlotWriter.empty`, or a
copy for arrays it made elsewhere) and :meth:`SlotWriter.layout` describes
the batch as plain values: its structure (dicts, lists, tuples,
namedtuples), each array as ``("array", offset, shape, dtype, tag)`` and
anything else as ``("value", v)``. That description travels as the ring
item's ``meta``; the trainer's :func:`build` turns it back into the same
structure with a :class:`SlotArray` per array, each holding the ring item
(so the slot) for as long as it, a view of it, or anything made from it
without a copy lives. Exceptions from workers travel as a picklable payload
(:func:`exception_payload`) and are raised again as their own type when
that can be rebuilt (:func:`rebuild_exception`).
"""

from __future__ import annotations

import math
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from ._buffer import Buffer, byte_offset, check_dtype, check_shape, memory_of, window
from ._errors import LoaderError

__all__ = [
    "ALIGN",
    "SlotArray",
    "SlotWriter",
    "align",
    "build",
    "default_collate",
    "exception_payload",
    "rebuild_exception",
]

ALIGN = 256  # every array in a slot starts on this boundary (enough for any dtype and for CUDA kernels)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------
# Worker side: writing a batch into a slot
# ---------------------------------------------------------------------------


class SlotWriter:
    """What ``collate(samples, writer)`` writes a batch with, in a worker.

    ``writer.empty(shape, dtype)`` returns a Buffer in the current slot (the
    next free, aligned part of it): write into it (``copy_from``, NumPy on
    the host backend, a GPU library through DLPack or
    ``__cuda_array_interface__``) and return it in the batch. Anything else
    array-like that ``collate`` returns is copied into the slot; plain
    Python values travel as they are. ``device`` is the slots' device
    (``"cpu"`` or a CUDA ordinal).
    """

    def __init__(self, manager: Any, slot: Buffer | None, device: int | str, backend: str | None) -> None:
        self._manager = manager
        self._slot = slot  # None: the first batch, laid out in scratch buffers to size the slots
        self._limit = slot.nbytes if slot is not None else None
        self.device = device
        self._backend = backend
        self.used = 0
        self._regions: dict[int, tuple[Buffer, int, str | None]] = {}

    def empty(self, shape: Any, dtype: Any = "float32", *, tag: str | None = None) -> Buffer:
        """An uninitialised array of ``shape`` and ``dtype`` in the slot (``tag``: for adapters)."""
        dims = check_shape(shape)
        dt = check_dtype(dtype)
        offset = align(self.used)
        end = offset + math.prod(dims) * dt.itemsize
        if self._slot is None:
            buf = self._manager.empty(dims, dt, self.device, backend=self._backend)
        else:
            if self._limit is not None and end > self._limit:
                raise LoaderError(
                    f"this batch needs more than the {self._limit} bytes of a slot (an array of {dims} {dt} "
                    f"would end at byte {end}); slots are sized from the first batch unless you pass "
                    "slot_bytes=: pass one large enough for the largest batch"
                )
            slot = self._slot
            buf = window(slot, offset, dims, dt)
        self.used = end
        self._regions[id(buf)] = (buf, offset, tag)
        return buf

    def put(self, array: Any, *, tag: str | None = None) -> Buffer:
        """Copy ``array`` (NumPy, array-like or a CUDA array) into the slot; return its Buffer there."""
        cai = getattr(array, "__cuda_array_interface__", None)
        if cai is not None:
            shape, dtype = tuple(cai["shape"]), np.dtype(cai["typestr"])
        else:
            array = np.asarray(array)
            shape, dtype = array.shape, array.dtype
        return self.empty(shape, dtype, tag=tag).copy_from(array)

    def layout(self, tree: Any) -> Any:
        """The batch's structure with each array replaced by ``("array", offset, shape, dtype, tag)``."""
        kind = type(tree)
        if isinstance(tree, Buffer):
            known = self._regions.get(id(tree))
            if known is None or known[0] is not tree:
                known = self._regions[id(self.put(tree))]
            buf, offset, tag = known
            return ("array", offset, buf.shape, buf.dtype.str, tag)
        if kind is dict:
            return ("dict", [(key, self.layout(value)) for key, value in tree.items()])
        if kind in (list, tuple):
            return (kind.__name__, [self.layout(value) for value in tree])
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
            return ("namedtuple", kind, [self.layout(value) for value in tree])
        if isinstance(tree, (np.ndarray, np.generic)) or (
            not isinstance(tree, (str, bytes)) and hasattr(tree, "__cuda_array_interface__")
        ):
            return self.layout(self.put(tree))
        return ("value", tree)

    def move_into(self, slot: Buffer) -> None:
        """First batch: copy the scratch arrays into ``slot`` at their offsets, then free them."""
        for buf, offset, _ in self._regions.values():
            target = window(slot, offset, buf.shape, buf.dtype)
            target.copy_from(buf)
            target.release()
            buf.release()
        self._regions.clear()

    def clear(self) -> None:
        """Drop this writer's views of the slot (before the slot is published)."""
        for buf, _, _ in self._regions.values():
            buf.release()
        self._regions.clear()
        self._slot = None


def _row(buf: Buffer, index: int, shape: tuple[int, ...]) -> Buffer:
    """Row ``index`` of a stacked array ``buf`` (a Buffer over the same memory)."""
    step = math.prod(shape) * buf.dtype.itemsize
    return window(buf, index * step, shape, buf.dtype)


def default_collate(samples: list[Any], writer: SlotWriter) -> Any:
    """Stack samples (arrays, numbers, or tuples/lists/dicts of them) into the slot.

    Arrays (NumPy, or CUDA arrays with ``__cuda_array_interface__``) of one
    shape and dtype become one array with a leading batch dimension;
    Python numbers an array of them; strings and other values a list.
    """
    first = samples[0]
    if isinstance(first, dict):
        return {key: default_collate([s[key] for s in samples], writer) for key in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(default_collate(list(field), writer) for field in zip(*samples, strict=True)))
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise ValueError("samples have different lengths; every sample of a batch must have the same structure")
        return type(first)(default_collate(list(field), writer) for field in zip(*samples, strict=True))
    if isinstance(first, bool) or isinstance(first, (int, float, complex, np.generic)):
        return writer.put(np.asarray(samples))
    cai = getattr(first, "__cuda_array_interface__", None)
    if cai is not None or isinstance(first, np.ndarray):
        shape = tuple(cai["shape"]) if cai is not None else first.shape
        dtype = np.dtype(cai["typestr"]) if cai is not None else first.dtype
        out = writer.empty((len(samples), *shape), dtype)
        if cai is None and out.device == "cpu":
            np.stack(samples, out=out.numpy())  # written in place, no extra copy
            return out
        for i, sample in enumerate(samples):
            s_shape = tuple(sample.__cuda_array_interface__["shape"]) if cai is not None else np.shape(sample)
            if s_shape != shape:
                raise ValueError(
                    f"sample {i} has shape {s_shape}, sample 0 has {shape}: samples of a batch must have one "
                    "shape to be stacked; pad them in the dataset, or pass collate= to lay the batch out yourself"
                )
            _row(out, i, shape).copy_from(sample)
        return out
    return list(samples)


# -- trainer side: the arrays of a batch ---------------------------------------


class SlotArray(Buffer):
    """An array of a batch from a :class:`SlotLoader`: a Buffer viewing its worker's slot.

    It holds the slot: the slot goes back to the worker when every
    SlotArray of the batch, every view of one, and everything made from
    one without a copy (NumPy arrays, DLPack and ``__cuda_array_interface__``
    tensors) is gone, or released. ``tag`` is what the worker's collate
    attached to this array (adapters use it, e.g. for dtypes NumPy lacks).
    """

    __slots__ = ("_hold", "tag")

    def __init__(self, base: Buffer, offset: int, shape: Any, dtype: Any, hold: Any, tag: str | None) -> None:
        super().__init__(memory_of(base), offset, shape, dtype)
        self._hold = hold  # (the ring item, the Manager): the slot and the memory's owner stay while we do
        self.tag = tag

    def view(self, dtype: object = None, shape: object = None) -> Buffer:
        plain = Buffer.view(self, dtype, shape)
        out = SlotArray(plain, byte_offset(plain), plain.shape, plain.dtype, self._hold, self.tag)
        plain.release()
        return out

    def numpy(self) -> np.ndarray[Any, Any]:
        if self.device == "cpu":
            self._check()
            return np.asarray(self)  # through __array_interface__: the array's base is this object
        return super().numpy()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.device != "cpu":
            raise AttributeError("device memory has no __array_interface__")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3}

    def release(self) -> None:
        """Release this array (and its hold on the slot). Idempotent."""
        super().release()
        self._hold = None

    def __repr__(self) -> str:
        state = "released" if self.released else self.backend
        return f"<gpushare.SlotArray shape={self.shape} dtype={self.dtype} device={self.device!r} {state}>"


def build(node: Any, item: Buffer, hold: Any, convert: Callable[[SlotArray], Any]) -> Any:
    kind = node[0]
    if kind == "array":
        _, offset, shape, dtype, tag = node
        return convert(SlotArray(item, byte_offset(item) + offset, shape, np.dtype(dtype), hold, tag))
    if kind == "value":
        return node[1]
    if kind == "dict":
        return {key: build(value, item, hold, convert) for key, value in node[1]}
    if kind == "namedtuple":
        return node[1](*(build(value, item, hold, convert) for value in node[2]))
    values = [build(value, item, hold, convert) for value in node[1]]
    return tuple(values) if kind == "tuple" else values


# -- exceptions from workers ----------------------------------------------------


def exception_payload(exc: BaseException, worker: int, seq: int) -> tuple[Any, str]:
    kind: Any = type(exc)
    try:
        pickle.loads(pickle.dumps(kind))
    except Exception:
        kind = None
    where = f"Caught {type(exc).__name__} in loader worker {worker} (pid {os.getpid()}) building batch {seq}"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return kind, f"{where}.\nOriginal traceback in the worker:\n{text}"


def rebuild_exception(payload: tuple[Any, str]) -> BaseException:
    kind, message = payload
    if kind is KeyError:  # KeyError's str() is the repr of its argument: keep the lines readable
        return KeyError(_Verbatim(message))
    if isinstance(kind, type) and issubclass(kind, BaseException):
        try:
            return kind(message)  # type: ignore[no-any-return]
        except Exception:
            pass
    return LoaderError(message)


class _Verbatim(str):
    """A message whose repr is itself (KeyError prints its argument's repr)."""

    def __repr__(self) -> str:
        return str(self)
