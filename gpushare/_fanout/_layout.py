"""The layout of a tensor set: every tensor's place in a slot (one allocation each).

A layout is decided once, when the set is made, from a mapping of names to
what describes a tensor (the values give names, shapes and dtypes only):

* a NumPy array, or an object with ``__cuda_array_interface__``;
* ``(shape, dtype)`` or ``(shape, dtype, tag)``.

A *tag* names a dtype NumPy lacks (``"bfloat16"``, ``"float8_e4m3fn"``,
...). Such a tensor is stored as the unsigned integer of its size and
carries the tag, as a loader batch does (:mod:`gpushare._batch`): adapters
(``gpushare.torch``) turn the tag back into their dtype. ``(shape,
"bfloat16")`` is the same as ``(shape, "uint16", "bfloat16")``, and so is a
NumPy array whose dtype NumPy only knows through an extension
(``ml_dtypes.bfloat16``).

Packing: tensors go in the mapping's order, each at the next multiple of
:data:`ALIGN` bytes (256: enough for every dtype, for vectorised CUDA
loads and for ``cuMemcpyBatchAsync``), so a slot is one contiguous
range of :attr:`Layout.nbytes` bytes and each tensor a window of it. The
layout travels with the set's pickled form as plain values
(:meth:`Layout.to_wire`) and is checked again when it is read back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .._buffer import check_dtype, check_shape
from .._errors import LayoutError

__all__ = ["ALIGN", "TAG_SIZES", "Layout", "TensorSpec", "align", "make_layout"]

#: Every tensor of a slot starts on a multiple of this many bytes.
ALIGN = 256

#: Dtypes NumPy lacks that a tag may name, with their size in bytes (a tag not listed
#: here is accepted with an unsigned integer dtype of the right size).
TAG_SIZES = {
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex32": 4,
}
_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_MAX_TENSORS = 1 << 16


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TensorSpec(NamedTuple):
    """One tensor of a layout: where it lives in a slot and what it is."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]  # how it is stored (an unsigned int of the tag's size when tagged)
    tag: str | None  # the dtype NumPy lacks, e.g. "bfloat16"; None for plain NumPy dtypes
    offset: int  # bytes from the start of the slot, a multiple of ALIGN
    nbytes: int

    @property
    def dtype_name(self) -> str:
        """The dtype as a user names it: the tag if any, else the NumPy name."""
        return self.tag or self.dtype.name

    def describe(self) -> str:
        return f"{self.name!r} {self.shape} {self.dtype_name}"


class Layout(Mapping[str, TensorSpec]):
    """Names -> :class:`TensorSpec`, in packing order; ``nbytes`` is one slot's size."""

    __slots__ = ("_specs", "names", "nbytes", "plans")

    def __init__(self, specs: list[TensorSpec]) -> None:
        self._specs = {s.name: s for s in specs}
        self.names = tuple(s.name for s in specs)
        last = specs[-1]
        self.nbytes = last.offset + last.nbytes
        self.plans: list[Any] = []  # the last few tensor mappings checked against it (see _copy.regions)

    def __getitem__(self, name: str) -> TensorSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.to_wire() == other.to_wire()

    def __hash__(self) -> int:
        return hash(tuple(self.to_wire()))

    def __repr__(self) -> str:
        return f"<gpushare tensor layout: {len(self)} tensors, {self.nbytes} bytes>"

    def specs(self) -> list[TensorSpec]:
        return list(self._specs.values())

    def to_wire(self) -> list[tuple[str, tuple[int, ...], str, str | None, int]]:
        """Plain values for the set's pickled form: ``(name, shape, dtype str, tag, offset)``."""
        return [(s.name, s.shape, s.dtype.str, s.tag, s.offset) for s in self._specs.values()]

    @classmethod
    def from_wire(cls, wire: list[Any]) -> Layout:
        """The layout :meth:`to_wire` described, checked (offsets aligned, in order, not overlapping)."""
        specs: list[TensorSpec] = []
        end = 0
        for name, shape, dtype, tag, offset in wire:
            dims = check_shape(shape)
            dt = check_dtype(dtype)
            nbytes = math.prod(dims) * dt.itemsize
            if offset % ALIGN or offset < end:
                raise LayoutError(f"a tensor set's layout arrived damaged (tensor {name!r} at offset {offset})")
            specs.append(TensorSpec(str(name), dims, dt, tag, int(offset), nbytes))
            end = offset + nbytes
        if not specs:
            raise LayoutError("a tensor set's layout arrived empty")
        return cls(specs)


def _tagged(shape: Any, tag: str, itemsize: int | None, name: str) -> tuple[tuple[int, ...], np.dtype[Any], str]:
    size = TAG_SIZES.get(tag, itemsize)
    if size is None or size not in _UNSIGNED:
        raise LayoutError(
            f"tensor {name!r}: tag {tag!r} names no dtype gpushare knows the size of; give the storage dtype "
            f"too, as (shape, 'uint16', {tag!r}) (an unsigned int of the tagged dtype's size)"
        )
    return check_shape(shape), np.dtype(_UNSIGNED[size]), tag


def _spec_of(name: str, value: Any) -> tuple[tuple[int, ...], np.dtype[Any], str | None]:
    """(shape, storage dtype, tag) of one layout value, or a LayoutError saying what is valid."""
    try:
        if isinstance(value, np.ndarray):
            return _from_dtype(name, value.shape, value.dtype)
        cai = getattr(value, "__cuda_array_interface__", None) if not isinstance(value, tuple) else None
        if cai is not None:
            return _from_dtype(name, tuple(cai["shape"]), np.dtype(cai["typestr"]))
        if isinstance(value, tuple) and len(value) in (2, 3):
            shape, dtype = value[0], value[1]
            tag = value[2] if len(value) == 3 else None
            if tag is not None:
                if not isinstance(tag, str) or not tag:
                    raise LayoutError(f"tensor {name!r}: the tag must be a dtype name (a str), not {tag!r}")
                dt = check_dtype(dtype)
                if dt.kind != "u":
                    raise LayoutError(
                        f"tensor {name!r}: a tagged tensor is stored as an unsigned int of the tag's size "
                        f"(e.g. (shape, 'uint16', 'bfloat16')), not as {dt}"
                    )
                shape_, stored, _ = _tagged(shape, tag, dt.itemsize, name)
                if stored != dt:
                    raise LayoutError(
                        f"tensor {name!r}: {tag} takes {stored.itemsize} byte(s) per element; store it as {stored}, "
                        f"not {dt}"
                    )
                return shape_, dt, tag
            if isinstance(dtype, str) and dtype in TAG_SIZES:
                return _tagged(shape, dtype, None, name)
            return _from_dtype(name, shape, dtype)
    except LayoutError:
        raise
    except (ValueError, TypeError) as exc:
        raise LayoutError(f"tensor {name!r}: {exc}") from None
    raise LayoutError(
        f"tensor {name!r}: {type(value).__name__} does not describe a tensor; give a NumPy array, an object "
        "with __cuda_array_interface__, (shape, dtype) or (shape, dtype, tag) (gpushare.torch.state_dict_layout "
        "makes a layout from a torch state dict)"
    )


def _from_dtype(name: str, shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype[Any], str | None]:
    if isinstance(dtype, np.dtype) and dtype.name in TAG_SIZES and dtype.kind not in "biufc":
        return _tagged(shape, dtype.name, dtype.itemsize, name)  # ml_dtypes.bfloat16 and friends
    try:
        dt = check_dtype(dtype)
    except ValueError as exc:
        raise LayoutError(f"tensor {name!r}: {exc}; for a dtype NumPy lacks give (shape, dtype, tag)") from None
    return check_shape(shape), dt, None


def make_layout(layout: Mapping[str, Any]) -> Layout:
    """Pack ``layout`` (names -> arrays or ``(shape, dtype[, tag])``) into one slot's places."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, Mapping):
        raise LayoutError(
            f"layout must be a mapping of names to tensors or (shape, dtype[, tag]), not {type(layout).__name__}"
        )
    if not layout:
        raise LayoutError("layout is empty: a tensor set needs at least one tensor")
    if len(layout) > _MAX_TENSORS:
        raise LayoutError(f"layout has {len(layout)} tensors; at most {_MAX_TENSORS} are supported")
    specs: list[TensorSpec] = []
    end = 0
    for name, value in layout.items():
        if not isinstance(name, str) or not name:
            raise LayoutError(f"layout names must be non-empty strings, not {name!r}")
        shape, dtype, tag = _spec_of(name, value)
        offset = align(end)
        nbytes = math.prod(shape) * dtype.itemsize
        specs.append(TensorSpec(name, shape, dtype, tag, offset, nbytes))
        end = offset + nbytes
    return Layout(specs)
