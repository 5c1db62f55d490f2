"""Weight sync for PyTorch modules on a gpushare TensorSet (re-exported by :mod:`gpushare.torch`).

- Trainer: :func:`state_dict_layout` makes the set's layout; :func:`publish_state_dict` copies a
  state dict into a draft on torch's current stream and publishes it; :func:`draft_tensors`
  gives a draft's tensors, to write in place.
- Engine, copy mode: :func:`load_state_dict` copies a snapshot into the module (one batched copy).
- Engine, zero-copy: :func:`bind` makes the module's tensors view a snapshot, which it keeps.
- Torch tensors over each slot are made once and kept; so is where each tensor goes (a plan).
torch is imported with this module; gpushare's core never imports it.
How each works: dev/design-notes.md, "Tensor sets (weight sync)".
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from .. import _cuda
from .._errors import LayoutError

__all__ = [
    "IncompatibleKeys",
    "as_tensor",
    "as_tensors",
    "bind",
    "draft_tensors",
    "load_state_dict",
    "publish_state_dict",
    "state_dict_layout",
]

_NUMPY_DTYPES = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_BOUND = "_gpushare_snapshot"  # the attribute a bound module keeps its snapshot in
_PLAN = "_gpushare_bind_plan"  # ... and where bind() put each tensor (_BindPlan)
_LOAD_PLAN = "_gpushare_load_plan"  # where load_state_dict() copies each tensor (a _BindPlan too)


class IncompatibleKeys(NamedTuple):
    """What :func:`load_state_dict` and :func:`bind` could not match (as torch's ``load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _layout_dtype(dtype: torch.dtype) -> tuple[str, str | None]:
    """The NumPy dtype a tensor is stored as, and a tag naming the torch dtype when NumPy has none."""
    known = _NUMPY_DTYPES.get(dtype)
    if known is not None:
        return known, None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _UNSIGNED[itemsize], str(dtype).rsplit(".", 1)[-1]  # bfloat16, float8_*, uint16, ...


def state_dict_layout(state_dict: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """A tensor set layout from a state dict, to pass to ``manager.tensor_set(...)``.

    Parameters
    ----------
    state_dict : Mapping of str to torch.Tensor
        ``model.state_dict()``.

    Returns
    -------
    dict of str to tuple
        Name to ``(shape, dtype)``, or ``(shape, dtype, tag)`` for a dtype NumPy lacks
        (bfloat16, float8): stored as an unsigned int of its size with the tag.
    """
    layout: dict[str, tuple[Any, ...]] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(
                f"state dict entry {name!r} is a {type(tensor).__name__}, not a tensor; a tensor set holds tensors "
                "only (drop other entries, or send them another way)"
            )
        stored, tag = _layout_dtype(tensor.dtype)
        layout[name] = (tuple(tensor.shape), stored) if tag is None else (tuple(tensor.shape), stored, tag)
    return layout


def as_tensor(view: Any) -> torch.Tensor:
    """A torch tensor viewing one tensor of a snapshot or draft (no copy), in its torch dtype.

    Parameters
    ----------
    view : Buffer
        One tensor of a snapshot or draft (``snap["name"]``).

    Returns
    -------
    torch.Tensor
        It holds the view, and so the version: on the host through the NumPy array it
        is made from, on CUDA through DLPack (torch's current stream waits for the
        version's ready event).
    """
    if view.device == "cpu":
        tensor = torch.from_numpy(view.numpy())
    else:
        tensor = torch.from_dlpack(view)
    tag = view.tag
    return tensor.view(getattr(torch, tag)) if tag else tensor


def as_tensors(snapshot: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a snapshot (or draft) as a torch tensor viewing it.

    Parameters
    ----------
    snapshot : Snapshot or Draft
        What ``reader.latest()``, ``reader.wait()`` or ``ts.draft()`` gave.

    Returns
    -------
    dict of str to torch.Tensor
        One tensor per name, each as :func:`as_tensor` makes it.
    """
    return {name: as_tensor(snapshot[name]) for name in snapshot}


def draft_tensors(draft: Any) -> Mapping[str, torch.Tensor]:
    """Every tensor of a draft (``ts.draft()``) as a torch tensor to write in place: a read-only
    mapping of names to tensors, in microseconds.

    Parameters
    ----------
    draft : Draft
        What ``ts.draft()`` gave, not yet published or released.

    Returns
    -------
    Mapping of str to torch.Tensor
        Read-only; its tensors are writable.

    Raises
    ------
    BufferReleasedError
        If the draft was already published or released.

    Notes
    -----
    The tensors are made once per slot of the set and reused by every later
    draft of that slot (:func:`as_tensors` makes one per view, each time:
    milliseconds for a model's worth of tensors on CUDA). They view the draft's
    version but do not hold it: write them on the draft's ``stream`` while the
    draft is out, then ``ts.publish(draft)``; once it is published or
    released, writing them writes a version engines may hold.
    """
    draft._held()  # the draft is still out
    return _version_tensors(draft._set, draft.slot)


def _stream_of(device: Any) -> Any:
    """torch's current stream on a CUDA ``device`` (an ordinal), or None on the host."""
    return torch.cuda.current_stream(device) if isinstance(device, int) else None


def publish_state_dict(
    tensor_set: Any, state_dict: Mapping[str, torch.Tensor], *, stream: Any = None, timeout: float | None = None
) -> int:
    """Publish ``state_dict`` as a new version of ``tensor_set``.

    Parameters
    ----------
    tensor_set : TensorSet
        The trainer's end, made from ``state_dict_layout(state_dict)``.
    state_dict : Mapping of str to torch.Tensor
        Every name of the set's layout, each tensor of the layout's shape and dtype
        (no casting).
    stream : torch.cuda.Stream or int, optional
        Where the copies run (default: torch's current stream on the set's device).
    timeout : float, optional
        Seconds to wait for a version no engine holds; None waits for as long as it
        takes.

    Returns
    -------
    int
        The version's number.

    Raises
    ------
    LayoutError
        If a name is missing or a tensor does not fit the layout.
    WaitTimeoutError
        If no version came free within ``timeout``.

    Notes
    -----
    Copies every tensor into a draft on ``stream`` (default: torch's current
    stream on the set's device): on a GPU, the contiguous tensors on the set's
    device with gpushare's copy kernel (all of them in one launch per 96), any
    other with ``torch._foreach_copy_``; then publishes the draft on that
    stream. Waits at most ``timeout`` seconds for a version no
    engine holds. The state dict must have every name of the set's layout,
    each tensor of the layout's shape and dtype (no casting).
    """
    device = tensor_set.device
    on = stream if stream is not None else _stream_of(device)
    if on is not None and not isinstance(on, torch.cuda.Stream):
        on = torch.cuda.ExternalStream(int(on), device=device)  # an int CUstream handle
    draft = tensor_set.draft(timeout, stream=on)  # first: a closed set says so (TensorSetClosedError)
    try:
        plan = _PublishPlan.kept(tensor_set, state_dict, on is not None)
        dsts, srcs, sizes = plan.addresses(tensor_set, draft.slot)
        if sizes:  # tensors on the set's GPU: copied by address on the stream, like torch's own kernels
            _cuda.memcpy_batch_async(dsts, srcs, sizes, device, on.cuda_stream, kernel=True)
        if plan.others:
            version = _version_tensors(tensor_set, draft.slot)
            outs = [version[name] for name in plan.others]
            ins = [state_dict[name] for name in plan.others]
            with torch.no_grad(), torch.cuda.stream(on) if on is not None else contextlib.nullcontext():
                if hasattr(torch, "_foreach_copy_"):
                    torch._foreach_copy_(outs, ins)
                else:  # an older torch: one copy per tensor
                    for dst, src in zip(outs, ins, strict=True):
                        dst.copy_(src)
    except BaseException:
        draft.release()
        raise
    return int(tensor_set.publish(draft, stream=on))


class _PublishPlan:
    """How :func:`publish_state_dict` copies one state dict's tensors into a set's versions,
    worked out on its first publish and kept with the set for the next.

    A trainer publishes the same weights every step: ``model.state_dict()`` is a
    new mapping of new tensor objects (detached) over the same memory. Checking
    each against the layout and sorting the kernel's copies from the others was
    a measurable share of a copy-mode sync (the `weight_sync_8b` benchmark
    scenario's 291 tensors), all of it before the GPU had anything to do. A kept plan is used again
    when the mapping has the layout's names and each tensor is at the same
    address, of the same shape and dtype, as contiguous as before and on the same
    side (host or GPU): then a new plan would copy the same bytes from the same
    addresses. Anything else works it out again. It keeps no tensor.
    """

    __slots__ = ("checks", "gpu", "kernel", "names", "others", "slots")

    KEPT = 2  # plans per set (a trainer publishing two models into one set is rare)

    def __init__(self, tensor_set: Any, state_dict: Mapping[str, torch.Tensor], gpu: bool) -> None:
        names = tensor_set.names
        missing = [n for n in names if n not in state_dict]
        unexpected = [n for n in state_dict if n not in tensor_set.layout]
        if missing or unexpected:
            raise LayoutError(
                f"the state dict does not match the tensor set's layout: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; make the set from this model's state_dict_layout(model.state_dict())"
            )
        shapes = _version_tensors(tensor_set, 0)  # any version: every one has the layout's tensors
        kernel: list[tuple[str, int]] = []  # (name, bytes): same GPU as the set, contiguous
        others: list[str] = []  # torch._foreach_copy_ (another device, strided; all of them on the host)
        checks = []
        for name, dst in shapes.items():
            src = state_dict[name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise LayoutError(
                    f"state dict tensor {name!r} is {tuple(src.shape)} {src.dtype}; the layout says "
                    f"{tuple(dst.shape)} {dst.dtype} (no casting or reshaping)"
                )
            contiguous = src.is_contiguous()
            checks.append((src.data_ptr(), src.shape, src.dtype, contiguous, src.is_cuda))
            if not dst.numel():
                continue
            if gpu and src.device == dst.device and contiguous:
                kernel.append((name, dst.numel() * dst.element_size()))
            else:
                others.append(name)
        self.gpu = gpu
        self.names = tuple(shapes)
        self.checks = tuple(checks)
        self.kernel = kernel
        self.others = tuple(others)
        self.slots: dict[int, tuple[list[int], list[int], list[int]]] = {}

    @classmethod
    def kept(cls, tensor_set: Any, state_dict: Mapping[str, torch.Tensor], gpu: bool) -> _PublishPlan:
        """The set's plan for these tensors: a kept one that still fits, else a new one (kept)."""
        plans: list[_PublishPlan] = tensor_set._adapters.setdefault("torch-publish", [])
        for i, plan in enumerate(plans):
            if plan.fits(state_dict, gpu):
                if i:
                    plans.insert(0, plans.pop(i))
                return plan
        plan = cls(tensor_set, state_dict, gpu)
        plans.insert(0, plan)
        del plans[cls.KEPT :]
        return plan

    def fits(self, state_dict: Mapping[str, torch.Tensor], gpu: bool) -> bool:
        if gpu != self.gpu or len(state_dict) != len(self.names):
            return False
        get = state_dict.get
        for name, (ptr, shape, dtype, contiguous, cuda) in zip(self.names, self.checks, strict=True):
            src = get(name)
            if (
                src is None
                or src.data_ptr() != ptr
                or src.shape != shape
                or src.dtype != dtype
                or src.is_contiguous() != contiguous
                or src.is_cuda != cuda
            ):
                return False
        return True

    def addresses(self, tensor_set: Any, slot: int) -> tuple[list[int], list[int], list[int]]:
        """The kernel's copies into version ``slot``: (version addresses, state dict addresses, bytes)."""
        found = self.slots.get(slot)
        if found is None:
            version = _version_tensors(tensor_set, slot)
            ptrs = dict(zip(self.names, (check[0] for check in self.checks), strict=True))
            found = self.slots[slot] = (
                [version[name].data_ptr() for name, _ in self.kernel],
                [ptrs[name] for name, _ in self.kernel],
                [size for _, size in self.kernel],
            )
        return found


def _version_tensors(tensor_set: Any, slot: int) -> Mapping[str, torch.Tensor]:
    """Torch tensors over every tensor of slot ``slot`` (names -> tensors, read-only, in
    layout order), made once per slot.

    Making a tensor from a Buffer is a DLPack export; a trainer that publishes a state
    dict of hundreds of tensors every step would pay one per tensor. These views are
    written only while a draft of that version is out (:func:`publish_state_dict`,
    :func:`draft_tensors`).
    """
    return _slot_tensors(tensor_set._adapters, slot, lambda: tensor_set._slot_buffer(slot), tensor_set.layout)


def _snapshot_tensors(snapshot: Any) -> Mapping[str, torch.Tensor]:
    """An engine's torch tensors over every tensor of ``snapshot``'s slot, made once per
    slot in this reader (as :func:`_version_tensors` for the trainer).

    They hold no version: whoever uses them holds the snapshot (:func:`bind` keeps it in the
    module), and orders its stream after the snapshot's ready event (``_order_stream``).
    """
    return _slot_tensors(snapshot._adapters, snapshot.slot, snapshot._slot_buffer, snapshot.layout)


def _slot_tensors(adapters: dict[str, Any], slot: int, version_buffer: Any, layout: Any) -> Mapping[str, torch.Tensor]:
    """The tensors of version ``slot`` kept in ``adapters`` (a set's or a reader's), made on first
    use from ``version_buffer()`` (a Buffer over the version's bytes, released here: the tensors
    keep a count of their own on the memory)."""
    cache = adapters.setdefault("torch", {})
    tensors = cache.get(slot)
    if tensors is None:
        buffer = version_buffer()
        try:
            flat = torch.from_numpy(buffer.numpy()) if buffer.device == "cpu" else torch.from_dlpack(buffer)
        finally:
            buffer.release()
        made = {}
        for name, spec in layout.items():
            dtype = getattr(torch, spec.tag or spec.dtype.name)
            made[name] = flat[spec.offset : spec.offset + spec.nbytes].view(dtype).view(spec.shape)
        tensors = cache[slot] = MappingProxyType(made)
    return tensors  # type: ignore[no-any-return]


def _match(module: torch.nn.Module, snapshot: Mapping[str, Any], strict: bool) -> tuple[Any, IncompatibleKeys]:
    own = module.state_dict(keep_vars=True)
    missing = [name for name in own if name not in snapshot]
    unexpected = [name for name in snapshot if name not in own]
    if strict and (missing or unexpected):
        raise LayoutError(
            f"the snapshot does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]} "
            f"({len(missing)} and {len(unexpected)}); pass strict=False to load what matches"
        )
    return own, IncompatibleKeys(missing, unexpected)


def load_state_dict(module: torch.nn.Module, snapshot: Mapping[str, Any], *, strict: bool = True) -> IncompatibleKeys:
    """Copy ``snapshot`` into ``module``'s own parameters and buffers (copy mode), in one batched copy.

    The copies run on torch's current stream of the module's device (no host
    wait on a GPU): later work on that stream sees the new weights. Release
    the snapshot afterwards (``with reader.wait(...) as snap:``).

    Parameters
    ----------
    module : torch.nn.Module
        The engine's model.
    snapshot : Snapshot
        A version from ``reader.latest()`` or ``reader.wait()``.
    strict : bool
        True (default): the names must match exactly.

    Returns
    -------
    IncompatibleKeys
        The missing and unexpected names, as ``Module.load_state_dict`` returns them.

    Raises
    ------
    LayoutError
        With ``strict``, if the names differ; or if a tensor's shape or dtype does
        not match.
    """
    reader = hasattr(snapshot, "_order_stream")  # a reader's snapshot, not a mapping of views
    # Where each tensor goes is worked out once per module and layout, as bind() does:
    # module.state_dict() walks every submodule (a measurable share of a copy-mode sync:
    # the `weight_sync` benchmark scenario), every sync; the kept plan is checked instead.
    plan = _BindPlan.kept(module, snapshot, strict, _LOAD_PLAN) if reader else None
    if plan is None:
        own, keys = _match(module, snapshot, strict)
        plan = _BindPlan.make(module, snapshot, strict, own, keys, _LOAD_PLAN) if reader else None
    if plan is not None:
        targets, keys = plan.targets(), plan.keys
    else:
        # The module's own tensor objects (not .data, a new object each time): the same objects come
        # every time, so the snapshot's layout remembers the checks (see gpushare._fanout._copy).
        targets = {name: own[name] for name in snapshot if name in own}
    devices = {t.device for t in targets.values()}
    cuda = [d for d in devices if d.type == "cuda"]
    snapshot.copy_to(targets, stream=torch.cuda.current_stream(cuda[0]) if cuda else None)  # type: ignore[attr-defined]
    return keys


def _owner_of(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attribute


def bind(module: torch.nn.Module, snapshot: Any, *, strict: bool = True) -> IncompatibleKeys:
    """Zero-copy: make ``module``'s parameters and buffers view ``snapshot``'s memory.

    Each parameter keeps its identity (``param.data`` is replaced); each
    buffer is replaced by the view. The module keeps the snapshot, and the
    snapshot bound before (if any) is released once every tensor points at
    the new one. Shapes and dtypes must match (no casting); ``strict`` as
    :func:`load_state_dict`. The module's tensors end up on the snapshot's
    device; on CUDA, torch's current stream waits for the version's writes.

    The module is what holds the version: its tensors view memory that this
    process maps once per slot and reuses for every version bound
    later (a rebind costs microseconds a tensor, not a DLPack export each).
    A tensor taken from the module does not hold the version on its own:
    once the module is rebound or dropped, the trainer may rewrite it.

    Parameters
    ----------
    module : torch.nn.Module
        The engine's model.
    snapshot : Snapshot
        A version from ``reader.latest()`` or ``reader.wait()``; the module holds it
        from now on.
    strict : bool
        As for :func:`load_state_dict`.

    Returns
    -------
    IncompatibleKeys
        The missing and unexpected names.

    Raises
    ------
    LayoutError
        If a shape or dtype differs, or, with ``strict``, the names differ.
    """
    reader = hasattr(snapshot, "_order_stream")  # a reader's snapshot, not a mapping of views
    plan = _BindPlan.kept(module, snapshot, strict) if reader else None
    if plan is None:
        own, keys = _match(module, snapshot, strict)
        # A reader's snapshot: the module's tensors over its slot are made once
        # per slot (DLPack on CUDA: one export per tensor, a cost per version), and
        # where each goes in the module is worked out once (module.state_dict() walks
        # every submodule, as load_state_dict() notes) and checked after.
        plan = _BindPlan.make(module, snapshot, strict, own, keys) if reader else None
    if plan is not None:
        made = plan.tensors(module, snapshot)
        _order_torch_stream(snapshot, made[0] if made else None)
        plan.assign(made)
        _hold(module, snapshot)
        return plan.keys
    if reader:  # a module _BindPlan cannot follow (state-dict hooks renaming its tensors)
        cached = _snapshot_tensors(snapshot)
        # A tensor object per bind (detach: same memory, no copy), so that modules bound to one
        # slot share no tensor object (a buffer is the module's own after this).
        tensors = {name: t.detach() for name, t in cached.items() if name in own}
        _order_torch_stream(snapshot, next(iter(cached.values()), None))
    else:
        tensors = {name: as_tensor(snapshot[name]) for name in snapshot if name in own}
    for name, tensor in tensors.items():
        _check_same(name, own[name].shape, own[name].dtype, tensor)
    with torch.no_grad():
        for name, tensor in tensors.items():
            current = own[name]
            if isinstance(current, torch.nn.Parameter):
                current.data = tensor
            else:
                owner, attribute = _owner_of(module, name)
                owner._buffers[attribute] = tensor
    _hold(module, snapshot)
    return keys


def _hold(module: torch.nn.Module, snapshot: Any) -> None:
    """The module keeps ``snapshot``; the one it kept before is released (its tensors point at
    the new one now)."""
    previous = module.__dict__.get(_BOUND)
    module.__dict__[_BOUND] = snapshot
    if previous is not None and previous is not snapshot:
        previous.release()


def _order_torch_stream(snapshot: Any, tensor: torch.Tensor | None) -> None:
    """On CUDA, torch's current stream (of ``tensor``'s device) waits for the version's writes."""
    if tensor is not None and tensor.is_cuda:
        snapshot._order_stream(torch.cuda.current_stream(tensor.device).cuda_stream)


def _check_same(name: str, shape: torch.Size, dtype: torch.dtype, tensor: torch.Tensor) -> None:
    """The module's tensor ``name`` (of ``shape`` and ``dtype``) can be bound to ``tensor``."""
    if shape != tensor.shape or dtype != tensor.dtype:
        raise LayoutError(
            f"module tensor {name!r} is {tuple(shape)} {dtype}; the snapshot's is "
            f"{tuple(tensor.shape)} {tensor.dtype}: bind() needs the layout the module was built with"
        )


class _BindPlan:
    """Where each tensor of a snapshot goes in a module, worked out by its first :func:`bind` to a
    layout (kept in the module's ``__dict__``) and checked, not worked out again, on the next.

    The check costs a few dictionary lookups per submodule and per tensor: every
    submodule is still its parent's child of that name, with as many parameters,
    buffers, non-persistent buffers and children as then, and every parameter and
    buffer bound is still the object in its place. Anything else (a submodule,
    parameter or buffer added, removed or replaced; another layout; another
    ``strict``) makes the next bind work it out again, as the first did.

    The tensors themselves, detached views over each slot (one object per
    module, so that no two modules share a buffer object), are kept with the reader
    (its ``adapters``, weakly keyed by module), so the reader's close lets go of them.
    """

    __slots__ = ("_targets", "bound", "keys", "layout", "names", "places", "strict", "token", "tree", "wanted")
    bound: list[Any]  # per name: the Parameter, or the buffer tensor now in the module
    keys: IncompatibleKeys
    layout: Any
    names: list[str]  # the snapshot's names the module has, in layout order
    places: list[tuple[torch.nn.Module, str, bool]]  # per name: owner, attribute, is a parameter
    strict: bool
    token: object
    tree: list[tuple[Any, ...]]  # (parent, name, submodule, its four counts) per edge
    wanted: list[tuple[torch.Size, torch.dtype]]

    def __init__(self) -> None:
        self.token = object()  # names this plan in the reader's cache, without a reference to it
        self._targets: dict[str, Any] | None = None

    @staticmethod
    def kept(module: torch.nn.Module, snapshot: Any, strict: bool, key: str = _PLAN) -> _BindPlan | None:
        """The plan an earlier bind (or, under ``_LOAD_PLAN``, load) kept in ``module``, if it
        still holds for this one."""
        plan = module.__dict__.get(key)
        if plan is not None and plan.layout is snapshot.layout and plan.strict == strict and plan.intact():
            return plan  # type: ignore[no-any-return]
        module.__dict__.pop(key, None)
        return None

    @classmethod
    def make(
        cls,
        module: torch.nn.Module,
        snapshot: Any,
        strict: bool,
        own: dict[str, Any],
        keys: IncompatibleKeys,
        key: str = _PLAN,
    ) -> _BindPlan | None:
        """Work the plan out from ``_match``'s answer (``own``, ``keys``) and keep it in the module;
        None for a module whose state-dict names are no attribute paths."""
        plan = cls()
        plan.layout, plan.strict, plan.keys = snapshot.layout, strict, keys
        plan.names = [name for name in snapshot if name in own]
        plan.places, plan.bound, plan.wanted = [], [], []
        for name in plan.names:
            current = own[name]
            try:
                owner, attribute = _owner_of(module, name)
            except AttributeError:
                return None  # a name that is no attribute path (a state-dict hook renamed it)
            is_param = isinstance(current, torch.nn.Parameter)
            if (owner._parameters if is_param else owner._buffers).get(attribute) is not current:
                return None
            plan.places.append((owner, attribute, is_param))
            plan.bound.append(current)
            plan.wanted.append((current.shape, current.dtype))  # type: ignore[union-attr]
        plan.tree = []
        seen = {id(module)}
        stack = [module]
        plan.tree.append((None, "", module, *_counts(module)))
        while stack:
            parent = stack.pop()
            for name, child in parent._modules.items():
                if child is None:
                    continue
                plan.tree.append((parent, name, child, *_counts(child)))
                if id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
        module.__dict__[key] = plan
        return plan

    def targets(self) -> dict[str, Any]:
        """The module's tensors by name, for a copy into them (load_state_dict): the same
        mapping object every time while the plan holds, so the copy's own checks are kept too."""
        found = self._targets
        if found is None:
            found = self._targets = dict(zip(self.names, self.bound, strict=True))
        return found

    def intact(self) -> bool:
        for parent, name, child, params, buffers, transient, children in self.tree:
            if parent is not None and parent._modules.get(name) is not child:
                return False
            if (
                len(child._parameters) != params
                or len(child._buffers) != buffers
                or len(child._non_persistent_buffers_set) != transient
                or len(child._modules) != children
            ):
                return False
        for (owner, attribute, is_param), current in zip(self.places, self.bound, strict=True):
            if (owner._parameters if is_param else owner._buffers).get(attribute) is not current:
                return False
        return True

    def tensors(self, module: torch.nn.Module, snapshot: Any) -> list[torch.Tensor]:
        """This module's tensors over ``snapshot``'s slot (made on its first bind to it)."""
        kept = snapshot._adapters.setdefault("torch-bind", weakref.WeakKeyDictionary())
        slots = kept.get(module)
        if slots is None:
            slots = kept[module] = {}
        found = slots.get(snapshot.slot)
        if found is not None and found[0] is self.token:
            return found[1]  # type: ignore[no-any-return]
        cached = _snapshot_tensors(snapshot)
        made = [cached[name].detach() for name in self.names]
        for name, (shape, dtype), tensor in zip(self.names, self.wanted, made, strict=True):
            _check_same(name, shape, dtype, tensor)
        slots[snapshot.slot] = (self.token, made)
        return made

    def assign(self, tensors: list[torch.Tensor]) -> None:
        bound = self.bound
        with torch.no_grad():
            for i, ((owner, attribute, is_param), tensor) in enumerate(zip(self.places, tensors, strict=True)):
                if is_param:
                    bound[i].data = tensor
                else:
                    owner._buffers[attribute] = tensor
                    bound[i] = tensor


def _counts(module: torch.nn.Module) -> tuple[int, int, int, int]:
    return (
        len(module._parameters),
        len(module._buffers),
        len(module._non_persistent_buffers_set),
        len(module._modules),
    )
