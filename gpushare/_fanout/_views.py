"""A tensor set's slot as tensors: :class:`SlotTensors` (what a Snapshot and a Draft are) and :class:`TensorView`.

A view is a Buffer over one tensor's bytes of the slot, with ``tag`` (a
dtype NumPy lacks). It *holds* what it came from (a snapshot's grant, a
draft's hold): so does every view made from it, and everything made from one
without a copy, so the slot stays held until all are gone. Views never point
back at their snapshot or draft, so the hold goes, and gives the slot back,
as soon as the last of them does. ``release()`` releases the whole *family*
(a ``WeakSet`` of the views) explicitly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from .._buffer import Buffer, HeldView, byte_offset, memory_of
from .._errors import BufferReleasedError
from ._layout import Layout

__all__ = ["Family", "SlotTensors", "TensorView", "release_family"]

Family = weakref.WeakSet  # the views of one snapshot or draft
_T = TypeVar("_T", bound="SlotTensors")


class TensorView(HeldView):
    """One tensor of a tensor set's version: a Buffer that holds its snapshot (or draft).

    ``tag`` names a dtype NumPy lacks (``"bfloat16"``) for a tensor stored as
    an unsigned int of its size; None otherwise. See :mod:`gpushare._fanout._views`.
    """

    __slots__ = ("_family",)

    def __init__(
        self, memory: Any, offset: int, shape: tuple[int, ...], dtype: Any, hold: Any, tag: str | None, family: Any
    ) -> None:
        HeldView.__init__(self, memory, offset, shape, dtype, hold, tag)
        self._family = family
        family.add(self)

    def _like(self, plain: Buffer, tag: str | None) -> TensorView:
        return TensorView(memory_of(plain), byte_offset(plain), plain.shape, plain.dtype, self._hold, tag, self._family)


def release_family(family: Any) -> None:
    """Release every view still alive in ``family``."""
    for view in list(family):
        view.release()


class SlotTensors(Mapping[str, TensorView]):
    """The tensors of one slot, by name, as views made on first access and held by ``hold``
    (see the module docstring). A :class:`~._tensor_reader.Snapshot` and a
    :class:`~._tensor_set.Draft` are these; ``release()`` is theirs."""

    __slots__ = ("_base", "_family", "_hold", "_memory", "_views", "layout", "slot")

    def __init__(self, layout: Layout, slot: int, memory: Any, base: int, hold: Any) -> None:
        self.layout = layout
        self.slot = slot
        self._memory = memory
        self._base = base  # where the slot starts in its allocation
        self._hold: Any = hold  # None once released
        self._views: dict[str, TensorView] = {}
        self._family: Any = None  # made with the first view

    @property
    def names(self) -> tuple[str, ...]:
        """The layout's tensor names, in layout order."""
        return self.layout.names

    @property
    def released(self) -> bool:
        """Whether ``release()`` ran (or the object was dropped): its tensors can no longer be read."""
        return self._hold is None

    def _released_error(self) -> BufferReleasedError:
        """What touching these tensors once released raises (each kind says how to get more)."""
        return BufferReleasedError("these tensors were released in this process")

    def _held(self) -> Any:
        hold = self._hold
        if hold is None:
            raise self._released_error()
        return hold

    def __getitem__(self, name: str) -> TensorView:
        view = self._views.get(name)
        if view is not None and self._hold is not None:
            return view
        hold = self._held()
        spec = self.layout.get(name)
        if spec is None:
            raise KeyError(name)
        if self._family is None:
            self._family = Family()
        view = TensorView(self._memory, self._base + spec.offset, spec.shape, spec.dtype, hold, spec.tag, self._family)
        self._views[name] = view
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, name: object) -> bool:
        return name in self.layout

    def _spend(self) -> Any:
        """Take the hold out (release or publish); every view made is released."""
        hold = self._held()
        self._hold = None
        if self._family is not None:
            self._views.clear()
            release_family(self._family)
        return hold

    release: Callable[[], None]  # a Snapshot's or a Draft's own

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
