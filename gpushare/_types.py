"""The type aliases of gpushare's public signatures, for type checkers and the reference.

Imported only under ``TYPE_CHECKING``: nothing here exists at run time.

- :data:`Shape` -- an int, or a sequence of ints (NumPy integers too).
- :data:`DType` -- a dtype name (``"float32"``, ``"bfloat16"``), a ``numpy.dtype`` or a scalar
  type (``numpy.float32``, an ml_dtypes type).
- :data:`Device` -- a CUDA ordinal, ``"cuda"``, ``"cuda:N"``, ``"cpu"``, a ``torch.device``
  (anything with ``type`` and ``index``), or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["DType", "Device", "DeviceLike", "Shape"]


class DeviceLike(Protocol):
    """What gpushare reads of a ``torch.device``."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> int | None: ...


Shape = int | Sequence[int]
DType = str | np.dtype[Any] | type
Device = int | str | DeviceLike | None
