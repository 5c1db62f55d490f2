"""The tensor set's policy, engine side: take the latest version, hold it as a :class:`Snapshot`.

A take is a request on the reader's socket (``Take``), answered by its thread
in the trainer under the trainer's lock with a ``Grant`` (or ``TimedOut``, or
``Closed``); dev/design-notes.md, "Tensor sets (weight sync)", says why it is not lock-free. A *grant* is this
process's hold on one slot: a reader holds at most one per slot, so two
snapshots of one version share it. Its finalizer gives the slot back with the
grant's id as the stamp (:meth:`~._slots.ReaderEnd.release`): no lock, no
message, safe in the garbage collector.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from multiprocessing import current_process
from typing import Any, NoReturn

from .._buffer import Buffer, byte_offset, memory_of
from .._errors import (
    BufferReleasedError,
    GpushareError,
    LayoutError,
    OwnerGoneError,
    TensorSetClosedError,
    WaitTimeoutError,
)
from .._service import Handler, ProtocolError, handles
from ._copy import copy_regions, copy_stream, host_copy, regions, stream_handle
from ._handles import TensorSetInfo
from ._layout import Layout
from ._registry import TENSOR_SET, Closed, Grant, Take, TimedOut, register
from ._slots import ReaderEnd
from ._views import SlotTensors

__all__ = ["Snapshot", "TensorSetReader", "attach_reader"]

#: Seconds a reader waits for an answer beyond its own timeout before it calls the trainer hung.
ANSWER_GRACE = 30.0


def attach_reader(address: str, info: dict[str, Any], authkey: bytes | None = None, owner_authkey: Any = None) -> Any:
    """Unpickling side: connect and register (errors are kept and raised by the first take)."""
    return TensorSetReader(address, info, authkey, owner_authkey)


def _link_owner(info: dict[str, Any], authkey: bytes) -> None:
    """Outside the trainer's process tree, the lifetime link that the slot buffers claim their
    leases over needs the memory owner's authkey: made before they are unpickled."""
    from .._lifetime import link_for

    owner_address, owner_token = info["owner"]
    link_for(owner_address, owner_token, authkey)


class _GrantInfo:
    """What a grant's finalizer needs besides the core: the copies its release must follow."""

    __slots__ = ("after",)

    def __init__(self) -> None:
        self.after: tuple[Any, int] | None = None  # (copy_to's done event, its ordinal)


class _Grant:
    """This process's hold on one slot (see the module docstring)."""

    __slots__ = ("__weakref__", "buffer", "gid", "info", "slot")

    def __init__(self, core: _ReaderCore, slot: int, gid: int, buffer: Buffer) -> None:
        self.slot = slot
        self.gid = gid
        self.buffer = buffer  # a count on the slot's memory while this grant lives
        self.info = _GrantInfo()
        finalizer = weakref.finalize(self, core.release, slot, gid, self.info)
        finalizer.atexit = False  # at exit the socket's closing frees everything at once


class _ReaderCore:
    """The reader's end of the slots and its grants; the reader handle and every grant keep it
    (and so the connection, which tells the trainer what is held) alive."""

    def __init__(self, address: str, info: dict[str, Any]) -> None:
        self.address = address
        self.info = info
        self.end = ReaderEnd()
        self.grants: dict[int, weakref.ref[_Grant]] = {}
        self.lock = threading.Lock()  # one take at a time
        self.error: tuple[type[GpushareError], str] | None = None
        self.closed: str | None = None
        self.offer: tuple[int, int, bool] | None = None  # after the trainer closed: (version, slot, recorded)
        self.taken = 0  # the newest version taken here
        self.adapters: dict[str, Any] = {}  # what adapters (gpushare.torch) keep per slot; cleared at shut

    def release(self, slot: int, gid: int, info: _GrantInfo) -> None:
        """A grant's finalizer (maybe in the garbage collector)."""
        if gid >= 0:  # else served after the trainer closed: nothing to give back
            self.end.release(slot, gid, info.after)

    def __del__(self) -> None:
        # The reader handle and every grant are gone: leave the set (closes the socket).
        try:
            self.shut()
        except Exception:  # interpreter shutdown
            pass

    def shut(self) -> None:
        end = self.end
        buffers, end.buffers = end.buffers, []
        self.adapters.clear()  # their views of the slots keep counts on the memory
        end.close()
        for b in buffers:  # each grant keeps a view of its slot's memory
            b.release()


class TensorSetReader(TensorSetInfo):
    """An engine's end of a :class:`~gpushare.TensorSet`: what a worker gets by unpickling one.

    Registers with the trainer when unpickled (mapping every slot once),
    then :meth:`latest` and :meth:`wait` return :class:`Snapshot` objects.
    Pickling a reader registers another reader wherever it is unpickled.
    Close it (or let the process exit) when done: the trainer then frees
    every slot it held.
    """

    def __init__(
        self, address: str, info: dict[str, Any], authkey: bytes | None = None, owner_authkey: Any = None
    ) -> None:
        self._address = address
        self._info = info
        self._authkey = authkey
        self._owner_authkey = owner_authkey
        self._layout = Layout.from_wire(info["layout"])
        self._core = core = _ReaderCore(address, info)
        if authkey is None:
            key, prepare = bytes(current_process().authkey), None
        else:  # a Ray worker: see _link_owner
            key, prepare = bytes(authkey), lambda: _link_owner(info, bytes(owner_authkey or authkey))
        try:
            closed = register(core.end, address, key, int(info["pid"]), TENSOR_SET, prepare)
        except GpushareError as exc:
            core.error = (type(exc), str(exc))
            core.shut()
            return
        if closed is not None:
            self._closed(core, closed)

    @staticmethod
    def _closed(core: _ReaderCore, message: Closed) -> None:
        """The trainer closed the set: keep the last version's buffer to serve it; let the rest go."""
        core.closed = f"the tensor set was closed by its trainer: {message.reason}"
        end = core.end
        buffers, end.buffers = end.buffers, []
        slot = message.slot
        keep = buffers[slot] if 0 <= slot < len(buffers) else None
        core.offer = (int(message.version), int(slot), bool(message.recorded)) if keep is not None else None
        core.shut()  # the connection, the channel; the buffers are released here instead
        for b in buffers:
            if b is not keep:
                b.release()
        end.buffers = buffers  # only buffers[slot] is still usable: the one offer() serves

    # -- description ----------------------------------------------------------------------
    @property
    def device(self) -> int | str:
        """Where this reader maps the slots: a CUDA ordinal in this process, or ``"cpu"``."""
        return self._core.end.device

    @property
    def version(self) -> int:
        """The newest version this reader has taken (0: none yet)."""
        return self._core.taken

    @property
    def closed(self) -> bool:
        """Whether this reader can take nothing more from the trainer (closed here or there, or gone)."""
        return self._core.end.conn is None

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
            conn = core.end.conn
            if conn is None:
                return self._take_closed(core, newer_than)
            # Hold every grant still held here: none can be released while the trainer answers.
            pinned = {slot: grant for slot, ref in core.grants.items() if (grant := ref()) is not None}
            try:
                conn.send(Take(newer_than, timeout))
            except OSError:
                pass  # the trainer closed or went: what it sent before is still to be read
            reply = self._answer(core, conn, timeout)
            answer = _Answer(self, core, newer_than, pinned)
            del pinned
            return answer.on_message(reply)

    def _answer(self, core: _ReaderCore, conn: Any, timeout: float | None) -> Any:
        try:
            if timeout is not None and not conn.conn.poll(max(0.0, timeout) + ANSWER_GRACE):
                self._gone(core, f"it did not answer within {timeout + ANSWER_GRACE:g} s")
            return conn.recv()
        except (EOFError, OSError) as exc:
            self._gone(core, f"exited without closing the tensor set ({type(exc).__name__})")
        except ProtocolError as exc:
            self._gone(core, f"broke the protocol ({exc})")

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
        buffers = core.end.buffers
        if offer is not None and offer[0] > newer_than and buffers:
            version, slot, recorded = offer
            grant = core.grants[slot]() if slot in core.grants else None
            if grant is None:  # never written again: nothing to give back (gid -1)
                grant = _Grant(core, slot, -1, buffers[slot].view())
                core.grants[slot] = weakref.ref(grant)
            return self._snapshot(core, version, slot, grant, recorded)
        last = f"; the last version was {offer[0]}" if offer is not None else ""
        raise TensorSetClosedError(
            f"{core.closed or 'this reader was closed in this process'}{last}; no newer version will come"
        )

    def _snapshot(self, core: _ReaderCore, version: int, slot: int, grant: _Grant, recorded: bool) -> Snapshot:
        events = core.end.slot_events
        if events:
            # One version per slot while held: the slot's memory waits for this publication, on
            # its event if the trainer recorded it (else its writes were done when it published).
            memory_of(grant.buffer).arm(events[slot], recorded)
        if version > core.taken:
            core.taken = version
        return Snapshot(self.layout, version, slot, grant, core.adapters)

    # -- ending ---------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the set: the trainer frees every slot this reader holds. Idempotent.

        Release snapshots first: a slot held here may be rewritten once the
        trainer knows this reader is gone (views keep the memory mapped, but no
        longer keep the trainer from writing it)."""
        core = self._core
        with core.lock:
            if core.end.conn is not None:
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


class _Answer(Handler):
    """What a take does with the trainer's answer, on the taking thread: the snapshot, or an error."""

    def __init__(self, reader: TensorSetReader, core: _ReaderCore, newer_than: int, pinned: dict[int, _Grant]) -> None:
        self.reader = reader
        self.core = core
        self.newer_than = newer_than
        self.pinned = pinned  # every grant still held here: none is released while the trainer answers

    @handles(Grant)
    def granted(self, reply: Grant) -> Snapshot:
        core = self.core
        slot = reply.slot
        grant = self.pinned.get(slot)
        if grant is None or grant.gid != reply.grant:
            grant = _Grant(core, slot, reply.grant, core.end.buffers[slot].view())
            core.grants[slot] = weakref.ref(grant)
        self.pinned = {}
        return self.reader._snapshot(core, int(reply.version), slot, grant, bool(reply.recorded))

    @handles(TimedOut)
    def timed_out(self, reply: TimedOut) -> NoReturn:
        raise WaitTimeoutError(str(reply.message))

    @handles(Closed)
    def closed(self, reply: Closed) -> Snapshot:
        self.reader._closed(self.core, reply)
        return self.reader._take_closed(self.core, self.newer_than)

    def on_unknown(self, reply: Any) -> NoReturn:
        self.reader._gone(self.core, f"it sent an unexpected answer {type(reply).__name__!r}")


class Snapshot(SlotTensors):
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

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

    __slots__ = ("__weakref__", "_adapters", "version")

    def __init__(self, layout: Layout, version: int, slot: int, grant: _Grant, adapters: dict[str, Any]) -> None:
        SlotTensors.__init__(self, layout, slot, memory_of(grant.buffer), byte_offset(grant.buffer), grant)
        self.version = version
        # What adapters keep per slot of this reader (gpushare.torch: tensors over it).
        self._adapters = adapters

    def _released_error(self) -> BufferReleasedError:
        return BufferReleasedError(
            f"snapshot of version {self.version} was released in this process; take a new one with "
            "reader.latest() or reader.wait(newer_than=...)"
        )

    def _slot_buffer(self) -> Buffer:
        """A plain Buffer (uint8, its own count) over this snapshot's slot, for adapters that keep
        their own views of each slot (``gpushare.torch``); the memory stays mapped while they keep
        it, and holds whichever version the slot has at the time."""
        return self._held().buffer.view()

    def _order_stream(self, stream: int) -> None:
        """Make ``stream`` (an int handle; CUDA) wait for this version's writes, with no host wait:
        for views of the slot made before it was published (an adapter's)."""
        self._held()
        memory = self._memory
        memory.source.check(memory)  # the trainer's memory is still there (OwnerGoneError)
        memory.order_stream(stream)

    def copy_to(self, targets: Mapping[str, Any], *, stream: object = None) -> None:
        """Copy tensors of this version into ``targets``, in one batched copy.

        Into host memory, or from a version on another GPU than the targets', the
        copies are done when this returns.

        Parameters
        ----------
        targets : mapping
            Names (a subset of the layout's) mapped to NumPy arrays, CUDA arrays or
            tensors with ``data_ptr()`` (torch, bfloat16 included), each with the
            layout's shape and dtype (or the tag's), contiguous and writable.
        stream : int, torch or CuPy stream, optional
            On a GPU the copies are queued after this stream's work and it waits for
            them, with no host wait. Default: the legacy default stream.

        Raises
        ------
        LayoutError
            Naming the first target that does not fit.
        OwnerGoneError
            If the trainer that owns the memory is gone.
        BufferReleasedError
            If this snapshot was released.
        """
        grant: _Grant = self._held()
        plan = regions(self.layout, targets, writable=True, what="target", complete=False)
        memory = self._memory
        memory.source.check(memory)  # the trainer's memory is still there (OwnerGoneError)
        srcs, dsts, sizes = plan.lists(memory.base + self._base)
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
        orders = (memory,) if memory.pending else ()  # the slot's ready event, if not waited on yet
        copy_regions(dsts, srcs, sizes, ordinal, stream_handle(stream), orders=orders, host=host or peer, peer=peer)
        if not host and not peer:
            # The release orders the trainer's next write after these copies.
            grant.info.after = (copy_stream(ordinal).done, ordinal)

    def release(self) -> None:
        """Give the version back (once no other snapshot of it in this process holds it) and
        release every view made from this snapshot. Idempotent."""
        if self._hold is not None:
            self._spend()  # drops the grant: its finalizer gives the slot back once it was the last

    def __repr__(self) -> str:
        state = "released" if self._hold is None else "held"
        return f"<gpushare.Snapshot version={self.version} {len(self)} tensors {state}>"
