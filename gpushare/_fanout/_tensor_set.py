"""The trainer's end of a tensor set as the user holds it: TensorSet, Draft, and create_tensor_set.

A TensorSet is a handle on a :class:`~._set_producer.SetProducer`; pickling it
gives an engine's end (:class:`~._tensor_reader.TensorSetReader`). It
publishes a version two ways: ``publish(tensors)`` copies them into a slot no
reader holds (:mod:`._copy`); ``draft()``, then ``publish(draft)``, publishes a
slot written in place. Either way the slot's ready event is recorded after the
writes, and the writes wait for the slot's last readers.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from multiprocessing import current_process
from typing import Any

from .._buffer import Buffer, byte_offset, memory_of
from .._errors import BackendUnavailableError, BufferReleasedError, LayoutError, TensorSetClosedError
from . import _channel
from ._copy import copy_regions, copy_stream, host_copy, regions, stream_handle
from ._handles import ProducerHandle, TensorSetInfo
from ._layout import Layout, make_layout
from ._set_producer import SetProducer
from ._views import SlotTensors
from ._wire import MAX_SLOTS

__all__ = ["Draft", "TensorSet", "create_tensor_set"]


class _DraftHold:
    """What a draft and its views hold: its slot, and a count on the slot's memory.

    Both go when the draft is published or released; a draft dropped unpublished
    (the draft and its last view collected, or the interpreter's exit) gives the
    slot back and drops the count through the finalizer. One finalizer and a bare
    count, not a Buffer of its own: a draft is taken and published every training
    step, where the in-place publish must cost as little as it can.
    """

    __slots__ = ("__weakref__", "epoch", "finalizer", "memory", "slot")

    def __init__(self, core: SetProducer, slot: int, epoch: int, memory: Any) -> None:
        self.slot = slot
        self.epoch = epoch
        self.memory = memory  # counted by TensorSet._acquire
        # A weak reference to this hold (no cycle): it runs when the last view goes.
        self.finalizer = weakref.finalize(self, _unpublished, core, slot, epoch, memory)

    def drop(self) -> None:
        """The draft was published or released: no finalizer; the memory's count goes now."""
        if self.finalizer.detach() is not None:
            self.memory.drop_one()


def _unpublished(core: SetProducer, slot: int, epoch: int, memory: Any) -> None:
    try:
        core.unpublished(slot, epoch)
    finally:
        memory.drop_one()


class Draft(SlotTensors):
    """A version of a :class:`TensorSet` to fill in place (``ts.draft()``), then ``ts.publish(d)``.

    A mapping of tensor names to writable :class:`TensorView` Buffers over
    a slot no reader holds. Publishing it copies nothing;
    ``release()`` (or dropping the draft and every view of it) gives the
    slot back unpublished. Either way its views are released: touching
    one afterwards raises :class:`~gpushare.BufferReleasedError`.
    """

    __slots__ = ("_set",)

    def __init__(self, owner: TensorSet, layout: Layout, base: int, hold: _DraftHold) -> None:
        # The hold: the slot and a count on its memory, while the draft is out.
        SlotTensors.__init__(self, layout, hold.slot, hold.memory, base, hold)
        self._set = owner

    def _released_error(self) -> BufferReleasedError:
        return BufferReleasedError("this draft was already published or released; take a new one with ts.draft()")

    def release(self) -> None:
        """Give the slot back unpublished (its contents are undefined for the next draft). Idempotent."""
        if self._hold is None:
            return
        hold = self._spend()
        try:
            self._set._core.give_back(hold.slot, hold.epoch)  # now, not when the hold is collected
        finally:
            hold.drop()

    def __repr__(self) -> str:
        state = "released" if self._hold is None else "being written"
        return f"<gpushare.Draft {len(self)} tensors {state}>"


class TensorSet(ProducerHandle, TensorSetInfo):
    """The trainer's end of a versioned set of tensors (``manager.tensor_set(layout, versions=2)``).

    ::

        ts = manager.tensor_set({"w": (shape, "float32"), "b": (n, "bfloat16")}, versions=2)
        engines = [mp.Process(target=engine, args=(ts,)) for _ in range(4)]  # each unpickling: a reader
        ...
        for step in range(steps):
            train(model)
            ts.publish(model_weights)              # copied into a version no engine holds

        def engine(reader):                        # the set unpickles as a TensorSetReader
            version = 0
            while True:
                with reader.wait(newer_than=version) as snap:   # the newest version (latest wins)
                    snap.copy_to(my_weights)       # copy mode; or use snap["w"] as weights (zero-copy)
                    version = snap.version

    Each slot is one Manager allocation holding every tensor at a 256-byte
    aligned offset (``layout``); ``versions`` slots (default 2) keep that many
    versions.
    The trainer never writes a version an engine holds; an engine holds a
    version from ``latest()``/``wait()`` until it releases the snapshot. See
    docs/guides/weight-sync.md.
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

    _core: SetProducer

    def __init__(self, core: SetProducer) -> None:
        ProducerHandle.__init__(self, core, "the trainer's TensorSet")
        self._layout = core.layout
        self._adapters: dict[str, Any] = {}  # what adapters (gpushare.torch) keep per set; cleared at close

    # -- description ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The latest version published (0: none yet)."""
        return self._core.version

    # -- publishing --------------------------------------------------------------------------
    def draft(self, timeout: float | None = None, *, stream: object = None) -> Draft:
        """A version no reader holds, to fill in place and :meth:`publish` (no copy by gpushare).

        Waits while every version is held or being written. The draft's contents
        are those of an older version, or undefined: write every tensor the engines
        will read.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for a free version; None waits for as long as it takes.
        stream : int, torch or CuPy stream, optional
            On CUDA, where the draft will be written (default: the legacy default
            stream); it is made to wait for the engines' last reads of the version,
            with no host wait.

        Returns
        -------
        Draft
            A mapping of the layout's names to writable tensors in the version.

        Raises
        ------
        WaitTimeoutError
            If no version came free within ``timeout``; it names who holds what.
        TensorSetClosedError
            If the set is closed.
        """
        core = self._core
        handle = stream_handle(stream) if core.cuda else None
        slot, epoch, memory, base = self._acquire(timeout, handle)
        return Draft(self, core.layout, base, _DraftHold(core, slot, epoch, memory))

    def _acquire(self, timeout: float | None, wait_stream: int | None) -> tuple[int, int, Any, int]:
        """A slot to write, and a count on its memory while it is written (the caller drops it):
        ``(slot, epoch, memory, where the slot starts in it)``."""
        core = self._core
        slot, epoch = core.acquire(timeout, wait_stream)
        buf = core.buffers[slot]
        if buf.released:  # closed meanwhile
            core.give_back(slot, epoch)
            raise core._closed_error()
        memory = memory_of(buf)
        memory.acquire()
        return slot, epoch, memory, byte_offset(buf)

    def publish(
        self, tensors: Mapping[str, Any] | Draft, *, stream: object = None, timeout: float | None = None
    ) -> int:
        """Publish a new version; engines waiting for a newer version get this one.

        Parameters
        ----------
        tensors : mapping or Draft
            A mapping with every name of the layout (NumPy arrays, CUDA arrays,
            torch tensors), copied in one batch into a version no engine holds; or a
            draft from :meth:`draft`, published as it is.
        stream : int, torch or CuPy stream, optional
            On CUDA, the copies run after this stream's work and it waits for them;
            a draft's ready event is recorded on it, where the draft was written.
            Default: the legacy default stream.
        timeout : float, optional
            Seconds to wait for a version no engine holds; None waits for as long as
            it takes.

        Returns
        -------
        int
            The version's number (1, 2, ...).

        Raises
        ------
        LayoutError
            If a tensor is missing or does not fit the layout, or the tensors are on
            several GPUs or another GPU than the set's.
        WaitTimeoutError
            If no version came free within ``timeout``.
        TensorSetClosedError
            If the set is closed.
        """
        core = self._core
        if isinstance(tensors, Draft):
            return self._publish_draft(tensors, stream)
        plan = regions(core.layout, tensors, writable=False, what="source", complete=True)
        devices = plan.devices
        if len(devices) > 1 or (core.cuda and devices - {core.device}):
            where = sorted(devices | ({core.device} if core.cuda else set()))  # type: ignore[arg-type]
            raise LayoutError(
                f"publish() copies from one GPU: the tensors and the set are on devices {where}; move the "
                "tensors to the set's GPU first"
            )
        private = copy_stream(core.device).stream if core.cuda else None  # type: ignore[arg-type]
        slot, epoch, memory, _ = self._acquire(timeout, private)
        try:
            dsts, srcs, sizes = plan.lists(core.bases[slot])
            recorded = False
            if sizes and not core.cuda and not devices:
                host_copy(dsts, srcs, sizes)
            elif sizes:
                ordinal: int = core.device if core.cuda else devices.pop()  # type: ignore[assignment]
                done = core.events[slot] if core.cuda else None  # the slot's ready event, after the copies
                copy_regions(
                    dsts, srcs, sizes, ordinal, stream_handle(stream), done=done, host=not core.cuda or plan.host
                )
                recorded = core.cuda
        except BaseException:
            core.give_back(slot, epoch)
            memory.drop_one()
            raise
        try:
            return core.publish(slot, epoch, recorded)
        finally:
            memory.drop_one()
            del plan, tensors  # what the copy read stays alive until here

    def _publish_draft(self, draft: Draft, stream: object) -> int:
        core = self._core
        if draft._set is not self:
            raise LayoutError("publish() takes a draft made by this tensor set's draft()")
        hold = draft._held()
        # Engines wait on this slot's event, never on the whole device.
        recorded = core.cuda and core.slots.record_ready(hold.slot, stream_handle(stream))
        draft._spend()
        try:
            if not core.still_writing(hold.slot, hold.epoch):
                raise BufferReleasedError("this draft's slot was given back already; take a new one with ts.draft()")
            try:
                return core.publish(hold.slot, hold.epoch, recorded)
            except TensorSetClosedError:
                core.give_back(hold.slot, hold.epoch)
                raise
        finally:
            hold.drop()  # published: the hold's collection gives nothing back

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The set's state now.

        Returns
        -------
        dict
            ``version`` (the latest published), ``versions``, ``readers`` (with
            ``reader_pids``), ``held`` ({version: [pids]}), ``free`` (versions no reader
            holds or is being written), ``writing`` (publishes or drafts in progress),
            ``published`` (so far), ``registered`` (readers ever), ``latest_available``
            (False while the latest is being rewritten), ``closed``.
        """
        return self._core.stats()

    def close(self) -> None:
        """End the set: readers may still take the latest version, then their next wait raises
        :class:`~gpushare.TensorSetClosedError`. Idempotent; never blocks on readers."""
        self._core.close("the trainer called close()")
        self._adapters.clear()

    def _shutdown(self) -> None:
        """The Manager shuts down: end the set, offering no last version (readers let go at once)."""
        self._core.close("its Manager was shut down", offer=False)
        self._adapters.clear()

    def _slot_buffer(self, slot: int) -> Buffer:
        """A plain Buffer (uint8, its own count) over slot ``slot``, for adapters that keep their
        own views of each slot (``gpushare.torch``), written only through drafts of that slot."""
        return self._core.buffers[slot].view()

    def __reduce__(self) -> tuple[Any, ...]:
        core = self._core
        if core.closed is not None:
            raise TensorSetClosedError(
                f"cannot pickle a closed tensor set ({core.closed}): it has nothing to give a reader"
            )
        from ._tensor_reader import attach_reader

        authkey = owner_authkey = None
        ray = sys.modules.get("ray")
        if ray is not None and getattr(ray, "is_initialized", lambda: False)():
            # A Ray worker is not in the trainer's process tree: the set's Ray form carries the
            # trainer's authkey (its service) and the memory owner's (the lifetime service).
            authkey = core.authkey
            owner_authkey = bytes(memory_of(core.buffers[0]).source.authkey)
        return (attach_reader, (core.address, core.info, authkey, owner_authkey))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"version {self.version}, {self._core.reader_count()} reader(s)"
        return (
            f"<gpushare.TensorSet {len(self.layout)} tensors, {self.nbytes} bytes x {self.versions} versions, "
            f"device={self.device!r}, {state}>"
        )


def create_tensor_set(
    manager: Any, layout: Mapping[str, Any], versions: int = 2, device: Any = None, *, backend: str | None = None
) -> TensorSet:
    """Allocate ``versions`` slots of ``layout`` with ``manager`` and start the set's service (all or nothing)."""
    packed = make_layout(layout)
    if isinstance(versions, bool) or not isinstance(versions, int) or not 1 <= versions <= MAX_SLOTS:
        raise LayoutError(f"versions={versions!r} must be an int from 1 to {MAX_SLOTS} (2 lets engines hold one)")
    if not _channel.available():
        raise BackendUnavailableError(
            "tensor sets need memfd_create and eventfd (Linux); on this platform send buffers through a Queue"
        )
    buffers: list[Buffer] = []
    try:
        for _ in range(versions):
            buffers.append(manager.empty((max(packed.nbytes, 1),), "uint8", device, backend=backend))
        core = SetProducer(buffers, packed, bytes(current_process().authkey))
    except BaseException:
        for b in buffers:
            b.release()
        raise
    return TensorSet(core)
