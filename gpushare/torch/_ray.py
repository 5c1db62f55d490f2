"""gpushare as a Ray tensor transport (Ray Direct Transport): torch tensors that one actor returns
reach other actors on the same node under gpushare leases. Registered by
:func:`gpushare.ray.register_tensor_transport`.

Protocol, per Ray object (``obj_id``):

- The source actor (``extract_tensor_transport_metadata``) takes one unclaimed, quiet lease per
  tensor: a CUDA tensor's memory as the torch drop-in shares it (no copy), a CPU tensor copied
  once into host shared memory of this process's Owner. The metadata carries the descriptors,
  the Owner's authkey and the node's identity; the leases are kept under ``obj_id``.
- Each receiving actor (``recv_multiple_tensors``) leases through the object's lease
  (``LeaseVia``), maps the memory and wraps it as a torch tensor of the sent shape and dtype,
  which holds its own lease until torch drops it. A receiver on another node cannot map the
  memory and gets an error that names what to use there.
- ``garbage_collect`` (Ray dropped the object) and ``abort_transport`` give the object's leases
  back; what receivers mapped stays valid until they drop it. An actor that is killed gives its
  leases back as any gpushare process does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from .. import _lifetime
from .._buffer import Buffer, attach_through, memory_of, node_identity, share_bytes
from .._errors import BackendUnavailableError, DescriptorError
from .._memory import Descriptor
from ._sharing import _current_stream, _share_storage, received_bytes, sharing_owner

__all__ = ["GpushareTransport", "GpushareTransportMetadata"]


@dataclass
class GpushareTransportMetadata(TensorTransportMetadata):
    """What a receiver needs: one descriptor per tensor (under an unclaimed lease of the
    source's Owner), the Owner's authkey, and the node the memory lives on."""

    descriptors: list[bytes] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each tensor starts in what its descriptor names
    authkey: bytes = b""
    node: str = ""


@dataclass
class GpushareCommunicatorMetadata(CommunicatorMetadata):
    """One-sided: nothing to agree on between the two actors."""


class _Sent:
    """One Ray object's tensors as this process shares them: the Buffers a CPU tensor was
    copied into, and each descriptor's unclaimed lease, until Ray drops the object."""

    __slots__ = ("buffers", "leases")

    def __init__(self) -> None:
        self.buffers: list[Buffer] = []
        self.leases: list[tuple[bytes, int]] = []  # (owner token, lease id)

    def drop(self) -> None:
        for token, lease_id in self.leases:
            owner = _lifetime.owner_for(token)
            if owner is not None:
                owner.leases.drop_unclaimed(lease_id)
        self.leases.clear()
        for buf in self.buffers:
            buf.release()
        self.buffers.clear()


def _share_cpu(tensor: torch.Tensor, sent: _Sent) -> bytes:
    """Copy a CPU tensor into host shared memory of this process's Owner; its descriptor."""
    from .._manager import RemoteAllocator

    owner = sharing_owner()
    nbytes = tensor.numel() * tensor.element_size()
    buf = RemoteAllocator(owner.address, owner.token).empty((max(nbytes, 1),), "uint8", "cpu")
    sent.buffers.append(buf)
    if nbytes:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        torch.from_numpy(buf.numpy()[:nbytes]).copy_(flat)
    return share_bytes(buf)


class GpushareTransport(TensorTransportManager):
    """Ray's tensor transport API on gpushare leases (see the module docstring)."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._lock = threading.Lock()

    def tensor_transport_backend(self) -> str:
        return "GPUSHARE"

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Asked before each actor task is submitted: no remote call. Every actor of a cluster
        # that registered the transport imports gpushare to unpickle this class.
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> GpushareTransportMetadata:
        sent = _Sent()
        meta: list[Any] = []
        descriptors: list[bytes] = []
        offsets: list[int] = []
        device_type = None
        authkey = b""
        try:
            for tensor in rdt_object:
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"the gpushare transport carries torch tensors, not {type(tensor).__name__}")
                kind = tensor.device.type
                if device_type is None:
                    device_type = kind
                elif kind != device_type:
                    raise ValueError("every tensor of one Ray object must be on the same kind of device")
                if kind == "cuda":
                    tensor = tensor.detach().contiguous()  # a view keeps its storage and offset
                    data = _share_storage(tensor.untyped_storage())
                    offset = int(tensor.storage_offset()) * tensor.element_size()
                elif kind == "cpu":
                    data, offset = _share_cpu(tensor, sent), 0
                else:
                    raise ValueError(f"the gpushare transport carries CPU and CUDA tensors, not {kind!r} ones")
                desc = Descriptor.from_bytes(data)
                owner = _lifetime.owner_for(desc.owner_token)
                if owner is not None:  # read by Ray as often as it likes, or never: no warning either way
                    owner.leases.quiet(desc.lease_id)
                    authkey = owner.authkey
                sent.leases.append((desc.owner_token, desc.lease_id))
                descriptors.append(data)
                offsets.append(offset)
                meta.append((tensor.shape, tensor.dtype))
        except BaseException:
            sent.drop()
            raise
        with self._lock:
            old = self._sent.pop(obj_id, None)
            self._sent[obj_id] = sent
        if old is not None:  # a retried task's second extraction: the first one's leases go
            old.drop()
        return GpushareTransportMetadata(
            tensor_meta=meta, tensor_device=device_type, descriptors=descriptors, offsets=offsets, authkey=authkey,
            node=node_identity(),
        )  # fmt: skip

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None) -> Any:
        return GpushareCommunicatorMetadata()

    def recv_multiple_tensors(
        self, obj_id: str, tensor_transport_metadata: Any, communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:  # fmt: skip
        meta = tensor_transport_metadata
        if not isinstance(meta, GpushareTransportMetadata):
            raise TypeError(f"the gpushare transport got {type(meta).__name__}, not its own metadata")
        if not meta.descriptors:
            return []
        if meta.node != node_identity():
            raise BackendUnavailableError(
                "the gpushare tensor transport maps memory between actors of one node, and this actor "
                f"(node {node_identity()}) is on another node than the tensors' source ({meta.node}). "
                "Send across nodes through Ray's object store (no tensor_transport) or a collective "
                "transport (tensor_transport='nccl' or 'gloo')"
            )
        tensors = [_receive(data, meta.authkey, shape, dtype, offset) for data, offset, (shape, dtype) in  # type: ignore[arg-type]
                   zip(meta.descriptors, meta.offsets, meta.tensor_meta, strict=True)]  # fmt: skip
        if target_buffers:
            for target, tensor in zip(target_buffers, tensors, strict=True):
                target.copy_(tensor)
            return list(target_buffers)
        return tensors

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        raise NotImplementedError("the gpushare transport is one-sided: the receiver maps what the source shares")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        with self._lock:
            sent = self._sent.pop(obj_id, None)
        if sent is not None:
            sent.drop()

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        # On the source: give the object's leases back (a receiver that already mapped its
        # tensors keeps them, under leases of its own); on a receiver nothing is held yet.
        self.garbage_collect(obj_id, None, [])

    def outstanding(self) -> int:
        """How many Ray objects this process shares now (for tests and stats)."""
        with self._lock:
            return len(self._sent)


def _receive(data: bytes, authkey: bytes, shape: Any, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A torch tensor over the memory one descriptor names, under a lease of this process."""
    desc = Descriptor.from_bytes(data)
    try:
        buf = attach_through(desc, authkey)
    except DescriptorError as exc:
        raise DescriptorError(
            f"a tensor sent through the gpushare transport can no longer be read ({exc}): its source "
            "gave it back (Ray dropped the object, or the transfer was aborted) or exited"
        ) from None
    if buf.device == "cpu":
        raw = torch.from_numpy(buf.numpy())  # the array holds the buffer, and so its lease
    else:
        device = memory_of(buf).device
        assert device is not None
        memory_of(buf).order_stream(_current_stream(device))
        raw = received_bytes(buf, device)
    count = 1
    for n in shape:
        count *= int(n)
    return raw[offset : offset + count * dtype.itemsize].view(dtype).reshape(tuple(shape))
