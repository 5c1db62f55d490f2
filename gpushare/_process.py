"""Process(..., device=...): a multiprocessing Process that is safe with CUDA.

What it adds to :class:`multiprocessing.Process`:

* ``device=`` binds the worker to a CUDA device before the target runs:
  the device's primary context is made current (the CUDA runtime, and so
  torch and CuPy, pick it up), ``GPUSHARE_DEVICE`` is set so gpushare's own
  defaults follow, and libraries already imported are told too.
* The target is pickled by reference when it can be and with cloudpickle
  when it cannot (lambdas, closures, functions of an interactive session).
  Arguments go through multiprocessing's own pickler, so queues, pipes and
  buffers in ``args`` travel as they always do.
* ``start()`` refuses the fork start method once CUDA is initialised in
  this process: a forked child cannot use CUDA, and the error says what to
  use instead.
* At exit the worker releases every buffer it still holds and closes its
  connections, so the owner recycles the memory at once.
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing.process import BaseProcess
from typing import Any

from . import _backends, _cuda, _lifetime
from ._errors import StartMethodError

__all__ = ["GpuProcessMixin", "cuda_initialized"]


def cuda_initialized() -> bool:
    """True when CUDA was initialised in this process by gpushare or torch."""
    if _cuda.initialized():
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


class _CloudTarget:
    """A target that plain pickle cannot carry, carried by cloudpickle."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        import cloudpickle

        return (_load_cloud_target, (cloudpickle.dumps(self.fn),))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _load_cloud_target(data: bytes) -> _CloudTarget:
    return _CloudTarget(pickle.loads(data))


def _portable(target: Any) -> Any:
    if target is None or isinstance(target, _CloudTarget):
        return target
    try:
        pickle.dumps(target)
    except Exception:
        return _CloudTarget(target)
    return target


def bind_device(device: int | str | None) -> None:
    """In a worker: make ``device`` the current CUDA device for every library."""
    if device is None:
        return
    if device == "cpu":
        os.environ["GPUSHARE_BACKEND"] = "host"
        return
    assert isinstance(device, int)
    os.environ["GPUSHARE_DEVICE"] = str(device)
    _cuda.make_current(device)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.Device(device).use()


class GpuProcessMixin(BaseProcess):
    """Adds ``device=``, cloudpickled targets, the fork check and cleanup at exit."""

    def __init__(
        self,
        group: None = None,
        target: Any = None,
        name: str | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        daemon: bool | None = None,
        device: Any = None,
    ) -> None:
        super().__init__(group, target, name, args, kwargs or {}, daemon=daemon)
        self._device = _backends.parse_device(device)

    @property
    def device(self) -> int | str | None:
        return self._device

    def _resolved_start_method(self) -> str:
        """The start method this process will use. The concrete classes name theirs;
        ``gpushare.Process`` (in :mod:`gpushare._context`, the layer above) overrides this
        to ask the default context."""
        method = getattr(self, "_start_method", None)
        if method is None:
            raise StartMethodError(
                f"{type(self).__name__} names no start method; start workers from a context "
                "(gpushare.get_context(method).Process) or with gpushare.Process"
            )
        return str(method)

    def start(self) -> None:
        if self._resolved_start_method() == "fork" and cuda_initialized():
            raise StartMethodError(
                "cannot start a process with the 'fork' start method: CUDA is already initialised in "
                "this process, and a forked child cannot use it (CUDA_ERROR_NOT_INITIALIZED). Use the "
                "default 'spawn' (gpushare.set_start_method('spawn')) or 'forkserver'"
            )
        self._target = _portable(getattr(self, "_target", None))
        super().start()

    def run(self) -> None:
        bind_device(self._device)
        try:
            super().run()
        finally:
            _lifetime.close_links()
