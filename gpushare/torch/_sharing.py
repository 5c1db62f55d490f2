"""CUDA tensors pickled with gpushare's lifetime (what gpushare.torch.multiprocessing installs).

- Sending: a storage over a gpushare Buffer (handed to torch by DLPack or
  ``__cuda_array_interface__``) travels as that Buffer, under its Manager's lifetime, so a
  ``Manager(owner="server")`` buffer's tensor outlives its sender. Any other CUDA tensor's
  storage is leased from this process's :class:`Owner` as
  foreign memory (``Owner.share_foreign``): the lease keeps the storage, so torch's
  caching allocator cannot hand the block out again until every receiver let go. While
  this process still uses the storage (torch's use count of it), its segment stays open
  in the receivers once they let go, so sending it again opens nothing. A storage this
  process received is re-shared through its own owner's lease.
- Receiving: the descriptor becomes a gpushare Buffer (a claimed lease on a mapping
  cached per process), and the storage a torch tensor over it; the storage holds the
  Buffer, so dropping the tensor, its views and its storage releases the lease, once the
  work queued on torch's current stream has finished (torch waits for that stream too).
- CPU tensors, storages, nested and sparse tensors go to torch's own reducers.
Why and the rules: dev/design-notes.md, "torch tensors".
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing import active_children, current_process, util
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as _torch_reductions

from .._buffer import Buffer, memory_of, rebuild_buffer, share_bytes
from .._interop import exported_buffer
from .._process import pickled_directly
from .._queues import CLOSE_PRIORITY, put_on_and_held_elsewhere

__all__ = [
    "get_release_timeout",
    "init_reductions",
    "rebuild_cuda_tensor",
    "reduce_tensor",
    "set_release_timeout",
    "sharing_owner",
]

_owner: Any = None
_owner_lock = threading.Lock()
#: Seconds a sender's exit waits, at most, for its tensors in flight to be claimed and let go.
_release_timeout = 5.0


def set_release_timeout(seconds: float) -> None:
    """How long this process's exit waits, at most, for the CUDA tensors it sent.

    At exit the sender keeps serving its receivers until every tensor it sent and that some
    process may still take (a consumer is connected, a child of this process runs, or another
    process holds a queue this process put on) has been claimed and let go, or until
    ``seconds`` have passed (5 by default), whichever comes first. Like
    ``Manager(release_timeout=...)``.

    Parameters
    ----------
    seconds : float
        The bound, zero or more.

    Raises
    ------
    ValueError
        If ``seconds`` is negative or not a number.
    """
    global _release_timeout
    value = float(seconds)
    if not value >= 0.0:
        raise ValueError(f"set_release_timeout() needs a number of seconds >= 0, not {seconds!r}")
    _release_timeout = value


def get_release_timeout() -> float:
    """The bound of :func:`set_release_timeout`.

    Returns
    -------
    float
        Seconds (5 unless set).
    """
    return _release_timeout


def _shutdown_at_exit(owner: Any) -> None:
    owner.shutdown(_release_timeout, sender_exit=True, may_claim=_may_claim)


def _may_claim() -> bool:
    """At this process's exit: whether a tensor it sent and nobody claimed yet may still be:
    a child of this process runs, or another process holds a queue this process put on."""
    return bool(active_children()) or put_on_and_held_elsewhere()


def sharing_owner() -> Any:
    """This process's owner of the CUDA tensors it sends (made on first use, shut down at exit)."""
    global _owner
    owner = _owner
    if owner is None:
        with _owner_lock:
            owner = _owner
            if owner is None:
                from .._lifetime._owner import Owner

                owner = Owner(authkey=bytes(current_process().authkey))
                # After this process's queues let go (so that a receiver blocked on one that
                # no other process holds raises OwnerGoneError at once, not after the wait for
                # leases), and before multiprocessing joins the children. A tensor left
                # unclaimed holds the exit up only while some process may still take it.
                util.Finalize(None, _shutdown_at_exit, [owner], exitpriority=CLOSE_PRIORITY - 1)
                _owner = owner
    return owner


#: torch's count of the references to a storage's memory: private (torch._C), so it is
#: read only if present, and tests/test_torch_mp.py checks what it counts. Without it a
#: segment is retired whenever its receivers let go, and opened again at its next send.
_use_count: Any = getattr(torch._C, "_storage_Use_Count", None)


#: The handle of torch's current stream on a device, as an int, with no Stream object made:
#: torch.cuda.current_stream(device) took 8-22 us a call on the H100 machines, and a CUDA
#: tensor's send asked once and its arrival twice. Private (torch._C), so used only if present;
#: tests/test_torch_mp.py checks it against the public call.
_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: int) -> int:
    """``torch.cuda.current_stream(device).cuda_stream``, cheaply where torch allows."""
    if _raw_stream is not None:
        return int(_raw_stream(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _used_here(storage: Any) -> bool:
    """Whether anything in this process besides ``storage`` itself (a tensor, a view)
    still uses the memory of ``storage``, the anchor of an idle shared segment."""
    return storage is not None and _use_count(storage._cdata) > 1


def _forget_owner() -> None:
    global _owner
    _owner = None


os.register_at_fork(after_in_child=_forget_owner)


class _Received:
    """The memory of one received storage: torch's tensor over it holds this object (through
    ``__cuda_array_interface__``), and this object holds the Buffer, and so its lease."""

    __slots__ = ("__cuda_array_interface__", "__weakref__", "buffer", "device")

    def __init__(self, buffer: Buffer, device: int) -> None:
        self.buffer = buffer
        self.device = device
        self.__cuda_array_interface__ = {
            "shape": (buffer.nbytes,),
            "typestr": "|u1",
            "data": (buffer.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,  # ordered below, on torch's current stream
        }

    def __del__(self) -> None:
        # The last tensor or storage over this memory went: as torch does for a received
        # storage, the work queued on torch's current stream (which may still use the
        # memory) finishes before the lease goes back. The legacy default stream's is
        # waited for by the release itself (gpushare._lifetime._link).
        try:
            if _current_stream(self.device) != 0:
                stream = torch.cuda.current_stream(self.device)
                if not stream.query():
                    stream.synchronize()
        except Exception:  # interpreter shutdown, or a broken context: release all the same
            pass


#: Storages received in this process, by their data pointer: re-sent through their owner.
_received: dict[int, weakref.ref[_Received]] = {}


def _storage_from(data: bytes) -> torch.UntypedStorage:
    buffer = rebuild_buffer(data)
    memory = memory_of(buffer)
    device = memory.device
    assert device is not None  # a CUDA tensor's storage is device memory
    memory.order_stream(_current_stream(device))
    return received_bytes(buffer, device).untyped_storage()


def received_bytes(buffer: Buffer, device: int) -> torch.Tensor:
    """A uint8 CUDA tensor over a received Buffer's memory, which holds the Buffer (and so its
    lease) while torch uses the memory; a re-send of it goes back through its owner."""
    holder = _Received(buffer, device)
    raw = torch.as_tensor(holder, device=torch.device("cuda", device))
    key = raw.data_ptr()

    def forget(ref: weakref.ref[_Received], key: int = key) -> None:
        if _received.get(key) is ref:
            del _received[key]

    _received[key] = weakref.ref(holder, forget)
    return raw


def _share_storage(storage: torch.UntypedStorage) -> bytes:
    """Descriptor bytes of ``storage``'s memory under a new lease: a storage received here
    goes back through its owner, one over a gpushare Buffer (DLPack, ``__cuda_array_interface__``)
    as that Buffer, under its Manager's lifetime; any other is leased as torch's memory."""
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    device = storage.device.index
    current = _current_stream(device)
    ref = _received.get(ptr)
    holder = ref() if ref is not None else None
    buffer = holder.buffer if holder is not None else exported_buffer(device, ptr)
    if buffer is not None and buffer.nbytes == nbytes and not buffer.released:
        # A Buffer's share records its ready event on the legacy default stream: order it
        # after the work on torch's current stream when that is another one.
        if current != 0:
            torch.cuda.default_stream(device).wait_stream(torch.cuda.current_stream(device))
        return share_bytes(buffer)
    held = _used_here if _use_count is not None else None
    return sharing_owner().share_foreign(ptr, nbytes, device, storage, current, held)


def reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """Pickle a tensor: a CUDA one by a gpushare lease, any other as torch does."""
    if tensor.device.type != "cuda" or tensor.is_nested or tensor.layout != torch.strided:
        return _torch_reductions.reduce_tensor(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
            "support crossing process boundaries.  If you just want to transfer the data, call detach() "
            "on the tensor before serializing (e.g., putting it on the queue)."
        )
    torch.utils.hooks.warn_if_has_hooks(tensor)
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        data = None
        uuid = str(torch.cuda.get_device_properties(storage.device).uuid)
    else:
        data, uuid = _share_storage(storage), None
    args = (type(tensor), tuple(tensor.size()), tensor.stride(), tensor.storage_offset(), tensor.dtype)
    return (rebuild_cuda_tensor, (*args, tensor.requires_grad, data, uuid))


def rebuild_cuda_tensor(
    cls: type, size: tuple[int, ...], stride: tuple[int, ...], offset: int, dtype: torch.dtype,
    requires_grad: bool, data: bytes | None, uuid: str | None,
) -> torch.Tensor:  # fmt: skip
    """Unpickling side of :func:`reduce_tensor` for a CUDA tensor."""
    if data is None:
        storage = torch.UntypedStorage(0, device=_device_of_uuid(uuid))
    else:
        storage = _storage_from(data)
    tensor = torch.empty((0,), dtype=dtype, device=storage.device)
    tensor.set_(storage, offset, size, stride)
    if cls is torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad = requires_grad
    return tensor


def _device_of_uuid(uuid: str | None) -> torch.device:
    for ordinal in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(ordinal).uuid) == uuid:
            return torch.device("cuda", ordinal)
    return torch.device("cuda", torch.cuda.current_device())


def init_reductions() -> None:
    """Register :func:`reduce_tensor` with multiprocessing's pickler for every tensor class,
    after torch's own reducers (which it then stands in front of for CUDA tensors)."""
    _torch_reductions.init_reductions()
    classes: list[type] = [torch.Tensor, torch.nn.parameter.Parameter, *torch._tensor_classes]
    for cls in classes:
        ForkingPickler.register(cls, reduce_tensor)
    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        pickled_directly(cls)
