"""Copies between a tensor set's slots and a trainer's or an engine's tensors, in one batch.

``TensorSet.publish(tensors)`` copies into a slot, ``Snapshot.copy_to(targets)``
out of one. Each tensor is first checked against the layout and becomes a
:class:`Region` (its address here, its device); a layout remembers the last few
mappings it checked (:class:`Plan`). Host memory only: one ``memmove`` per
tensor. A GPU involved: one batched call on this process's private stream of
that device (:func:`copy_stream`), ordered after the caller's stream and the
events named, with ``done`` recorded after the copies and waited on by the
caller's stream. dev/design-notes.md ("Tensor sets (weight sync)") says why.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from .. import _cuda
from .._errors import LayoutError
from ._layout import Layout, TensorSpec

__all__ = ["CopyStream", "Plan", "Region", "copy_regions", "copy_stream", "region_of", "regions", "stream_handle"]

_PLANS = 4  # mappings remembered per layout


class Region(NamedTuple):
    """One tensor's memory outside the set: its address here and its CUDA device (None: host)."""

    ptr: int
    device: int | None


def stream_handle(stream: object) -> int:
    """An int CUstream from ``stream``: None (0, the legacy default stream), an int, or an
    object with ``cuda_stream`` (torch) or ``ptr`` (CuPy)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    try:
        return int(stream)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise LayoutError(
            f"stream={stream!r} is not a CUDA stream; pass an int CUstream handle, a torch.cuda.Stream or a "
            "cupy.cuda.Stream (None: the legacy default stream)"
        ) from None


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _dtype_ok(spec: TensorSpec, got: str, itemsize: int | None = None) -> bool:
    """A tensor of dtype ``got`` may fill ``spec``: the same dtype (the tag for a tagged one),
    or a tagged tensor's storage dtype (its raw bits)."""
    if got == spec.dtype_name or got == spec.dtype.name:
        return True
    # An opaque dtype of the tag's size (an ml_dtypes array through __cuda_array_interface__).
    return spec.tag is not None and got.startswith("void") and itemsize == spec.dtype.itemsize


def _mismatch(spec: TensorSpec, what: str, problem: str, fix: str) -> LayoutError:
    return LayoutError(
        f"{what} for tensor {spec.name!r} {problem}; the layout says {spec.shape} {spec.dtype_name}. {fix}"
    )


def region_of(obj: Any, spec: TensorSpec, *, writable: bool, what: str) -> tuple[Region, Any, Any]:
    """``obj``'s memory for ``spec``, checked; what must stay alive while it is copied; and how
    a plan rechecks it later (None: it cannot be remembered, ``()``: its identity is enough,
    else ``(address, numel, dtype)`` of a torch tensor).

    ``writable``: ``obj`` is a target. ``what`` names the role in messages ("source", "target").
    """
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and hasattr(obj, "element_size") and hasattr(obj, "is_contiguous"):
        region = _tensor_region(obj, spec, what)
        return region, obj, (region.ptr, obj.numel(), obj.dtype)
    if isinstance(obj, np.ndarray):
        region, kept = _host_region(obj, spec, writable, what)
        return region, kept, () if kept is obj else None
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _cai_region(cai, spec, writable, what), obj, None if cai.get("stream") else ()
    if not writable and not isinstance(obj, (str, bytes)):
        try:  # a source may be anything NumPy reads (a list, a host Buffer, an ml_dtypes array)
            array = np.asarray(obj)
        except Exception:
            array = None
        if array is not None and array.dtype != object:
            region, kept = _host_region(array, spec, writable, what)
            return region, kept, None
    raise _mismatch(
        spec,
        f"the {what}",
        f"is a {type(obj).__name__}",
        "Give a NumPy array, a CUDA array (__cuda_array_interface__) or a tensor (data_ptr(), e.g. torch)",
    )


def _tensor_region(t: Any, spec: TensorSpec, what: str) -> Region:
    got = str(t.dtype).rsplit(".", 1)[-1]
    shape = tuple(t.shape)
    if shape != spec.shape:
        raise _mismatch(spec, f"the {what}", f"has shape {shape}", "Give a tensor of the layout's shape")
    if not _dtype_ok(spec, got):
        raise _mismatch(spec, f"the {what}", f"has dtype {got}", "Give a tensor of the layout's dtype (no casting)")
    if not t.is_contiguous():
        raise _mismatch(spec, f"the {what}", "is not contiguous", "Pass tensor.contiguous() instead")
    if int(t.numel()) * int(t.element_size()) != spec.nbytes:
        raise _mismatch(spec, f"the {what}", "has another size", "Give a tensor of the layout's shape and dtype")
    device = t.device
    if device.type == "cuda":
        return Region(int(t.data_ptr()), int(device.index or 0))
    if device.type == "cpu":
        return Region(int(t.data_ptr()), None)
    raise _mismatch(spec, f"the {what}", f"is on device {device}", "Use a CPU or CUDA tensor")


def _host_region(a: np.ndarray[Any, Any], spec: TensorSpec, writable: bool, what: str) -> tuple[Region, Any]:
    if a.shape != spec.shape:
        raise _mismatch(spec, f"the {what}", f"has shape {a.shape}", "Give an array of the layout's shape")
    if not _dtype_ok(spec, a.dtype.name, a.dtype.itemsize):
        raise _mismatch(spec, f"the {what}", f"has dtype {a.dtype}", "Give an array of the layout's dtype (no casting)")
    if not a.flags.c_contiguous:
        if writable:
            raise _mismatch(spec, f"the {what}", "is not C-contiguous", "Copy into a C-contiguous array")
        a = np.ascontiguousarray(a)  # a source: copied here once, then into the slot
    if writable and not a.flags.writeable:
        raise _mismatch(spec, f"the {what}", "is read-only", "Give a writable array")
    return Region(int(a.ctypes.data), None), a


def _cai_region(cai: Mapping[str, Any], spec: TensorSpec, writable: bool, what: str) -> Region:
    shape = tuple(cai["shape"])
    dtype = np.dtype(cai["typestr"])
    if shape != spec.shape:
        raise _mismatch(spec, f"the {what}", f"has shape {shape}", "Give an array of the layout's shape")
    if not _dtype_ok(spec, dtype.name, dtype.itemsize):
        raise _mismatch(spec, f"the {what}", f"has dtype {dtype}", "Give an array of the layout's dtype (no casting)")
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize) and spec.nbytes:
        raise _mismatch(spec, f"the {what}", "is not C-contiguous", "Make it contiguous first")
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise _mismatch(spec, f"the {what}", "is read-only", "Give a writable array")
    stream = cai.get("stream")
    device = _cuda.pointer_device(int(ptr)) if ptr else 0
    if stream:  # v3: the exporter's work on that stream must be done before we touch the memory
        _cuda.stream_synchronize(int(stream), device)
    return Region(int(ptr), device)


class Plan:
    """A mapping of tensors checked against a layout (see the module docstring)."""

    __slots__ = ("addresses", "checks", "complete", "found", "keep", "names", "objects", "specs", "writable")

    def __init__(
        self, writable: bool, complete: bool, specs: list[TensorSpec], found: list[Region], keep: list[Any]
    ) -> None:
        self.writable = writable
        self.complete = complete
        self.specs = specs
        self.found = found
        self.keep = keep  # what must stay alive while copying (the objects, or contiguous copies)
        self.names: tuple[str, ...] = ()
        self.objects: tuple[Any, ...] = ()
        self.checks: tuple[Any, ...] = ()
        # per slot base address: (slot-side addresses, the tensors' addresses, sizes) of the
        # non-empty tensors, in layout order
        self.addresses: dict[int, tuple[list[int], list[int], list[int]]] = {}

    def matches(self, tensors: Mapping[str, Any], writable: bool, complete: bool) -> bool:
        if writable != self.writable or complete != self.complete or len(tensors) != len(self.names):
            return False
        get = tensors.get
        for name, ref, check in zip(self.names, self.objects, self.checks, strict=True):
            obj = get(name)
            if obj is None or obj is not ref():
                return False
            if check and (obj.data_ptr() != check[0] or obj.numel() != check[1] or obj.dtype != check[2]):
                return False
        return True

    def lists(self, base: int) -> tuple[list[int], list[int], list[int]]:
        """``(slot addresses, tensor addresses, sizes)`` for the slot at ``base``."""
        found = self.addresses.get(base)
        if found is None:
            inside, outside, sizes = [], [], []
            for spec, region in zip(self.specs, self.found, strict=True):
                if spec.nbytes:
                    inside.append(base + spec.offset)
                    outside.append(region.ptr)
                    sizes.append(spec.nbytes)
            found = (inside, outside, sizes)
            if len(self.addresses) < 8:
                self.addresses[base] = found
        return found

    @property
    def devices(self) -> set[int]:
        return {r.device for r in self.found if r.device is not None}

    @property
    def host(self) -> bool:
        """Whether any of the tensors is in host memory."""
        return any(r.device is None for r in self.found)


def regions(layout: Layout, tensors: Mapping[str, Any], *, writable: bool, what: str, complete: bool) -> Plan:
    """Every tensor of ``tensors`` as a region, in layout order (``complete``: every name needed);
    a plan the layout remembers when the same tensors come again."""
    if not isinstance(tensors, Mapping):
        raise LayoutError(
            f"expected a mapping of tensor names to {what}s (a dict, a state dict), not {type(tensors).__name__}"
        )
    plans = layout.plans
    for i, plan in enumerate(plans):
        if plan.matches(tensors, writable, complete):
            if i:
                plans.insert(0, plans.pop(i))
            return plan  # type: ignore[no-any-return]
    unknown = [name for name in tensors if name not in layout]
    if unknown:
        shown = ", ".join(map(repr, unknown[:5])) + (" ..." if len(unknown) > 5 else "")
        raise LayoutError(
            f"{len(unknown)} {what}(s) name no tensor of the set's layout: {shown}. Valid names are the layout's "
            f"({', '.join(map(repr, layout.names[:5]))}{' ...' if len(layout) > 5 else ''})"
        )
    if complete and len(tensors) != len(layout):
        missing = [name for name in layout if name not in tensors]
        shown = ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise LayoutError(
            f"publish() needs every tensor of the layout ({len(layout)}); {len(missing)} missing: {shown}. A version "
            "is written whole; to change a few tensors in place use ts.draft()"
        )
    specs: list[TensorSpec] = []
    found: list[Region] = []
    keep: list[Any] = []
    names: list[str] = []
    objects: list[Any] = []
    checks: list[Any] = []
    for name in layout.names if complete else [n for n in layout.names if n in tensors]:
        spec = layout[name]
        obj = tensors[name]
        region, kept, check = region_of(obj, spec, writable=writable, what=what)
        specs.append(spec)
        found.append(region)
        keep.append(kept)
        names.append(name)
        objects.append(obj)
        checks.append(check)
    plan = Plan(writable, complete, specs, found, keep)
    if all(check is not None for check in checks):
        try:  # weakly: a plan must not keep anyone's tensors (a trainer's temporaries) alive
            refs = tuple(weakref.ref(obj) for obj in objects)
        except TypeError:  # an object that takes no weak reference: not remembered
            return plan
        remembered = Plan(writable, complete, specs, found, [])  # `keep` is the caller's mapping then
        remembered.names, remembered.objects, remembered.checks = tuple(names), refs, tuple(checks)
        plans.insert(0, remembered)
        del plans[_PLANS:]
    return plan


def host_copy(dsts: Iterable[int], srcs: Iterable[int], sizes: Iterable[int]) -> None:
    """Host memory to host memory: one memmove per tensor."""
    move = ctypes.memmove
    for dst, src, size in zip(dsts, srcs, sizes, strict=True):
        if size:
            move(dst, src, size)


class CopyStream:
    """This process's private stream on one device, with the events that order it (see the module docstring)."""

    __slots__ = ("done", "lock", "ordinal", "start", "stream")

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.stream = _cuda.stream_create(ordinal)
        self.start = _cuda.event_create(ordinal)  # recorded on the caller's stream, waited on by ours
        self.done = _cuda.event_create(ordinal)  # recorded after the copies, waited on by the caller's
        self.lock = threading.Lock()


_streams: dict[int, CopyStream] = {}
_streams_lock = threading.Lock()


def copy_stream(ordinal: int) -> CopyStream:
    """The private copy stream of device ``ordinal`` (made on first use, kept for the process)."""
    found = _streams.get(ordinal)
    if found is None:
        with _streams_lock:
            found = _streams.get(ordinal)
            if found is None:
                found = _streams[ordinal] = CopyStream(ordinal)
    return found


def copy_regions(
    dsts: list[int],
    srcs: list[int],
    sizes: list[int],
    ordinal: int,
    stream: int,
    *,
    waits: Iterable[tuple[Any, bool]] = (),
    orders: Iterable[Any] = (),
    done: Any = None,
    host: bool = False,
    peer: bool = False,
) -> None:
    """Queue the copies on ``ordinal``'s private stream after ``stream``'s work, after each event of
    ``waits`` (``(event, done_already)``: one already done is skipped) and after the producer
    events of the Memories in ``orders``; record ``done`` (default the private stream's own event)
    after them and make ``stream`` wait for it. ``host``: host memory is involved, so wait for
    the copies here before returning. ``peer``: one side is another GPU's memory, so the
    copies go one ``cuMemcpyAsync`` each, the call made for copies between GPUs (the
    batched call was never seen to work there; see ``Snapshot.copy_to``)."""
    private = copy_stream(ordinal)
    with private.lock:
        ours = private.stream
        if not _cuda.stream_idle(ordinal, stream):
            _cuda.event_record(private.start, ordinal, stream)
            _cuda.stream_wait_event(ours, private.start, ordinal)
        for event, finished in waits:
            if not finished:
                _cuda.stream_wait_event(ours, event, ordinal)
        for memory in orders:
            memory.order_stream(ours)
        _cuda.memcpy_batch_async(dsts, srcs, sizes, ordinal, ours, batch=not peer, kernel=not host)
        end = private.done if done is None else done
        _cuda.event_record(end, ordinal, ours)
        _cuda.stream_wait_event(stream, end, ordinal)
    if host:
        _cuda.event_synchronize(end, ordinal)
