"""The engine's end of a tensor set: registration, taking versions, snapshots, releases.

See :mod:`gpushare._fanout` for the protocol. Three objects:

* :class:`TensorSetReader`, what unpickling a :class:`~._tensor_set.TensorSet`
  gives (each unpickling registers one reader), a handle on a ``_ReaderCore``:
  the connection to the trainer, the version buffers (mapped once), the
  shared channel whose release words this reader writes, and on CUDA the
  trainer's per-version ready events and this reader's release events;
* a *grant* (``_Grant``): this process's hold on one version, as the
  trainer granted it. A reader holds at most one grant per version slot:
  taking a version it already holds gets the same grant back (the trainer
  answers with the same grant id), so two snapshots of one version share
  it. Its finalizer (``weakref.finalize``: it runs only once every weak
  reference to the grant is cleared) writes the release word and pokes the
  trainer's release eventfd -- no lock and no message, so it may run in the
  garbage collector. The grant also keeps a Buffer view of the version, so
  the memory stays mapped (and leased) while it lives, even if the reader
  is closed;
* :class:`Snapshot`, one taken version: a mapping of names to
  :class:`~._views.TensorView` (created on first access) that holds the
  grant, as each of its views does.

Why a take is a request, answered under the trainer's lock
-----------------------------------------------------------
A reader could take the latest version by reading it from shared memory and
marking it held there, with no message. But the trainer, picking a version
to rewrite, would then read "not held" while a reader, having read "latest
is v", is about to mark v held: each side stores, then loads the other's
word, and both need the store to be visible before their load (a store-load
barrier on both sides, as in Dekker's algorithm). Python has no portable way
to express that barrier, so a take goes to the trainer on the reader's
socket and is answered by that reader's thread under the trainer's lock:
the trainer always knows who holds what. Releases stay lock-free: a
release word is written once, by the reader, and read by the trainer only
after it (then it is free to rewrite the version, never before).

The one race left is a take that returns a version this reader already
holds while the last snapshot of it is being dropped in another thread.
Before it sends a take, the reader takes a strong reference to each grant
it still holds (a weak reference's ``()`` either returns a live object or
None, atomically under the GIL); a grant referenced so cannot be finalized,
so its release word cannot be written during the take, and the trainer's
answer names either it (still held) or a new grant.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from collections.abc import Iterator, Mapping
from multiprocessing import AuthenticationError, connection, current_process, reduction
from typing import Any, NoReturn

from .. import _cuda
from .._authsocket import connect, shutdown_socket, socket_timeouts
from .._buffer import Buffer, byte_offset, memory_of
from .._errors import (
    BufferReleasedError,
    GpushareError,
    LayoutError,
    OwnerGoneError,
    TensorSetClosedError,
    WaitTimeoutError,
)
from ._channel import Channel, poke
from ._copy import copy_regions, copy_stream, host_copy, regions, stream_handle
from ._layout import Layout
from ._views import Family, TensorView, release_family
from ._wire import REGISTER_TIMEOUT

__all__ = ["Snapshot", "TensorSetReader", "attach_reader"]

log = logging.getLogger("gpushare")

#: Seconds a reader waits for an answer beyond its own timeout before it calls the trainer hung.
ANSWER_GRACE = 30.0


def attach_reader(address: str, info: dict[str, Any], authkey: bytes | None = None, owner_authkey: Any = None) -> Any:
    """Unpickling side: connect and register (errors are kept and raised by the first take)."""
    return TensorSetReader(address, info, authkey, owner_authkey)


class _GrantInfo:
    """What a grant's finalizer needs besides the core: the device its copies ran on."""

    __slots__ = ("copied",)

    def __init__(self) -> None:
        self.copied: int | None = None  # the ordinal of the private stream copy_to used


class _Grant:
    """This process's hold on one version (see the module docstring)."""

    __slots__ = ("__weakref__", "buffer", "gid", "info", "slot")

    def __init__(self, core: _ReaderCore, slot: int, gid: int, buffer: Buffer) -> None:
        self.slot = slot
        self.gid = gid
        self.buffer = buffer  # a count on the version's memory while this grant lives
        self.info = _GrantInfo()
        finalizer = weakref.finalize(self, core.release, slot, gid, self.info)
        finalizer.atexit = False  # at exit the socket's closing frees everything at once


class _ReaderCore:
    """The reader's connection and shared state; the reader handle and every grant keep it
    (and so the connection, which tells the trainer what is held) alive."""

    def __init__(self, address: str, info: dict[str, Any]) -> None:
        self.address = address
        self.info = info
        self.conn: connection.Connection | None = None
        self.channel: Channel | None = None
        self.release_fd = -1
        self.buffers: list[Buffer] = []
        self.device: int | str = "cpu"
        self.slot_events: list[Any] = []  # the trainer's per-version ready events, opened here
        self.release_events: list[Any] = []  # ours, recorded at each release (CUDA)
        self.grants: dict[int, weakref.ref[_Grant]] = {}
        self.lock = threading.Lock()  # one take at a time
        self.error: tuple[type[GpushareError], str] | None = None
        self.closed: str | None = None
        self.offer: tuple[int, int, bool] | None = None  # after the trainer closed: (version, slot, recorded)
        self.taken = 0  # the newest version taken here
        self.adapters: dict[str, Any] = {}  # what adapters (gpushare.torch) keep per version slot; cleared at shut

    # -- releases (maybe from the garbage collector: no lock, no message) ---------------
    def release(self, slot: int, gid: int, info: _GrantInfo) -> None:
        channel = self.channel
        if channel is None or gid < 0:  # closed here, or a version served after the trainer closed
            return
        recorded = False
        if self.release_events:
            try:
                device: int = self.device  # type: ignore[assignment]
                if info.copied is not None:  # copy_to's copies: on our private stream
                    done = copy_stream(info.copied).done
                    if not _cuda.event_done(done, info.copied):
                        _cuda.stream_wait_event(0, done, device)
                # Idle default stream: our reads are done; the release word says so, and the
                # trainer orders nothing after us.
                recorded = not _cuda.stream_idle(device)
                if recorded:
                    _cuda.event_record(self.release_events[slot], device)
            except Exception:  # e.g. at interpreter exit; keep the version rather than free it under our reads
                log.exception("gpushare: could not record the release of a tensor set version; keeping it")
                return
        try:
            channel.release(slot, gid, recorded)
        except ValueError:  # closed meanwhile by another thread
            return
        poke(self.release_fd)

    def __del__(self) -> None:
        # The reader handle and every grant are gone: leave the set (closes the socket).
        try:
            self.shut()
        except Exception:  # interpreter shutdown
            pass

    def shut(self) -> None:
        conn, self.conn = self.conn, None
        channel, self.channel = self.channel, None
        release_fd, self.release_fd = self.release_fd, -1
        buffers, self.buffers = self.buffers, []
        self.adapters.clear()  # their views of the versions keep counts on the memory
        if conn is not None:
            shutdown_socket(conn.fileno())
            conn.close()
        if release_fd >= 0:
            os.close(release_fd)
        if channel is not None:
            channel.close()
        for b in buffers:  # each grant keeps a view of its version's memory
            b.release()
        # Our release events stay open until this process exits: the trainer may still
        # order its next write of a version after one of them.


class TensorSetReader:
    """An engine's end of a :class:`~gpushare.TensorSet`: what a worker gets by unpickling one.

    Registers with the trainer when unpickled (mapping every version once),
    then :meth:`latest` and :meth:`wait` return :class:`Snapshot` objects.
    Pickling a reader registers another reader wherever it is unpickled.
    Close it (or let the process exit) when done: the trainer then frees
    every version it held.
    """

    def __init__(
        self, address: str, info: dict[str, Any], authkey: bytes | None = None, owner_authkey: Any = None
    ) -> None:
        self._address = address
        self._info = info
        self._authkey = authkey
        self._owner_authkey = owner_authkey
        self.layout = Layout.from_wire(info["layout"])
        self._core = core = _ReaderCore(address, info)
        try:
            self._register(core)
        except GpushareError as exc:
            core.error = (type(exc), str(exc))
            core.shut()

    def _register(self, core: _ReaderCore) -> None:
        pid = self._info["pid"]
        key = id(core)
        local = pid == os.getpid()
        try:
            if self._authkey is not None:
                # Outside the trainer's process tree (a Ray worker): the lifetime link that the
                # version buffers claim their leases over needs the owner's authkey, so it is
                # made here, before they are unpickled.
                from .._lifetime import link_for

                owner_address, owner_token = self._info["owner"]
                link_for(owner_address, owner_token, bytes(self._owner_authkey or self._authkey))
            authkey = bytes(current_process().authkey) if self._authkey is None else bytes(self._authkey)
            core.conn = conn = connect(self._address, authkey, REGISTER_TIMEOUT)
            socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
            conn.send(("hello", os.getpid(), key))
            reply = conn.recv()  # maps every version (claims one lease each)
            if reply[0] == "closed":
                self._closed(core, reply)
                return
            core.buffers = list(reply[1])
            with socket.socket(fileno=os.dup(conn.fileno())) as raw:
                fd, core.release_fd = reduction.recvfds(raw, 2)
            try:
                core.channel = Channel.attach(fd, len(core.buffers))
            except ValueError as exc:
                raise OSError(str(exc)) from exc
            core.device = core.buffers[0].device
            handles: list[bytes] = []
            if isinstance(core.device, int):
                handles = self._cuda_events(core, reply[2], local, key)
            conn.send(("ready", handles))
            reply = conn.recv()
            if reply[0] == "closed":  # closed while this reader registered
                self._closed(core, reply)
                return
            socket_timeouts(conn.fileno(), 0, 0)
        except AuthenticationError as exc:
            raise OwnerGoneError(
                f"the tensor set's trainer (pid {pid}) refused this process: authentication failed. A tensor set "
                "is shared with processes started from the trainer's process tree (same multiprocessing authkey), "
                "or through Ray, whose form of it carries the authkey"
            ) from exc
        except (OSError, EOFError) as exc:
            raise OwnerGoneError(
                f"cannot register with the tensor set's trainer (pid {pid}) at {self._address} ({exc}): it closed "
                "the set or exited, or runs on another machine (a tensor set is shared within one machine)"
            ) from exc

    @staticmethod
    def _cuda_events(core: _ReaderCore, handles: list[bytes], local: bool, key: int) -> list[bytes]:
        """Open the trainer's version events; make ours (their handles go to the trainer)."""
        device: int = core.device  # type: ignore[assignment]
        if local:
            # In the trainer's own process the driver refuses to open its interprocess events:
            # both ends use the same event objects instead.
            from ._set_producer import LOCAL_PRODUCERS, LOCAL_RELEASE_EVENTS

            producer = LOCAL_PRODUCERS.get(core.address)
            if producer is None:
                raise OSError("the tensor set was closed in this process")
            core.slot_events = list(producer.events)
            core.release_events = [_cuda.event_create(device) for _ in core.buffers]
            LOCAL_RELEASE_EVENTS[key] = core.release_events
            return []
        core.slot_events = [_cuda.event_open(h, device) for h in handles]
        mine = []
        for _ in core.buffers:
            event, handle = _cuda.event_create_ipc(device)
            core.release_events.append(event)
            mine.append(handle)
        return mine

    @staticmethod
    def _closed(core: _ReaderCore, message: tuple[Any, ...]) -> None:
        """The trainer closed the set: keep the last version's buffer to serve it; let the rest go."""
        _, reason, version, slot, recorded = message
        core.closed = f"the tensor set was closed by its trainer: {reason}"
        buffers, core.buffers = core.buffers, []
        keep = buffers[slot] if 0 <= slot < len(buffers) else None
        core.offer = (int(version), int(slot), bool(recorded)) if keep is not None else None
        core.shut()  # the connection, the channel; the buffers are released here instead
        for b in buffers:
            if b is not keep:
                b.release()
        core.buffers = buffers  # only buffers[slot] is still usable: the one offer() serves

    # -- description ----------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def nbytes(self) -> int:
        """Bytes of one version (every tensor, at its aligned offset)."""
        return self.layout.nbytes

    @property
    def versions(self) -> int:
        return int(self._info["versions"])

    @property
    def device(self) -> int | str:
        """Where this reader maps the versions: a CUDA ordinal in this process, or ``"cpu"``."""
        return self._core.device

    @property
    def version(self) -> int:
        """The newest version this reader has taken (0: none yet)."""
        return self._core.taken

    @property
    def closed(self) -> bool:
        """Whether this reader can take nothing more from the trainer (closed here or there, or gone)."""
        return self._core.conn is None

    # -- taking versions ------------------------------------------------------------------
    def latest(self, timeout: float | None = None) -> Snapshot:
        """The newest version, as a :class:`Snapshot` (waits while none was published yet).

        Raises :class:`~gpushare.WaitTimeoutError` after ``timeout`` seconds,
        :class:`~gpushare.TensorSetClosedError` once the trainer closed the
        set and no version is left to take, :class:`~gpushare.OwnerGoneError`
        if the trainer is gone.
        """
        return self._take(0, timeout)

    def wait(self, newer_than: int = 0, timeout: float | None = None) -> Snapshot:
        """The first version newer than ``newer_than``: the newest when several came (latest wins,
        so a slow engine skips versions). Errors as :meth:`latest`."""
        return self._take(int(newer_than), timeout)

    def _take(self, newer_than: int, timeout: float | None) -> Snapshot:
        core = self._core
        with core.lock:
            if core.error is not None:
                kind, message = core.error
                raise kind(message)
            conn = core.conn
            if conn is None:
                return self._take_closed(core, newer_than)
            # Hold every grant still held here: none can be released while the trainer answers.
            pinned = {slot: grant for slot, ref in core.grants.items() if (grant := ref()) is not None}
            try:
                conn.send(("take", newer_than, timeout))
            except OSError:
                pass  # the trainer closed or went: what it sent before is still to be read
            reply = self._answer(core, conn, timeout)
            kind = reply[0]
            if kind == "grant":
                _, version, slot, gid, recorded = reply
                grant = pinned.get(slot)
                if grant is None or grant.gid != gid:
                    grant = _Grant(core, slot, gid, core.buffers[slot].view())
                    core.grants[slot] = weakref.ref(grant)
                del pinned
                return self._snapshot(core, int(version), slot, grant, bool(recorded))
            if kind == "timeout":
                raise WaitTimeoutError(str(reply[1]))
            if kind == "closed":
                self._closed(core, reply)
                return self._take_closed(core, newer_than)
            self._gone(core, f"it sent an unexpected answer {kind!r}")

    def _answer(self, core: _ReaderCore, conn: connection.Connection, timeout: float | None) -> tuple[Any, ...]:
        try:
            if timeout is not None and not conn.poll(max(0.0, timeout) + ANSWER_GRACE):
                self._gone(core, f"it did not answer within {timeout + ANSWER_GRACE:g} s")
            reply = conn.recv()
        except (EOFError, OSError) as exc:
            self._gone(core, f"exited without closing the tensor set ({type(exc).__name__})")
        if not isinstance(reply, tuple) or not reply:
            self._gone(core, f"it sent {reply!r}")
        return reply

    def _gone(self, core: _ReaderCore, why: str) -> NoReturn:
        message = (
            f"the tensor set's trainer (pid {self._info['pid']}) {why}; no newer version will come. Weights copied "
            "out of earlier snapshots stay valid; snapshots still held stay valid if the set's Manager was made "
            "with owner='server'"
        )
        core.error = (OwnerGoneError, message)
        core.shut()
        raise OwnerGoneError(message)

    def _take_closed(self, core: _ReaderCore, newer_than: int) -> Snapshot:
        offer = core.offer
        if offer is not None and offer[0] > newer_than and core.buffers:
            version, slot, recorded = offer
            grant = core.grants[slot]() if slot in core.grants else None
            if grant is None:  # never written again: nothing to give back (gid -1)
                grant = _Grant(core, slot, -1, core.buffers[slot].view())
                core.grants[slot] = weakref.ref(grant)
            return self._snapshot(core, version, slot, grant, recorded)
        last = f"; the last version was {offer[0]}" if offer is not None else ""
        raise TensorSetClosedError(
            f"{core.closed or 'this reader was closed in this process'}{last}; no newer version will come"
        )

    def _snapshot(self, core: _ReaderCore, version: int, slot: int, grant: _Grant, recorded: bool) -> Snapshot:
        if core.slot_events:
            # One version per slot while held: the slot's memory waits for this publication, on
            # its event if the trainer recorded it (else its writes were done when it published).
            memory_of(grant.buffer).arm(core.slot_events[slot], recorded)
        if version > core.taken:
            core.taken = version
        return Snapshot(self.layout, version, slot, grant, core.adapters)

    # -- ending ---------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the set: the trainer frees every version this reader holds. Idempotent.

        Release snapshots first: a version held here may be rewritten once the
        trainer knows this reader is gone (views keep the memory mapped, but no
        longer keep the trainer from writing it)."""
        core = self._core
        with core.lock:
            if core.conn is not None:
                core.closed = "this reader was closed in this process"
            core.offer = None  # after the trainer closed: the last version is not served any more either
            core.shut()

    def stats(self) -> dict[str, Any]:
        """``version`` (newest taken), ``held`` (versions held here, by slot), ``closed``."""
        core = self._core
        held = sorted(slot for slot, ref in core.grants.items() if ref() is not None)
        return {"version": core.taken, "held_slots": held, "closed": self.closed}

    def __enter__(self) -> TensorSetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (attach_reader, (self._address, self._info, self._authkey, self._owner_authkey))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version {self.version} taken"
        return f"<gpushare.TensorSetReader {len(self.layout)} tensors, {self.nbytes} bytes, {state}>"


class Snapshot(Mapping[str, TensorView]):
    """One version of a :class:`~gpushare.TensorSet`, as an engine took it.

    A mapping of tensor names to :class:`TensorView` (Buffers over the
    version's memory: zero-copy weights), plus ``version``. The version is
    held -- the trainer will not rewrite it -- until :meth:`release` (then
    every view raises :class:`~gpushare.BufferReleasedError` when touched), or
    until the snapshot, every view of it and everything made from one
    without a copy (NumPy arrays, DLPack and CAI tensors) are garbage
    collected. :meth:`copy_to` copies it into the engine's own tensors
    (copy mode); then release it at once.
    """

    __slots__ = ("__weakref__", "_adapters", "_family", "_grant", "_views", "layout", "slot", "version")

    def __init__(self, layout: Layout, version: int, slot: int, grant: _Grant, adapters: dict[str, Any]) -> None:
        self.layout = layout
        self.version = version
        self.slot = slot
        self._grant: _Grant | None = grant
        self._views: dict[str, TensorView] = {}
        self._family: Any = Family()
        # What adapters keep per version slot of this reader (gpushare.torch: tensors over it).
        self._adapters = adapters

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def released(self) -> bool:
        return self._grant is None

    def _held(self) -> _Grant:
        grant = self._grant
        if grant is None:
            raise BufferReleasedError(
                f"snapshot of version {self.version} was released in this process; take a new one with "
                "reader.latest() or reader.wait(newer_than=...)"
            )
        return grant

    def __getitem__(self, name: str) -> TensorView:
        view = self._views.get(name)
        if view is not None and self._grant is not None:
            return view
        grant = self._held()
        spec = self.layout.get(name)
        if spec is None:
            raise KeyError(name)
        base = grant.buffer
        view = TensorView(
            memory_of(base), byte_offset(base) + spec.offset, spec.shape, spec.dtype, grant, spec.tag, self._family
        )
        self._views[name] = view
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, name: object) -> bool:
        return name in self.layout

    def _version_buffer(self) -> Buffer:
        """A plain Buffer (uint8, its own count) over this snapshot's version slot, for adapters
        that keep their own views of each slot (``gpushare.torch``); the memory stays mapped
        while they keep it, and holds whichever version the slot has at the time."""
        return self._held().buffer.view()

    def _order_stream(self, stream: int) -> None:
        """Make ``stream`` (an int handle; CUDA) wait for this version's writes, with no host wait:
        for views of the version made before it was published (an adapter's)."""
        memory = memory_of(self._held().buffer)
        memory.source.check(memory)  # the trainer's memory is still there (OwnerGoneError)
        memory.order_stream(stream)

    def copy_to(self, targets: Mapping[str, Any], *, stream: object = None) -> None:
        """Copy tensors of this version into ``targets`` (names -> NumPy arrays, CUDA arrays or
        tensors with ``data_ptr()``: torch, bfloat16 included), in one batched copy.

        Every target must have the layout's shape and dtype (or the tag's) and be
        contiguous and writable; names may be a subset of the layout. On a GPU the
        copies are queued after ``stream``'s work (default: the legacy default
        stream) and ``stream`` waits for them, with no host wait; into host memory,
        or from a version on another GPU than the targets', they are done when this
        returns. Raises :class:`~gpushare.LayoutError`
        naming the first target that does not fit.
        """
        grant = self._held()
        plan = regions(self.layout, targets, writable=True, what="target", complete=False)
        memory = memory_of(grant.buffer)
        memory.source.check(memory)  # the trainer's memory is still there (OwnerGoneError)
        srcs, dsts, sizes = plan.lists(memory.base + byte_offset(grant.buffer))
        if not sizes:
            return
        devices = plan.devices
        if memory.device is None and not devices:
            host_copy(dsts, srcs, sizes)
            return
        if len(devices) > 1:
            raise LayoutError(
                f"copy_to() copies to one GPU at a time; the targets are on devices {sorted(devices)}: call it "
                "once per device with that device's targets"
            )
        ordinal = devices.pop() if devices else memory.device
        assert ordinal is not None
        host = memory.device is None or plan.host
        # A version on another GPU than the targets': its ready event is waited on here, in
        # its own GPU's context, and the copies before returning. Queuing that wait on the
        # targets' GPU instead (cuStreamWaitEvent of the version's event on our stream there)
        # crashed the engine (SIGSEGV in the driver; dev/performance.md, "Weight sync", cross-GPU copy_to).
        peer = not host and memory.device != ordinal
        if peer:
            memory.ready()  # and no longer pending: nothing left to order the copies after
        copy_regions(
            dsts,
            srcs,
            sizes,
            ordinal,
            stream_handle(stream),
            orders=(memory,) if memory.pending else (),
            host=host or peer,
            peer=peer,
        )
        if not host and not peer:
            grant.info.copied = ordinal  # the release orders the trainer's next write after these copies

    def release(self) -> None:
        """Give the version back (once no other snapshot of it in this process holds it) and
        release every view made from this snapshot. Idempotent."""
        grant, self._grant = self._grant, None
        if grant is None:
            return
        self._views.clear()
        release_family(self._family)
        del grant  # the last reference here: the grant's finalizer writes the release word

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._grant is None else "held"
        return f"<gpushare.Snapshot version={self.version} {len(self)} tensors {state}>"
