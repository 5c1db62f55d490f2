"""The Manager: a multiprocessing SyncManager that also owns shared buffers.

``dict()``, ``list()``, ``Queue()`` and the rest work exactly as in
:mod:`multiprocessing` (they are served by the usual manager server
process). Buffers are different. By default (``owner="process"``) they are
allocated *in the process that created the Manager*, which owns them, and
their lifetime is run by the :class:`~gpushare._lifetime.Owner` service in
that process (see that module for the lease protocol). With
``owner="server"`` the Owner lives in the manager's server process instead
and every Buffer a client holds is a lease on server memory, so buffers
outlive the process that asked for them (see :mod:`gpushare._server`).
In both modes the server process ends when the process that started it
dies without shutting it down.

Sizes are rounded up to a multiple of 2 MiB so that no two buffers ever
share an exported driver allocation, and freed allocations go to a
size-class pool keyed by (backend, device, rounded size).
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Callable
from multiprocessing import current_process, util
from multiprocessing.managers import SyncManager
from typing import Any

import numpy as np

from . import _backends, _lifetime, _server
from ._buffer import Buffer, check_dtype, check_shape
from ._errors import LeakWarning, ManagerClosedError, OutOfMemoryError
from ._lifetime import Owner
from ._reduction import rebuild_buffer
from ._ring import Ring, create_ring

__all__ = ["GRANULARITY", "BufferManager", "round_size"]

#: Every allocation is a multiple of this (the CUDA VMM granularity, 2 MiB).
GRANULARITY = 2 << 20
_MAX_BYTES = 1 << 50  # beyond any device; catches overflowing shapes early


def _no_default_context() -> Any:
    raise RuntimeError("gpushare._context was not imported; import gpushare, not its private modules")


#: The context of a BufferManager made without ``ctx``: gpushare's default context, set by
#: gpushare._context when it is imported (it sits above this module, which must not import it).
default_context: Callable[[], Any] = _no_default_context


_DTYPE_NAMES: dict[Any, str] = {}  # dtype -> its name, for allocation labels (few dtypes exist)


def round_size(nbytes: int) -> int:
    return max(1, math.ceil(nbytes / GRANULARITY)) * GRANULARITY


class BufferManager(SyncManager):
    """A multiprocessing Manager that allocates buffers other processes can map.

    Parameters beyond SyncManager's:

    backend
        Default backend for CUDA buffers (``"cuda_ipc"``).
    lease_timeout
        Seconds a pickled-but-never-unpickled buffer stays leased (60).
    release_timeout
        Seconds shutdown waits for workers to release their buffers (5).
    pool_limit
        Bytes of freed allocations kept for reuse (None: no limit; see trim()).
    owner
        ``"process"`` (default): the process that started the Manager owns the
        memory. ``"server"``: the Manager's server process owns it, and a
        buffer lives while any process holds it, even after the process that
        asked for it died (see gpushare._server).
    """

    def __init__(
        self,
        address: Any = None,
        authkey: bytes | None = None,
        serializer: str = "pickle",
        ctx: Any = None,
        *,
        backend: str | None = None,
        lease_timeout: float = 60.0,
        release_timeout: float = 5.0,
        pool_limit: int | None = None,
        owner: str = "process",
        **kwargs: Any,
    ) -> None:
        if ctx is None:
            ctx = default_context()
        super().__init__(address, authkey, serializer, ctx, **kwargs)
        if backend is not None:
            _backends.get(backend)  # unknown names fail here, not at first use
        self._default_backend = backend
        if owner not in _server.OWNER_MODES:
            raise ValueError(f"owner={owner!r}; valid: {', '.join(map(repr, _server.OWNER_MODES))}")
        self._owner_mode = owner
        self._server_buffers: Any = None  # owner="server": the proxy of the server's ServerBuffers
        self._closed = [False]  # set by shutdown()
        self._owner_options: dict[str, Any] = {
            "lease_timeout": lease_timeout,
            "shutdown_timeout": release_timeout,
            "pool_limit": pool_limit,
        }
        self._owner: Owner | None = None
        self._rings: weakref.WeakSet[Ring] = weakref.WeakSet()  # closed at shutdown, before waiting for leases

    # -- lifecycle -----------------------------------------------------------
    def start(self, initializer: Any = None, initargs: Any = ()) -> None:
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        options = self._owner_options
        super().start(_server.server_init, (self._owner_mode, options, initializer, initargs))
        server_shutdown = self.shutdown  # SyncManager.start() installs a Finalize here
        rings = self._rings
        if self._owner_mode == "server":
            buffers = self._server()

            def shutdown_owner(timeout: float | None) -> None:
                _lifetime.close_link(buffers.token())  # this process's buffers go first
                for message in buffers.shutdown(timeout):
                    warnings.warn(message, LeakWarning, stacklevel=3)

        else:
            owner = self._owner = Owner(authkey=bytes(current_process().authkey), **options)

            def shutdown_owner(timeout: float | None) -> None:
                owner.shutdown(timeout)

        done = threading.Event()
        self_closed = self._closed  # a list, so the closure does not hold the Manager itself

        def shutdown(timeout: float | None = None) -> None:
            if done.is_set():
                return
            done.set()
            self_closed[0] = True
            try:
                for ring in list(rings):
                    ring.close()  # consumers give their slot leases back
                shutdown_owner(timeout)
            finally:
                server_shutdown()

        self.shutdown = shutdown  # type: ignore[method-assign,assignment]
        # Also when the Manager is collected, or at exit: after pools terminate their
        # workers (priority 15), before gpushare's queues announce their creator's exit
        # (10) and the stdlib's own finalizer stops the server (0). Workers still
        # holding buffers get the bounded wait and the leak report, then "bye".
        util.Finalize(self, shutdown, exitpriority=12)

    def _require_owner(self) -> Owner:
        if self._owner is None:
            raise ManagerClosedError("the Manager is not started; use 'with gpushare.Manager() as m:'")
        return self._owner

    def _server(self) -> Any:
        """owner="server": the proxy of the server's ServerBuffers (made on first use)."""
        if self._closed[0]:
            raise ManagerClosedError("the Manager was shut down; make a new Manager to allocate buffers")
        if self._server_buffers is None:
            try:
                self._server_buffers = self._gpushare_buffers()  # type: ignore[attr-defined]
            except (OSError, EOFError) as exc:
                raise ManagerClosedError(f"the Manager's server cannot be reached ({exc}); it was shut down") from exc
        return self._server_buffers

    # -- allocation ------------------------------------------------------------
    def empty(self, shape: Any, dtype: Any = "float32", device: Any = None, *, backend: str | None = None) -> Buffer:
        """An uninitialised buffer (contents are whatever the memory held)."""
        dims = check_shape(shape)
        dt = check_dtype(dtype)
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes > _MAX_BYTES:
            raise OutOfMemoryError(f"shape {dims} of {dt} needs {nbytes} bytes, more than any device holds")
        chosen, ordinal = _backends.resolve(device, backend or self._default_backend)
        name = _DTYPE_NAMES.get(dt)
        if name is None:  # NumPy formats a dtype's name slowly: a few microseconds per buffer
            name = _DTYPE_NAMES.setdefault(dt, str(dt))
        label = f"{dims} {name} on {'cpu' if ordinal is None else f'cuda:{ordinal}'}"
        if self._owner_mode == "server":
            uuid = None
            if ordinal is not None:
                from . import _cuda

                uuid = _cuda.device_uuid(ordinal)
            data = self._server().allocate(dims, dt.str, uuid, chosen.name, round_size(nbytes), label)
            return rebuild_buffer(data)  # claims the lease the server took for this process
        memory = self._require_owner().allocate(chosen, round_size(nbytes), ordinal, label)
        return Buffer(memory, 0, dims, dt)

    def zeros(self, shape: Any, dtype: Any = "float32", device: Any = None, *, backend: str | None = None) -> Buffer:
        return self.empty(shape, dtype, device, backend=backend).fill(0)

    def full(
        self, shape: Any, value: Any, dtype: Any = "float32", device: Any = None, *, backend: str | None = None
    ) -> Buffer:
        return self.empty(shape, dtype, device, backend=backend).fill(value)

    def from_numpy(self, array: Any, device: Any = None, *, backend: str | None = None) -> Buffer:
        """A buffer holding a copy of ``array`` (host -> device on CUDA)."""
        src = np.asarray(array)
        return self.empty(src.shape, src.dtype, device, backend=backend).copy_from(src)

    def buffer(self, nbytes: int, device: Any = None, *, backend: str | None = None) -> Buffer:
        """An untyped buffer of ``nbytes`` bytes (dtype uint8); see Buffer.view()."""
        if int(nbytes) < 0:
            raise ValueError(f"nbytes={nbytes} is negative")
        return self.empty((int(nbytes),), "uint8", device, backend=backend)

    def ring(
        self,
        shape: Any,
        dtype: Any = "float32",
        device: Any = None,
        *,
        slots: int = 4,
        consumers: int = 1,
        backend: str | None = None,
        spin: bool | float | str = "auto",
    ) -> Ring:
        """A ring of ``slots`` pre-shared buffers for producer -> consumers pipelines.

        Pickle the ring into each consumer (e.g. as a Process argument);
        ``publish()`` first waits for ``consumers`` registrations. ``spin``:
        how long an end that waits busy-waits on shared memory before it
        sleeps. ``"auto"`` (default): at most 50 us, and only while its
        previous wait was shorter than that (a fast stream costs no
        wakeups, sparse items no spinning); True (5 ms) or seconds: that
        long every time, lower latency for a core per process; False: never.
        See :class:`~gpushare.Ring` and the protocol in ``gpushare._ring``.
        """
        ring = create_ring(self, shape, dtype, device, slots=slots, consumers=consumers, backend=backend, spin=spin)
        self._rings.add(ring)
        return ring

    # -- observability and upkeep ------------------------------------------------------
    @property
    def owner(self) -> str:
        """``"process"`` or ``"server"``: which process owns this Manager's memory."""
        return self._owner_mode

    def stats(self) -> dict[str, Any]:
        """Counts of buffers, bytes, leases and consumers (see docs/design.md)."""
        if self._owner_mode == "server":
            return dict(self._server().stats())
        return self._require_owner().stats()

    def trim(self) -> int:
        """Free every pooled (unused) allocation now; return the bytes freed."""
        if self._owner_mode == "server":
            return int(self._server().trim())
        return self._require_owner().trim()


BufferManager.register("_gpushare_buffers", callable=_server.server_buffers)
