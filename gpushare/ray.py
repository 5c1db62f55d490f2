"""gpushare.ray: gpushare Buffers as Ray task and actor arguments, return values and ``ray.put`` objects.

Nothing to register and nothing to call: in a process where Ray is initialised, a Buffer
pickles in Ray's form (:func:`reduce_for_ray`), which carries its owner's node and authkey.

- A reader on the owner's machine (same :func:`node_identity`) gets a :class:`~gpushare.Buffer`
  over the same memory, under a lease of its own.
- A reader on another machine gets a :class:`NodeCopy`: a small Ray task on the owner's Ray node
  copies the bytes, and Ray's object store carries them.
- A Ray object pins its memory until the owner Manager's ``lease_timeout``: read it before.
- The object carries the owner's multiprocessing authkey: a Ray cluster is one trust domain.
The Ray guide has the details; dev/design-notes.md, "Descriptors", the internals.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from . import _lifetime
from ._buffer import NODE_ID_ENV, Buffer, attach_through, descriptor_of, memory_of, node_identity
from ._errors import DescriptorError, GpushareError, OwnerGoneError
from ._memory import Descriptor

__all__ = ["NODE_ID_ENV", "TRANSPORT", "NodeCopy", "node_identity", "reduce_for_ray", "register_tensor_transport"]

TRANSPORT = "GPUSHARE"
"""The name :func:`register_tensor_transport` registers by default (Ray matches it in any case)."""


class NodeCopy(np.ndarray):
    """A Buffer's bytes as they arrived on another node: a writable host copy.

    It has the host-side methods of :class:`~gpushare.Buffer` that make sense
    for a copy (``numpy()``, ``release()``, ``released``, ``with``) so code
    written for a mapped Buffer runs unchanged; writes stay on this node.
    """

    _released: bool

    def __array_finalize__(self, obj: Any) -> None:
        self._released = False

    def numpy(self) -> np.ndarray:
        """The copy as a plain ndarray.

        Returns
        -------
        numpy.ndarray
            A view of the copy (no further copy).
        """
        return self.view(np.ndarray)

    def release(self) -> None:
        """Nothing to give back: the copy is this process's own memory."""
        self._released = True

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran (the copy stays readable: it is this node's own memory)."""
        return self._released

    def __enter__(self) -> NodeCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _authkey_of(buf: Buffer) -> bytes:
    """The owner's authkey (a received buffer's source knows it from its link)."""
    return bytes(memory_of(buf).source.authkey)


def reduce_for_ray(buf: Buffer) -> tuple[Any, tuple[Any, ...]]:
    """The Ray form of ``buf`` (see the module docstring); takes one lease.

    Parameters
    ----------
    buf : Buffer
        The buffer being pickled in a process connected to Ray.

    Returns
    -------
    tuple
        ``(callable, args)``, as ``__reduce__`` returns: on the same node it maps the
        buffer; on another it becomes a :class:`NodeCopy`.
    """
    import ray

    authkey = _authkey_of(buf)
    desc = descriptor_of(buf)
    owner = _lifetime.owner_for(desc.owner_token)
    if owner is not None:  # Ray may read the object many times or never: no warning either way
        owner.leases.quiet(desc.lease_id)
    return _rebuild, (desc.to_bytes(), node_identity(), ray.get_runtime_context().get_node_id(), authkey)


def _attach_here(desc: Descriptor, authkey: bytes) -> Buffer:
    """Map the buffer in this process (on the owner's node) under a lease of its own."""
    try:
        return attach_through(desc, authkey)
    except DescriptorError as exc:
        raise DescriptorError(
            f"a gpushare buffer in this Ray object can no longer be read ({exc}): a Ray object pins its "
            "buffer for the owner Manager's lease_timeout after it is made, and afterwards only while the "
            "owner's allocation is unchanged. Read it sooner, raise lease_timeout, or put the buffer again"
        ) from None


def _rebuild(data: bytes, node: str, ray_node: str, authkey: bytes) -> Buffer | NodeCopy:
    desc = Descriptor.from_bytes(data)
    if node == node_identity() and os.path.exists(desc.address):
        return _attach_here(desc, authkey)
    return _copy_from_owner_node(data, ray_node, authkey)


def _fetch_copy(data: bytes, authkey: bytes) -> np.ndarray:
    """Runs on the owner's node: map the buffer, copy its bytes out, let it go."""
    buf = _attach_here(Descriptor.from_bytes(data), authkey)
    with buf:
        out = buf.numpy()
        return out.copy() if buf.device == "cpu" else out  # a host view must not outlive the lease


@functools.lru_cache(maxsize=1)
def _fetch_task() -> Any:
    import ray

    return ray.remote(num_cpus=0, max_retries=0)(_fetch_copy)


def _copy_from_owner_node(data: bytes, ray_node: str, authkey: bytes) -> NodeCopy:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise OwnerGoneError(
            "this gpushare buffer was made on another machine and this process is not connected to Ray, "
            "which carries copies between nodes; read it inside a Ray task or actor, or after ray.init()"
        )
    strategy = NodeAffinitySchedulingStrategy(node_id=ray_node, soft=False)
    ref = _fetch_task().options(scheduling_strategy=strategy).remote(data, authkey)
    try:
        array = ray.get(ref)
    except GpushareError as exc:  # Ray's task error subclasses the cause's class
        cause = getattr(exc, "cause", exc)
        if isinstance(cause, (OwnerGoneError, DescriptorError)):
            raise type(cause)(f"reading a gpushare buffer from its owner's node failed: {cause}") from None
        raise
    except ray.exceptions.RayError as exc:
        raise OwnerGoneError(
            f"the Ray node that owns this gpushare buffer could not copy it ({type(exc).__name__}: {exc}); "
            "its owner's node is probably gone. Keep the owner alive until readers are done"
        ) from None
    return np.array(array, copy=True).view(NodeCopy)  # Ray hands out read-only views of its store


def register_tensor_transport(name: str = TRANSPORT) -> str:
    """Register gpushare as a Ray tensor transport for torch tensors, CPU and CUDA.

    Call it in the driver before defining the actor classes whose methods name it (Ray checks
    the name there) and before creating those actors (Ray hands registered transports to the
    actors it creates); calling it again is harmless. Then pick it per method,
    ``@ray.method(tensor_transport="gpushare")``. An actor class that receives such tensors but
    has no method that names a transport needs ``@ray.remote(enable_tensor_transport=True)``:
    without it Ray runs the transfer on the thread of the method waiting for it, and both wait.

    A tensor returned by one actor reaches other actors on the same node as a mapping of the
    same memory: a CUDA tensor with no copy, a CPU tensor copied once into shared memory. Each
    object's memory is held until Ray drops the object; a receiver's tensor holds it until the
    receiver drops the tensor. A receiver on another node gets ``BackendUnavailableError``.

    Parameters
    ----------
    name : str
        The transport's name, as methods and ``ray.put`` name it (default ``"GPUSHARE"``).

    Returns
    -------
    str
        The name registered (upper case, as Ray keeps it).

    Raises
    ------
    BackendUnavailableError
        If Ray has no tensor transport API (Ray older than 2.54) or torch is missing.
    ValueError
        If another transport of that name is registered already.
    """
    from ._errors import BackendUnavailableError

    try:
        import torch
        from ray.experimental import register_tensor_transport as register
    except ImportError as exc:
        import ray

        raise BackendUnavailableError(
            f"the gpushare tensor transport needs torch and Ray's tensor transport API (Ray 2.54 or later; "
            f"this is Ray {ray.__version__}): {exc}. Install both, or pass gpushare Buffers to Ray tasks "
            "as they are (no registration)"
        ) from None
    from ray.experimental.rdt import util

    from .torch._ray import GpushareTransport

    known = util.transport_manager_info.get(name.upper())
    if known is not None and known.transport_manager_class is GpushareTransport:
        return name.upper()
    register(name, ["cuda", "cpu"], GpushareTransport, torch.Tensor)
    return name.upper()
