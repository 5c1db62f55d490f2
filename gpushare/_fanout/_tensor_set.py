"""The trainer's end of a tensor set as the user holds it: TensorSet, Draft, and create_tensor_set.

A TensorSet is a thin handle on a :class:`~._set_producer.SetProducer` (the
versions' states, the readers' service); pickling it gives an engine's end
(:class:`~._tensor_reader.TensorSetReader`). See :mod:`gpushare._fanout` for
the protocol.

Publishing, the two ways:

* ``ts.publish(tensors)``: the trainer's tensors are copied into a version
  no reader holds (one batched copy: :mod:`._copy`), which then becomes the
  latest. On CUDA the copies run after the trainer's ``stream`` and after
  the reads of the version's last readers (their release events), the
  version's ready event is recorded after them, and ``stream`` waits for it,
  so the trainer's next step cannot change a tensor before it was copied.
* ``d = ts.draft()``, fill ``d[name]`` in place, ``ts.publish(d)``: no copy
  by gpushare. The draft's ``stream`` waits for the version's last readers
  when the draft is made; ``publish`` records the ready event on the
  ``stream`` it is given (where the draft was written). A draft dropped or
  released unpublished gives its version back.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator, Mapping
from multiprocessing import current_process
from typing import Any

from .. import _cuda
from .._buffer import Buffer, byte_offset, memory_of
from .._errors import BackendUnavailableError, BufferReleasedError, LayoutError, TensorSetClosedError
from . import _channel
from ._copy import copy_regions, copy_stream, host_copy, regions, stream_handle
from ._layout import Layout, make_layout
from ._set_producer import SetProducer
from ._views import Family, TensorView, release_family
from ._wire import MAX_SLOTS

__all__ = ["Draft", "TensorSet", "create_tensor_set"]


class _DraftHold:
    """What a draft and its views hold: its version, and a count on the version's memory.

    Both go when the draft is published or released; a draft dropped unpublished
    (the draft and its last view collected, or the interpreter's exit) gives the
    version back and drops the count through the finalizer. One finalizer and a
    bare count, not a Buffer of its own: a draft is taken and published every
    training step, and each costs microseconds there (the in-place publish).
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


class Draft(Mapping[str, TensorView]):
    """A version of a :class:`TensorSet` to fill in place (``ts.draft()``), then ``ts.publish(d)``.

    A mapping of tensor names to writable :class:`TensorView` Buffers over
    the version's memory (no reader holds it). Publishing it copies nothing;
    ``release()`` (or dropping the draft and every view of it) gives the
    version back unpublished. Either way its views are released: touching
    one afterwards raises :class:`~gpushare.BufferReleasedError`.
    """

    __slots__ = ("_base", "_family", "_hold", "_set", "_views", "layout", "slot")

    def __init__(self, owner: TensorSet, layout: Layout, base: int, hold: _DraftHold) -> None:
        self._set = owner
        self.layout = layout
        self.slot = hold.slot
        self._base = base  # where the version starts in its allocation
        self._hold: _DraftHold | None = hold  # the version and a count on its memory, while the draft is out
        self._views: dict[str, TensorView] = {}
        self._family: Any = None  # made with the first view

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def released(self) -> bool:
        """Whether the draft was published or released (its views are gone)."""
        return self._hold is None

    def _out(self) -> _DraftHold:
        hold = self._hold
        if hold is None:
            raise BufferReleasedError("this draft was already published or released; take a new one with ts.draft()")
        return hold

    def __getitem__(self, name: str) -> TensorView:
        view = self._views.get(name)
        if view is not None and self._hold is not None:
            return view
        hold = self._out()
        spec = self.layout.get(name)
        if spec is None:
            raise KeyError(name)
        if self._family is None:
            self._family = Family()
        view = TensorView(hold.memory, self._base + spec.offset, spec.shape, spec.dtype, hold, spec.tag, self._family)
        self._views[name] = view
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, name: object) -> bool:
        return name in self.layout

    def _spend(self) -> _DraftHold:
        """Take the draft's version out of it (publish or release); its views are released."""
        hold = self._out()
        self._hold = None
        if self._family is not None:
            self._views.clear()
            release_family(self._family)
        return hold

    def release(self) -> None:
        """Give the version back unpublished (its contents are undefined for the next draft). Idempotent."""
        if self._hold is None:
            return
        hold = self._spend()
        try:
            self._set._core.give_back(hold.slot, hold.epoch)  # now, not when the hold is collected
        finally:
            hold.drop()

    def __enter__(self) -> Draft:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._hold is None else "being written"
        return f"<gpushare.Draft {len(self)} tensors {state}>"


class TensorSet:
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

    Every version is one Manager allocation holding every tensor at a
    256-byte aligned offset (``layout``); ``versions`` of them (default 2).
    The trainer never writes a version an engine holds; an engine holds a
    version from ``latest()``/``wait()`` until it releases the snapshot. See
    :mod:`gpushare._fanout` for the protocol and docs/guides/weight-sync.md.
    """

    def __init__(self, core: SetProducer) -> None:
        self._core = core
        self._adapters: dict[str, Any] = {}  # what adapters (gpushare.torch) keep per set; cleared at close
        self._finalizer = weakref.finalize(
            self, core.close, "the trainer's TensorSet was garbage collected without close()"
        )

    # -- description ------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """Names -> TensorSpec (shape, dtype, tag, offset, nbytes), in packing order."""
        return self._core.layout

    @property
    def names(self) -> tuple[str, ...]:
        return self._core.layout.names

    @property
    def nbytes(self) -> int:
        """Bytes of one version (every tensor, at its aligned offset)."""
        return self._core.layout.nbytes

    @property
    def versions(self) -> int:
        return self._core.n

    @property
    def version(self) -> int:
        """The latest version published (0: none yet)."""
        return self._core.version

    @property
    def device(self) -> int | str:
        """The CUDA ordinal of the versions in this process, or ``"cpu"``."""
        return self._core.device

    @property
    def backend(self) -> str:
        return self._core.buffers[0].backend

    @property
    def closed(self) -> bool:
        return self._core.closed is not None

    # -- publishing --------------------------------------------------------------------------
    def draft(self, timeout: float | None = None, *, stream: object = None) -> Draft:
        """A version no reader holds, to fill in place and :meth:`publish` (no copy by gpushare).

        Waits while every version is held or being written, for at most
        ``timeout`` seconds (then :class:`~gpushare.WaitTimeoutError` naming
        who holds what). On CUDA, ``stream`` (where the draft will be
        written; default the legacy default stream) is made to wait for the
        last reads of the version by engines, with no host wait. The draft's
        contents are those of an older version, or undefined: write every
        tensor the engines will read.
        """
        core = self._core
        handle = stream_handle(stream) if core.cuda else None
        slot, epoch, memory, base = self._acquire(timeout, handle)
        return Draft(self, core.layout, base, _DraftHold(core, slot, epoch, memory))

    def _acquire(self, timeout: float | None, wait_stream: int | None) -> tuple[int, int, Any, int]:
        """A version to write, and a count on its memory while it is written (the caller drops it):
        ``(slot, epoch, memory, where the version starts in it)``."""
        core = self._core
        slot, epoch = core.acquire(timeout, wait_stream)
        version = core.buffers[slot]
        if version.released:  # closed meanwhile
            core.give_back(slot, epoch)
            raise core._closed_error()
        memory = memory_of(version)
        memory.acquire()
        return slot, epoch, memory, byte_offset(version)

    def publish(
        self, tensors: Mapping[str, Any] | Draft, *, stream: object = None, timeout: float | None = None
    ) -> int:
        """Publish a new version; return its number (1, 2, ...).

        ``tensors`` is either a mapping with every name of the layout (NumPy
        arrays, CUDA arrays, torch tensors: copied, in one batch, into a
        version no engine holds, waiting at most ``timeout`` seconds for one),
        or a :class:`Draft` from :meth:`draft`, published as it is. On CUDA the
        copies run after ``stream``'s work (an int handle, a torch or CuPy
        stream; default the legacy default stream) and ``stream`` waits for
        them; a draft's ready event is recorded on ``stream``, where it was
        written. Engines waiting for a newer version get this one.
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
                copy_regions(
                    dsts,
                    srcs,
                    sizes,
                    ordinal,
                    stream_handle(stream),
                    done=core.events[slot] if core.cuda else None,
                    host=not core.cuda or plan.host,
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
        hold = draft._out()
        recorded = False
        if core.cuda:
            # Engines wait on this version's event (nothing device-wide). A stream with nothing
            # queued has finished every write: no record, and engines wait for nothing.
            on = stream_handle(stream)
            device: int = core.device  # type: ignore[assignment]
            recorded = not _cuda.stream_idle(device, on)
            if recorded:
                _cuda.event_record(core.events[hold.slot], device, on)
        draft._spend()
        try:
            if not core.still_writing(hold.slot, hold.epoch):
                raise BufferReleasedError("this draft's version was given back already; take a new one with ts.draft()")
            try:
                return core.publish(hold.slot, hold.epoch, recorded)
            except TensorSetClosedError:
                core.give_back(hold.slot, hold.epoch)
                raise
        finally:
            hold.drop()  # published: the hold's collection gives nothing back

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``version`` (latest published), ``versions``, ``readers`` (with ``reader_pids``),
        ``held`` ({version: [pids]}), ``free`` (versions no reader holds or is being written),
        ``writing`` (publishes or drafts in progress), ``published`` (so far), ``registered``
        (readers ever), ``latest_available`` (False while the latest is being rewritten),
        ``closed``."""
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

    def _version_buffer(self, slot: int) -> Buffer:
        """A plain Buffer (uint8, its own count) over version ``slot``, for adapters that keep their
        own views of each version (``gpushare.torch``), written only through drafts of that slot."""
        return self._core.buffers[slot].view()

    def __enter__(self) -> TensorSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
    """Allocate ``versions`` versions of ``layout`` with ``manager`` and start the set's service (all or nothing)."""
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
