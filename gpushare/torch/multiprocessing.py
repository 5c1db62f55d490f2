"""A drop-in for ``torch.multiprocessing`` whose CUDA tensors travel with gpushare's lifetime.

::

    import gpushare.torch.multiprocessing as mp    # in place of: import torch.multiprocessing as mp

The names are torch.multiprocessing's: multiprocessing's (from gpushare, so ``Process``,
``Queue``, ``Pool``, ``Pipe`` ... are gpushare's), the sharing strategies, ``spawn`` and
``start_processes``, and torch's names outside its ``__all__`` (``reductions``, torch's own
reducer module, and the thread-name helpers). Importing it registers gpushare's tensor reducers
with multiprocessing's pickler, as importing torch.multiprocessing registers torch's:
CPU tensors are shared as torch shares them, and a CUDA tensor's memory is leased, freed for
reuse once every receiver let it go, with no ``torch.cuda.ipc_collect()``. A sender's exit
serves its receivers for up to :func:`set_release_timeout` seconds (:func:`get_release_timeout`
reads it). Reference: docs/reference/torch-multiprocessing.md; what changes from torch:
docs/guides/torch-multiprocessing.md.
"""

from __future__ import annotations

import multiprocessing as _multiprocessing

from torch.multiprocessing import (  # noqa: F401 (reductions, the thread names: torch's, outside __all__)
    ENV_VAR_PARALLEL_START,
    ProcessContext,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    _get_thread_name,
    _set_thread_name,
    get_all_sharing_strategies,
    get_sharing_strategy,
    reductions,
    set_sharing_strategy,
    spawn,
    start_processes,
)

import gpushare as _gpushare

from ._sharing import get_release_timeout, init_reductions, set_release_timeout

_NAMES = list(_multiprocessing.__all__)
globals().update((name, getattr(_gpushare, name)) for name in _NAMES)

init_reductions()

__all__ = [
    *_NAMES,
    "ProcessContext",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "get_all_sharing_strategies",
    "get_release_timeout",
    "get_sharing_strategy",
    "set_release_timeout",
    "set_sharing_strategy",
    "spawn",
    "start_processes",
]
