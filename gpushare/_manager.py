"""The Manager: a multiprocessing SyncManager that also owns shared buffers.

- ``dict()``, ``list()``, ``Queue()`` and the rest are the stdlib's, served by its server process.
- Buffers: with ``owner="process"`` (default) an Owner in the creating process allocates them,
  made with the first buffer; with ``owner="server"`` the server's Owner does
  (:class:`RemoteAllocator`, :mod:`gpushare._manager_server`).
- Sizes round up to :data:`GRANULARITY` (2 MiB); the buffer machinery loads with the first buffer.
- Shutdown: :meth:`BufferManager.shutdown`, ``with``, garbage collection or exit (a finalizer).
Modes and lifetimes: dev/design-notes.md, "Who owns the memory".
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from multiprocessing import current_process, process, util
from multiprocessing.managers import State, SyncManager  # type: ignore[attr-defined,unused-ignore]

from . import _manager_server, _seams
from ._errors import LeakWarning, ManagerClosedError, OutOfMemoryError
from ._process import MAIN_GUARD_EXIT, main_guard_error

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._buffer import Buffer
    from ._fanout import Ring, TensorSet
    from ._lifetime._protocol import OwnerAddress
    from ._types import Device, DType, Shape

__all__ = ["GRANULARITY", "BufferManager", "RemoteAllocator", "round_size"]

GRANULARITY = 2 << 20
"""Every allocation is a multiple of this many bytes (2 MiB, the CUDA VMM granularity)."""
_MAX_BYTES = 1 << 50  # beyond any device; catches overflowing shapes early

_DTYPE_NAMES: dict[Any, str] = {}  # dtype -> its name, for allocation labels (few dtypes exist)


def round_size(nbytes: int) -> int:
    return max(1, math.ceil(nbytes / GRANULARITY)) * GRANULARITY


def _allocation_request(shape: Any, dtype: Any, device: Any, backend: str | None) -> tuple[Any, ...]:
    """Check a request and resolve where it goes: (backend, ordinal, dims, dtype, rounded size, label)."""
    from . import _backends
    from ._buffer import check_dtype, check_shape

    dims = check_shape(shape)
    dt = check_dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes > _MAX_BYTES:
        raise OutOfMemoryError(f"shape {dims} of {dt} needs {nbytes} bytes, more than any device holds")
    chosen, ordinal = _backends.resolve(device, backend)
    name = _DTYPE_NAMES.get(dt)
    if name is None:  # NumPy formats a dtype's name slowly, and every buffer asks
        name = _DTYPE_NAMES.setdefault(dt, str(dt))
    label = f"{dims} {name} on {'cpu' if ordinal is None else f'cuda:{ordinal}'}"
    return chosen, ordinal, dims, dt, round_size(nbytes), label


class RemoteAllocator:
    """Allocates buffers from an Owner in another process (``Alloc`` requests over this
    process's link to it): the client side of a server-owned Manager, and how a loader's
    workers get slots that the trainer owns. The memory belongs to that Owner; each
    Buffer here is a lease on it, like any received buffer, so it lives while some
    process holds it."""

    def __init__(self, address: str, token: bytes, default_backend: str | None = None) -> None:
        self.address = address
        self.token = token
        self.default_backend = default_backend

    def link(self) -> Any:
        from ._lifetime import link_for

        return link_for(self.address, self.token)

    def released_transient(self) -> None:
        """Have the Owner read this process's releases now (a message, not a wait), so that
        it frees the ``transient`` buffers just released at once."""
        from ._lifetime import owner_for

        if owner_for(self.token) is None:  # in the owner's own process, releases need no reading
            self.link().recorder.nudge()

    def empty(
        self, shape: Shape, dtype: DType = "float32", device: Device = None, *, backend: str | None = None,
        transient: bool = False,
    ) -> Buffer:  # fmt: skip
        """An uninitialised buffer, allocated by the Owner for this process. ``transient``:
        the Owner frees it once unused instead of pooling it for a later request of its
        size (scratch memory of a size no later request asks for)."""
        from ._buffer import rebuild_buffer
        from ._lifetime import owner_for
        from ._lifetime._protocol import Alloc

        chosen, ordinal, dims, dt, nbytes, label = _allocation_request(
            shape, dtype, device, backend or self.default_backend
        )
        owner = owner_for(self.token)
        if owner is not None:  # asked in the owner's own process: no request needed
            from ._buffer import Buffer

            return Buffer(owner.allocate(chosen, nbytes, ordinal, label, transient), 0, dims, dt)
        uuid = None
        if ordinal is not None:
            from . import _cuda

            uuid = _cuda.device_uuid(ordinal)
        data = self.link().request(Alloc, chosen.name, uuid, nbytes, label, dt.str, dims, transient)
        return rebuild_buffer(data)  # claims the lease the Owner took for this process


class _Owning:
    """What a Manager's buffers need, kept apart from the Manager object so that its
    finalizer (which holds this) does not keep the Manager alive.

    ``owner="process"``: the Owner of this process, made with the first buffer.
    ``owner="server"``: the address and token of the server's Owner, read from the
    server on first use.
    """

    def __init__(self, mode: str, options: dict[str, Any]) -> None:
        self.mode = mode
        self.options = options
        self.lock = threading.Lock()
        self.owner: Any = None  # process mode: the Owner
        self.server: OwnerAddress | None = None  # owner="server": where the server's Owner listens
        self.closed = False

    def local_owner(self) -> Any:
        if self.closed:
            raise ManagerClosedError("the Manager was shut down; make a new Manager to allocate buffers")
        owner = self.owner
        if owner is None:
            with self.lock:
                owner = self.owner
                if owner is None:
                    from ._lifetime._owner import Owner

                    owner = self.owner = Owner(authkey=bytes(current_process().authkey), **self.options)
        return owner

    def remote(self, fetch: Any, default_backend: str | None) -> RemoteAllocator:
        """The server's Owner as an allocator (``fetch()`` reads its address once)."""
        if self.closed:
            raise ManagerClosedError("the Manager was shut down; make a new Manager to allocate buffers")
        if self.server is None:
            with self.lock:
                if self.server is None:
                    self.server = fetch()
        return RemoteAllocator(self.server.address, self.server.token, default_backend)

    def shutdown(self, timeout: float | None) -> None:
        """Shut the buffer side down (the server itself is stopped by the caller)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            owner, server = self.owner, self.server
        if owner is not None:
            owner.shutdown(timeout)
        elif server is not None:
            wait = self.options["shutdown_timeout"] if timeout is None else timeout
            for message in _manager_server.shutdown_owner(server, wait):
                warnings.warn(message, LeakWarning, stacklevel=4)


class BufferManager(SyncManager):
    """A multiprocessing Manager that allocates buffers other processes can map.

    ``gpushare.Manager(**options)`` makes one and starts it; ``with`` shuts it down.
    It is also a full ``multiprocessing.managers.SyncManager`` (``dict()``,
    ``list()``, ``Queue()`` ...).

    Parameters
    ----------
    address, authkey, serializer, ctx
        As for ``SyncManager``; ``ctx`` is gpushare's default context when omitted.
    backend : str, optional
        The default backend of CUDA buffers: ``"cuda_ipc"`` (when omitted),
        ``"cuda_vmm"`` or ``"cuda_pool"``.
    lease_timeout : float
        Seconds a buffer pickled but never unpickled stays leased (60). Past that the
        lease expires with a :class:`~gpushare.LeaseExpiredWarning`, and unpickling it
        raises :class:`~gpushare.DescriptorError`.
    release_timeout : float
        Seconds :meth:`shutdown` waits for other processes to release their buffers,
        and for shares in flight to be claimed (5).
    pool_limit : int, optional
        Bytes of freed allocations kept for reuse (None: no limit; see :meth:`trim`).
    owner : {"process", "server"}
        ``"process"`` (default): the process that started the Manager owns the
        memory. ``"server"``: the Manager's server process owns it, and a buffer
        lives while any process holds it, even after the process that asked for it
        died (docs/concepts.md, ``owner="server"``).

    Raises
    ------
    BackendUnavailableError
        If ``backend`` is not a known backend.
    ValueError
        If ``owner`` is not one of the two modes.
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

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
            ctx = _seams.default_context()
        super().__init__(address, authkey, serializer, ctx, **kwargs)
        if backend is not None:
            from . import _backends

            _backends.get(backend)  # unknown names fail here, not at first use
        self._default_backend = backend
        if owner not in _manager_server.OWNER_MODES:
            raise ValueError(f"owner={owner!r}; valid: {', '.join(map(repr, _manager_server.OWNER_MODES))}")
        self._owner_mode = owner
        self._owner_options: dict[str, Any] = {
            "lease_timeout": lease_timeout,
            "shutdown_timeout": release_timeout,
            "pool_limit": pool_limit,
        }
        self._owning = _Owning(owner, self._owner_options)
        self._rings: weakref.WeakSet[Ring] = weakref.WeakSet()  # closed at shutdown, before waiting for leases
        self._tensor_sets: weakref.WeakSet[TensorSet] = weakref.WeakSet()  # the same

    # -- lifecycle -----------------------------------------------------------
    def start(self, initializer: Any = None, initargs: Any = ()) -> None:
        """Start the Manager's server process, as ``SyncManager.start`` does.

        Parameters
        ----------
        initializer : callable, optional
            Called in the server process with ``initargs`` before it serves.
        initargs : tuple
            The arguments of ``initializer``.

        Raises
        ------
        TypeError
            If ``initializer`` is given and is not callable.
        MainGuardError
            If the server process died importing the main module (a script without an
            ``if __name__ == "__main__":`` guard).
        """
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        try:
            super().start(_manager_server.server_init, (self._owner_mode, self._owner_options, initializer, initargs))
        except EOFError:  # the server exited before it sent its address
            server = getattr(self, "_process", None)
            if server is not None:
                server.join(5.0)
                if server.exitcode == MAIN_GUARD_EXIT:
                    raise main_guard_error("the Manager's server process", server.pid) from None
            raise
        self._install_shutdown()

    def connect(self) -> None:
        """Connect to a running Manager's server (``address=``). Buffers allocated through a
        connected Manager are owned as its ``owner=`` says: pass ``owner="server"`` to
        allocate from the server (a process-owned Manager cannot be shared this way)."""
        super().connect()

    def _install_shutdown(self) -> None:
        server_shutdown = self.shutdown  # SyncManager.start() installs a Finalize here
        rings = self._rings
        tensor_sets = self._tensor_sets
        owning = self._owning
        done = threading.Event()

        def shutdown(timeout: float | None = None) -> None:
            if done.is_set():
                return
            done.set()
            try:
                for ring in list(rings):
                    ring.close()  # consumers give their slot leases back
                for tensor_set in list(tensor_sets):
                    tensor_set._shutdown()  # readers waiting for a version let go of theirs
                owning.shutdown(timeout)
            finally:
                server_shutdown()

        server = self._process  # type: ignore[attr-defined]
        address, authkey, client = self._address, self._authkey, self._Client  # type: ignore[attr-defined]

        def collected_or_exiting() -> None:
            # Server-owned memory lives while any process holds it: the server, asked to exit
            # once none does, is neither stopped by the stdlib's finalizer nor joined at this
            # process's exit.
            if owning.mode != "server" or done.is_set() or not _manager_server.ask_to_retire(address, authkey, client):
                shutdown()
                return
            done.set()
            for ring in list(rings):
                ring.close()  # consumers read what was published, then the ring ends
            for tensor_set in list(tensor_sets):
                tensor_set.close()  # readers keep the latest version
            with owning.lock:
                owning.closed = True  # no more allocations; buffers held here stay leases like any other
            server_shutdown.cancel()
            process._children.discard(server)  # type: ignore[attr-defined]
            threading.Thread(target=server.join, name="gpushare-server-reaper", daemon=True).start()

        self.shutdown = shutdown  # type: ignore[method-assign,assignment]
        # Also when the Manager is collected, or at exit: after pools terminate their
        # workers (priority 15), before gpushare's queues announce their creator's exit
        # (10) and the stdlib's own finalizer stops the server (0). Workers still
        # holding buffers get the bounded wait and the leak report, then "bye"; with
        # owner="server" they keep the memory instead.
        util.Finalize(self, collected_or_exiting, exitpriority=12)

    def _server_owner(self) -> OwnerAddress:
        """owner="server": where the server's Owner listens (one manager call)."""
        try:
            proxy = self._gpushare_owner()  # type: ignore[attr-defined]
        except (OSError, EOFError) as exc:
            raise ManagerClosedError(f"the Manager's server cannot be reached ({exc}); it was shut down") from exc
        where = proxy._getvalue()
        del proxy  # it holds the Manager: keep none
        return where  # type: ignore[no-any-return]

    # -- allocation ------------------------------------------------------------
    def empty(
        self, shape: Shape, dtype: DType = "float32", device: Device = None, *, backend: str | None = None
    ) -> Buffer:
        """An uninitialised buffer: its contents are whatever the memory held.

        Parameters
        ----------
        shape, dtype, device, backend
            As for :meth:`zeros`.

        Returns
        -------
        Buffer

        Raises
        ------
        NoDeviceError, OutOfMemoryError, BackendUnavailableError
            As for :meth:`zeros`.
        ManagerClosedError
            If the Manager is not started or was shut down.
        """
        from ._buffer import Buffer

        self._check_started()
        if self._owner_mode == "server":
            return self._owning.remote(self._server_owner, self._default_backend).empty(
                shape, dtype, device, backend=backend
            )
        chosen, ordinal, dims, dt, nbytes, label = _allocation_request(
            shape, dtype, device, backend or self._default_backend
        )
        memory = self._owning.local_owner().allocate(chosen, nbytes, ordinal, label)
        return Buffer(memory, 0, dims, dt)

    def zeros(
        self, shape: Shape, dtype: DType = "float32", device: Device = None, *, backend: str | None = None
    ) -> Buffer:
        """A buffer of zero bytes (0 in every numeric dtype), as ``numpy.zeros``.

        Parameters
        ----------
        shape : int or tuple of int
            The buffer's shape.
        dtype : str or numpy.dtype
            Its element type (``"float32"`` by default; ``"bfloat16"`` and the float8 kinds too).
        device : int, "cuda:N", torch.device, "cpu" or None
            A CUDA device, ``"cpu"`` for host shared memory, or None: the current CUDA
            device when one is usable, else host memory (with a warning once).
        backend : str, optional
            The CUDA sharing mechanism (``"cuda_ipc"``, ``"cuda_vmm"``, ``"cuda_pool"``);
            the Manager's default when omitted.

        Returns
        -------
        Buffer

        Raises
        ------
        NoDeviceError
            If ``device`` names a CUDA device this machine does not have or cannot use.
        OutOfMemoryError
            If the device or the host has not the memory.
        BackendUnavailableError
            If ``backend`` cannot run on this machine.
        """
        buf = self.empty(shape, dtype, device, backend=backend)
        buf.view("uint8", (buf.nbytes,)).fill(0)  # zero bytes, as numpy.zeros (float8_e8m0fnu has no 0.0)
        return buf

    def full(
        self, shape: Shape, value: Any, dtype: DType = "float32", device: Device = None, *, backend: str | None = None
    ) -> Buffer:
        """A buffer with every element ``value``, as ``numpy.full``.

        Parameters
        ----------
        shape : int or tuple of int
            The buffer's shape.
        value : number
            The value of every element, converted to ``dtype``.
        dtype, device, backend
            As for :meth:`zeros`.

        Returns
        -------
        Buffer

        Raises
        ------
        NoDeviceError, OutOfMemoryError, BackendUnavailableError
            As for :meth:`zeros`.
        """
        return self.empty(shape, dtype, device, backend=backend).fill(value)

    def from_numpy(self, array: Any, device: Device = None, *, backend: str | None = None) -> Buffer:
        """A buffer holding a copy of ``array``, with its shape and dtype.

        Parameters
        ----------
        array : array_like
            Anything ``numpy.asarray`` takes; copied host to device on a CUDA backend.
        device, backend
            As for :meth:`zeros`.

        Returns
        -------
        Buffer

        Raises
        ------
        NoDeviceError, OutOfMemoryError, BackendUnavailableError
            As for :meth:`zeros`.
        """
        import numpy as np

        src = np.asarray(array)
        return self.empty(src.shape, src.dtype, device, backend=backend).copy_from(src)

    def buffer(self, nbytes: int, device: Device = None, *, backend: str | None = None) -> Buffer:
        """An untyped buffer of ``nbytes`` bytes (dtype uint8), to be typed by :meth:`Buffer.view`.

        Parameters
        ----------
        nbytes : int
            Its size in bytes (the allocation rounds up to :data:`GRANULARITY`).
        device, backend
            As for :meth:`zeros`.

        Returns
        -------
        Buffer

        Raises
        ------
        ValueError
            If ``nbytes`` is negative.
        NoDeviceError, OutOfMemoryError, BackendUnavailableError
            As for :meth:`zeros`.
        """
        if int(nbytes) < 0:
            raise ValueError(f"nbytes={nbytes} is negative")
        return self.empty((int(nbytes),), "uint8", device, backend=backend)

    def ring(
        self,
        shape: Shape,
        dtype: DType = "float32",
        device: Device = None,
        *,
        slots: int = 4,
        consumers: int = 1,
        backend: str | None = None,
        spin: bool | float | str = "auto",
    ) -> Ring:
        """A ring of ``slots`` pre-shared buffers for producer -> consumers pipelines.

        Pickle the ring into each consumer (e.g. as a Process argument);
        ``publish()`` first waits for ``consumers`` registrations. See
        :class:`~gpushare.Ring` and docs/guides/ring.md.

        Parameters
        ----------
        shape, dtype, device
            Each slot's, as for :meth:`zeros`.
        slots : int
            How many buffers the producer cycles through (4).
        consumers : int
            How many consumers get every item (1).
        backend : str, optional
            As for :meth:`zeros`.
        spin : "auto", bool or float
            How long an end that waits busy-waits on shared memory before it
            sleeps. ``"auto"`` (default): at most 50 us, and only while its
            previous wait was shorter than that (a fast stream costs no wakeups,
            sparse items no spinning); True (5 ms) or seconds: that long every
            time, lower latency for a core per process; False: never.

        Returns
        -------
        Ring
            The producer's end.

        Raises
        ------
        ValueError
            If ``slots`` is not from 1 to 65536, ``consumers`` is negative, or ``spin``
            is not one of the above.
        NoDeviceError, OutOfMemoryError, BackendUnavailableError
            As for :meth:`zeros`.
        """
        from ._fanout import create_ring

        ring = create_ring(self, shape, dtype, device, slots, consumers, backend, spin)
        self._rings.add(ring)
        return ring

    def tensor_set(
        self, layout: Any, versions: int = 2, device: Device = None, *, backend: str | None = None
    ) -> TensorSet:
        """A versioned set of tensors for weight sync: the trainer publishes, engines take versions.

        Each version is one buffer of this Manager holding every tensor at a
        256-byte aligned offset. Pickle the set into each engine (a Process
        argument, a Queue, a Ray actor argument): it arrives as a reader. See
        :class:`~gpushare.TensorSet` and docs/guides/weight-sync.md.

        Parameters
        ----------
        layout : dict
            Names mapped to NumPy arrays, objects with ``__cuda_array_interface__``,
            ``(shape, dtype)`` or ``(shape, dtype, tag)`` (a tag names a dtype NumPy
            lacks, stored as an unsigned int of its size);
            ``gpushare.torch.state_dict_layout`` makes one from a state dict.
        versions : int
            How many versions exist at once (2): the trainer writes one while
            engines read the others.
        device, backend
            As for :meth:`zeros`.

        Returns
        -------
        TensorSet
            The trainer's end.

        Raises
        ------
        LayoutError
            If the layout is empty or names a shape or dtype that cannot be stored.
        NoDeviceError, OutOfMemoryError, BackendUnavailableError
            As for :meth:`zeros`.
        """
        from ._fanout import create_tensor_set

        tensor_set = create_tensor_set(self, layout, versions, device, backend=backend)
        self._tensor_sets.add(tensor_set)
        return tensor_set

    # -- observability and upkeep ------------------------------------------------------
    @property
    def owner(self) -> str:
        """``"process"`` or ``"server"``: which process owns this Manager's memory."""
        return self._owner_mode

    def stats(self) -> dict[str, Any]:
        """What this Manager holds now.

        Returns
        -------
        dict
            ``live_buffers``, ``bytes_allocated``, ``bytes_in_use``, ``bytes_pooled``,
            ``pooled_buffers``, ``leases``, ``unclaimed_leases``, ``consumers``,
            ``consumer_pids``, ``backends`` (bytes per backend), ``reused``,
            ``leaked_buffers`` and ``closed`` (docs/concepts.md explains each).
        """
        if self._owner_mode == "server":
            from ._lifetime._protocol import Stats

            return dict(self._owning.remote(self._server_owner, None).link().request(Stats))
        owner = self._owning.owner
        if owner is None:  # no buffer yet
            return _empty_stats(closed=self._owning.closed)
        return dict(owner.stats())

    def trim(self) -> int:
        """Free every pooled (unused) allocation now.

        Returns
        -------
        int
            The bytes freed.
        """
        if self._owner_mode == "server":
            from ._lifetime._protocol import Trim

            return int(self._owning.remote(self._server_owner, None).link().request(Trim))
        owner = self._owning.owner
        return 0 if owner is None else int(owner.trim())

    def allocator(self) -> Any:
        """Where another process can allocate buffers owned as this Manager's are.

        Returns
        -------
        RemoteAllocator
            A picklable handle: pass it to a process, which calls its ``empty()``
            (and the like) to allocate; the memory belongs to this Manager's owner.

        Raises
        ------
        ManagerClosedError
            If the Manager is not started.
        """
        self._check_started()
        if self._owner_mode == "server":
            return self._owning.remote(self._server_owner, self._default_backend)
        owner = self._owning.local_owner()
        return RemoteAllocator(owner.address, owner.token, self._default_backend)

    @property
    def _owner(self) -> Any:
        """``owner="process"``: this process's Owner (made now if no buffer made it yet)."""
        self._check_started()
        return self._owning.local_owner()

    def _check_started(self) -> None:
        if self._state.value == State.INITIAL:  # type: ignore[attr-defined,unused-ignore]
            raise ManagerClosedError("the Manager is not started; use 'with gpushare.Manager() as m:'")


def _empty_stats(closed: bool) -> dict[str, Any]:
    """What stats() says before the first buffer (no Owner yet)."""
    return {
        "live_buffers": 0,
        "bytes_allocated": 0,
        "bytes_in_use": 0,
        "bytes_pooled": 0,
        "pooled_buffers": 0,
        "leases": 0,
        "unclaimed_leases": 0,
        "consumers": 0,
        "consumer_pids": [],
        "backends": {},
        "reused": 0,
        "leaked_buffers": 0,
        "closed": closed,
    }


BufferManager.register("_gpushare_owner", callable=_manager_server.owner_info)
BufferManager.register("_gpushare_retire", callable=_manager_server.retire)
