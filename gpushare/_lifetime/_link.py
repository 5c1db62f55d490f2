"""The consumer side: one :class:`Link` per owner per process, and :func:`attach`.

A Link is its parts stacked: the channel to the owner (:mod:`._channel`) and the lease
recorder (:mod:`._recorder`); this module adds the connection's set-up (``hello`` and the
journal's fd), attaching a descriptor (claim, map once and cache, open the ready event
once) and closing. :func:`attach` rebuilds a descriptor's memory in this process, through
the owner itself when this process is the owner.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import queue
import socket
import threading
from multiprocessing import AuthenticationError, current_process, reduction
from typing import Any

from .. import _backends, _cuda, _journal
from .._descriptor import Descriptor
from .._errors import DescriptorError, OwnerGoneError
from .._memory import Memory
from .._service import connect, shutdown_socket
from ._common import _CLAIM, _RELEASE, _process_ready, log
from ._owner import owner_for
from ._recorder import _Recorder


class _LeaseSource:
    """A lease claimed by this (non-owner) process over its link."""

    __slots__ = ("lease_id", "link")

    def __init__(self, link: Link, lease_id: int) -> None:
        self.link = link
        self.lease_id = lease_id

    def drop(self, memory: Memory) -> None:
        self.link._note(_RELEASE, self.lease_id, memory.alloc_id)

    def share(self, memory: Memory) -> tuple[int, bytes]:
        """Re-share a received buffer (A -> B -> C): a new lease from the owner, and a
        ready event recorded here, after this process's own work on the buffer (and,
        if this process never waited for the producer, after the producer's too)."""
        lease_id = int(self.link.request("lease", memory.alloc_id, memory.generation, self.lease_id))
        if memory.device is None:
            return lease_id, b""
        memory.order_stream(0)  # the legacy default stream waits for the producer's ready event
        return lease_id, _process_ready.record(memory.device)

    def check(self, memory: Memory) -> None:
        refused = self.link._failed.get(self.lease_id)
        if refused is not None:
            raise DescriptorError(f"the owner refused this buffer's lease: {refused}")
        if self.link.gone is not None:
            raise OwnerGoneError(
                f"the process that owns this buffer is gone ({self.link.gone}); its memory may be freed. "
                "Keep the owner's Manager open until workers are done with its buffers"
            )


_links: dict[bytes, Link] = {}
_links_lock = threading.Lock()


class Link(_Recorder):
    """This process's connection to one owner, with its mapping cache."""

    def __init__(self, address: str, token: bytes, authkey: bytes) -> None:
        self.token = token
        self.authkey = bytes(authkey)
        self._address = address
        self.gone: str | None = None
        self.refused: str | None = None  # the owner said the descriptor was not its own
        self._send_lock = threading.Lock()
        self._map_lock = threading.Lock()
        self._mappings: dict[int, _backends.Mapping] = {}
        self._events: dict[tuple[bytes, int], Any] = {}  # (event handle, device) -> opened event
        self._failed: dict[int, str] = {}  # lease id -> why the owner refused an asynchronous claim
        self._held: set[int] = set()  # lease ids claimed by this process and not yet released
        self._waiting: dict[int, list[Any]] = {}
        self._wait_lock = threading.Lock()
        self._reqs = itertools.count(1)
        # Lease records (see _journal; the map lock guards it too): written straight
        # into the journal when that can be done without blocking, else queued here,
        # in order, for the writer thread: (_CLAIM | _RELEASE, lease, alloc, accounted).
        self._journal = _journal.create_writer()
        self._backlog: collections.deque[tuple[int, int, int, bool]] = collections.deque()
        self._nudged_at = 0  # journal head when the owner was last nudged
        # Wakes the writer: 1 (backlog), _NUDGE, or None (stop). SimpleQueue.put is
        # safe inside the garbage collector, where releases may run.
        self._wake: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._retired = False  # closed: by close(), or because the owner is gone and unused
        try:
            self.conn = connect(address, authkey)
        except AuthenticationError as exc:
            raise OwnerGoneError(
                "the owner of this buffer refused this process: authentication failed. Processes "
                "share buffers only with processes started from the Manager's process tree (same "
                "multiprocessing authkey)"
            ) from exc
        except (OSError, EOFError) as exc:
            raise OwnerGoneError(
                f"cannot reach the owner of this buffer at {address} ({exc}): the process that made it "
                "exited or shut its Manager down"
            ) from exc
        self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self._send(("hello", os.getpid(), token, self._journal is not None))
        if self._journal is not None:
            assert self._journal.fd is not None
            try:
                reduction.sendfds(self._sock, [self._journal.fd])
            except OSError as exc:
                self._mark_gone(f"connection lost: {exc}")
                raise OwnerGoneError(f"cannot reach the owner of this buffer ({exc})") from exc
            finally:
                self._journal.close_fd()
        self._reader = threading.Thread(target=self._read_loop, name="gpushare-link-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="gpushare-link-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def attach(self, desc: Descriptor) -> Memory:
        """Claim the descriptor's lease, map its memory (cached), return it (the caller makes the Buffer).

        Steady state (the allocation is already mapped here, so the owner
        already counts this process among its mappers and cannot free it
        under us) costs one message and no wait: the claim is sent and the
        owner answers only if it refuses it, which marks the buffer bad.
        A first arrival maps the memory while the owner answers its claim, and
        uses the mapping only once the claim is accepted (:meth:`_first_arrival`).
        """
        backend = _backends.get(desc.backend)
        lease_id, alloc_id = desc.lease_id, desc.alloc_id
        with self._map_lock:
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
                claimed = self._append_locked(_CLAIM, lease_id)
        if mapping is not None:
            if not claimed:  # behind the backlog, or the journal is full: the writer's
                self._defer(_CLAIM, lease_id, alloc_id, True)
        else:
            mapping = self._first_arrival(backend, desc)
        event = None
        if desc.event:
            try:
                event = self._event(desc.event, mapping.device)
            except BaseException:
                self._note(_RELEASE, lease_id, alloc_id)
                raise
        # Positionally (see Memory.__init__ for the order): one per arrival. Not released
        # at exit by the Buffer: close_links() closes this link then, and the owner drops
        # every lease of a closed connection.
        return Memory(
            backend,
            mapping.ptr,
            desc.alloc_nbytes,
            mapping.device,
            desc.device_uuid,
            desc.owner_token,
            desc.address,
            alloc_id,
            desc.generation,
            desc.handle,
            mapping.native,  # native
            _LeaseSource(self, lease_id),  # source
            event,
            False,  # exit_release
        )

    def _first_arrival(self, backend: _backends.Backend, desc: Descriptor) -> _backends.Mapping:
        """Claim the lease and map its allocation, which is not mapped here yet.

        The owner answers the claim while the memory is being mapped: the open is
        the driver's slow part, and the round trip to the owner costs about as much
        (0.15-0.2 ms each on an H100 host). The mapping is used only once the owner
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
        claim = self.ask("claim", lease_id, alloc_id)
        try:
            # Opened without the map lock: an fd-based open waits on the reader
            # thread, which takes that lock to answer the owner's unmap requests.
            opened = backend.open(
                desc.handle,
                desc.alloc_nbytes,
                desc.device_uuid,
                lambda: int(self.request("fd", alloc_id)),
                desc.owner_token,
            )
        except BaseException as exc:
            try:
                self.answer(claim)  # a refusal explains a failed open best (the memory went)
            except (DescriptorError, OwnerGoneError) as refusal:
                raise refusal from exc
            self._note(_RELEASE, lease_id, -1)  # claimed but never mapped: give it back
            raise
        try:
            self.answer(claim)
        except BaseException:
            backend.close(opened)
            raise
        with self._map_lock:
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
            event = _cuda.event_open(handle, device)
            with self._map_lock:
                event, duplicate = self._events.setdefault(key, event), event
            if duplicate is not event:  # another thread opened it first
                _cuda.event_destroy(duplicate, device)
        return event

    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    def _retire_if_unused(self) -> None:
        """The owner is gone: once no buffer here holds a lease of it, close this link.

        Its threads, socket, journal and cached mappings would otherwise stay
        for as long as this process lives: one set per dead owner, and on a
        GPU each mapping keeps the dead owner's device memory allocated.
        Buffers still held keep their mapping until they are released; the
        last release asks the writer thread to come back here.
        """
        with self._map_lock:
            if self.gone is None or self._held or self._retired:
                return
        with _links_lock:
            if _links.get(self.token) is self:
                del _links[self.token]
        self.close()

    def close(self) -> None:
        """Flush releases, close the connection, unmap everything."""
        with self._map_lock:
            if self._retired:
                return
            self._retired = True
        self._wake.put(None)
        if threading.current_thread() is not self._writer:  # the writer may retire the link itself
            self._writer.join(timeout=5.0)
        self._mark_gone("this process closed its connection to the owner (Manager shut down, or exiting)")
        try:
            # Shut down before closing: the reader thread is blocked reading this
            # socket, and a close alone would neither wake it nor send EOF.
            shutdown_socket(self.conn.fileno())
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5.0)
        try:
            self.conn.close()
            self._sock.close()
        except OSError:
            pass
        with self._map_lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()
        with self._map_lock:
            events, self._events = self._events, {}
        for (_, device), event in events.items():
            try:
                _cuda.event_destroy(event, device)
            except Exception:
                log.exception("gpushare: destroying an opened event failed")
        with self._map_lock:
            mappings = list(self._mappings.values())
            self._mappings.clear()
        for mapping in mappings:
            try:
                _backends.get(mapping.backend).close(mapping)
            except Exception:
                pass


def attach(desc: Descriptor) -> Memory:
    """This process's memory for a descriptor (``_reduction.rebuild_buffer`` makes the Buffer)."""
    owner = owner_for(desc.owner_token)
    if owner is not None:
        return owner.attach_local(desc)
    return link_for(desc.address, desc.owner_token).attach(desc)


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
    return link


def link_stats() -> dict[str, Any]:
    """Per-process figures of the consumer side (opens, cached mappings)."""
    return {
        "owners": len(_links),
        "open_mappings": sum(link.open_mappings for link in _links.values()),
        "opens": {name: _backends.get(name).opens for name in _backends._instances},
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
        links = list(_links.values())
        _links.clear()
    for link in links:
        link.close()


atexit.register(close_links)


def _after_fork_in_child() -> None:
    # A forked child shares none of its parent's threads or sockets: it has no
    # links until it makes its own.
    global _links_lock
    _links.clear()
    _links_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
