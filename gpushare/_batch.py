"""The layout of a batch in a slot: the worker's SlotWriter, the trainer's SlotArray.

- In the worker, ``collate(samples, writer)`` places each array at the next ``ALIGN``-byte
  boundary (:class:`SlotWriter`); :meth:`SlotWriter._layout` describes the batch as plain values,
  sent as the ring item's ``meta``.
- In the trainer, :func:`build` rebuilds the structure, a :class:`SlotArray` per array holding the item.
- CPU samples for a CUDA slot go through page-locked :class:`Staging` on the legacy default stream.
- Exceptions travel as :func:`exception_payload`, raised again by :func:`rebuild_exception`.
The layout's form and why staging: dev/design-notes.md, "The loader".
"""

from __future__ import annotations

import ctypes
import math
import os
import pickle
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._buffer import Buffer, HeldView, byte_offset, check_dtype, check_shape, memory_of, window
from ._errors import LoaderError

if TYPE_CHECKING:
    from ._types import DType, Shape

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


class Staging:
    """A worker's page-locked host memory for CPU samples bound for CUDA slots (see the module docstring).

    :meth:`write` streams bytes to device addresses through ``BUFFERS``
    areas of ``min(CHUNK, hint)`` bytes, used in turn; :meth:`flush` copies
    what the current area holds. Made on first use: a worker whose samples
    are made on the GPU never pins any host memory. The device calls are
    methods of their own (``_alloc``, ``_free``, ``_copy``, ``_record``,
    ``_wait``) so that the chunking can be checked with host memory.
    """

    BUFFERS = 2
    CHUNK = 4 << 20  # copies of 4 MiB run at the link's pace; 8 MiB per worker whatever the batch

    def __init__(self, device: int, chunk: int = CHUNK) -> None:
        self.device = device
        self.chunk = chunk
        self._areas: list[list[Any]] = [[0, 0, None] for _ in range(self.BUFFERS)]  # [ptr, nbytes, event]
        self._turn = 0
        self._fill = 0  # bytes written into the current area
        self._dst = 0  # the device address the current area's first byte goes to
        self._size = 0  # the areas' size, once made
        self.copies = 0  # host-to-device copies queued so far

    @classmethod
    def bytes_for(cls, slot_bytes: int) -> int:
        """The page-locked bytes a worker's staging holds with slots of ``slot_bytes`` (0: none yet)."""
        return cls.BUFFERS * min(cls.CHUNK, slot_bytes) if slot_bytes > 0 else 0

    @property
    def nbytes(self) -> int:
        """Page-locked bytes held now."""
        return sum(area[1] for area in self._areas)

    def reserve(self, hint: int) -> None:
        """Size the areas for slots of ``hint`` bytes (``min(chunk, hint)`` each); before a batch."""
        want = min(self.chunk, max(1, hint))
        if want > self._size:
            self.flush()
            for area in self._areas:
                self._wait(area)
                if area[0]:
                    self._free(area[0])
                area[0], area[1] = self._alloc(want), want
            self._size = want

    def write(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` at host address ``src`` (kept alive by the caller for the call) to
        device address ``dst``, through the areas: on the host now, to the device asynchronously."""
        if not self._size:
            self.reserve(self.chunk)  # no size given (reserve): full chunks
        done = 0
        while done < nbytes:
            if self._fill and dst + done != self._dst + self._fill:
                self.flush()  # the next bytes go elsewhere in the slot
            area = self._areas[self._turn]
            if not self._fill:
                self._wait(area)  # its last copy read it: usually long done
                self._dst = dst + done
            take = min(area[1] - self._fill, nbytes - done)
            ctypes.memmove(area[0] + self._fill, src + done, take)
            self._fill += take
            done += take
            if self._fill == area[1]:
                self.flush()

    def discard(self) -> None:
        """Drop what the current area holds without copying it (a batch that failed)."""
        self._fill = 0

    def flush(self) -> None:
        """Queue the copy of what the current area holds, record its event, turn to the next area."""
        if not self._fill:
            return
        area = self._areas[self._turn]
        self._copy(self._dst, area[0], self._fill)
        self._record(area)
        self.copies += 1
        self._fill = 0
        self._turn = (self._turn + 1) % self.BUFFERS

    def close(self) -> None:
        """Free the areas once their last copies are done."""
        self.flush()
        for area in self._areas:
            self._wait(area)
            if area[2] is not None:
                self._destroy(area[2])
            if area[0]:
                self._free(area[0])
        self._areas = [[0, 0, None] for _ in range(self.BUFFERS)]
        self._size = 0

    # -- the device's side (host memory in the tests of the chunking) --------------------------
    def _alloc(self, nbytes: int) -> int:
        from . import _cuda

        return int(_cuda.host_alloc(nbytes, self.device))

    def _free(self, ptr: int) -> None:
        from . import _cuda

        _cuda.host_free(ptr, self.device)

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        from . import _cuda

        _cuda.memcpy_htod_async(dst, src, nbytes, self.device, 0)

    def _record(self, area: list[Any]) -> None:
        from . import _cuda

        if area[2] is None:
            area[2] = _cuda.event_create(self.device)
        _cuda.event_record(area[2], self.device, 0)

    def _wait(self, area: list[Any]) -> None:
        if area[2] is not None:
            from . import _cuda

            _cuda.event_synchronize(area[2], self.device)

    def _destroy(self, event: Any) -> None:
        from . import _cuda

        _cuda.event_destroy(event, self.device)


class SlotWriter:
    """What ``collate(samples, writer)`` writes a batch with, in a worker.

    ``writer.empty(shape, dtype)`` returns a Buffer in the current slot (the
    next free, aligned part of it): write into it (``copy_from``, NumPy on
    the host backend, a GPU library through DLPack or
    ``__cuda_array_interface__``) and return it in the batch.
    ``writer.stacked(shape, dtype, parts)`` writes an array whose bytes are
    ``parts`` (host ``(address, length)`` pairs, in order: the samples of a
    stack) and returns its Buffer: on the host backend straight into the
    slot, on CUDA through the worker's page-locked staging.
    ``writer.staged_empty(shape, dtype)`` returns ``(host, buffer)``: a NumPy
    array to write the values into on the CPU, and the Buffer in the slot they
    will be in once the batch is published (on the host backend ``host`` is
    the slot itself; on CUDA, a host array sent through staging at
    the end of the batch).
    Anything else array-like that ``collate`` returns is copied into the
    slot; plain Python values travel as they are. ``device`` is the slots'
    device (``"cpu"`` or a CUDA ordinal).
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

    def __init__(
        self,
        allocator: Any,
        slot: Buffer | None,
        device: int | str,
        backend: str | None,
        staging: Staging | None = None,
    ) -> None:
        # Scratch buffers come from allocator.empty(shape, dtype, device, backend=, transient=True)
        # (a RemoteAllocator): its Owner frees them once unused rather than pooling them.
        self._allocator = allocator
        self._slot = slot  # None: the first batch, laid out in scratch buffers to size the slots
        self._limit = slot.nbytes if slot is not None else None
        self.device = device
        self._backend = backend
        # Staging needs the slot (its addresses): the first batch, in scratch buffers, copies directly.
        self._staging = staging if slot is not None and isinstance(device, int) else None
        if self._staging is not None and self._limit is not None:
            self._staging.reserve(self._limit)
        self._pending: list[tuple[int, Any]] = []  # (offset, host array) from staged_empty, sent at finish
        self._scratch_copies: list[tuple[Buffer, Any]] = []  # first batch: (buffer, host array) to copy at finish
        self.used = 0
        self._regions: dict[int, tuple[Buffer, int, str | None]] = {}

    def empty(self, shape: Shape, dtype: DType = "float32", *, tag: str | None = None) -> Buffer:
        """An uninitialised array in the slot, at its next aligned free place.

        Parameters
        ----------
        shape : int or tuple of int
            The array's shape.
        dtype : str or numpy.dtype
            Its element type (``"float32"``).
        tag : str, optional
            A dtype name NumPy lacks (``"bfloat16"``), for adapters: the trainer's
            :class:`SlotArray` carries it.

        Returns
        -------
        Buffer
            The array, to write and return in the batch.

        Raises
        ------
        LoaderError
            If the batch would outgrow the slot (pass ``slot_bytes=`` to the loader).
        """
        dims = check_shape(shape)
        dt = check_dtype(dtype)
        offset = align(self.used)
        end = offset + math.prod(dims) * dt.itemsize
        if self._slot is None:
            buf = self._allocator.empty(dims, dt, self.device, backend=self._backend, transient=True)
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

    def staged_empty(self, shape: Shape, dtype: DType = "float32", *, tag: str | None = None) -> tuple[Any, Buffer]:
        """An array in the slot, written on the CPU.

        On CUDA ``host`` is plain memory sent through staging when the batch is
        done; :meth:`stacked` saves that host copy when the values are already in
        memory.

        Parameters
        ----------
        shape, dtype, tag
            As for :meth:`empty`.

        Returns
        -------
        host : numpy.ndarray
            Where to write the values (on the host backend, the slot itself).
        buffer : Buffer
            Where they are in the slot once the batch is done: return it in the batch.

        Raises
        ------
        LoaderError
            As for :meth:`empty`.
        """
        buf = self.empty(shape, dtype, tag=tag)
        if buf.device == "cpu":
            return buf.numpy(), buf
        host = np.empty(buf.shape, buf.dtype)
        if self._staging is None:  # the first batch (scratch buffers): copied at finish
            self._scratch_copies.append((buf, host))
        else:
            self._pending.append((self._regions[id(buf)][1], host))
        return host, buf

    def stacked(self, shape: Shape, dtype: DType, parts: list[tuple[int, int]], *, tag: str | None = None) -> Buffer:
        """An array in the slot whose bytes are ``parts``, in order: the samples of a stack.

        Each byte is copied once on the host: into a host slot, or into page-locked
        staging bound for a CUDA slot.

        Parameters
        ----------
        shape, dtype, tag
            As for :meth:`empty`.
        parts : list of (int, int)
            Host ``(address, length)`` pairs, which the caller keeps alive for the call.

        Returns
        -------
        Buffer
            The array, to return in the batch.

        Raises
        ------
        ValueError
            If the parts do not hold exactly the array's bytes.
        LoaderError
            As for :meth:`empty`.
        """
        buf = self.empty(shape, dtype, tag=tag)
        total = sum(length for _, length in parts)
        if total != buf.nbytes:
            buf.release()
            del self._regions[id(buf)]
            raise ValueError(f"the parts hold {total} bytes; an array of {buf.shape} {buf.dtype} has {buf.nbytes}")
        if buf.device == "cpu":
            at = buf.ptr
            for address, length in parts:
                ctypes.memmove(at, address, length)
                at += length
        elif self._staging is None:  # the first batch (scratch buffers): copied at finish
            host = np.empty(buf.nbytes, np.uint8)
            at = host.ctypes.data
            for address, length in parts:
                ctypes.memmove(at, address, length)
                at += length
            self._scratch_copies.append((buf, host.view(buf.dtype).reshape(buf.shape)))
        else:
            at = buf.ptr
            for address, length in parts:
                self._staging.write(at, address, length)
                at += length
        return buf

    def put(self, array: Any, *, tag: str | None = None) -> Buffer:
        """Copy an array into the slot.

        Parameters
        ----------
        array : array_like or CUDA array
            NumPy, anything ``numpy.asarray`` takes, or an object with
            ``__cuda_array_interface__``.
        tag : str, optional
            As for :meth:`empty`.

        Returns
        -------
        Buffer
            The copy in the slot, to return in the batch.

        Raises
        ------
        LoaderError
            As for :meth:`empty`.
        """
        cai = getattr(array, "__cuda_array_interface__", None)
        if cai is not None:
            shape, dtype = tuple(cai["shape"]), np.dtype(cai["typestr"])
            return self.empty(shape, dtype, tag=tag).copy_from(array)
        array = np.ascontiguousarray(array)
        return self.stacked(array.shape, array.dtype, [(array.ctypes.data, array.nbytes)] if array.nbytes else [],
                            tag=tag)  # fmt: skip

    def _finish(self) -> None:
        """Send what :meth:`staged_empty` handed out through staging and queue the last copy,
        before the slot is published. On the host backend there is nothing to do."""
        for buf, host in self._scratch_copies:
            buf.copy_from(host)
        self._scratch_copies.clear()
        if self._staging is None:
            return
        assert self._slot is not None
        for offset, host in sorted(self._pending, key=lambda pending: pending[0]):
            self._staging.write(self._slot.ptr + offset, host.ctypes.data, host.nbytes)
        self._pending.clear()
        self._staging.flush()

    def _layout(self, tree: Any) -> Any:
        """The batch's structure with each array replaced by ``("array", offset, shape, dtype, tag)``."""
        kind = type(tree)
        if isinstance(tree, Buffer):
            known = self._regions.get(id(tree))
            if known is None or known[0] is not tree:
                known = self._regions[id(self.put(tree))]
            buf, offset, tag = known
            return ("array", offset, buf.shape, buf.dtype.str, tag)
        if kind is dict:
            return ("dict", [(key, self._layout(value)) for key, value in tree.items()])
        if kind in (list, tuple):
            return (kind.__name__, [self._layout(value) for value in tree])
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
            return ("namedtuple", kind, [self._layout(value) for value in tree])
        if isinstance(tree, (np.ndarray, np.generic)) or (
            not isinstance(tree, (str, bytes)) and hasattr(tree, "__cuda_array_interface__")
        ):
            return self._layout(self.put(tree))
        return ("value", tree)

    def _move_into(self, slot: Buffer) -> None:
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
        self._pending.clear()
        self._scratch_copies.clear()
        if self._staging is not None:
            self._staging.discard()  # a batch that failed half-way: its bytes go nowhere


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
    if isinstance(first, np.ndarray):
        # Each sample copied once: into the host slot itself, or into staging for a CUDA slot.
        if all(isinstance(s, np.ndarray) and s.shape == first.shape and s.dtype == first.dtype for s in samples):
            dense = [np.ascontiguousarray(s) for s in samples]  # kept alive until the bytes are copied
            parts = [(a.ctypes.data, a.nbytes) for a in dense if a.nbytes]
            return writer.stacked((len(samples), *first.shape), first.dtype, parts)
        host, out = writer.staged_empty((len(samples), *first.shape), first.dtype)  # np.stack promotes, or says why not
        try:
            np.stack(samples, out=host)
        except ValueError as exc:
            shapes = sorted({np.shape(s) for s in samples}, key=str)
            if len(shapes) < 2:
                raise
            raise ValueError(
                f"samples of one batch have shapes {shapes[:4]}: samples of a batch must have one shape to be "
                "stacked; pad them in the dataset, or pass collate= to lay the batch out yourself"
            ) from exc
        return out
    cai = getattr(first, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        out = writer.empty((len(samples), *shape), np.dtype(cai["typestr"]))
        for i, sample in enumerate(samples):
            s_shape = tuple(sample.__cuda_array_interface__["shape"])
            if s_shape != shape:
                raise ValueError(
                    f"sample {i} has shape {s_shape}, sample 0 has {shape}: samples of a batch must have one "
                    "shape to be stacked; pad them in the dataset, or pass collate= to lay the batch out yourself"
                )
            _row(out, i, shape).copy_from(sample)
        return out
    return list(samples)


# -- trainer side: the arrays of a batch ---------------------------------------


class SlotArray(HeldView):
    """An array of a batch from a :class:`SlotLoader`: a Buffer viewing its worker's slot.

    It holds the slot: the slot goes back to the worker when every
    SlotArray of the batch, every view of one, and everything made from
    one without a copy (NumPy arrays, DLPack and ``__cuda_array_interface__``
    tensors) is gone, or released. ``tag`` is what the worker's collate
    attached to this array (adapters use it, e.g. for dtypes NumPy lacks).
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

    __slots__ = ()

    def __init__(self, base: Buffer, offset: int, shape: Any, dtype: Any, hold: Any, tag: str | None) -> None:
        # hold: (the ring item, the Manager): the slot and the memory's owner stay while this does
        super().__init__(memory_of(base), offset, shape, dtype, hold, tag)

    def _like(self, plain: Buffer, tag: str | None) -> SlotArray:
        return SlotArray(plain, byte_offset(plain), plain.shape, plain.dtype, self._hold, tag)


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
