"""A trainer whose weights live in a tensor set: it trains them in place and publishes without a copy.

- :func:`train_in_set` moves a module's parameters into a ``versions=1`` set (the same
  Parameter objects, ``param.data`` replaced) and publishes them: version 1.
- :meth:`TrainerWeights.update` takes the version back as a draft once no engine holds it,
  runs the block (the optimizer's step), copies in buffers, and publishes.
- Engines copy and let go (``load_state_dict``); a bound engine would stall ``update()``.
- :meth:`TrainerWeights.detach` gives the parameters memory of their own again.
Re-exported by :mod:`gpushare.torch`. Why and the steps: dev/design-notes.md, "Tensor sets (weight sync)".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._errors import LayoutError
from ._weights import _match, _owner_of, _stream_of, _version_tensors, publish_state_dict

__all__ = ["TrainerWeights", "train_in_set"]


def train_in_set(module: torch.nn.Module, tensor_set: Any, *, timeout: float | None = None) -> TrainerWeights:
    """Move ``module``'s parameters into ``tensor_set``'s one version and publish it (version 1).

    ``tensor_set`` must be made with ``versions=1`` from this module's
    ``state_dict_layout(module.state_dict())``, on the module's device. Then
    write the parameters only inside :meth:`TrainerWeights.update`, which
    publishes them: between updates engines copy the version while forward
    and backward read it. ``timeout`` bounds each wait for engines that hold
    the version (:class:`~gpushare.WaitTimeoutError` naming them). Engines
    must copy and let go (``load_state_dict`` or ``snap.copy_to``, then
    release); engines that keep a version (``bind``) need
    ``publish_state_dict`` and two versions. Until
    :meth:`TrainerWeights.detach`, the parameters keep the version's memory
    alive, even past the set's ``close()``.

    Parameters
    ----------
    module : torch.nn.Module
        The model being trained, on the set's device.
    tensor_set : TensorSet
        Made with ``versions=1`` from ``state_dict_layout(module.state_dict())``.
    timeout : float, optional
        Bounds each wait for engines that hold the version.

    Returns
    -------
    TrainerWeights
        The handle whose :meth:`TrainerWeights.update` writes and publishes.

    Raises
    ------
    LayoutError
        If the set does not have one version with the module's layout.
    WaitTimeoutError
        From a later wait, naming the engines that hold the version.
    """
    return TrainerWeights(module, tensor_set, timeout)


class TrainerWeights:
    """A module whose parameters live in a one-version tensor set (:func:`train_in_set`)."""

    def __init__(self, module: torch.nn.Module, tensor_set: Any, timeout: float | None) -> None:
        if tensor_set.versions != 1:
            raise LayoutError(
                f"train_in_set() needs a tensor set made with versions=1 (this one has {tensor_set.versions}): "
                "the trainer's weights are its one version, written in place; for engines that hold versions "
                "(bind), publish copies with publish_state_dict() into a set of two"
            )
        own, keys = _match(module, tensor_set.layout, strict=False)
        if keys.missing_keys or keys.unexpected_keys:
            raise LayoutError(
                f"the tensor set's layout does not match the module's state dict: the module has "
                f"{keys.missing_keys[:5]} besides, the layout {keys.unexpected_keys[:5]}; make the set from "
                "state_dict_layout(module.state_dict())"
            )
        self.module = module
        self.tensor_set = tensor_set
        self.timeout = timeout
        self.version = 0  # the last version published from here
        self._device = tensor_set.device
        seen: set[int] = set()  # parameters already placed (under their first name in the state dict)
        self._params: list[tuple[str, torch.nn.Parameter]] = []  # what lives in the version
        self._copied: list[tuple[str, torch.nn.Module, str, bool]] = []  # what update() copies in
        for name, tensor in own.items():
            if isinstance(tensor, torch.nn.Parameter) and id(tensor) not in seen:
                seen.add(id(tensor))
                self._params.append((name, tensor))
            else:  # a buffer, or a tied parameter's second name
                owner, attribute = _owner_of(module, name)
                self._copied.append((name, owner, attribute, isinstance(tensor, torch.nn.Parameter)))
        where = torch.device("cpu") if self._device == "cpu" else torch.device("cuda", self._device)
        elsewhere = [name for name, param in self._params if param.device != where]
        if elsewhere:
            raise LayoutError(
                f"parameters {elsewhere[:3]} are not on {where}, where the tensor set is: move the module "
                "there first, or make the set on the module's device"
            )
        self._ptrs: list[int] = []
        self._in_update = False
        self._detached = False
        on = _stream_of(self._device)
        # The copy, then the parameters moved onto the version; their own memory goes once the
        # copy is done (waited for here, once: the caching allocator would hand it out at once).
        version = publish_state_dict(tensor_set, module.state_dict(), stream=on, timeout=timeout)
        if on is not None:
            on.synchronize()
        views = _version_tensors(tensor_set, 0)
        with torch.no_grad():
            for name, param in self._params:
                param.data = views[name]
        self._ptrs = [param.data_ptr() for _, param in self._params]
        self.version = version

    @property
    def detached(self) -> bool:
        """Whether :meth:`detach` ran: the parameters are the module's own memory again."""
        return self._detached

    @contextlib.contextmanager
    def update(self, timeout: float | None = None) -> Iterator[TrainerWeights]:
        """Write the parameters in the block (an optimizer's step); publish them when it ends.

        Waits at most ``timeout`` (default: the one given to :func:`train_in_set`)
        for engines that hold the version; on a GPU, torch's current stream
        waits for their reads. On leaving the block, buffers (and a tied
        parameter's second name) are copied into the version and it is
        published on torch's current stream; :attr:`version` is its number.
        An exception in the block publishes nothing (engines wait for the next
        version) and is raised again.

        Parameters
        ----------
        timeout : float, optional
            Bounds the wait for engines that hold the version.

        Yields
        ------
        TrainerWeights
            This object.

        Raises
        ------
        WaitTimeoutError
            If engines still held the version after ``timeout``.
        LayoutError
            If the weights were detached, or inside another ``update()``.
        """
        if self._detached:
            raise LayoutError("these weights were detached from their tensor set; call train_in_set() again")
        if self._in_update:
            raise LayoutError("update() is already running for these weights (updates do not nest)")
        moved = [name for (name, param), ptr in zip(self._params, self._ptrs, strict=True) if param.data_ptr() != ptr]
        if moved:
            raise LayoutError(
                f"{len(moved)} parameter(s) no longer view the tensor set ({moved[:3]}): the module was moved, "
                "cast or given new tensors; detach() and call train_in_set() again"
            )
        tensor_set = self.tensor_set
        on = _stream_of(self._device)
        draft = tensor_set.draft(self.timeout if timeout is None else timeout, stream=on)
        self._in_update = True
        try:
            try:
                yield self
                if self._copied:
                    version = _version_tensors(tensor_set, draft.slot)
                    outs = [version[name] for name, *_ in self._copied]
                    ins = [_current(*copied) for copied in self._copied]
                    with torch.no_grad(), torch.cuda.stream(on) if on is not None else contextlib.nullcontext():
                        torch._foreach_copy_(outs, ins)
            except BaseException:
                draft.release()
                raise
            self.version = int(tensor_set.publish(draft, stream=on))
        finally:
            self._in_update = False

    def detach(self) -> None:
        """Give every parameter memory of its own again (a copy of its values) and leave the set.
        Idempotent; not inside :meth:`update`."""
        if self._detached:
            return
        if self._in_update:
            raise LayoutError("detach() inside update(): leave the block first")
        on = _stream_of(self._device)
        with torch.no_grad(), torch.cuda.stream(on) if on is not None else contextlib.nullcontext():
            for _, param in self._params:
                param.data = param.data.clone()
        self._detached = True

    close = detach

    def __enter__(self) -> TrainerWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "detached" if self._detached else f"version {self.version}"
        return f"<gpushare.torch.TrainerWeights {len(self._params)} parameters in a tensor set, {state}>"


def _current(name: str, owner: torch.nn.Module, attribute: str, is_param: bool) -> torch.Tensor:
    """The module's tensor ``name`` now (a buffer may have been replaced since)."""
    tensor = (owner._parameters if is_param else owner._buffers).get(attribute)
    if tensor is None:
        raise LayoutError(f"the module has no tensor {name!r} any more; the tensor set's layout has it")
    return tensor
