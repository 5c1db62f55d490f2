"""Contexts: multiprocessing's contexts, with gpushare's Process and Manager.

Mirrors :mod:`multiprocessing.context`. Each concrete context (``spawn``,
``forkserver``, ``fork``) hands out gpushare Process classes, so anything
built on ``ctx.Process`` -- ``Pool`` included -- starts gpushare workers, and
``ctx.Manager()`` returns a started :class:`~gpushare.BufferManager`.

The default context starts with **spawn** (CUDA cannot survive fork). It
is separate from multiprocessing's own default: ``gpushare.set_start_method``
never changes what plain ``multiprocessing`` does.

Importing this module costs next to nothing beyond :mod:`multiprocessing`
itself: the queue and Manager modules load when a context first makes one.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import context as _mpctx

from ._process import GpuProcessMixin

# typing is not imported at run time: it costs every process about 3 ms (see gpushare._seams).
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
    """What gpushare's contexts change: Manager, Queue, JoinableQueue."""

    def Queue(self, maxsize: int = 0) -> Any:
        """A queue that pickles items in ``put()`` (see gpushare._queues)."""
        from ._queues import Queue

        return Queue(maxsize, ctx=self.get_context())  # type: ignore[attr-defined]

    def JoinableQueue(self, maxsize: int = 0) -> Any:
        """A joinable queue that pickles items in ``put()`` (see gpushare._queues)."""
        from ._queues import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())  # type: ignore[attr-defined]

    def Manager(self, **options: Any) -> Any:
        """A started :class:`~gpushare.BufferManager` (also a full multiprocessing Manager)."""
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

    Uses the start method of gpushare's default context (spawn unless
    :func:`gpushare.set_start_method` says otherwise).
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
        return [m for m in ("spawn", "forkserver", "fork") if m in multiprocessing.get_all_start_methods()]


_default_context = DefaultContext(_concrete["spawn"])


def get_context(method: str | None = None) -> Any:
    return _default_context.get_context(method)


def get_start_method(allow_none: bool = False) -> Any:
    return _default_context.get_start_method(allow_none)
