"""What the user's handles on both fan-outs share.

:class:`ProducerHandle` is the producer's end (a Ring, a TensorSet) on its
policy object: it closes the fan-out when it is collected.
:class:`TensorSetInfo` describes a tensor set from the ``info`` the trainer
made, which both its ends hold (a reader got it by unpickling).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ._layout import Layout

__all__ = ["ProducerHandle", "TensorSetInfo"]

_H = TypeVar("_H", bound="ProducerHandle")


class ProducerHandle:
    """A producer's handle on its policy object (``_core``)."""

    def __init__(self, core: Any, what: str) -> None:
        self._core = core
        self._info: dict[str, Any] = core.info
        self._finalizer = weakref.finalize(self, core.close, f"{what} was garbage collected without close()")

    @property
    def device(self) -> int | str:
        """The CUDA ordinal of the slots in this process, or ``"cpu"``."""
        return self._core.device  # type: ignore[no-any-return]

    @property
    def backend(self) -> str:
        """The sharing mechanism of the slots: ``"cuda_ipc"``, ``"cuda_vmm"``, ``"cuda_pool"`` or ``"host"``."""
        return self._core.buffers[0].backend  # type: ignore[no-any-return]

    @property
    def closed(self) -> bool:
        """Whether this end was closed (by ``close()``, or because its Manager shut down)."""
        return self._core.closed is not None

    close: Callable[[], None]  # the handle's own

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorSetInfo:
    """What both ends of a tensor set know of it."""

    _layout: Layout
    _info: dict[str, Any]

    @property
    def layout(self) -> Layout:
        """Names -> TensorSpec (shape, dtype, tag, offset, nbytes), in packing order."""
        return self._layout

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names, in packing order."""
        return self.layout.names

    @property
    def nbytes(self) -> int:
        """Bytes of one version (every tensor, at its aligned offset)."""
        return self.layout.nbytes

    @property
    def versions(self) -> int:
        """How many versions the set keeps: one per slot."""
        return int(self._info["versions"])
