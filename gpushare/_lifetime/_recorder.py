"""A consumer's lease records: claims and releases written to its journal without blocking.

Releases run inside the garbage collector, on any thread: :meth:`LeaseRecorder.note`
only ever *tries* its lock (the link's lock, which guards the journal too: one
lock per record instead of two), writes the record straight into the
shared-memory journal (:mod:`gpushare._journal`) when it can, and otherwise
appends it to a backlog that the writer thread moves into the journal in
order, nudging the owner (``Drain``) when the journal fills. Without a
journal the backlog goes as ``Batch`` messages.

A release is *accounted* in the link (the lease no longer holds its mapping:
``unhold``) before its record is written, so an owner that has read the
release and asks this process to unmap finds the mapping unused.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _journal
from ._protocol import CLAIM, NUDGE, RELEASE, REQUEST_TIMEOUT, RETIRE, Batch, Drain, log

__all__ = ["LeaseRecorder"]

_DRAIN = Drain()


class LeaseRecorder:
    """The lease journal's writer side: ``note``, the backlog and the writer thread."""

    def __init__(
        self,
        lock: threading.Lock,
        journal: _journal.JournalWriter | None,
        unhold: Callable[[int, int], None],
        retire: Callable[[], None],
        address: str,
    ) -> None:
        self._lock = lock  # the link's: guards the journal, the backlog's order and unhold
        self._journal = journal
        self._unhold = unhold  # (lease, alloc), lock held: the link stops counting the lease
        self._retire = retire  # the link closes itself if the owner is gone and nothing uses it
        self._address = address
        # Records not yet in the journal, in order: (CLAIM | RELEASE, lease, alloc, accounted).
        self._backlog: collections.deque[tuple[int, int, int, bool]] = collections.deque()
        self._nudged_at = 0  # journal head when the owner was last nudged
        # Wakes the writer: 1 (backlog), NUDGE, RETIRE, or None (stop). SimpleQueue.put is
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
        if journal.head - self._nudged_at >= _journal.NUDGE_AT and journal.unconsumed() >= _journal.NUDGE_AT:
            self._nudged_at = journal.head
            self._wake.put(NUDGE)
        return True

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
                time.sleep(0.001)

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

    def backlog(self) -> int:
        """Records still waiting for the writer thread."""
        return len(self._backlog)
