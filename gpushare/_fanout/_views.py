"""A tensor of a tensor set as handed out: :class:`TensorView`, and the family it belongs to.

A :class:`~._tensor_reader.Snapshot` (an engine's version) and a
:class:`~._tensor_set.Draft` (the trainer's version being filled in place)
give each tensor as a TensorView: a Buffer over that tensor's bytes of the
version's allocation, with ``tag`` (the dtype NumPy lacks, if any).

A view *holds* what it came from -- the snapshot's grant or the draft's
slot -- through ``_hold``, the way a loader batch's arrays hold their ring
item (:class:`gpushare._batch.SlotArray`): every view, every view of a view,
and everything made from one without a copy (NumPy arrays on the host, whose
base is the view; DLPack and ``__cuda_array_interface__`` tensors, which keep
a view) keeps it, so the version stays held until all of them are gone. The
hold is an object whose only reference is from these views and their
snapshot or draft: when the last goes, CPython frees it at once (no
reference cycle: views never point back at their snapshot) and its
finalizer gives the version back.

Each view also joins its *family* (a ``WeakSet`` shared by the snapshot or
draft and all views made from it), so that ``release()`` of the snapshot or
draft releases every one of them explicitly: touching one afterwards raises
:class:`~gpushare.BufferReleasedError`.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .._buffer import Buffer, byte_offset, memory_of

__all__ = ["Family", "TensorView", "release_family"]

Family = weakref.WeakSet  # the views of one snapshot or draft


class TensorView(Buffer):
    """One tensor of a tensor set's version: a Buffer that holds its snapshot (or draft).

    ``tag`` names a dtype NumPy lacks (``"bfloat16"``) for a tensor stored as
    an unsigned int of its size; None otherwise. See :mod:`gpushare._fanout._views`.
    """

    __slots__ = ("_family", "_hold", "tag")

    def __init__(
        self, memory: Any, offset: int, shape: tuple[int, ...], dtype: Any, hold: Any, tag: str | None, family: Any
    ) -> None:
        Buffer.__init__(self, memory, offset, shape, dtype)
        self._hold = hold
        self.tag = tag
        self._family = family
        family.add(self)

    def view(self, dtype: object = None, shape: object = None) -> Buffer:
        plain = Buffer.view(self, dtype, shape)
        tag = self.tag if plain.dtype == self.dtype else None  # a view as another dtype is no longer the tag's
        out = TensorView(memory_of(plain), byte_offset(plain), plain.shape, plain.dtype, self._hold, tag, self._family)
        plain.release()
        return out

    def numpy(self) -> np.ndarray[Any, Any]:
        """Host backend: a zero-copy NumPy view that holds the version; CUDA: a host copy."""
        if self.device == "cpu":
            self._check()
            return np.asarray(self)  # through __array_interface__: the array's base is this view
        return super().numpy()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.device != "cpu":
            raise AttributeError("device memory has no __array_interface__")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3}

    def release(self) -> None:
        """Release this view (and its hold on the version). Idempotent."""
        super().release()
        self._hold = None

    def __repr__(self) -> str:
        state = "released" if self.released else self.backend
        tag = f" tag={self.tag}" if self.tag else ""
        return f"<gpushare.TensorView shape={self.shape} dtype={self.dtype}{tag} device={self.device!r} {state}>"


def release_family(family: Any) -> None:
    """Release every view still alive in ``family``."""
    for view in list(family):
        view.release()
