"""The fan-out ring: pre-shared slots for steady producer -> N consumers pipelines.

A :class:`Ring` is ``slots`` buffers of one shape and dtype, allocated by a
Manager in the producer's process, plus a small authenticated Unix-socket
service (owned by the ring, in that process) that hands slots to every
registered consumer. Each consumer maps each slot once, when it registers;
after that a handoff moves only a slot index: no descriptor, no lease, no
open per item.

Roles
-----
* The producer (the process that called ``manager.ring(...)``) acquires a
  free slot, writes it, and publishes it to every registered consumer.
* A consumer is what a worker gets by unpickling the ring (as a Process
  argument, through a queue or a pipe): a :class:`RingConsumer`. *Each
  unpickling registers one consumer*, and every registered consumer receives
  every slot published after it registered, so a consumer end nobody reads
  from must be closed, or it holds slots until its process exits.

Registration (pickled messages, after multiprocessing's HMAC challenge both
ways with the process authkey, like the lifetime service)
--------------------------------------------------------------------------
consumer -> producer ``("hello", pid)``; producer -> consumer
``("slots", [buffer, ...], [slot event handle, ...])`` -- the slot buffers,
pickled as usual (one lease each, claimed by the consumer: the lifetime
service keeps the memory alive while the consumer maps it), and on CUDA
the producer's per-slot interprocess events -- immediately followed on the
socket (SCM_RIGHTS) by three fds: the consumer's shared-memory channel, its
item eventfd and the ring's release eventfd (see ``_channel``); consumer ->
producer ``("ready", [release event handle, ...])`` once it mapped them (on
CUDA, one event per slot that it records when it releases that slot);
producer -> consumer ``("registered",)``, sent under the lock that
:meth:`Ring.publish` takes its list of consumers with. From that moment the
consumer receives exactly the slots published after it, and unpickling
returns only then. Either producer message may instead be
``("closed", reason)``.

Handoffs (shared memory and eventfds; no socket message, no pickle)
-------------------------------------------------------------------
Publishing writes an entry ``slot | sequence | meta`` into each
consumer's channel and adds one to its eventfd; releasing writes the
publication's ``sequence + 1`` into the consumer's release word for that
slot and adds one to the release eventfd. The layout, and why it needs no
lock and no memory barrier, is in :mod:`gpushare._fanout._channel`. A meta
that pickles to more than ``INLINE_META`` bytes (at most 1 MiB) goes on the
socket just before its entry, as a ``u8 1 | meta`` frame in
multiprocessing's framing. The socket otherwise carries only the end:
``u8 2 | reason (utf-8)`` after the last item, and EOF when either process
goes -- which is how each side learns that the other died: the consumer
sleeps in ``poll`` on its eventfd *and* its socket, the producer on the
release eventfd *and* every consumer socket.

Spinning
--------
An end that waits (:meth:`RingConsumer.get` with no entry there yet, a
:meth:`Ring.acquire` that finds no free slot) checks the shared words in a
loop for a while before it sleeps, giving its core away every few looks
(``sched_yield``). How long is ``manager.ring(..., spin=)``:

* ``"auto"`` (the default): at most 50 us, and only when this end's
  previous wait was shorter than that. Waking a sleeping process costs
  about that much, so a wait costs at most about twice what sleeping at
  once would; a stream of items closer together than 50 us costs neither
  side a sleep or a wakeup, and items further apart cost no spinning
  after the first long wait (``_wire.SpinPolicy``).
* ``True`` (5 ms) or seconds: that long, every wait: a handoff then costs
  no wakeup of a sleeping process, at the price of a busy CPU while
  waiting. For latency-critical pipelines with a core to spare per process.
* ``False`` (or 0): never; every wait sleeps in ``poll`` at once.

States of a slot (kept by the producer)
---------------------------------------
``free`` -> :meth:`Ring.acquire` -> ``acquired`` (the producer writes it)
-> :meth:`Ring.publish` -> ``published`` to the set of consumers registered
at that moment -> ``free`` again when every one of them has released it.
An acquired slot whose buffer is released (or collected) without being
published goes straight back to ``free``; a slot published while no
consumer is registered is free again at once.

Who frees what
--------------
* A consumer releases each item it got: ``item.release()``,
  ``ring.release(item)``, ``with ring.get() as item:``, the end of a loop
  iteration (``for item in ring``), or garbage collection of the item.
* A consumer that exits or dies closes its socket: the producer sees EOF
  the next time it drains (:meth:`Ring.acquire` drains when no slot is
  free, :meth:`Ring.stats` always), applies the releases it wrote before
  it went, and frees every slot it still held; it goes on with the
  remaining consumers. A consumer whose socket stays full for
  ``SEND_TIMEOUT`` seconds (only metas too long to go inline use it) is
  dropped the same way.
* The producer never frees memory itself: the slots are Manager buffers.
  :meth:`Ring.close` sends ``CLOSED`` to every consumer and releases the
  ring's own references; consumers release theirs when they read
  ``CLOSED``; the Manager recycles each slot when the last reference goes.
* Items take no reference of their own. Each end keeps one Buffer per
  slot, and a slot has at most one item out in an end (acquired and not
  yet published in the producer; got and not yet released in a consumer),
  so an end that closes keeps the Buffer of a slot whose item is still
  out, and releases it when that item goes. An item costs no reference
  count and no finalizer object, and stays usable until it is released.

Waiting for consumers
---------------------
``consumers=N`` (default 1) makes :meth:`Ring.publish` wait until N
consumers have registered (counting every registration since the ring was
made), so the first items are not published into a ring nobody listens to
yet. Once N have registered, publish never waits for registrations again: a
consumer that dies is not waited for, and the producer goes on with the
others (with none, a published slot is simply free again).

Ending
------
A consumer's :meth:`RingConsumer.get` returns every item published before
the producer closed the ring, then raises :class:`RingClosedError`
(iteration just stops). If the producer's process exits or dies without
closing the ring, ``get`` raises :class:`OwnerGoneError` instead: a crash
never looks like a clean end.

Device memory (CUDA slots): per-slot events, nothing device-wide
----------------------------------------------------------------
The producer has one interprocess event per slot and records it at
:meth:`Ring.publish` (on the legacy default stream, or the ``stream=``
given); a consumer opens each once, at registration, and a slot it gets
waits on its slot's event exactly like a buffer from a Queue waits on its
ready event (``ptr`` and gpushare's accessors on the host, DLPack and CAI
consumers on their stream). Each consumer has one interprocess event per
slot too, recorded on its default stream when it releases the slot; when
the producer acquires the slot again its default stream waits for those
of the consumers that read it last (``cuStreamWaitEvent``: the host never
blocks). Work that reads or writes a slot on another stream must be
ordered with the default stream first (or pass ``stream=`` to publish).
Neither side records on a stream with nothing queued (all of that
stream's work is then done), and each says in shared memory whether it
recorded: a flag in the entry (``SLOT_RECORDED``) and one in the release
word (``RECORDED``). Unflagged, the other side calls the driver not at
all; flagged, the consumer waits on the slot event, and the producer
waits only on release events that are not complete yet (``cuEventQuery``):
an unconditional GPU wait on another process's event ties the two
contexts together on every item.
On the host backend none of this is needed.

Every call that can block takes a ``timeout`` and raises
:class:`~gpushare.WaitTimeoutError` (a ``TimeoutError``) saying what it
waited for.

Modules: ``_ring`` (:class:`Ring`, the producer's handle, and
:func:`create_ring`), ``_producer`` (the producer's state and service),
``_consumer`` (:class:`RingConsumer`), ``_channel`` (one consumer's shared
memory), ``_item`` (:class:`~._item.RingItem`, what both ends hand out) and
``_wire`` (limits, spinning, socket framing).
"""

from ._channel import Channel
from ._consumer import RingConsumer
from ._item import RingItem
from ._producer import Producer
from ._ring import Ring, create_ring
from ._wire import MAX_META, REGISTER_TIMEOUT, SEND_TIMEOUT, SPIN_DEFAULT

__all__ = [
    "MAX_META",
    "REGISTER_TIMEOUT",
    "SEND_TIMEOUT",
    "SPIN_DEFAULT",
    "Channel",
    "Producer",
    "Ring",
    "RingConsumer",
    "RingItem",
    "create_ring",
]
