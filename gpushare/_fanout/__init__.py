"""Fan-out: the ring (pre-shared slots, producer -> N consumers) and tensor sets (weight sync).

Two patterns share this package's machinery (an authenticated Unix-socket
service in the producer, version or slot buffers that are Manager buffers
mapped once per consumer, a shared-memory channel of release words per
consumer, eventfds, per-slot interprocess events on CUDA): the *ring*, for
streams of items every consumer must see, described first, and the *tensor
set*, for versions of which each consumer wants only the newest, described
after it.

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

Tensor sets: versioned weights, trainer -> engines
===================================================
A :class:`TensorSet` (``manager.tensor_set(layout, versions=2)``) is
``versions`` Manager buffers, each holding every tensor of ``layout`` at a
256-byte aligned offset (``_layout``), plus a service in the trainer's
process like the ring's. The trainer publishes whole versions; an engine
takes the newest one and holds it while it uses it (zero-copy: the
snapshot's views are its weights) or copies it into its own tensors (copy
mode) and lets it go. Slow engines skip versions: the latest wins.

Registration (after the HMAC challenge, as for the ring)
--------------------------------------------------------
reader -> trainer ``("hello", pid, key)``; trainer -> reader ``("versions",
[buffer, ...], [version event handle, ...])`` (one lease per version,
claimed by the reader, which maps each once) followed by two fds
(SCM_RIGHTS): the reader's channel (a ``_channel.Channel`` of which only the
*release words* are used, one per version) and the set's release eventfd;
reader -> trainer ``("ready", [release event handle, ...])`` (CUDA: one per
version, recorded when the reader releases that version); trainer -> reader
``("registered",)``. A reader outside the trainer's process tree (a Ray
actor) gets the set's Ray form, which carries the trainer's authkey and the
memory owner's; it makes its lifetime link with the owner's authkey before
the version buffers are unpickled.

Taking a version: a request, answered under the trainer's lock
----------------------------------------------------------------
reader -> trainer ``("take", newer_than, timeout)``, answered by that
reader's thread in the trainer, once a version newer than ``newer_than`` is
available (at once for the latest), with ``("grant", version, slot, grant
id, recorded)``, or ``("timeout", message)``, or ``("closed", reason, last
version, its slot, recorded)``. The trainer records the grant as held
before it answers, so it always knows who holds what; a lock-free take
would need a store-load barrier on both sides, which Python cannot express
portably (``_tensor_reader`` says why, and how a take that meets a
concurrent release of the same version stays right). A reader holds at
most one grant per version; taking a version it holds returns the same
grant.

Releasing: a release word and a poke, no message
------------------------------------------------
A snapshot holds its grant, and so does each of its views and everything
made from one without a copy (``_views``); when the last goes (or at
``snap.release()``), the grant's finalizer writes ``grant id + 1`` (and
``RECORDED`` when it recorded its release event, CUDA) into the release
word of the version's slot and pokes the release eventfd: finalizer-safe,
no lock, no message. The trainer reads release words whenever it needs
current state: before it grants a reader anything, when it picks a version
to write, for ``stats()``. A reader's socket closing (exit, SIGKILL, its
``close()``) frees everything it held, at once: its thread in the trainer
sleeps in ``poll`` on the socket.

Publishing
----------
``publish(tensors)`` (copied, in one batched copy) or ``draft()`` then
``publish(draft)`` (written in place) writes a version no reader holds and
nobody else writes, preferring one that is not the latest; if only the
latest is free it takes it, and readers asking meanwhile wait until the new
one lands (a draft of it given back unpublished leaves no latest until the
next publish). When every version is held it waits (``timeout``) in
``poll`` on the release eventfd and a wake pipe the readers' threads write
when a reader goes, then raises :class:`~gpushare.WaitTimeoutError` naming
the holders ("version 7 held by pids 123, 456"). The new version's number
is the previous one's plus one; readers waiting for one are woken through
an eventfd of their thread. Nothing of the tensors goes through a socket.

Device memory: per-version events, as the ring's slots
------------------------------------------------------
The trainer has an interprocess event per version, recorded when the version
is published (after the batched copies on its private stream, or on the
draft's ``stream``), and not recorded when that stream was idle; readers
open them once and a snapshot's memory waits on its version's event like a
ring item (``Memory.arm``: accessors on the host, DLPack and CAI consumers
on their stream, ``copy_to`` on its private stream). Each reader records its
per-version release event at release (on its default stream, after
``copy_to``'s copies), unless its default stream is idle; the trainer's next
write of that version (its private copy stream, or the draft's stream)
waits for the recorded ones that are not complete yet. ``copy_to`` and
``publish(tensors)`` use ``cuMemcpyBatchAsync`` on a private non-blocking
stream ordered after the caller's stream by events (the batched call
refuses the legacy default stream), and the caller's stream then waits for
the copies: no host synchronisation on the hot path. The exception is a
reader on another GPU than the set's: its ``copy_to`` waits for the
version's event and for its copies (one ``cuMemcpyAsync`` each) on the host,
since queuing the version's event on a stream of the other GPU crashed the
driver (``cuStreamWaitEvent``, in the two-GPU tests).

Ending
------
``close()`` makes each reader's thread send ``("closed", ...)`` and end; a
reader may still take the last version (it is never written again), then
its next wait raises :class:`~gpushare.TensorSetClosedError`. A trainer that
dies shows as EOF without that message: :class:`~gpushare.OwnerGoneError`.
Weights copied out stay valid; snapshots still held stay valid when the
memory is server-owned (``Manager(owner="server")``).

Modules: ``_tensor_set`` (:class:`TensorSet`, :class:`Draft`,
:func:`create_tensor_set`), ``_set_producer`` (the trainer's state and
service), ``_tensor_reader`` (:class:`TensorSetReader`, :class:`Snapshot`,
grants), ``_views`` (:class:`TensorView`), ``_layout`` (packing) and
``_copy`` (checking tensors against the layout, batched copies).
"""

from ._channel import Channel
from ._consumer import RingConsumer
from ._item import RingItem
from ._layout import ALIGN, Layout, TensorSpec, make_layout
from ._producer import Producer
from ._ring import Ring, create_ring
from ._set_producer import SetProducer
from ._tensor_reader import Snapshot, TensorSetReader
from ._tensor_set import Draft, TensorSet, create_tensor_set
from ._views import TensorView
from ._wire import MAX_META, REGISTER_TIMEOUT, SEND_TIMEOUT, SPIN_DEFAULT

__all__ = [
    "ALIGN",
    "MAX_META",
    "REGISTER_TIMEOUT",
    "SEND_TIMEOUT",
    "SPIN_DEFAULT",
    "Channel",
    "Draft",
    "Layout",
    "Producer",
    "Ring",
    "RingConsumer",
    "RingItem",
    "SetProducer",
    "Snapshot",
    "TensorSet",
    "TensorSetReader",
    "TensorSpec",
    "TensorView",
    "create_ring",
    "create_tensor_set",
    "make_layout",
]
