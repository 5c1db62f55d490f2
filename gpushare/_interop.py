"""Zero-copy views of a Buffer for other libraries.

- ``__cuda_array_interface__`` v3: pointer, shape, ``typestr``, C order; ``stream`` is a stream
  of this process made to wait on the producer's ready event while not yet waited, else None.
- ``__dlpack__(stream=s)``: stream ``s`` waits on the ready event; ``None`` waits on the host;
  ``-1`` does not wait.
- DLPack on the host is NumPy's exporter; on CUDA a ``DLManagedTensor`` built with ctypes,
  in a ``"dltensor"`` capsule, holding a Buffer until the consumer calls the deleter.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import numpy as np

from . import _cuda
from ._memory import EXTENSION_DTYPES

__all__ = ["copy_from_cuda_array", "cuda_array_interface", "dlpack_device", "exported_buffer", "to_dlpack"]

KDL_CPU = 1
KDL_CUDA = 2
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


_streams: dict[int, int] = {}  # device -> this process's stream for ordering CAI consumers
_streams_lock = threading.Lock()


def _ordering_stream(device: int) -> int:
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = _cuda.stream_create(device)
        return stream


def cuda_array_interface(buf: Any, memory: Any) -> dict[str, Any]:
    address = buf._address()
    stream = None
    if memory.pending:
        # v3: hand the consumer a stream that waits for the producer's ready event;
        # it orders its own stream after ours, with no host-side wait.
        stream = _ordering_stream(memory.device)
        memory.order_stream(stream)
    key = (memory.device, address)
    if _exported.get(key) is not buf:  # asked again and again of one buffer: entered once
        _exported[key] = buf  # the consumer holds ``buf`` itself
    return {
        "shape": buf.shape,
        "typestr": buf.dtype.str,
        "descr": [("", buf.dtype.str)],
        "data": (address, False),
        "strides": None,
        "version": 3,
        "stream": stream,
    }


def copy_from_cuda_array(buf: Any, memory: Any, cai: dict[str, Any]) -> None:
    shape = tuple(cai["shape"])
    dtype = np.dtype(cai["typestr"])
    size = int(np.prod(shape, dtype=np.int64))
    if dtype != buf.dtype or size != buf.size:
        raise ValueError(
            f"cannot copy a CUDA array of shape {shape} and dtype {dtype} into a buffer of shape "
            f"{buf.shape} and dtype {buf.dtype}: device copies need the same dtype and element count"
        )
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != buf.view(shape=shape).strides:
        raise ValueError("the source CUDA array is not C-contiguous; make it contiguous first")
    stream = cai.get("stream")
    if stream:  # v3: the producer's work on this stream must finish before we read
        _cuda.stream_synchronize(int(stream), memory.device)
    if buf.nbytes:
        _cuda.memcpy(buf.ptr, int(cai["data"][0]), buf.nbytes, memory.device)


def dlpack_device(buf: Any, memory: Any) -> tuple[int, int]:
    device = memory.device
    return (KDL_CPU, 0) if device is None else (KDL_CUDA, device)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

# Exported tensors still owned by a consumer, by the address of their struct.
_live: dict[int, tuple[Any, ...]] = {}
_live_lock = threading.Lock()

#: CUDA buffers handed to another library, through DLPack or ``__cuda_array_interface__``, by
#: (device, address), while that library holds them: gpushare.torch.multiprocessing sends a
#: tensor over one of them as that buffer, under its owner's lifetime (see exported_buffer).
_exported: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()


def exported_buffer(device: int, address: int) -> Any:
    """The CUDA Buffer last handed to another library at ``address`` on ``device`` (an
    ordinal of this process) and still held there, or None."""
    return _exported.get((device, address))


@_DELETER
def _deleter(managed: Any, live: Any = _live, lock: Any = _live_lock, addressof: Any = ctypes.addressof) -> None:
    # What it uses is bound here, not looked up in this module, which may be torn down by then.
    with lock:
        live.pop(addressof(managed.contents), None)


# A consumer's tensor may be freed during interpreter teardown, after this module's globals
# are cleared (a torch tensor kept in a global of __main__, which is cleared last): its
# deleter must still find its struct and its callback. So the table of structs and both
# callbacks get one reference that is never given back, and outlive the module.
def _immortal(obj: object) -> None:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


_immortal(_live)
_immortal(_live_lock)
_immortal(_deleter)


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
# The destructor gets a PyObject* of a capsule being destroyed: look at it
# through raw-pointer prototypes so no new reference to it is ever made.
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(
    capsule: int,
    is_valid: Any = _capsule_is_valid,
    get_pointer: Any = _capsule_get_pointer,
    live: Any = _live,
    lock: Any = _live_lock,
) -> None:
    # A capsule never consumed keeps its name "dltensor": free it ourselves.
    # A consumed one was renamed "used_dltensor" and its consumer calls the deleter.
    if is_valid(capsule, b"dltensor"):
        address = get_pointer(capsule, b"dltensor")
        with lock:
            live.pop(address, None)


_immortal(_capsule_destructor)
_immortal(_capsule_is_valid)
_immortal(_capsule_get_pointer)


def to_dlpack(
    buf: Any,
    memory: Any,
    *,
    stream: object = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> Any:
    buf._check()
    if copy:
        raise BufferError("gpushare exports views only (copy=True is not supported); copy on the consumer side")
    if dl_device is not None and tuple(dl_device) != dlpack_device(buf, memory):
        raise BufferError(f"this buffer lives on DLPack device {dlpack_device(buf, memory)}, not {tuple(dl_device)}")
    if memory.device is None and buf.dtype.name not in EXTENSION_DTYPES:  # NumPy exports host memory
        view = buf.numpy()
        if max_version is None:
            return view.__dlpack__()
        return view.__dlpack__(max_version=max_version)
    ndim = buf.ndim
    shape = (ctypes.c_int64 * max(ndim, 1))(*buf.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*[s // buf.dtype.itemsize for s in buf.strides])
    address = buf._address()
    if stream is None:  # no stream named: the data must be ready for any of them
        memory.ready()
    elif stream != -1:  # -1: the consumer asked for no synchronisation
        memory.order_stream(int(stream))  # type: ignore[call-overload]
    managed = _DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = address
    tensor.device = _DLDevice(KDL_CPU, 0) if memory.device is None else _DLDevice(KDL_CUDA, memory.device)
    tensor.ndim = ndim
    code = EXTENSION_DTYPES.get(buf.dtype.name)  # bfloat16, float8 (ml_dtypes): their own codes
    if code is None:
        code = _DL_CODES["b" if buf.dtype == np.bool_ else buf.dtype.kind]
    tensor.dtype = _DLDataType(code, buf.dtype.itemsize * 8, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    keep = buf.view()  # its own count on the memory, alive until the deleter runs
    if memory.device is not None:  # CUDA memory: what exported_buffer() finds
        _exported[(memory.device, keep._address())] = keep
    address = ctypes.addressof(managed)
    with _live_lock:
        _live[address] = (managed, shape, strides, keep)
    return _capsule_new(address, b"dltensor", _capsule_destructor)


def live_exports() -> int:
    """DLPack tensors handed out and not yet deleted (for tests)."""
    return len(_live)
