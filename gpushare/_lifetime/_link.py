"""The consumer side: one :class:`Link` per owner per process, and :func:`attach`.

A Link is the consumer's end of the lease service (:data:`~._protocol.LEASE`), composed of:

* ``client`` (:class:`gpushare._service.Client`): the authenticated socket to the owner,
  requests and their replies, and the reader thread that hands the Link what the owner
  says unasked (the Link is its handler: ``Unmap``, ``ClaimFailed``, ``Bye``, ``Refused``,
  and the connection's end, which marks the owner gone);
* ``recorder`` (:class:`LeaseRecorder`, below): claims and releases as
  journal records that never block, and the writer thread;
* the mapping cache (this class): every allocation of that owner mapped in
  this process, how many leases of this process use each, and the owner's
  ready events opened here.

:func:`attach` rebuilds a descriptor's memory in this process, through the
owner itself when this process is the owner. In steady state (the allocation
is already mapped here) an arrival costs one journal record and no message:
the owner already counts this process among the allocation's mappers and
cannot free it without asking. A first arrival sends its claim and maps the
memory while the owner answers.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
import time
import weakref
from multiprocessing import AuthenticationError, current_process
from typing import TYPE_CHECKING, Any

from .. import _backends, _seams
from .._errors import DescriptorError, OwnerGoneError
from .._memory import Descriptor, Memory
from .._service import Client, Err, Handler, Ok, OkFd, Pending, handles
from ._protocol import (
    CLAIM,
    LEASE,
    NUDGE,
    NUDGE_AT,
    RELEASE,
    REQUEST_TIMEOUT,
    RETIRE,
    SHUT_BEFORE_CLAIM,
    UNMAP,
    Batch,
    Bye,
    Claim,
    ClaimFailed,
    Drain,
    ExportFd,
    Hello,
    JournalWriter,
    LeaseVia,
    Refused,
    Unmap,
    Unmapped,
    create_writer,
    log,
    owner_for,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Concatenate, ParamSpec

    P = ParamSpec("P")

__all__ = ["LeaseRecorder", "Link", "attach", "close_link", "close_links", "link_for", "link_stats", "links"]


# -- lease records: the journal's writer side -----------------------------------------------
_DRAIN = Drain()


class LeaseRecorder:
    """The lease journal's writer side: ``note``, the backlog and the writer thread.

    The writer thread also closes the mappings the owner asks this process to unmap
    (:meth:`unmap_later`): a close takes the driver 100-200 us, and done on the reader
    thread it held back the replies behind it, a first arrival's claim answer among them.

    Releases run inside the garbage collector, on any thread: :meth:`note` only ever
    *tries* its lock (the link's lock, which guards the journal too: one lock per
    record instead of two), writes the record straight into the journal when it can,
    and otherwise appends it to a backlog that the writer thread moves into the
    journal in order, nudging the owner (``Drain``) when the journal fills. Without a
    journal the backlog goes as ``Batch`` messages. A release is *accounted* in the
    link (the lease no longer holds its mapping: ``unhold``) before its record is
    written, so an owner that has read the release and asks this process to unmap
    finds the mapping unused.
    """

    def __init__(
        self,
        lock: threading.Lock,
        journal: JournalWriter | None,
        unhold: Callable[[int, int], None],
        retire: Callable[[], None],
        unmap: Callable[[int], None],
        address: str,
    ) -> None:
        self._lock = lock  # the link's: guards the journal, the backlog's order and unhold
        self._journal = journal
        self._unhold = unhold  # (lease, alloc), lock held: the link stops counting the lease
        self._retire = retire  # the link closes itself if the owner is gone and nothing uses it
        self._unmap = unmap  # (alloc): unmap it unless in use here, and answer the owner
        self._unmaps: collections.deque[int] = collections.deque()  # alloc ids the owner asked to unmap
        self._address = address
        # Records not yet in the journal, in order: (CLAIM | RELEASE, lease, alloc, accounted).
        self._backlog: collections.deque[tuple[int, int, int, bool]] = collections.deque()
        self._nudged_at = 0  # journal head when the owner was last nudged
        # Wakes the writer: 1 (backlog), NUDGE, RETIRE, UNMAP, or None (stop). SimpleQueue.put is
        # safe inside the garbage collector, where releases may run.
        self._wake: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._send: Callable[[tuple[Any, ...]], None] = lambda message: None
        self._gone: Callable[[], bool] = lambda: False
        self._writer: threading.Thread | None = None

    def start(self, send_quietly: Callable[[tuple[Any, ...]], None], gone: Callable[[], bool]) -> None:
        """Start the writer thread, which sends with ``send_quietly`` and stops retrying once ``gone()``."""
        self._send = send_quietly
        self._gone = gone
        self._writer = threading.Thread(target=self._write_loop, name="gpushare-link-writer", daemon=True)
        self._writer.start()

    # -- recording (any thread, the garbage collector included) -----------------------
    def note(self, kind: int, lease_id: int, alloc_id: int) -> None:
        """Record a claim or a release of ``lease_id``. Never blocks.

        Possibly on a thread that already holds the lock, so it only ever *tries*
        it. The fast path accounts for a release and appends the record to the
        journal at once; anything else goes to the backlog, which the writer thread
        empties in order (a record is never written before one queued earlier).
        """
        if self._lock.acquire(blocking=False):
            try:
                if kind == RELEASE:
                    self._unhold(lease_id, alloc_id)
                if self.append_locked(kind, lease_id):
                    return
            finally:
                self._lock.release()
            self.defer(kind, lease_id, alloc_id, True)
        else:
            self.defer(kind, lease_id, alloc_id, False)

    def append_locked(self, kind: int, lease_id: int) -> bool:
        """Lock held. Write the record straight into the journal if nothing is queued
        before it and there is room; False if not."""
        journal = self._journal
        if journal is None or self._backlog or not journal.try_append(kind, lease_id):
            return False
        if journal.head - self._nudged_at >= NUDGE_AT and journal.unconsumed() >= NUDGE_AT:
            self._nudged_at = journal.head
            self._wake.put(NUDGE)
        return True

    def may_be_dropped(self, lease_id: int) -> bool:
        """Lock held, after the claim's record (if any) is written: whether the owner may drop
        ``lease_id`` unclaimed without reading that record first (it announced so in the
        journal; or there is no journal). The claimer then asks the owner before using it."""
        journal = self._journal
        return journal is None or lease_id <= journal.dropped()

    def defer(self, kind: int, lease_id: int, alloc_id: int, accounted: bool) -> None:
        """Queue a record for the writer thread (behind the backlog, or the journal is
        full); ``accounted``: a release's ``unhold`` was already done."""
        self._backlog.append((kind, lease_id, alloc_id, accounted))
        self._wake.put(1)

    def nudge(self) -> None:
        """Have the owner read the journal now (the writer thread sends ``Drain``): after
        releasing transient memory, so that the owner frees it at once, not at its next
        housekeeping round."""
        self._wake.put(NUDGE)

    def request_retire(self) -> None:
        """Ask the writer thread to retire the link (never from the garbage collector's thread itself)."""
        self._wake.put(RETIRE)

    def unmap_later(self, alloc_id: int) -> None:
        """Have the writer thread unmap ``alloc_id`` and answer the owner (the reader thread's
        ``Unmap``: the reader goes on reading meanwhile)."""
        self._unmaps.append(alloc_id)
        self._wake.put(UNMAP)

    # -- the writer thread ------------------------------------------------------------
    def _write_loop(self) -> None:
        stop = False
        while not stop:
            signals = [self._wake.get()]
            while True:
                try:
                    signals.append(self._wake.get_nowait())
                except queue.Empty:
                    break
            stop = None in signals
            self._answer_unmaps()  # before a stop too: the owner waits for every answer
            if RETIRE in signals:
                self._retire()
            if self._journal is None:
                self._send_backlog()
                continue
            if NUDGE in signals:
                self._send(_DRAIN)
            # Journal full: hold the backlog, nudge, retry, until it is written or the owner is gone.
            deadline = time.monotonic() + REQUEST_TIMEOUT
            while not self._write_backlog() and not self._gone():
                self._send(_DRAIN)
                if time.monotonic() > deadline:
                    log.error(
                        "gpushare: the owner (address %s) has not read this process's lease records for %g s",
                        self._address,
                        REQUEST_TIMEOUT,
                    )
                    deadline = time.monotonic() + REQUEST_TIMEOUT
                self._answer_unmaps()
                time.sleep(0.001)

    def _answer_unmaps(self) -> None:
        while self._unmaps:
            self._unmap(self._unmaps.popleft())

    def _write_backlog(self) -> bool:
        """Move backlog records into the journal, in order; False if it filled up first."""
        with self._lock:
            journal = self._journal
            if journal is None:  # closed: the owner learns the rest from the connection's end
                return True
            while self._backlog:
                if journal.full():
                    return False
                kind, lease_id, alloc_id, accounted = self._backlog[0]
                if kind == RELEASE and not accounted:
                    self._unhold(lease_id, alloc_id)
                journal.append(kind, lease_id)
                self._backlog.popleft()
        return True

    def _send_backlog(self) -> None:
        """No journal: send the backlog as one ``Batch`` message (claims, then releases)."""
        batch = []
        while self._backlog:
            batch.append(self._backlog.popleft())
        if not batch:
            return
        with self._lock:
            for kind, lease_id, alloc_id, accounted in batch:
                if kind == RELEASE and not accounted:
                    self._unhold(lease_id, alloc_id)
        claims = [lease_id for kind, lease_id, _, _ in batch if kind == CLAIM]
        releases = [lease_id for kind, lease_id, _, _ in batch if kind == RELEASE]
        self._send(Batch(claims, releases))

    def close(self) -> None:
        """Stop the writer (after the records queued before), then close the journal."""
        self._wake.put(None)
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():  # the writer may retire the link
            writer.join(timeout=5.0)
        with self._lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()

    @property
    def has_journal(self) -> bool:
        return self._journal is not None

    def disown(self) -> None:
        """A forked child's copy: the journal, the connection and the leases are its
        parent's, so nothing is recorded into them from here. A buffer the child inherited
        and drops leaves its parent's lease alone (its records stay queued here, and no
        writer thread runs in the child to send them)."""
        self._journal = None

    def backlog(self) -> int:
        """Records still waiting for the writer thread."""
        return len(self._backlog)


# -- the link and its mapping cache ----------------------------------------------------------


_cuda_layer: Any = None  # gpushare._cuda, imported at the first release of CUDA memory


def _finish_default_stream(device: int) -> None:
    """Wait for the work queued on this process's legacy default stream, where torch's and
    CuPy's work runs, unless it is idle (a query, the common case): once the owner reads a
    release it may hand the memory out again, so no kernel of this process may still read
    or write it. A failure is logged and the release goes on: the stream is then unusable."""
    global _cuda_layer
    _cuda = _cuda_layer
    if _cuda is None:  # CUDA memory only: a host process never loads the CUDA layer
        from .. import _cuda

        _cuda_layer = _cuda
    try:
        if not _cuda.stream_idle(device):
            _cuda.stream_synchronize(0, device)
    except Exception:
        log.exception("gpushare: waiting for the default stream before a release failed")


class _LeaseSource:
    """A lease claimed by this (non-owner) process over its link."""

    __slots__ = ("lease_id", "link")

    def __init__(self, link: Link, lease_id: int) -> None:
        self.link = link
        self.lease_id = lease_id

    def drop(self, memory: Memory) -> None:
        # An owner that is gone hands nothing out again: there is nothing to wait for.
        link = self.link
        if memory.device is not None and link.gone is None:
            _finish_default_stream(memory.device)
        release = _release
        if release is not None:  # the same in one C call
            release(link, self.lease_id, memory.alloc_id)
        else:
            link.recorder.note(RELEASE, self.lease_id, memory.alloc_id)

    def share(self, memory: Memory) -> tuple[int, bytes, bytes]:
        """Re-share a received buffer (A -> B -> C): a new lease from the owner, and a
        ready event recorded here, after this process's own work on the buffer (and,
        if this process never waited for the producer, after the producer's too)."""
        lease_id = int(self.link.request(LeaseVia, memory.alloc_id, memory.generation, self.lease_id, True))
        if memory.device is None:
            return lease_id, b"", memory.handle
        from ._ready import process_ready  # CUDA memory only: a host process never loads the CUDA layer

        memory.order_stream(0)  # the legacy default stream waits for the producer's ready event
        return lease_id, process_ready.record(memory.device), memory.handle

    def check(self, memory: Memory) -> None:
        link = self.link
        refused = link.failed.get(self.lease_id)
        if refused is not None:
            raise DescriptorError(f"the owner refused this buffer's lease: {refused}")
        if link.gone is not None:
            raise link.gone_error()

    @property
    def authkey(self) -> bytes:
        return self.link.authkey


_links: dict[bytes, Link] = {}
_links_lock = threading.Lock()
#: Every Link this process made and still references, current or replaced (a forked child disowns them).
_made: weakref.WeakSet[Link] = weakref.WeakSet()


class Link(Handler):
    """This process's connection to one owner, with its mapping cache."""

    def __init__(self, address: str, token: bytes, authkey: bytes) -> None:
        self.token = token
        self.authkey = bytes(authkey)
        self.address = address
        self.shut_down = False  # the owner is gone because its Manager was shut down (its process may live on)
        self.closed_here = False  # it is gone because this process closed the connection
        self.refused: str | None = None  # the owner said the descriptor was not its own
        self.failed: dict[int, str] = {}  # lease id -> why the owner refused an asynchronous claim
        # Guards the cache below and the recorder's journal (one lock per record, not two).
        self._lock = threading.Lock()
        self._mappings: dict[int, _backends.Mapping] = {}  # alloc id -> mapping
        self._events: dict[tuple[bytes, int], Any] = {}  # (event handle, device) -> opened event
        self._held: set[int] = set()  # lease ids claimed here and not yet released
        self._retired = False  # closed: by close(), or because the owner is gone and unused
        journal = create_writer()
        self.recorder = LeaseRecorder(
            self._lock, journal, self._unhold_locked, self._retire_if_unused, self._answer_unmap, address
        )
        try:
            self.client = _connect(address, authkey, self)
            try:
                self.send(Hello(os.getpid(), token, None if journal is None else journal.fd))
            except BaseException:
                self.client.channel.close()
                raise
        except BaseException:
            if journal is not None:
                journal.close()
            raise
        finally:
            if journal is not None:
                journal.close_fd()  # the owner has its own; the mapping stays
        self.recorder.start(self.send_quietly, lambda: self.gone is not None)
        self.client.start()

    @property
    def gone(self) -> str | None:
        """Why the owner is gone, or None while it is there."""
        return self.client.ended

    # -- requests -------------------------------------------------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        """Send a message of the lease protocol; a lost connection raises OwnerGoneError
        (DescriptorError if the owner refused this link)."""
        try:
            self.client.send(message)
        except (OSError, ValueError) as exc:
            raise self._lost() from exc

    def send_quietly(self, message: tuple[Any, ...]) -> None:
        """Send if the owner is still there; a gone owner is no error here (it learns nothing new)."""
        if self.gone is None:
            try:
                self.send(message)
            except OwnerGoneError:
                pass

    def request(self, kind: Callable[Concatenate[int, P], tuple[Any, ...]], *args: P.args, **kwargs: P.kwargs) -> Any:
        """A request to the owner (``kind(req, *args)``: ``LeaseVia``, ``Alloc``, ``Stats``,
        ``Trim``, ``ExportFd``), answered: its value, or an fd."""
        return self.answer(self.ask(kind, *args, **kwargs))

    def ask(self, kind: Callable[Concatenate[int, P], tuple[Any, ...]], *args: P.args, **kwargs: P.kwargs) -> Pending:
        """Send a request without waiting; :meth:`answer` waits for its reply. Requests are
        served in the order they were sent, so a later one may depend on it."""
        if self.refused is not None:
            raise DescriptorError(self.refused)
        if self.gone is not None:
            raise self.gone_error()
        try:
            return self.client.ask(kind, *args, **kwargs)
        except (OSError, ValueError) as exc:
            raise self._lost() from exc

    def _lost(self) -> DescriptorError | OwnerGoneError:
        """The error for a send that failed. An owner that refused this process (the
        descriptor named another Manager) says so and closes: a send can fail before
        the reader thread has read why."""
        self.client.join_reader(1.0)
        if self.refused is not None:
            return DescriptorError(self.refused)
        return self.gone_error()

    def answer(self, pending: Pending, timeout: float = REQUEST_TIMEOUT) -> Any:
        """The reply to a request made with :meth:`ask` (raises what the owner refused)."""
        try:
            reply = self.client.answer(pending, timeout)
        except TimeoutError:
            raise OwnerGoneError(f"the owner of this buffer did not answer within {timeout:g} s") from None
        if type(reply) is Ok:
            return reply.value
        if type(reply) is OkFd:
            return reply.fd
        if type(reply) is Err:
            raise DescriptorError(reply.message)
        if self.refused is not None:
            raise DescriptorError(self.refused)
        raise self.gone_error()

    # -- what the owner says unasked (the client's reader thread) -----------------------------
    @handles(Unmap)
    def _on_unmap(self, message: Unmap) -> None:
        self.recorder.unmap_later(message.alloc)  # the writer thread closes it: see LeaseRecorder

    @handles(ClaimFailed)
    def _on_claim_failed(self, message: ClaimFailed) -> None:
        self.failed[message.lease] = message.message

    @handles(Bye)
    def _on_bye(self, message: Bye) -> None:
        self.shut_down = True
        self.client.end(message.reason)
        self._retire_if_unused()

    @handles(Refused)
    def _on_refused(self, message: Refused) -> None:
        self.refused = message.message
        self.client.end(message.message)

    def on_close(self) -> None:
        """The connection ended: the owner is gone."""
        self._retire_if_unused()

    def gone_error(self) -> OwnerGoneError:
        """The error for a use of this owner's memory once it is gone, saying which way it went:
        its Manager was shut down (its process may well be running), this process closed the
        connection, or the owner's process exited or stopped answering."""
        if self.shut_down and self.gone == SHUT_BEFORE_CLAIM:
            return OwnerGoneError(
                "the owner of this buffer (a Manager, or a torch sender) was shut down before this process "
                "claimed the buffer it received: a shutdown (or a sender's exit) serves shares in flight for up "
                "to its release_timeout (Manager(release_timeout=...); a torch sender's: "
                "gpushare.torch.multiprocessing.set_release_timeout()), and this one was not claimed in time. "
                "Keep the owner running until its receivers have their buffers, or raise that bound"
            )
        if self.shut_down:
            return OwnerGoneError(
                "the Manager that owns this buffer was shut down: it shares no memory any more, and this "
                "buffer's may be freed (the process that made the Manager may still be running). Keep the "
                "Manager open (inside its 'with' block, before shutdown()) until workers are done with its buffers"
            )
        if self.closed_here:
            return OwnerGoneError(
                f"this process closed its connection to the owner of this buffer ({self.gone}); its memory "
                "may no longer be used here"
            )
        return OwnerGoneError(
            f"the process that owns this buffer is gone ({self.gone}); its memory may be freed. Keep the "
            "owner's process and its Manager running until workers are done with its buffers"
        )

    # -- attaching descriptors ------------------------------------------------------------
    def attach(self, desc: Descriptor) -> Memory:
        """Claim the descriptor's lease, map its memory (cached), return it (the caller makes the Buffer)."""
        backend = _backends.get(desc.backend)
        lease_id, alloc_id = desc.lease_id, desc.alloc_id
        with self._lock:
            if lease_id in self._held:
                raise DescriptorError(
                    f"lease {lease_id} is already held by a buffer in this process: a pickled buffer "
                    "can be unpickled once; pickle the buffer once per receiver"
                )
            mapping = self._mappings.get(alloc_id)
            if mapping is not None:
                mapping.refs += 1
                self._held.add(lease_id)
                # Claimed by a record in the journal, written under the lock already
                # held: the caller pays for a few bytes of shared memory, not a message.
                claimed = self.recorder.append_locked(CLAIM, lease_id)
                ask = self.recorder.may_be_dropped(lease_id)
        if mapping is not None:
            if ask:  # the owner may have dropped it unclaimed: it says so (and claims it, unread)
                self.confirm(lease_id, alloc_id)
            elif not claimed:  # behind the backlog, or the journal is full: the writer's
                self.recorder.defer(CLAIM, lease_id, alloc_id, True)
        else:
            mapping = self._first_arrival(backend, desc)
        event = None
        if desc.event:
            try:
                event = self._event(desc.event, mapping.device)
            except BaseException:
                self.recorder.note(RELEASE, lease_id, alloc_id)
                raise
        # Not released at exit by the Buffer (exit_release False): close_links() closes this
        # link then, and the owner drops every lease of a closed connection.
        return Memory(
            backend, mapping.ptr, desc.alloc_nbytes, mapping.device, desc.device_uuid, desc.owner_token,
            desc.address, alloc_id, desc.generation, desc.handle, mapping.native, _LeaseSource(self, lease_id),
            event, False,
        )  # fmt: skip

    def confirm(self, lease_id: int, alloc_id: int) -> None:
        """Claim ``lease_id`` (of the mapped ``alloc_id``) by a message the owner answers, after
        reading the journal record if one was written: for a lease it may have dropped unclaimed
        (``LeaseRecorder.may_be_dropped``). Refused, the lease is given back and the refusal raised."""
        try:
            self.answer(self.ask(Claim, lease_id, alloc_id))
        except BaseException:
            self.recorder.note(RELEASE, lease_id, alloc_id)
            raise

    def _first_arrival(self, backend: _backends.Backend, desc: Descriptor) -> _backends.Mapping:
        """Claim the lease and map its allocation, which is not mapped here yet.

        The owner answers the claim while the memory is being mapped: the open is
        the driver's slow part, and the round trip to the owner costs about as much
        (both are in the `first_share` benchmark scenario). The mapping is used only once the owner
        has accepted the claim, and from then on it counts this process among the
        allocation's mappers, so it frees nothing before this process unmaps. Until
        then a valid lease is what keeps the allocation from being freed or reused:
        the owner expires a lease only after ``lease_timeout`` unclaimed. A claim the
        owner refuses (a descriptor unpickled twice, or too late) closes the mapping
        unused and raises; a failed open reports that refusal when there is one. An
        fd-based open asks the owner for the fd after the claim, and the owner serves
        the two in that order.
        """
        lease_id, alloc_id = desc.lease_id, desc.alloc_id
        claim = self.ask(Claim, lease_id, alloc_id)
        try:
            # Opened without the lock: an fd-based open waits on the reader thread,
            # which takes that lock to answer the owner's unmap requests.
            opened = backend.open(
                desc.handle,
                desc.alloc_nbytes,
                desc.device_uuid,
                lambda: int(self.request(ExportFd, alloc_id)),
                desc.owner_token,
            )
        except BaseException as exc:
            try:
                self.answer(claim)  # a refusal explains a failed open best (the memory went)
            except (DescriptorError, OwnerGoneError) as refusal:
                raise refusal from exc
            self.recorder.note(RELEASE, lease_id, -1)  # claimed but never mapped: give it back
            raise
        try:
            self.answer(claim)
        except BaseException:
            backend.close(opened)
            raise
        with self._lock:
            self._held.add(lease_id)
            mapping = self._mappings.setdefault(alloc_id, opened)
            mapping.refs += 1
        if mapping is not opened:  # another thread mapped it first
            backend.close(opened)
        return mapping

    def _event(self, handle: bytes, device: int | None) -> Any:
        """A sharer's ready event (the owner's, or a re-sharing process's), opened once
        per process: each sharer records a few per device in turn."""
        assert device is not None
        key = (handle, device)
        event = self._events.get(key)
        if event is None:
            from .. import _cuda  # once per sharer's event: only CUDA buffers carry one

            event = _cuda.event_open(handle, device)
            with self._lock:
                event, duplicate = self._events.setdefault(key, event), event
            if duplicate is not event:  # another thread opened it first
                _cuda.event_destroy(duplicate, device)
        return event

    # -- the recorder's and the reader's callbacks -------------------------------------------
    def _unhold_locked(self, lease_id: int, alloc_id: int) -> None:
        """A released lease no longer keeps its mapping in use (before its record is written:
        an owner that read the release and asks this process to unmap must find it unused)."""
        self._held.discard(lease_id)
        mapping = self._mappings.get(alloc_id)
        if mapping is not None:
            mapping.refs -= 1
        if self.gone is not None and not self._held and not self._retired:
            self.recorder.request_retire()  # the last buffer of a gone owner (not here: maybe in gc)

    def _answer_unmap(self, alloc_id: int) -> None:
        """The writer thread: unmap ``alloc_id`` unless a buffer here uses it, and say which."""
        self.send_quietly(Unmapped(alloc_id, self._unmap(alloc_id)))

    def _unmap(self, alloc_id: int) -> bool:
        """The owner asks to unmap ``alloc_id``: done (True) unless a buffer here still uses it."""
        with self._lock:
            mapping = self._mappings.get(alloc_id)
            if mapping is None:
                return True
            if mapping.refs > 0:
                return False
            del self._mappings[alloc_id]
        try:
            _backends.get(mapping.backend).close(mapping)
        except Exception:
            log.exception("gpushare: closing a mapping failed")
        return True

    def _retire_if_unused(self) -> None:
        """The owner is gone: once no buffer here holds a lease of it, close this link.

        Its threads, socket, journal and cached mappings would otherwise stay
        for as long as this process lives: one set per dead owner, and on a
        GPU each mapping keeps the dead owner's device memory allocated.
        Buffers still held keep their mapping until they are released; the
        last release asks the writer thread to come back here.
        """
        with self._lock:
            if self.gone is None or self._held or self._retired:
                return
        with _links_lock:
            if _links.get(self.token) is self:
                del _links[self.token]
        self.close()

    # -- closing ----------------------------------------------------------------------
    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    def close(self) -> None:
        """Flush the records, close the connection, unmap everything."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
        self.recorder.close()  # records queued before go into the journal first
        if self.gone is None:
            self.closed_here = True
        # The owner reads the journal and drops this process's leases.
        self.client.close("this process's Manager shut down, or it is exiting")
        with self._lock:
            events, self._events = self._events, {}
            mappings = list(self._mappings.values())
            self._mappings.clear()
        if events:
            from .. import _cuda  # events were opened: the CUDA layer is loaded
        for (_, device), event in events.items():
            try:
                _cuda.event_destroy(event, device)
            except Exception:
                log.exception("gpushare: destroying an opened event failed")
        for mapping in mappings:
            try:
                _backends.get(mapping.backend).close(mapping)
            except Exception:
                pass
        try:  # what the backends keep per owner (an imported memory pool)
            _backends.forget(self.token)
        except Exception:
            log.exception("gpushare: dropping a closed link's backend state failed")


def _connect(address: str, authkey: bytes, link: Link) -> Client:
    """A client of the lease service at ``address`` whose handler is ``link`` (not reading yet)."""
    try:
        return Client(address, authkey, LEASE, link, "gpushare-link-reader")
    except AuthenticationError as exc:
        raise OwnerGoneError(
            "the owner of this buffer refused this process: authentication failed. Processes "
            "share buffers only with processes started from the Manager's process tree (same "
            "multiprocessing authkey)"
        ) from exc
    except (OSError, EOFError) as exc:
        raise OwnerGoneError(
            f"cannot reach the owner of this buffer at {address} ({exc}): the process that made it "
            "exited or shut its Manager down (a torch sender: exited) before this process claimed the "
            "buffer it received. A shutdown serves such in-flight shares for up to its release_timeout "
            "(Manager(release_timeout=...); a torch sender's: gpushare.torch.multiprocessing.set_release_timeout()); "
            "keep the owner running until its receivers have them, or raise that bound"
        ) from exc


def attach(desc: Descriptor) -> Memory:
    """This process's memory for a descriptor (the caller makes the Buffer)."""
    owner = owner_for(desc.owner_token)
    if owner is not None:
        return owner.attach_local(desc)
    return link_for(desc.address, desc.owner_token).attach(desc)


def arrival_parts(memory: Memory) -> tuple[Any, ...] | None:
    """What the C arrival (``gpushare._handoff.c``) needs of the link ``memory`` arrived
    over, to take the next lease on the same allocation as :meth:`Link.attach` does:
    ``(client, lock, held, mappings, mapping, recorder, link)``; None unless ``memory``
    was leased over a link that records in a journal and still maps it."""
    source = memory.source
    if type(source) is not _LeaseSource:
        return None
    link = source.link
    if not link.recorder.has_journal or link.gone is not None:
        return None
    mapping = link._mappings.get(memory.alloc_id)
    if mapping is None:
        return None
    return (link.client, link._lock, link._held, link._mappings, mapping, link.recorder, link)


def arrival_source() -> type:
    """The lease source of a buffer received over a link (the C arrival makes them)."""
    return _LeaseSource


#: ``LeaseRecorder.note(RELEASE, ...)`` in one call, ``release(link, lease_id, alloc_id)``: the
#: C arrival's (``gpushare._handoff.c``), once it is in use in this process.
_release: Callable[[Link, int, int], None] | None = None


def release_in_c(release: Callable[[Link, int, int], None]) -> None:
    """Record releases with ``release`` from now on (see ``_release``)."""
    global _release
    _release = release


def link_for(address: str, token: bytes, authkey: bytes | None = None) -> Link:
    """This process's link to the owner ``token`` (made on first use). ``authkey``
    defaults to the process authkey, which processes of the Manager's tree share;
    others (Ray workers) are given the owner's."""
    link = _links.get(token)
    if link is None or link.gone is not None:
        with _links_lock:
            link = _links.get(token)
            if link is None or link.gone is not None:
                key = bytes(current_process().authkey) if authkey is None else authkey
                link = Link(address, token, key)
                _links[token] = link
                _made.add(link)
                _seams.at_worker_exit(close_links)  # a worker's exit skips atexit
    return link


def links() -> list[Link]:
    """This process's open links (tests and statistics read them)."""
    return list(_links.values())


def link_stats() -> dict[str, Any]:
    """Per-process figures of the consumer side (opens, cached mappings)."""
    return {
        "owners": len(_links),
        "open_mappings": sum(link.open_mappings for link in _links.values()),
        "opens": _backends.opens(),
    }


def close_link(token: bytes) -> None:
    """Release every lease this process holds from one owner and close that connection."""
    with _links_lock:
        link = _links.pop(token, None)
    if link is not None:
        link.close()


def close_links() -> None:
    """Release every lease this process holds and close its connections (worker exit)."""
    with _links_lock:
        all_links = list(_links.values())
        _links.clear()
    for link in all_links:
        link.close()


atexit.register(close_links)


def _after_fork_in_child() -> None:
    # A forked child shares none of its parent's threads or sockets: it has no
    # links until it makes its own, and the ones it inherited record nothing.
    global _links_lock
    for link in list(_made):
        link.recorder.disown()
    _made.clear()
    _links.clear()
    _links_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
