"""Sharing backends behind one contract (:mod:`._base`), chosen in one place.

:func:`get` is the only function that maps a backend name to its class;
:func:`resolve` is the only one that turns a user's ``device=`` and
``backend=`` into a (backend, device ordinal) pair.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

from .._errors import BackendUnavailableError, NoDeviceError
from ._base import Allocation, Backend, Mapping

__all__ = ["BACKENDS", "Allocation", "Backend", "Mapping", "forget", "get", "opens", "parse_device", "resolve"]

#: Every backend name, in the order ``python -m gpushare info`` lists them.
BACKENDS = ("cuda_ipc", "cuda_vmm", "cuda_pool", "host")
DEFAULT_CUDA_BACKEND = "cuda_ipc"

_instances: dict[str, Backend] = {}
_lock = threading.Lock()
_warned_no_gpu = False
_supported: set[tuple[str, int]] = set()  # (backend, device) pairs already checked


def get(name: str) -> Backend:
    """The process-wide instance of backend ``name``."""
    backend = _instances.get(name)
    if backend is not None:
        return backend
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            if name == "host":
                from .host import HostBackend

                backend = HostBackend()
            elif name == "cuda_ipc":
                from .cuda_ipc import CudaIpcBackend

                backend = CudaIpcBackend()
            elif name == "cuda_vmm":
                from .cuda_vmm import CudaVmmBackend

                backend = CudaVmmBackend()
            elif name == "cuda_pool":
                from .cuda_pool import CudaPoolBackend

                backend = CudaPoolBackend()
            else:
                raise BackendUnavailableError(f"unknown backend {name!r}; valid backends are {', '.join(BACKENDS)}")
            _instances[name] = backend
    return backend


def forget(scope: bytes) -> None:
    """Every backend loaded in this process drops its cache for owner ``scope``."""
    for backend in list(_instances.values()):
        backend.forget(scope)


def opens() -> dict[str, int]:
    """Handles each backend has actually mapped in this process (cache hits do not count)."""
    return {name: backend.opens for name, backend in _instances.items()}


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_level() -> int:
    """The warnings stacklevel of the first frame outside gpushare (the user's call)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def parse_device(device: object) -> int | str | None:
    """Normalise a user's ``device=``: ``None``, ``"cpu"`` or a CUDA ordinal.

    Accepts exactly the documented values: None, an int, ``"cuda"``, ``"cuda:N"``,
    ``"cpu"`` and objects with ``.type`` ``"cuda"`` or ``"cpu"`` and ``.index``
    (``torch.device``), as torch spells them. Touches no driver.
    """
    if device is None:
        return None
    if isinstance(device, bool):
        raise ValueError(f"device={device!r} is not a device; {_DEVICES}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device} is negative; CUDA ordinals start at 0")
        return device
    kind = getattr(device, "type", None)
    if isinstance(kind, str):  # torch.device and friends
        if kind == "cpu":
            return "cpu"
        if kind == "cuda":
            index = getattr(device, "index", None)
            return 0 if index is None else int(index)
        raise ValueError(f"device={device!r} is a {kind!r} device; gpushare shares CUDA and host memory: {_DEVICES}")
    if isinstance(device, str):
        if device == "cpu":
            return "cpu"
        if device == "cuda":
            return 0
        if device.startswith("cuda:") and device[5:].isdigit() and device[5:].isascii():
            return int(device[5:])
        text = device.strip().lower()
        hint = ""
        if text in ("cpu", "host"):
            hint = " (did you mean 'cpu'?)"
        elif text in ("cuda", "gpu"):
            hint = " (did you mean 'cuda'?)"
        elif text.startswith(("cuda:", "gpu:")) and text.partition(":")[2].strip().isdigit():
            hint = f" (did you mean 'cuda:{int(text.partition(':')[2])}'?)"
        raise ValueError(f"device={device!r} is not a device name{hint}; {_DEVICES}")
    raise ValueError(f"device={device!r} is not a device; {_DEVICES}")


_DEVICES = "use an int, 'cuda', 'cuda:N', a torch.device, 'cpu' or None"


def _gpu_usable() -> bool:
    from .. import _cuda  # only device=None asks: an explicit 'cpu' never loads the CUDA layer

    return _cuda.available()


def resolve(device: object, backend: str | None = None) -> tuple[Backend, int | None]:
    """Pick the backend and device ordinal for an allocation.

    ``device=None`` means the worker's device (``GPUSHARE_DEVICE``) or 0
    when a GPU is usable, else the host backend with one warning.
    ``GPUSHARE_BACKEND=host`` forces the host backend for ``device=None``.
    """
    global _warned_no_gpu
    parsed = parse_device(device)
    if backend is not None and backend not in BACKENDS:
        get(backend)  # raises, naming the valid backends
    if backend == "host" and parsed not in (None, "cpu"):
        raise BackendUnavailableError(
            f"backend='host' shares host memory, but device={device!r} names a GPU; "
            "use device='cpu' with it, or a CUDA backend for GPU memory"
        )
    if parsed is None:
        if backend == "host" or os.environ.get("GPUSHARE_BACKEND", "").lower() == "host":
            parsed = "cpu"
        elif _gpu_usable():
            parsed = int(os.environ.get("GPUSHARE_DEVICE", "0") or 0)
        else:
            if backend not in (None, "host"):
                raise NoDeviceError(
                    f"backend={backend!r} needs a GPU, and none is usable here. For host shared memory "
                    "use device='cpu' without backend= (or with backend='host')"
                )
            if not _warned_no_gpu:
                _warned_no_gpu = True
                warnings.warn(
                    "gpushare: no usable GPU, so device=None buffers use the host shared-memory "
                    "backend; pass device='cpu' or set GPUSHARE_BACKEND=host to silence this",
                    RuntimeWarning,
                    stacklevel=_caller_level(),
                )
            parsed = "cpu"
    if parsed == "cpu":
        if backend not in (None, "host"):
            raise BackendUnavailableError(
                f"backend={backend!r} shares GPU memory, but device='cpu' asks for host memory; "
                "use backend='host' (or no backend) with device='cpu'"
            )
        return get("host"), None
    assert isinstance(parsed, int)
    from .. import _cuda  # a GPU is asked for: the CUDA layer loads here, not with the host backend

    try:
        count = _cuda.device_count()
    except NoDeviceError as exc:  # no driver, no GPU: say which request needed one
        raise NoDeviceError(f"device={device!r} asks for CUDA device {parsed}, but: {exc}") from exc.__cause__
    if parsed >= count:
        raise NoDeviceError(
            f"CUDA device {parsed} does not exist: this process sees {count} device(s) "
            f"(ordinals 0..{count - 1}). Pick one of those or device='cpu'."
        )
    chosen = get(backend or DEFAULT_CUDA_BACKEND)
    if not chosen.is_cuda:
        raise BackendUnavailableError(f"backend {chosen.name!r} cannot hold memory on CUDA device {parsed}")
    if (chosen.name, parsed) not in _supported:
        chosen.check_device(parsed)
        _supported.add((chosen.name, parsed))
    return chosen, parsed
