"""gpushare.torch: a PyTorch DataLoader whose workers build batches in pre-shared slots, and weight sync.

::

    from gpushare.torch import DataLoader

    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=4, device="cuda:0")
    for images, labels in loader:      # CUDA tensors viewing a worker's slot: no copy here
        loss = model(images, labels)   # the slot goes back when the batch is dropped

:class:`DataLoader` is :class:`gpushare.SlotLoader` with torch's conventions: samplers
(``shuffle``, ``sampler``, ``batch_sampler``, ``generator``), ``collate_fn``, ``worker_init_fn``,
``timeout``, ``prefetch_factor``, per-worker seeds and ``get_worker_info()`` in workers. Without
``collate_fn``, samples (tensors, arrays, numbers, and tuples, lists, dicts of them) are stacked
*into* the slot; with one, its result is copied in. Slots live on ``device`` (default: the current
CUDA device when torch sees one, else host shared memory, as CPU tensors). Plain
``torch.utils.data.DataLoader`` runs gpushare's workers with ``multiprocessing_context=gpushare.get_context()``.

Weight sync on a :class:`~gpushare.TensorSet`: :func:`publish_state_dict`, :func:`load_state_dict`,
:func:`bind`, :func:`train_in_set`. torch is imported with this module; gpushare does not depend on it.

Rooms: ``_dataloader`` (the DataLoader), ``_weights`` (state dicts on a TensorSet), ``_trainer``
(training in a set) and ``_sharing`` (CUDA tensors pickled under gpushare's lifetime, for
:mod:`gpushare.torch.multiprocessing`). Each loads at the first use of one of its names, so
``import gpushare.torch.multiprocessing`` loads the drop-in alone.
"""

from __future__ import annotations

from importlib import import_module as _import_module

try:
    import torch as _torch  # noqa: F401  (checked here, where the missing package is named)
except ImportError as exc:  # pragma: no cover - exercised where torch is missing
    raise ImportError(
        "gpushare.torch needs PyTorch, which is not installed in this environment; install torch "
        "(https://pytorch.org) or use gpushare.SlotLoader, which needs no torch"
    ) from exc

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .._loader_workers import prepare_loaders as prepare_loaders
    from ._dataloader import DataLoader as DataLoader
    from ._trainer import TrainerWeights as TrainerWeights
    from ._trainer import train_in_set as train_in_set
    from ._weights import as_tensor as as_tensor
    from ._weights import as_tensors as as_tensors
    from ._weights import bind as bind
    from ._weights import draft_tensors as draft_tensors
    from ._weights import load_state_dict as load_state_dict
    from ._weights import publish_state_dict as publish_state_dict
    from ._weights import state_dict_layout as state_dict_layout

__all__ = [
    "DataLoader",
    "TrainerWeights",
    "as_tensor",
    "as_tensors",
    "bind",
    "draft_tensors",
    "load_state_dict",
    "prepare_loaders",
    "publish_state_dict",
    "state_dict_layout",
    "train_in_set",
]

#: Where each public name lives, loaded at its first use.
_HOMES = {
    "DataLoader": "._dataloader",
    "TrainerWeights": "._trainer",
    "train_in_set": "._trainer",
    "prepare_loaders": ".._loader_workers",
    **dict.fromkeys(
        ("as_tensor", "as_tensors", "bind", "draft_tensors", "load_state_dict", "publish_state_dict",
         "state_dict_layout"),
        "._weights",
    ),
}  # fmt: skip


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
