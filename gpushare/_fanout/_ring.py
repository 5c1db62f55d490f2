"""The producer's end of a ring as the user holds it: :class:`Ring`, and :func:`create_ring`.

A Ring is a handle on a :class:`~._ring_producer.RingProducer`; pickling it
gives a consumer end (:class:`~._consumer.RingConsumer`). Its slots are windows
of one allocation, one starting every ``SLOT_ALIGN`` bytes; each is a Buffer
under a lease of its own, so a consumer arms one Memory per slot and maps the
allocation once.
"""

from __future__ import annotations

import math
from multiprocessing import current_process
from typing import Any, NoReturn

from .._buffer import Buffer, check_dtype, check_shape, window
from .._errors import BackendUnavailableError, RingClosedError
from . import _channel
from ._handles import ProducerHandle
from ._ring_producer import RingProducer
from ._wire import MAX_SLOTS, check_spin

__all__ = ["SLOT_ALIGN", "Ring", "create_ring"]

#: Where each slot of a ring starts in the ring's one allocation: on separate pages for
#: any host page size, so each host slot can be page-locked on its own.
SLOT_ALIGN = 1 << 16


class Ring(ProducerHandle):
    """The producer end of a ring of pre-shared slots (made by ``manager.ring(...)``).

    ::

        with manager.ring((64, 1024), "float32", slots=4, consumers=2) as ring:
            workers = [mp.Process(target=consume, args=(ring,)) for _ in range(2)]
            ...
            for step in range(steps):
                buf = ring.acquire(timeout=10)   # a free slot (blocks while all are busy)
                buf.copy_from(batch)             # write it
                ring.publish(buf, meta=step)     # hand it to every registered consumer

        def consume(ring):                       # the ring unpickles as a RingConsumer
            for item in ring:                    # until the producer closes the ring
                use(item, item.meta)             # released when the loop moves on

    Pickling a Ring gives a consumer end; each unpickling registers one
    consumer. docs/guides/ring.md tells how to use one. The producer's methods are meant for one thread; ``close()``
    and ``stats()`` may come from another.
    """

    __module__ = "gpushare"  # its public name (help, tracebacks, pickles)

    _core: RingProducer

    def __init__(self, core: RingProducer) -> None:
        ProducerHandle.__init__(self, core, "the producer's Ring")

    @property
    def slots(self) -> int:
        """How many pre-shared buffers the ring cycles through."""
        return self._core.n

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of every slot."""
        return self._core.buffers[0].shape

    @property
    def dtype(self) -> Any:
        """The element type of every slot, a ``numpy.dtype``."""
        return self._core.buffers[0].dtype

    @property
    def spin(self) -> float | str:
        """``"auto"``, or the seconds each end spins on shared memory before it sleeps (0: never spins)."""
        return self._core.spin.setting

    def acquire(self, timeout: float | None = None) -> Buffer:
        """A free slot's buffer, to write and then :meth:`publish`.

        Blocks while every slot is held by some consumer (or acquired and not yet
        published), applying releases as they arrive. Releasing the returned
        buffer without publishing it returns the slot. On CUDA the producer's
        default stream is made to wait for the consumers' reads of the slot (their
        release events): write the slot on the default stream, or synchronize with
        it first.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for a free slot; None (default) waits for as long as it takes.

        Returns
        -------
        Buffer
            The slot, of the ring's shape and dtype.

        Raises
        ------
        WaitTimeoutError
            If no slot came free within ``timeout`` (a ``TimeoutError``); it names who
            holds what.
        RingClosedError
            If the ring is closed.
        """
        return self._core.acquire(self, timeout)

    def publish(self, buf: Buffer, meta: Any = None, *, timeout: float | None = None, stream: int | None = None) -> int:
        """Hand ``buf`` (from :meth:`acquire`) to every registered consumer.

        Until ``consumers`` consumers have registered, waits for them. ``buf`` is
        released here: the slot belongs to the consumers until they all release it.

        Parameters
        ----------
        buf : Buffer
            A slot from :meth:`acquire`, written.
        meta : object, optional
            Small and picklable, without Buffers (it is pickled once for every
            consumer); it travels with the item as ``item.meta``.
        timeout : float, optional
            Seconds to wait for the consumers to register; None waits for as long as
            it takes.
        stream : int, optional
            On CUDA, the stream (an int handle) the slot's ready event is recorded on;
            consumers order their reads after it. Default: the legacy default stream,
            where torch's and CuPy's default work runs. Work on other streams that
            writes the slot must be ordered before this one.

        Returns
        -------
        int
            The item's sequence number.

        Raises
        ------
        WaitTimeoutError
            If the consumers did not register within ``timeout``.
        RingClosedError
            If the ring is closed.
        ValueError
            If ``buf`` is not a slot of this ring acquired and not yet published.
        """
        return self._core.publish(self, buf, meta, timeout, stream)

    def close(self) -> None:
        """End the ring: consumers get every item already published, then RingClosedError
        (their iteration stops). Idempotent; never blocks on consumers."""
        self._core.close("the producer called close()")

    def stats(self) -> dict[str, Any]:
        """The ring's state now.

        Returns
        -------
        dict
            Slots ``free``, ``acquired`` and ``busy`` (held by consumers); ``consumers``
            (live, with ``consumer_pids``); ``registered`` (ever); ``published`` (items
            so far); ``closed``.
        """
        return self._core.stats()

    def _not_a_consumer(self, *args: Any, **kwargs: Any) -> NoReturn:
        """A consumer's call (``get``, ``items``, ``release``, iteration), made on the producer's end.

        Raises
        ------
        TypeError
            Always, saying how a consumer gets its end: by unpickling the ring (a Process
            argument, a queue or a pipe).
        """
        raise TypeError(
            "this is the producer end of the ring (acquire/publish); consumers get theirs by unpickling "
            "it: pass the ring as a spawned Process argument, or through a queue or a pipe. (Under the "
            "fork start method Process arguments are inherited, not pickled: send the ring through a queue)"
        )

    get = items = release = __iter__ = _not_a_consumer

    def __reduce__(self) -> tuple[Any, ...]:
        if self._core.closed is not None:
            raise RingClosedError(
                f"cannot pickle a closed ring ({self._core.closed}): it has no items left to give a consumer"
            )
        from ._consumer import attach

        return (attach, (self._core.address, self._core.info))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._core.consumer_count()} consumer(s)"
        return (
            f"<gpushare.Ring slots={self.slots} shape={self.shape} dtype={self.dtype} device={self.device!r} {state}>"
        )


def create_ring(
    manager: Any, shape: Any, dtype: Any, device: Any, slots: int, consumers: int, backend: str | None,
    spin: bool | float | str,
) -> Ring:  # fmt: skip
    """Allocate ``slots`` buffers (windows of one allocation) with ``manager`` and start the
    ring's service (all or nothing). The arguments and their defaults are ``BufferManager.ring``'s."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots={slots!r} must be an int from 1 to {MAX_SLOTS}")
    if isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 0:
        raise ValueError(f"consumers={consumers!r} must be an int >= 0 (how many registrations publish() waits for)")
    spin_s, adaptive = check_spin(spin)
    if not _channel.available():
        raise BackendUnavailableError(
            "rings need memfd_create and eventfd (Linux); on this platform send buffers through a Queue or a Pipe"
        )
    dims, dt = check_shape(shape), check_dtype(dtype)
    stride = max(1, math.ceil(math.prod(dims) * dt.itemsize / SLOT_ALIGN)) * SLOT_ALIGN
    buffers: list[Buffer] = []
    try:
        whole = manager.empty((stride * slots,), "uint8", device, backend=backend)
        try:
            buffers = [window(whole, i * stride, dims, dt) for i in range(slots)]
        finally:
            whole.release()  # each slot holds its own count on the allocation
        core = RingProducer(buffers, consumers, bytes(current_process().authkey), spin_s, adaptive)
    except BaseException:
        for b in buffers:
            b.release()
        raise
    return Ring(core)
