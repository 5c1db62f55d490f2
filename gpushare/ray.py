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
from ._buffer import Buffer, attach_buffer, descriptor_of, memory_of
from ._errors import DescriptorError, GpushareError, OwnerGoneError
from ._lifetime._protocol import LeaseVia
from ._memory import Descriptor

__all__ = ["NODE_ID_ENV", "NodeCopy", "node_identity", "reduce_for_ray"]

NODE_ID_ENV = "GPUSHARE_NODE_ID"
"""The environment variable that names this machine, where the boot id is not enough (see node_identity)."""
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def node_identity() -> str:
    """Which machine this process runs on.

    Returns
    -------
    str
        ``$GPUSHARE_NODE_ID`` if set, else the kernel's boot id.
    """
    override = os.environ.get(NODE_ID_ENV)
    if override:
        return override
    return _boot_id()


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open(_BOOT_ID) as f:
            return "boot:" + f.read().strip()
    except OSError:  # not Linux /proc: the host name is the best we have
        import socket

        return "host:" + socket.gethostname()


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
        owner = _lifetime.owner_for(desc.owner_token)
        if owner is not None:
            lease = owner.leases.lease_via(desc.alloc_id, desc.generation, desc.lease_id, _lifetime.LOCAL)
        else:
            link = _lifetime.link_for(desc.address, desc.owner_token, authkey)
            lease = int(link.request(LeaseVia, desc.alloc_id, desc.generation, desc.lease_id, False))
    except DescriptorError as exc:
        raise DescriptorError(
            f"a gpushare buffer in this Ray object can no longer be read ({exc}): a Ray object pins its "
            "buffer for the owner Manager's lease_timeout after it is made, and afterwards only while the "
            "owner's allocation is unchanged. Read it sooner, raise lease_timeout, or put the buffer again"
        ) from None
    return attach_buffer(desc._replace(lease_id=lease))


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
