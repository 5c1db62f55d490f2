"""Contexts: multiprocessing's contexts, with gpushare's Process and Manager.

- Mirrors :mod:`multiprocessing.context`. The ``spawn``, ``forkserver`` and ``fork`` contexts
  hand out gpushare's Process, Pool, queues and a started :class:`~gpushare.BufferManager`,
  so anything built on ``ctx.Process`` (a ``ProcessPoolExecutor`` too) starts gpushare workers.
- The default context starts with spawn and is separate from multiprocessing's own.
- The queue, Pool and Manager modules load when a context first makes one.
"""

from __future__ import annotations

import multiprocessing
import sys
from multiprocessing import context as _mpctx

from ._process import GpuProcessMixin

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["DefaultContext", "Process", "get_context", "get_start_method"]


class SpawnProcess(GpuProcessMixin, _mpctx.SpawnProcess):
    """A gpushare worker started with spawn."""

    _start_method = "spawn"


class ForkServerProcess(GpuProcessMixin, _mpctx.ForkServerProcess):
    """A gpushare worker started by the forkserver."""

    _start_method = "forkserver"


class ForkProcess(GpuProcessMixin, _mpctx.ForkProcess):
    """A gpushare worker started with fork (refused once CUDA is initialised)."""

    _start_method = "fork"


class _ManagerMixin:
    """What gpushare's contexts change: Manager, Queue, JoinableQueue, SimpleQueue, Pool."""

    def Queue(self, maxsize: int = 0) -> Any:
        """A queue for processes, as ``multiprocessing.Queue``.

        ``put()`` pickles the item in the caller (lambdas and closures too), and
        ``get()`` raises :class:`~gpushare.OwnerGoneError` instead of waiting forever
        once no other process can put.

        Parameters
        ----------
        maxsize : int
            The most items the queue holds, counted across every process (0: no bound).

        Returns
        -------
        gpushare.queues.Queue
        """
        from ._queues import Queue

        return Queue(maxsize, ctx=self.get_context())  # type: ignore[attr-defined]

    def JoinableQueue(self, maxsize: int = 0) -> Any:
        """:meth:`Queue` with ``task_done()`` and ``join()``, as ``multiprocessing.JoinableQueue``.

        Parameters
        ----------
        maxsize : int
            As for :meth:`Queue`.

        Returns
        -------
        gpushare.queues.JoinableQueue
        """
        from ._queues import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())  # type: ignore[attr-defined]

    def SimpleQueue(self) -> Any:
        """``multiprocessing.SimpleQueue`` whose items are pickled as a Process's arguments are
        (lambdas and closures too).

        Returns
        -------
        gpushare.queues.SimpleQueue
        """
        from ._queues import SimpleQueue

        if "concurrent.futures.process" in sys.modules:
            # Perhaps a ProcessPoolExecutor's result queue: its calls must carry what this does.
            from ._pool import carry_executor_calls

            carry_executor_calls()
        return SimpleQueue(ctx=self.get_context())  # type: ignore[attr-defined]

    def Pool(
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: Any = (),
        maxtasksperchild: int | None = None,
    ) -> Any:
        """A ``multiprocessing.pool.Pool`` of gpushare processes whose tasks and results are
        pickled as a Process's arguments are (lambdas and closures too).

        Parameters
        ----------
        processes, initializer, initargs, maxtasksperchild
            As for ``multiprocessing.Pool``.

        Returns
        -------
        multiprocessing.pool.Pool
        """
        from ._pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self.get_context())  # type: ignore[attr-defined]

    def Manager(self, **options: Any) -> Any:
        """A started :class:`~gpushare.BufferManager` (also a full multiprocessing Manager).

        Parameters
        ----------
        **options
            :class:`~gpushare.BufferManager`'s parameters.

        Returns
        -------
        BufferManager
            Started; ``with`` shuts it down.
        """
        from ._manager import BufferManager

        manager = BufferManager(ctx=self.get_context(), **options)  # type: ignore[attr-defined]
        manager.start()
        return manager


class SpawnContext(_ManagerMixin, _mpctx.SpawnContext):
    _name = "spawn"
    Process = SpawnProcess


class ForkServerContext(_ManagerMixin, _mpctx.ForkServerContext):
    _name = "forkserver"
    Process = ForkServerProcess


class ForkContext(_ManagerMixin, _mpctx.ForkContext):
    _name = "fork"
    Process = ForkProcess


_concrete: dict[str, Any] = {"spawn": SpawnContext(), "forkserver": ForkServerContext(), "fork": ForkContext()}


class Process(GpuProcessMixin):
    """A gpushare worker: ``multiprocessing.Process`` plus ``device=``.

    The target and arguments may be lambdas and closures (they travel with cloudpickle
    when the standard pickle cannot carry them). At exit the child releases every
    buffer it still holds. It uses the start method of gpushare's default context
    (spawn unless :func:`gpushare.set_start_method` says otherwise).

    Parameters
    ----------
    group, target, name, args, kwargs, daemon
        As for ``multiprocessing.Process``.
    device : int, "cuda:N", torch.device or "cpu", optional
        The CUDA device the child works on, made current in the child before the
        target runs (in torch and CuPy too, where loaded), or ``"cpu"`` for a child
        whose ``device=None`` means host memory. None (default) leaves the child's
        device alone.

    Raises
    ------
    ValueError
        If ``device`` is not one of the values above.
    NoDeviceError
        From ``start()``, in the parent, when the child would not have the CUDA device.
    StartMethodError
        From ``start()``: the fork start method once CUDA is initialised in the parent.
    """

    _start_method = None

    def _resolved_start_method(self) -> str:
        return str(get_start_method())

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _default_context.get_context().Process._Popen(process_obj)

    @staticmethod
    def _after_fork() -> None:
        return _default_context.get_context().Process._after_fork()


class DefaultContext(_ManagerMixin, _mpctx.DefaultContext):
    Process = Process  # type: ignore[assignment]
    _actual_context: Any
    _default_context: Any

    def get_context(self, method: str | None = None) -> Any:
        """gpushare's context for ``method`` ("spawn", "forkserver", "fork"), or the default."""
        if method is None:
            if self._actual_context is None:
                self._actual_context = self._default_context
            return self._actual_context
        try:
            ctx = _concrete[method]
        except KeyError:
            raise ValueError(f"cannot find context for {method!r}; valid: {', '.join(_concrete)}") from None
        ctx._check_available()
        return ctx

    def get_all_start_methods(self) -> list[str]:
        """The start methods this platform has, as ``multiprocessing.get_all_start_methods``.

        Returns
        -------
        list of str
            Those of "spawn", "forkserver" and "fork" this platform has, in that order.
        """
        return [m for m in ("spawn", "forkserver", "fork") if m in multiprocessing.get_all_start_methods()]


_default_context = DefaultContext(_concrete["spawn"])


def get_context(method: str | None = None) -> Any:
    """gpushare's context for a start method, as ``multiprocessing.get_context``.

    Its Process, Manager, Pool and queues are gpushare's. ``gpushare.set_start_method``
    never changes plain multiprocessing's default, nor the other way round.

    Parameters
    ----------
    method : {"spawn", "forkserver", "fork"}, optional
        None (default): the default context, spawn unless ``gpushare.set_start_method``
        chose another.

    Returns
    -------
    gpushare.context.SpawnContext, ForkServerContext, ForkContext or DefaultContext

    Raises
    ------
    ValueError
        If ``method`` is not a start method this platform has.
    """
    return _default_context.get_context(method)


def get_start_method(allow_none: bool = False) -> Any:
    """The default context's start method, as ``multiprocessing.get_start_method``."""
    return _default_context.get_start_method(allow_none)


# Their public names in help() and tracebacks; gpushare.context holds the contexts, so one pickled
# by reference is found there. SpawnProcess and its kin keep their module, which a spawned child
# imports to rebuild one (gpushare.context would cost it two modules more).
for _cls in (SpawnContext, ForkServerContext, ForkContext, DefaultContext):
    _cls.__module__ = "gpushare.context"
for _function in (*vars(_ManagerMixin).values(), DefaultContext.get_context, DefaultContext.get_all_start_methods,
                  get_context, get_start_method):  # fmt: skip
    if callable(_function):
        _function.__module__ = "gpushare"
Process.__module__ = "gpushare"  # a spawned child finds it as gpushare.Process, which the facade holds
DefaultContext.get_context.__doc__ = get_context.__doc__  # gpushare.get_context is the bound method
del _cls, _function
