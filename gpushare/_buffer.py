"""Buffer: a typed window onto shared memory, and how it travels between processes.

- In a process, a :class:`Buffer` views one :class:`~gpushare._memory.Memory` and takes a count
  on it; the last Buffer gone drops the Memory. ``release()`` is idempotent; a released
  buffer raises :class:`~gpushare._errors.BufferReleasedError`.
- Between processes it travels as ``(rebuild_buffer, (descriptor bytes,))``, a new lease per
  pickling (:func:`share_bytes`): ``Buffer.__reduce__`` asks :func:`reduce_buffer` (the Ray form
  in a process connected to Ray); the Queue writes and reads the same bytes itself
  (:func:`queue_pickle`, :func:`from_queue_pickle`). A Queue message naming an allocation
  this process already maps arrives in one C call where ``_handoff.c`` builds
  (``gpushare._native``): each arrival the Python path makes leaves it an entry.
- Other modules reach a Buffer's memory through :func:`window` and :func:`memory_of`.
Why: dev/design-notes.md, "Descriptors"; the steps: dev/design.md, "A handoff, step by step".
"""

from __future__ import annotations

import math
import os
import struct
import sys
import weakref
from typing import TYPE_CHECKING, Any

from . import _native, _seams
from ._errors import BufferReleasedError
from ._memory import (
    EXTENSION_DTYPES,
    Descriptor,
    Memory,
    _dtype,
    _extension_dtype,
    descriptor_key,
    descriptor_layout,
    dtype_text,
)

if TYPE_CHECKING:
    import numpy as np

    from ._types import DType, Shape

__all__ = [
    "Buffer",
    "Memory",
    "attach_buffer",
    "byte_offset",
    "check_dtype",
    "check_shape",
    "descriptor_of",
    "from_queue_pickle",
    "memory_of",
    "queue_pickle",
    "rebuild_buffer",
    "reduce_buffer",
    "share_bytes",
    "window",
]

_SUPPORTED_KINDS = "biufc"


def check_dtype(dtype: object) -> np.dtype[Any]:
    """A NumPy dtype gpushare can share, or a ValueError saying what is valid."""
    import numpy as np

    extension = _extension_dtype(dtype)
    if extension is not None:
        return extension
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise ValueError(
            f"dtype={dtype!r} is not a dtype NumPy knows; use e.g. 'float32', 'float16', 'int64', 'uint8', "
            f"or one of {', '.join(EXTENSION_DTYPES)} (with ml_dtypes)"
        ) from exc
    if dt.name in EXTENSION_DTYPES:  # an ml_dtypes dtype object
        return dt
    if dt.kind not in _SUPPORTED_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(
            f"dtype {dt} cannot be shared: only plain bool, integer, float and complex dtypes "
            "(e.g. 'float32', 'float16', 'int64', 'uint8') have a device layout"
        )
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def check_shape(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of ints: one dimension or an iterable of them, each an integer
    (``int``, a NumPy integer, anything with ``__index__``) >= 0. Anything else raises
    ValueError naming the dimension: a float too (2.5 is no size; 2.0 is refused alike
    rather than truncated), and a bool (an int to Python, never meant as a size)."""
    if type(shape) is tuple and len(shape) <= 32 and all(type(d) is int and d >= 0 for d in shape):
        return shape  # the usual case, checked at once
    import operator

    import numpy as np

    if isinstance(shape, (int, float, np.integer, np.floating)):
        shape = (shape,)
    if isinstance(shape, (str, bytes)):
        raise ValueError(f"shape={shape!r} is not a tuple of ints")
    try:
        items: tuple[Any, ...] = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"shape={shape!r} is not a tuple of ints") from None
    dims = []
    for axis, d in enumerate(items):
        try:
            if isinstance(d, (bool, np.bool_)):
                raise TypeError
            dims.append(operator.index(d))
        except TypeError:
            raise ValueError(
                f"shape={shape!r}: dimension {axis} is {d!r}, a {type(d).__name__}; dimensions are "
                "integers (int or a NumPy integer), not floats or bools"
            ) from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape={tuple(dims)} has a negative dimension; dimensions are >= 0")
    if len(dims) > 32:
        raise ValueError(f"shape={tuple(dims)} has {len(dims)} dimensions; at most 32 are supported")
    return tuple(dims)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class _Drop:
    """A Buffer's finalizer without ``weakref.finalize`` (registry, exit hook):
    :meth:`Buffer.__del__` calls it when the Buffer is collected.

    Has what Buffer uses of a finalizer: ``alive``, and calling it, which
    drops the count once. A second call, from another thread too, does
    nothing: the Memory sits in a one-item list, and ``list.pop`` is one
    atomic step under the GIL (an attribute swap would be two).
    """

    __slots__ = ("_held", "alive")

    def __init__(self, memory: Memory) -> None:
        self._held = [memory]
        self.alive = True

    def __call__(self) -> None:
        held = self._held
        if not held:  # already dropped (the common case at collection: cheaper than the IndexError)
            return
        try:
            memory = held.pop()
        except IndexError:  # another thread dropped it just now
            return
        self.alive = False
        memory.drop_one()


class Buffer:
    """A C-contiguous typed array in shared memory (CUDA device or host).

    Made by a Manager (``manager.empty(...)``) in the owning process, or
    rebuilt from a descriptor when a buffer arrives in another process.
    Buffers have no public constructor.
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

    __slots__ = ("__weakref__", "_dtype", "_export", "_finalizer", "_memory", "_offset", "_shape")

    def __init__(
        self, memory: Memory, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any], finalizer: Any = None
    ) -> None:
        self._memory = memory
        self._offset = offset
        self._shape = shape
        self._dtype = dtype
        self._export: Buffer | None = None  # keeps memory handed out by pointer alive (see release())
        self._finalizer: weakref.finalize[Any, Any] | _Drop
        if finalizer is not None:  # a ring item: no count (see the module docstring)
            self._finalizer = finalizer
            return
        memory.acquire()
        if memory.exit_release:
            self._finalizer = weakref.finalize(self, memory.drop_one)
        else:
            self._finalizer = _Drop(memory)

    def __del__(self) -> None:
        # Runs the _Drop finalizer (a weakref.finalize one runs by itself; calling
        # it again is a no-op). It writes shared memory or enqueues, never waits.
        try:
            self._finalizer()
        except Exception:  # interpreter shutdown, or __init__ failed before setting it
            pass

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """How a Buffer pickles, for every pickler but gpushare's Queue (which writes the
        same bytes itself): its descriptor under a new lease, rebuilt by
        :func:`rebuild_buffer`; in a process connected to Ray, the Ray form
        (:mod:`gpushare.ray`)."""
        return reduce_buffer(self)

    # -- description --------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The buffer's shape, as NumPy gives it (C order)."""
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """The element type, a ``numpy.dtype`` (``ml_dtypes``' for bfloat16 and the float8 kinds)."""
        return self._dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions, ``len(shape)``."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of elements, the product of ``shape``."""
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        """The bytes its elements take, ``size * dtype.itemsize``."""
        return self.size * self._dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides (C order), as NumPy reports them."""
        return _c_strides(self._shape, self._dtype.itemsize)

    @property
    def device(self) -> int | str:
        """The CUDA ordinal of the memory in this process, or ``"cpu"``."""
        device = self._memory.device
        return "cpu" if device is None else device

    @property
    def device_uuid(self) -> str | None:
        """The GPU's UUID (``"GPU-..."``), the same in every process; None on the host."""
        uuid = self._memory.device_uuid
        if not uuid:
            return None
        from ._cuda import format_uuid

        return format_uuid(uuid)

    @property
    def backend(self) -> str:
        """The sharing mechanism of its memory: ``"cuda_ipc"``, ``"cuda_vmm"``, ``"cuda_pool"`` or ``"host"``."""
        return str(self._memory.backend.name)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called on this buffer (it may not be used after that)."""
        return not self._finalizer.alive

    @property
    def ptr(self) -> int:
        """The address of the first element in this process (device pointer on CUDA).

        In a consumer, the first access waits until the producer's work queued on
        its default stream before it shared the buffer has finished, so the
        pointer is safe to use from any stream.
        """
        self._check()
        memory = self._memory
        if memory.pending:
            memory.ready()
        return memory.base + self._offset

    def _address(self) -> int:
        """The address, checked, without waiting for the producer (interop orders by stream)."""
        self._check()
        return self._memory.base + self._offset

    def _check(self) -> None:
        if not self._finalizer.alive:
            raise BufferReleasedError(
                f"this {self._describe()} was released in this process; its memory may not be "
                "touched here any more. Keep a reference (or do not call release()) while you use it"
            )
        self._memory.source.check(self._memory)

    def _describe(self) -> str:
        return f"buffer {self._shape} {self._dtype} on {self.device}"

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.backend}"
        return f"<gpushare.Buffer shape={self._shape} dtype={self._dtype} device={self.device!r} {state}>"

    # -- lifetime -----------------------------------------------------------
    def release(self) -> None:
        """Release this process's reference. Idempotent.

        In a worker this gives the lease back to the owner; in the owner the
        memory is recycled once no worker holds it either.

        Memory already handed to another library is never pulled from under
        it: NumPy arrays from :meth:`numpy` and DLPack tensors hold their own
        reference, and a view taken through ``__cuda_array_interface__``
        (which can only point back at this object) keeps the memory until
        this Buffer object itself is garbage collected.
        """
        self._finalizer()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- views and copies -----------------------------------------------------
    def view(self, dtype: DType | None = None, shape: Shape | None = None) -> Buffer:
        """A new Buffer over the same memory with another dtype and/or shape.

        The view keeps the memory alive on its own: releasing this buffer does not
        end it.

        Parameters
        ----------
        dtype : str or numpy.dtype, optional
            The view's element type; this buffer's when omitted.
        shape : int or tuple of int, optional
            The view's shape, which may hold one ``-1``. When omitted, the last
            dimension is rescaled to the new dtype (or the view is flat).

        Returns
        -------
        Buffer
            A view that may be smaller than this buffer, never larger.

        Raises
        ------
        ValueError
            If the shape does not fit the buffer's bytes or cannot be inferred.
        BufferReleasedError
            If this buffer was released.
        """
        self._check()
        dt = self._dtype if dtype is None else check_dtype(dtype)
        if shape is None:
            if self.nbytes % dt.itemsize:
                raise ValueError(f"{self.nbytes} bytes are not a whole number of {dt} items")
            if self._shape and (self._shape[-1] * self._dtype.itemsize) % dt.itemsize == 0:
                new_shape = (*self._shape[:-1], self._shape[-1] * self._dtype.itemsize // dt.itemsize)
            else:
                new_shape = (self.nbytes // dt.itemsize,)
        else:
            import numpy as np

            dims = list(shape) if not isinstance(shape, (int, np.integer)) else [int(shape)]  # type: ignore[call-overload]
            if dims.count(-1) > 1:
                raise ValueError(f"shape={tuple(dims)} has more than one -1")
            if -1 in dims:
                known = math.prod(d for d in dims if d != -1)
                if known == 0 or (self.nbytes // dt.itemsize) % known:
                    raise ValueError(f"cannot infer the -1 in shape={tuple(dims)} for {self.nbytes} bytes of {dt}")
                dims[dims.index(-1)] = (self.nbytes // dt.itemsize) // known
            new_shape = check_shape(dims)
        if math.prod(new_shape) * dt.itemsize > self.nbytes:
            raise ValueError(
                f"a view of shape {new_shape} and dtype {dt} needs {math.prod(new_shape) * dt.itemsize} bytes; "
                f"this buffer has {self.nbytes}"
            )
        return Buffer(self._memory, self._offset, new_shape, dt)

    def numpy(self) -> np.ndarray[Any, Any]:
        """The contents as a NumPy array.

        Returns
        -------
        numpy.ndarray
            On the host backend a zero-copy view of the shared memory; on a CUDA
            backend a host copy of the device memory.

        Raises
        ------
        BufferReleasedError
            If this buffer was released.
        """
        import numpy as np

        self._check()
        memory = self._memory
        if memory.device is None:
            array = np.asarray(_HostView(self.view()))
            return array if array.dtype == self._dtype else array.view(self._dtype)  # ml_dtypes' by bytes
        out = np.empty(self._shape, self._dtype)
        if self.nbytes:
            memory.backend.copy_out(out.ctypes.data, self.ptr, self.nbytes, memory.device)
        return out

    def copy_from(self, array: object) -> Buffer:
        """Copy ``array`` into this buffer.

        Parameters
        ----------
        array : array_like or CUDA array
            A NumPy array, anything ``numpy.asarray`` takes, or (for a CUDA buffer) an
            object with ``__cuda_array_interface__`` (torch, CuPy, Numba), copied on
            the device. It must have as many elements as the buffer and is cast to the
            buffer's dtype.

        Returns
        -------
        Buffer
            This buffer.

        Raises
        ------
        ValueError
            If the element counts differ.
        BufferReleasedError
            If this buffer was released.
        """
        self._check()
        memory = self._memory
        cai = getattr(array, "__cuda_array_interface__", None) if memory.device is not None else None
        if cai is not None:
            from ._interop import copy_from_cuda_array

            copy_from_cuda_array(self, memory, cai)
            return self
        import numpy as np

        src = np.ascontiguousarray(np.asarray(array), dtype=self._dtype)
        if src.size != self.size:
            raise ValueError(
                f"cannot copy {src.size} elements (shape {src.shape}) into a buffer of shape {self._shape}"
            )
        if self.nbytes:
            memory.backend.copy_in(self.ptr, src.ctypes.data, self.nbytes, memory.device)
        return self

    def fill(self, value: object) -> Buffer:
        """Set every element to ``value``.

        Parameters
        ----------
        value : number
            The value, converted to the buffer's dtype.

        Returns
        -------
        Buffer
            This buffer.

        Raises
        ------
        BufferReleasedError
            If this buffer was released.
        """
        import numpy as np

        self._check()
        pattern = np.array(value, dtype=self._dtype).tobytes()
        if self.nbytes:
            self._memory.backend.fill(self.ptr, pattern, self.nbytes, self._memory.device)
        return self

    # -- interop (see _interop) ---------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self._memory.device is None:
            raise AttributeError("a host-backend buffer has no __cuda_array_interface__; use numpy() or np.asarray()")
        from ._interop import cuda_array_interface

        if self._export is None:
            self._export = self.view()  # the consumer holds only `self`: see release()
        return cuda_array_interface(self, self._memory)

    def __array__(self, dtype: object = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if self._memory.device is not None:
            raise TypeError(
                "a CUDA buffer cannot become a NumPy array implicitly; use buf.numpy() for a host copy, "
                "or a GPU library (torch.from_dlpack(buf), cupy.asarray(buf))"
            )
        import numpy as np

        array = self.numpy()
        if dtype is not None and np.dtype(dtype) != array.dtype:  # type: ignore[call-overload]
            return array.astype(dtype)  # type: ignore[call-overload]
        return array.copy() if copy else array

    def __dlpack__(
        self,
        *,
        stream: object = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        from ._interop import to_dlpack

        return to_dlpack(self, self._memory, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        from ._interop import dlpack_device

        return dlpack_device(self, self._memory)


def memory_of(buf: Buffer) -> Memory:
    """The Memory ``buf`` views (for the modules that build their own views on it)."""
    return buf._memory


def window(buf: Buffer, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any], cls: type[Buffer] = Buffer) -> Any:
    """A Buffer of class ``cls`` over ``shape`` x ``dtype`` starting ``offset`` bytes into ``buf``.

    It takes its own count on the memory (it stays valid after ``buf`` is
    released), like :meth:`Buffer.view`, but may start anywhere inside ``buf``
    (a batch's arrays in a ring slot, a weight set's tensors in an allocation).
    The caller checks the bounds; ``cls`` is ``Buffer`` or a subclass whose
    constructor takes ``(memory, offset, shape, dtype)`` first.
    """
    return cls(buf._memory, buf._offset + offset, shape, dtype)


def byte_offset(buf: Buffer) -> int:
    """Where ``buf`` starts in its allocation, in bytes."""
    return buf._offset


class HeldView(Buffer):
    """A Buffer that holds something while it lives, let go by :meth:`release` or when it goes: a
    loader's batch array holds its ring slot (``_batch.SlotArray``), a tensor set's tensor its
    snapshot or draft (``_fanout._views.TensorView``). So does everything made from it without a
    copy: its views (:meth:`view` makes one of the same kind), and its host memory's NumPy arrays,
    whose base it is. ``tag`` names a dtype NumPy lacks (``"bfloat16"``) for data stored as an
    unsigned int of its size, or anything an adapter attached; None otherwise.
    """

    __slots__ = ("_hold", "tag")

    def __init__(self, memory: Memory, offset: int, shape: Any, dtype: Any, hold: Any, tag: str | None) -> None:
        Buffer.__init__(self, memory, offset, shape, dtype)
        self._hold = hold
        self.tag = tag

    def _like(self, plain: Buffer, tag: str | None) -> HeldView:
        """A view of this kind over ``plain``'s window, holding what this one holds."""
        raise NotImplementedError

    def view(self, dtype: DType | None = None, shape: Shape | None = None) -> Buffer:
        plain = Buffer.view(self, dtype, shape)
        tag = self.tag if plain.dtype == self.dtype else None  # a view as another dtype is no longer the tag's
        out = self._like(plain, tag)
        plain.release()
        return out

    def numpy(self) -> np.ndarray[Any, Any]:
        """The contents as a NumPy array.

        Returns
        -------
        numpy.ndarray
            Host memory: a zero-copy view, which holds what this view holds; device
            memory: a host copy.
        """
        if self.device == "cpu":
            import numpy as np

            self._check()
            return np.asarray(self)  # through __array_interface__: the array's base is this object
        return super().numpy()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.device != "cpu":
            raise AttributeError("device memory has no __array_interface__")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3}

    def release(self) -> None:
        """Release this view, and with it its hold. Idempotent."""
        super().release()
        self._hold = None

    def __repr__(self) -> str:
        state = "released" if self.released else self.backend
        tag = f" tag={self.tag}" if self.tag else ""
        kind = type(self).__name__
        return f"<gpushare.{kind} shape={self.shape} dtype={self.dtype}{tag} device={self.device!r} {state}>"


class _HostView:
    """Hands NumPy a host buffer's memory together with a reference that keeps it.

    The resulting array's ``base`` is this object, whose Buffer holds a count
    on the memory, so the allocation cannot be recycled under the array even
    after the user releases the Buffer the array came from.
    """

    __slots__ = ("__array_interface__", "buffer")

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        dtype = buffer.dtype
        self.__array_interface__ = {
            "shape": buffer.shape,
            # An ml_dtypes dtype has no typestr NumPy parses back: its bytes, viewed as it by numpy().
            "typestr": f"|V{dtype.itemsize}" if dtype.name in EXTENSION_DTYPES else dtype.str,
            "data": (buffer.ptr, False),
            "strides": None,
            "version": 3,
        }


# -- the wire form: sending -------------------------------------------------------------------
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
        dtype=dtype_text(buf.dtype),
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
#: The function a buffer's pickle names: rebuild_buffer, below (tests/test_child_imports.py checks it).
REBUILD = ("gpushare._buffer", "rebuild_buffer")
# Protocol 5 (PROTO), the global REBUILD (two SHORT_BINUNICODE, STACK_GLOBAL), the
# descriptor (BINBYTES, 4-byte length), then TUPLE1, REDUCE, STOP. No frame, no memo:
# both are optional to every unpickler. from_queue_pickle reads it back.
QUEUE_HEAD = b"\x80\x05" + b"".join(b"\x8c" + bytes([len(p)]) + p for p in (n.encode() for n in REBUILD)) + b"\x93B"
QUEUE_TAIL = b"\x85R."
QUEUE_LENGTH = struct.Struct("<I")
QUEUE_DATA_AT = len(QUEUE_HEAD) + QUEUE_LENGTH.size


def queue_pickle(buf: Buffer) -> bytes:
    """The pickle of ``reduce_buffer(buf)``, built directly (a new lease, like any pickling)."""
    share = _share
    if share is not None:
        whole = share(buf)  # None: the Python path's turn, with nothing changed
        if whole is not None:
            return whole
    data = share_bytes(buf)
    if _shares is not False:
        _plan_share(buf)
    return QUEUE_HEAD + QUEUE_LENGTH.pack(len(data)) + data + QUEUE_TAIL


def reduce_buffer(buf: Buffer) -> tuple[Any, tuple[Any, ...]]:
    """``Buffer.__reduce__``: ``(rebuild_buffer, (descriptor bytes,))`` with a new lease, or,
    inside a process connected to Ray, the Ray form (see the module docstring)."""
    ray = sys.modules.get("ray")  # a probe: Ray is never imported here
    if ray is not None:
        ray_form = _seams.ray_form()
        if ray_form is not None and getattr(ray, "is_initialized", lambda: False)():
            return ray_form(buf)
    return (rebuild_buffer, (share_bytes(buf),))


# -- the wire form: receiving -----------------------------------------------------------------
def rebuild_buffer(data: bytes) -> Buffer:
    """Unpickling side: parse and check the descriptor, claim its lease, map it."""
    return attach_buffer(Descriptor.from_bytes(data))


_attach: Any = None  # _lifetime.attach, imported at the first arrival


def attach_buffer(desc: Descriptor) -> Buffer:
    """The Buffer a checked descriptor names, mapped in this process under its lease."""
    global _attach
    attach = _attach
    if attach is None:  # here, not above: a process that never receives loads no lease service
        from ._lifetime import attach

        _attach = attach
    return Buffer(attach(desc), desc.offset, desc.shape, _dtype(desc.dtype))  # a cached dtype


def attach_through(desc: Descriptor, authkey: bytes) -> Buffer:
    """The Buffer ``desc`` names, mapped here under a lease of its own taken through the
    descriptor's unclaimed one (``LeaseVia``): how a process outside the owner's process tree
    (a Ray worker) reads a descriptor many processes may read. ``authkey``: the owner's.
    Raises DescriptorError once that lease is gone."""
    from . import _lifetime
    from ._lifetime._protocol import LeaseVia

    owner = _lifetime.owner_for(desc.owner_token)
    if owner is not None:
        lease = owner.leases.lease_via(desc.alloc_id, desc.generation, desc.lease_id, _lifetime.LOCAL)
    else:
        link = _lifetime.link_for(desc.address, desc.owner_token, authkey)
        lease = int(link.request(LeaseVia, desc.alloc_id, desc.generation, desc.lease_id, False))
    return attach_buffer(desc._replace(lease_id=lease))


NODE_ID_ENV = "GPUSHARE_NODE_ID"
"""The environment variable that names this machine, where the boot id is not enough (see node_identity)."""


def node_identity() -> str:
    """Which machine this process runs on (a descriptor's owner address is a Unix socket,
    reachable only on the same machine).

    Returns
    -------
    str
        ``$GPUSHARE_NODE_ID`` if set, else the kernel's boot id.
    """
    override = os.environ.get(NODE_ID_ENV)
    if override:
        return override
    return _boot_id()


_BOOT_ID: list[str] = []


def _boot_id() -> str:
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT_ID.append("boot:" + f.read().strip())
        except OSError:  # not Linux /proc: the host name is the best there is
            import socket

            _BOOT_ID.append("host:" + socket.gethostname())
    return _BOOT_ID[0]


def from_queue_pickle(data: bytes) -> Buffer | None:
    """The Buffer ``data`` is the :func:`queue_pickle` of, or None for any other pickle."""
    if data.startswith(QUEUE_HEAD) and data.endswith(QUEUE_TAIL):
        arrive = _arrive
        if arrive is not None:
            buf = arrive(data)  # None: the Python path's turn, with nothing changed
            if buf is not None:
                return buf
        (length,) = QUEUE_LENGTH.unpack_from(data, len(QUEUE_HEAD))
        if QUEUE_DATA_AT + length + len(QUEUE_TAIL) == len(data):
            desc = data[QUEUE_DATA_AT : QUEUE_DATA_AT + length]
            buf = rebuild_buffer(desc)
            if _arrivals is not False:
                _remember_arrival(desc, buf)
            return buf
    return None


# -- both ends in one C call (gpushare._handoff.c) --------------------------------------------
#: The slots the C calls set, in their order: Memory's (the first twelve are an arrival
#: entry's values, taken from a Memory the Python path made), Buffer's, _Drop's, a received
#: buffer's lease source's, and a Lease's.
HANDOFF_SLOTS = (
    ("address", "alloc_id", "alloc_nbytes", "backend", "base", "device", "device_uuid", "event", "generation",
     "handle", "native", "owner_token", "_refs", "exit_release", "pending", "source", "templates"),
    ("_memory", "_offset", "_shape", "_dtype", "_export", "_finalizer"),
    ("_held", "alive"),
    ("lease_id", "link"),
    ("lease_id", "record", "generation", "holder", "created", "keep", "quiet"),
)  # fmt: skip
ARRIVALS_MAX = 256  # arrival entries kept (one per view of an allocation and ready event); all forgotten at this many
_handoff: Any = None  # the C module, False where it is not used
_shares: Any = None  # this process's Shares, False where the C share is not used
_share: Any = None  # its share(), once a plan is kept
_arrivals: Any = None  # this process's Arrivals, False where the C arrival is not used
_arrive: Any = None  # its arrive(), once it holds an entry
_arrival_parts: Any = None  # _lifetime.arrival_parts, imported at the first arrival that asks
#: Where a plan (_plan_share) holds the handle its template was made for (_handoff.c's P_HANDLE).
_PLAN_HANDLE = 12
#: Why the C calls are not in use in this process (None while they are, or before the first try).
handoff_why_not: str | None = None


def _plan_share(buf: Buffer) -> None:
    """The Python path shared ``buf`` (its template is made): keep what the C share needs
    to share the same view alike, in the Memory's templates, if it is a Manager's own."""
    global _shares, _share
    memory = buf._memory
    parts_of = getattr(memory.source, "share_parts", None)
    templates = memory.templates
    if parts_of is None or templates is None:
        return
    parts = parts_of()
    allocation = parts[7]
    key = (buf._offset, buf._shape, buf._dtype)
    known = templates.get(key)
    if known is not None and known[_PLAN_HANDLE] == allocation.handle:
        return
    template = templates.get((*key, allocation.handle))
    if template is None:
        return
    shares = _shares
    if shares is None:
        shares = _shares = _new_handoff(
            "Shares", _lease_type(), HANDOFF_SLOTS[4], QUEUE_HEAD, QUEUE_TAIL, weakref.finalize,
            weakref.finalize._registry,  # type: ignore[attr-defined]
        )  # fmt: skip
        if shares is False:
            return
    templates[key] = (*parts, memory.generation, allocation.handle, *template.parts())
    _share = shares.share


def _lease_type() -> type:
    from ._lifetime._records import Lease  # the owner side: loaded in this process already

    return Lease


def _remember_arrival(desc: bytes, buf: Buffer) -> None:
    """The Python path attached ``buf`` from descriptor bytes ``desc``: keep what the C
    arrival needs to attach the next sharing of the same view alike."""
    global _arrivals, _arrive, _arrival_parts
    arrival_parts = _arrival_parts
    if arrival_parts is None:  # imported once: a process whose buffers are its own asks at every arrival
        from ._lifetime import arrival_parts

        _arrival_parts = arrival_parts
    memory = buf._memory
    parts = arrival_parts(memory)
    if parts is None:  # not leased over a link that journals its claims (the owner's own process, say)
        return
    table = _arrivals
    if table is None:
        from ._lifetime import CLAIM, NUDGE, RELEASE, arrival_source, journal_layout, release_in_c

        memory_slots, buffer_slots, drop_slots, source_slots, _ = HANDOFF_SLOTS
        table = _arrivals = _new_handoff(
            "Arrivals", Memory, memory_slots, Buffer, buffer_slots, _Drop, drop_slots, arrival_source(), source_slots,
            QUEUE_HEAD, QUEUE_TAIL, *descriptor_layout(), *journal_layout(), CLAIM, RELEASE, NUDGE,
        )  # fmt: skip
        if table is False:
            return
        release_in_c(table.release)
    if len(table) >= ARRIVALS_MAX:
        table.clear()
    client, lock, held, mappings, mapping, recorder, link = parts
    values = tuple(getattr(memory, name) for name in HANDOFF_SLOTS[0][:12])
    entry = (client, lock, held, mappings, mapping, recorder, memory.alloc_id, values, buf._offset, buf._shape,
             buf._dtype, link)  # fmt: skip
    table.add(descriptor_key(desc), entry)
    _arrive = table.arrive


def _forget_handoff() -> None:
    """A forked child: its parent's links are not its own (``_lifetime`` drops them), so
    neither are the arrival entries made over them. It makes its own, as its Python path
    makes its own links."""
    global _arrive
    _arrive = None
    if _arrivals:
        _arrivals.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_handoff)


def _new_handoff(kind: str, *args: Any) -> Any:
    """A ``kind`` (Shares or Arrivals) of the C module made with ``args``, or False
    (``handoff_why_not`` says why)."""
    global _handoff, handoff_why_not
    if _handoff is None:
        _handoff = _native.handoff_module() or False
        if _handoff is False:
            handoff_why_not = _native.handoff_why_not()
    if _handoff is False:
        return False
    try:
        return getattr(_handoff, kind)(*args)
    except (TypeError, ValueError) as exc:  # a class's slots changed: the Python path alone
        handoff_why_not = f"the C {kind} does not fit these classes: {exc}"
        return False
