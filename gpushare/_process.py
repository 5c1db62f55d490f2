"""Process(..., device=...): a multiprocessing Process that is safe with CUDA.

- ``device=`` binds the worker to a CUDA device before the target runs.
- The process object goes to a spawned or forkserver child as one stream made by
  :func:`dumps`: ForkingPickler's bytes when everything goes by reference, else cloudpickle's
  with ForkingPickler's reducers. gpushare's queues and Pool pickle with it too.
- ``start()`` refuses fork after CUDA, checks ``device=`` in the parent, and in a child still
  importing the main module raises MainGuardError (see "a script without the main guard").
- At exit the worker releases every buffer it holds and closes its connections.
Why: dev/design-notes.md, "Processes and contexts".
"""

from __future__ import annotations

import _thread
import copyreg
import io
import os
import pickle
import sys
import threading
import types
import weakref
from multiprocessing import reduction as _mp_reduction
from multiprocessing.context import get_spawning_popen
from multiprocessing.process import BaseProcess, current_process
from multiprocessing.reduction import ForkingPickler

from . import _seams
from ._errors import MainGuardError, NoDeviceError, StartMethodError

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._types import Device

__all__ = [
    "MAIN_GUARD_EXIT",
    "GpuProcessMixin",
    "cuda_initialized",
    "dumps",
    "main_guard_error",
    "pickled_directly",
    "stopped_by_main_guard",
]


def cuda_initialized() -> bool:
    """True when CUDA was initialised in this process by gpushare or torch."""
    if _seams.cuda_initialized():
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
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython" or _unreadable_main(main):
        return None
    return main


def _unreadable_main(main: Any) -> bool:
    """Whether the main module came from no file a child could run again: a script fed on
    standard input (``python - <<EOF``), whose ``__file__`` is ``'<stdin>'``."""
    path = getattr(main, "__file__", None)
    if not path or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return False
    return not os.path.isfile(path)


_hiding_main = threading.Lock()


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


_dry = _thread._local()  # .stubbed: whether this thread's dry run stubbed a reducer


def _stub(obj: Any) -> Any:
    _dry.stubbed = True
    return (int, ())


def _reduce_method_by_name(method: Any) -> Any:
    """multiprocessing's reducer for bound methods, for a method that ``getattr`` finds again."""
    if not _method_by_name(method):
        raise _ByValueNeededError
    return _mp_reduction._reduce_method(method)  # type: ignore[attr-defined]


_tables: tuple[dict[Any, Any], dict[Any, Any], dict[Any, Any]] | None = None


def _dry_run_table() -> dict[Any, Any]:
    """ForkingPickler's dispatch table for the dry run: the reducers registered with it,
    and gpushare's own and the Buffer's, stubbed (they take leases, duplicate fds or move tensors to shared
    memory, which a dry run must not do); multiprocessing's reducers for methods and
    partials kept, to be looked into. Rebuilt when a registration changed."""
    global _tables
    from ._buffer import Buffer  # pickles by its own __reduce__, which takes a lease

    extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    cached = _tables
    if cached is not None and cached[0] == copyreg.dispatch_table and cached[1] == extra:
        return cached[2]
    table = dict(copyreg.dispatch_table)
    table.update(extra)
    for kind, reducer in list(table.items()):
        # Stubbed: connections, sockets, heap arenas, tensors, buffers. Kept: the reducers
        # multiprocessing registers for methods and partials, which must be looked into.
        if reducer not in _PURE_REDUCERS and (kind in extra or getattr(kind, "__module__", "").startswith("gpushare")):
            table[kind] = _stub
    table[Buffer] = _stub
    if table.get(types.MethodType) in _PURE_REDUCERS:  # a method getattr would not find goes by value
        table[types.MethodType] = _reduce_method_by_name
    _tables = (dict(copyreg.dispatch_table), dict(extra), table)
    return table


class _NoMainPickler(pickle.Pickler):
    """The dry run's pickler where the child does not re-import the main module: its
    functions and classes, which the plain pickler would name, only go by value."""

    def __init__(self, file: Any, protocol: int | None, main: Any) -> None:
        super().__init__(file, protocol)
        self.main = main

    def reducer_override(self, value: Any) -> Any:
        if isinstance(value, (types.FunctionType, type)) and not _by_reference(self.main, value):
            raise _ByValueNeededError
        return NotImplemented


def _dry_run(obj: Any, protocol: int | None, main: Any) -> tuple[bool, bytes | None]:
    """Does ``obj`` pickle with multiprocessing's own pickler, every function and class
    by reference? Pickled with the :func:`_dry_run_table`, so no reducer acts. Returns
    (False, None) when only cloudpickle can carry it (or fails to, with its own
    explanation); (True, the pickle) when no reducer was stubbed, so that the pickle is
    byte for byte what ForkingPickler writes; (True, None) when ForkingPickler must run.

    Where the child re-imports the main module the C pickler does all of it: it names a
    function or class by reference exactly when the child finds it by that name, and
    fails otherwise. Elsewhere the main module's own go by value (:class:`_NoMainPickler`).
    """
    out = io.BytesIO()
    if main is None:
        pickler: pickle.Pickler = _NoMainPickler(out, protocol, main)
    else:
        pickler = pickle.Pickler(out, protocol)
    pickler.dispatch_table = _dry_run_table()
    outer = getattr(_dry, "stubbed", False)
    _dry.stubbed = False
    try:
        pickler.dump(obj)
    except TypeError:
        # Not a function or class the plain pickler cannot name (that is a PicklingError or an
        # AttributeError) but an object no pickler carries in multiprocessing: an open file, a lock,
        # a generator. Its error is the stdlib's own, and cloudpickle must not send a copy instead.
        raise
    except Exception:
        return False, None
    finally:
        stubbed, _dry.stubbed = _dry.stubbed, outer
    return True, None if stubbed else out.getvalue()


# (a weak reference to sys.modules["__main__"], whether _main_module_reimported() returns it). Weak:
# a strong one kept the main module, and so the objects its globals name, alive past the interpreter's
# clearing of it, until after multiprocessing's own modules were cleared; their finalizers then failed
# at exit (a SharedMemoryManager's __del__: "'NoneType' object has no attribute 'debug'").
_main_cache: tuple[Any, bool] = (lambda: None, False)


def _reimported_main() -> Any:
    """:func:`_main_module_reimported`, asked once per main module."""
    global _main_cache
    main = sys.modules.get("__main__")
    if main is None:
        return None
    if _main_cache[0]() is not main:
        _main_cache = (weakref.ref(main), _main_module_reimported() is main)
    return main if _main_cache[1] else None


_DIRECT: set[type] = set()  # classes whose objects skip the dry run (pickled_directly)


def pickled_directly(cls: type) -> None:
    """Objects of exactly ``cls`` go straight to ForkingPickler in :func:`dumps`: their reducer
    acts (a lease, an fd), so the dry run could only say so, and what it returns (a module
    function and plain values) never needs cloudpickle. A Buffer, a torch tensor."""
    _DIRECT.add(cls)


def dumps(obj: Any, protocol: int | None = pickle.HIGHEST_PROTOCOL) -> bytes:
    """Pickle ``obj`` for another process (see the module docstring): what a child is
    started with, a gpushare queue's items, a Pool's tasks and results, an executor's
    calls. ``protocol=None`` is ForkingPickler's default (what multiprocessing's queues
    and connections use).

    When nothing in ``obj`` needs a registered reducer that acts (the usual task or
    result), the dry run's pickle is the answer: one pass. Objects that only pickle
    while multiprocessing is spawning a child (locks, semaphores, connections, the
    authkey) must be pickled then.
    """
    if type(obj) in _DIRECT:  # a queue's most common item: the dry run could only say "pickle it"
        main, plain, data = None, True, None
    else:
        main = _reimported_main()
        plain, data = _dry_run(obj, protocol, main)
    if data is not None:
        return data
    out = io.BytesIO()
    if plain:
        ForkingPickler(out, protocol).dump(obj)
        return out.getvalue()
    import cloudpickle

    class _ChildPickler(cloudpickle.Pickler):
        dispatch_table = _dispatch_table()  # the C pickler reads it once, in __init__

        def reducer_override(self, obj: Any) -> Any:
            if main is not None and isinstance(obj, (types.FunctionType, type)) and _in_main(main, obj):
                return NotImplemented  # by reference, as __main__.name: the child re-imports main
            return super().reducer_override(obj)

    _ChildPickler(out, protocol=protocol).dump(obj)
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


def _check_device(device: int) -> None:
    """``start()`` of a process bound to CUDA device ``device``: raise NoDeviceError here,
    before the child starts, when it would not have that device. When ``CUDA_VISIBLE_DEVICES``
    changed since the driver loaded here, only the child can tell, and it is left to.

    A parent that has not initialised CUDA does not load the driver for this (that would
    cost it the driver's start and, from then on, the fork start method): it reads what
    the kernel driver lists, an upper bound that refuses a machine without a GPU and an
    ordinal past the devices present; the child checks the rest."""
    from . import _cuda

    try:
        count = _cuda.child_device_count() if cuda_initialized() else _cuda.present_device_count()
    except NoDeviceError as exc:
        raise NoDeviceError(f"cannot start a process on CUDA device {device}: {exc}") from exc.__cause__
    if count is not None and device >= count:
        raise NoDeviceError(
            f"cannot start a process on CUDA device {device}: a child would see {count} CUDA device(s) "
            f"(ordinals 0..{count - 1}; CUDA_VISIBLE_DEVICES renumbers them), and the child inherits "
            "its environment. Pick one of those, or device='cpu' (host shared memory) or device=None"
        )


# -- a script without the main guard ---------------------------------------------------
#
# A child started with spawn or forkserver imports the main module again (as __mp_main__)
# before it unpickles its process object. A script that starts processes at its top level
# would start them again there, in every child; multiprocessing refuses with a RuntimeError,
# and a Pool, which replaces a worker that exits, starts another, which fails the same way,
# forever. Here the child raises MainGuardError and exits at once with MAIN_GUARD_EXIT, and
# a parent that waits for such a child (a Pool, a Manager) raises MainGuardError in turn.

MAIN_GUARD_EXIT = 78  # EX_CONFIG: the exit code of a child stopped by MainGuardError

_GUARD_FIX = (
    'put the code that starts processes (Process, Pool, Manager, executors) under `if __name__ == "__main__":`, '
    "or, if CUDA is not used before they start, use the 'fork' start method "
    "(gpushare.set_start_method('fork')), whose children do not import the main module again"
)


def _main_guard_error_here() -> MainGuardError:
    """The error for ``start()`` in a child still importing the main module, naming the
    main module's line that started the process. When it ends the child (uncaught: unless
    the script catches it), it is printed without the traceback through multiprocessing's
    bootstrap, exit handlers run, and the child exits at once with MAIN_GUARD_EXIT, which
    its parent recognises."""
    where = "the main module"
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            where = f"line {frame.f_lineno} of {frame.f_code.co_filename}"
            break
        frame = frame.f_back
    error = MainGuardError(
        f"{where} starts a process, and this child process (pid {os.getpid()}) ran it again while it "
        "imported the main module, as every child started with spawn (gpushare's default) or forkserver "
        f"does: what the main module does at its top level runs again in each child. To fix it, {_GUARD_FIX}"
    )
    previous = sys.excepthook

    def exit_now(kind: Any, value: Any, tb: Any) -> None:
        if value is not error:
            previous(kind, value, tb)
            return
        try:
            sys.stderr.write(f"gpushare.MainGuardError: {error}\n")
            import atexit

            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(MAIN_GUARD_EXIT)

    sys.excepthook = exit_now
    return error


def main_guard_error(who: str, pid: int | None) -> MainGuardError:
    """In a parent: the error for its child ``who`` that exited with MAIN_GUARD_EXIT."""
    path = getattr(sys.modules.get("__main__"), "__file__", None) or "the main module"
    return MainGuardError(
        f"{who} (pid {pid}) stopped at once: it imported the main module ({path}) again, as a child "
        "started with spawn or forkserver does, and that module starts processes at its top level "
        f"(the child printed the line). To fix it, {_GUARD_FIX}"
    )


_spawned: weakref.WeakSet[BaseProcess] = weakref.WeakSet()  # children this process started that import main


def stopped_by_main_guard() -> Any:
    """A child this process started (spawn or forkserver) that exited with MAIN_GUARD_EXIT,
    or None. Asking reaps the children that exited, as ``exitcode`` does."""
    for child in list(_spawned):
        if child._parent_pid != os.getpid():  # type: ignore[attr-defined]
            continue
        try:
            stopped = child.exitcode == MAIN_GUARD_EXIT
        except ValueError:  # close()d: its exit code is gone, and with it any guard error
            continue
        if stopped:
            return child
    return None


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
        device: Device = None,
    ) -> None:
        super().__init__(group, target, name, args, kwargs or {}, daemon=daemon)
        from ._backends import parse_device

        self._device = parse_device(device)

    @property
    def device(self) -> int | str | None:
        """The ``device=`` given, normalised: a CUDA ordinal, ``"cpu"`` or None."""
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
        if getattr(current_process(), "_inheriting", False):
            raise _main_guard_error_here()
        method = self._resolved_start_method()
        if method == "fork" and cuda_initialized():
            raise StartMethodError(
                "cannot start a process with the 'fork' start method: CUDA is already initialised in "
                "this process, and a forked child cannot use it (CUDA_ERROR_NOT_INITIALIZED). Use the "
                "default 'spawn' (gpushare.get_context('spawn'), or gpushare.set_start_method('spawn', "
                "force=True)) or 'forkserver'"
            )
        if isinstance(self._device, int) and method != "fork":  # fork: loading the driver here would break the child
            _check_device(self._device)
        main: Any = sys.modules.get("__main__")
        if method != "fork" and _unreadable_main(main):
            # A child cannot run '<stdin>' again (multiprocessing's would die with FileNotFoundError, and a
            # Pool would replace it forever): it starts as from an interactive session instead, and the
            # script's functions and classes travel by value.
            with _hiding_main:
                path = main.__dict__.pop("__file__")
                try:
                    super().start()
                finally:
                    main.__file__ = path
        else:
            super().start()
        if method != "fork":
            _spawned.add(self)

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
            _seams.worker_exit()  # the links' leases go back now: a worker ends without atexit
