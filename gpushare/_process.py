"""Process(..., device=...): a multiprocessing Process that is safe with CUDA.

What it adds to :class:`multiprocessing.Process`:

* ``device=`` binds the worker to a CUDA device before the target runs:
  the device's primary context is made current (the CUDA runtime, and so
  torch and CuPy, pick it up), ``GPUSHARE_DEVICE`` is set so gpushare's own
  defaults follow, and libraries already imported are told too.
* The process object (target, arguments, attributes) travels to a spawned
  or forkserver child in one pickle stream made by :func:`dumps`. When
  everything in it can go by reference -- the usual case: a module-level
  target, the main module's functions when the child re-imports that module
  -- that stream is exactly what multiprocessing's ``ForkingPickler`` writes,
  and neither process imports cloudpickle (about 15 ms). Otherwise (lambdas,
  closures, functions of an interactive session or of ``python -c``) it is
  cloudpickle's, so those travel by value, with every reducer registered with
  ``ForkingPickler`` in its dispatch table (so queues, pipes, locks,
  ``Value``/``Array``/``Barrier``, buffers, torch tensors -- whatever
  multiprocessing itself would carry -- travel as they always do). Which one
  is decided by a dry run that pickles into nothing with every registered
  reducer stubbed out, so that deciding takes no lease, duplicates no fd and
  moves no tensor into shared memory. One stream keeps object identity: a
  target's ``self`` that is also in ``args`` arrives as one object.
* ``start()`` refuses the fork start method once CUDA is initialised in
  this process: a forked child cannot use CUDA, and the error says what to
  use instead.
* At exit the worker releases every buffer it still holds and closes its
  connections, so the owner recycles the memory at once.

A spawned child imports only what it unpickles: this module, the context's,
and the target's own. The backends, the CUDA layer and the lifetime service
load when a worker first touches a device or a buffer.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
from multiprocessing import reduction as _mp_reduction
from multiprocessing.context import get_spawning_popen
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler

from ._errors import StartMethodError

# typing is not imported at run time: it costs every process about 3 ms (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["GpuProcessMixin", "cuda_initialized", "dumps"]


def cuda_initialized() -> bool:
    """True when CUDA was initialised in this process by gpushare or torch."""
    cuda = sys.modules.get("gpushare._cuda")  # not imported: gpushare initialised nothing
    if cuda is not None and cuda.initialized():
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _main_module_reimported() -> Any:
    """The main module when a spawned child re-imports it (as multiprocessing.spawn does), else None.

    Then the child has the same functions and classes under ``__main__`` and
    they can travel by reference; otherwise (an interactive session, ``python
    -c``, ``python -m pkg`` with a ``__main__.py``) only by value.
    """
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else main
    path = getattr(main, "__file__", None)
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return main


def _in_main(main: Any, obj: Any) -> bool:
    """True when ``obj`` is reachable as ``__main__.<its qualname>``."""
    if getattr(obj, "__module__", None) != "__main__":
        return False
    found = main
    for part in getattr(obj, "__qualname__", "<>").split("."):
        found = getattr(found, part, None)
    return found is obj


def _dispatch_table() -> dict[Any, Any]:
    """copyreg's reducers, then cloudpickle's own, then ForkingPickler's.

    ForkingPickler's registrations (multiprocessing.heap's Arena, connections,
    sockets, torch's tensors and storages, gpushare's Buffer, a user's own)
    win, as they do in multiprocessing. Built at each pickling: a library may
    register a reducer at any time. Bound methods go by reference
    (``getattr(self, name)``, multiprocessing's way) when that finds the same
    method, and by cloudpickle's way only when it does not: cloudpickle would
    send a classmethod's function by value, with a copy of its module's
    globals instead of the child's module.
    """
    import copyreg

    import cloudpickle

    table = dict(copyreg.dispatch_table)
    table.update(cloudpickle.Pickler.dispatch_table)
    cloud_method = table.get(types.MethodType)
    table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    if table.get(types.MethodType) is getattr(_mp_reduction, "_reduce_method", None) and cloud_method is not None:

        def reduce_method(method: Any) -> Any:
            return (
                (getattr, (method.__self__, method.__func__.__name__))
                if _method_by_name(method)
                else cloud_method(method)
            )

        table[types.MethodType] = reduce_method
    return table


def _method_by_name(method: Any) -> bool:
    """Whether ``getattr(method.__self__, its name)`` finds this same bound method."""
    try:
        return bool(getattr(method.__self__, method.__func__.__name__, None) == method)
    except Exception:  # an attribute that raises: not findable by name
        return False


def _by_reference(main: Any, obj: Any) -> bool:
    """Whether a function or class ``obj`` pickles by reference and the child finds it."""
    module_name = getattr(obj, "__module__", None)
    if module_name == "__main__":
        return _in_main(main, obj) if main is not None else False
    qualname = getattr(obj, "__qualname__", "")
    if not module_name or "<" in qualname:  # <lambda>, <locals>: made at run time
        return False
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is obj


#: ForkingPickler's reducers with no side effect, whose arguments a dry run must look into.
_PURE_REDUCERS = {
    getattr(_mp_reduction, name)
    for name in ("_reduce_method", "_reduce_method_descriptor", "_reduce_partial")
    if hasattr(_mp_reduction, name)
}


class _ByValueNeededError(Exception):
    """The dry run met something only cloudpickle carries."""


def _stub(obj: Any) -> Any:
    return (int, ())


class _Sink:
    """Where the dry run writes: nowhere."""

    def write(self, data: Any) -> int:
        return len(data)


def _plain_stream_suffices(obj: Any, main: Any) -> bool:
    """Dry run: does ``obj`` pickle with multiprocessing's own pickler, every function and
    class by reference? Nothing is written, and the reducers registered with
    ForkingPickler, and gpushare's own, are stubbed: they take leases, duplicate fds or
    move tensors to shared memory, which a dry run must not do. Any failure sends the
    object to cloudpickle, which carries more, or fails with its own explanation."""
    import copyreg

    extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    table = dict(copyreg.dispatch_table)
    table.update(extra)
    for kind, reducer in list(table.items()):
        # Stubbed: connections, sockets, heap arenas, tensors, buffers. Kept: the reducers
        # multiprocessing registers for methods and partials, which must be looked into.
        if reducer not in _PURE_REDUCERS and (kind in extra or getattr(kind, "__module__", "").startswith("gpushare")):
            table[kind] = _stub

    class _DryRun(pickle.Pickler):
        dispatch_table = table

        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, (types.FunctionType, type)):
                if not _by_reference(main, value):
                    raise _ByValueNeededError
            elif isinstance(value, types.MethodType) and not _method_by_name(value):
                raise _ByValueNeededError
            return NotImplemented

    try:
        _DryRun(_Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:
        return False
    return True


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` for a child process (see the module docstring).

    Must run while multiprocessing is spawning the child (inside its own
    pickling of the process object) for the objects that only pickle then:
    locks, semaphores, connections, the authkey.
    """
    main = _main_module_reimported()
    if _plain_stream_suffices(obj, main):
        out = io.BytesIO()
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(obj)
        return out.getvalue()
    import cloudpickle

    class _ChildPickler(cloudpickle.Pickler):
        dispatch_table = _dispatch_table()  # the C pickler reads it once, in __init__

        def reducer_override(self, obj: Any) -> Any:
            if main is not None and isinstance(obj, (types.FunctionType, type)) and _in_main(main, obj):
                return NotImplemented  # by reference, as __main__.name: the child re-imports main
            return super().reducer_override(obj)

    out = io.BytesIO()
    _ChildPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def _rebuild_process(data: bytes, device: Any = None) -> Any:
    """In the child: the process object, from :meth:`GpuProcessMixin.__reduce_ex__`'s bytes.

    A child bound to a CUDA device starts making the device's context first, on
    a thread: unpickling the target and its arguments imports their modules
    (torch, for a loader's dataset: seconds), and the context is made meanwhile
    instead of after them. :func:`bind_device` in ``run()`` waits for it.
    """
    if isinstance(device, int):
        from . import _cuda

        _cuda.start_context(device)
    cls, state = pickle.loads(data)
    process = cls.__new__(cls)
    process.__dict__.update(state)
    return process


def bind_device(device: int | str | None) -> None:
    """In a worker: make ``device`` the current CUDA device for every library."""
    if device is None:
        return
    if device == "cpu":
        os.environ["GPUSHARE_BACKEND"] = "host"
        return
    assert isinstance(device, int)
    os.environ["GPUSHARE_DEVICE"] = str(device)
    from . import _cuda

    _cuda.make_current(device)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.Device(device).use()


class GpuProcessMixin(BaseProcess):
    """Adds ``device=``, cloudpickle with ForkingPickler's reducers, the fork check and cleanup at exit."""

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
        from ._backends import parse_device

        self._device = parse_device(device)

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
        super().start()

    def __reduce_ex__(self, protocol: Any) -> Any:
        if get_spawning_popen() is None:  # not a child's start (copy.copy, say): as multiprocessing does
            return super().__reduce_ex__(protocol)
        # multiprocessing's Popen spawning the child: the whole process object
        # goes as one stream of :func:`dumps` (see the module docstring).
        return (_rebuild_process, (dumps((type(self), self.__dict__)), self._device))

    def run(self) -> None:
        bind_device(self._device)
        try:
            super().run()
        finally:
            lifetime = sys.modules.get("gpushare._lifetime")  # not imported: no link to close
            if lifetime is not None:
                lifetime.close_links()
