"""A consumer's lease records: claims and releases written to its journal without blocking.

Releases run inside the garbage collector, on any thread: :meth:`_Recorder._note` only
ever *tries* its lock (the link's map lock, which guards the journal too: one lock per
record instead of two), writes the record straight into the shared-memory journal
(:mod:`gpushare._journal`) when it can, and otherwise appends it to a backlog that the
writer thread (:meth:`_Recorder._write_loop`) moves into the journal in order, nudging the
owner (``drain``) when the journal fills. Without a journal the backlog goes as ``batch``
messages.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from .. import _journal
from .._errors import OwnerGoneError
from ._channel import _Channel
from ._common import _CLAIM, _NUDGE, _RELEASE, _RETIRE, REQUEST_TIMEOUT, log


class _Recorder(_Channel):
    """The lease journal's writer side: ``_note``, the backlog and the writer thread."""

    def _note(self, kind: int, lease_id: int, alloc_id: int) -> None:
        """Record a claim or a release of ``lease_id``. Never blocks.

        Runs in user code and inside the garbage collector, on any thread,
        possibly one that already holds the map lock: so it only ever *tries*
        it. The fast path accounts for a release and appends the record to
        the journal at once; anything else goes to the backlog, which the
        writer thread empties in order (a record is never written before one
        queued earlier).
        """
        if self._map_lock.acquire(blocking=False):
            try:
                if kind == _RELEASE:
                    self._unhold(lease_id, alloc_id)
                if self._append_locked(kind, lease_id):
                    return
            finally:
                self._map_lock.release()
            self._defer(kind, lease_id, alloc_id, True)
        else:
            self._defer(kind, lease_id, alloc_id, False)

    def _defer(self, kind: int, lease_id: int, alloc_id: int, accounted: bool) -> None:
        """Queue a record for the writer thread (behind the backlog, or the journal is
        full); ``accounted``: a release's ``_unhold`` was already done."""
        self._backlog.append((kind, lease_id, alloc_id, accounted))
        self._wake.put(1)

    def _append_locked(self, kind: int, lease_id: int) -> bool:
        """Map lock held (it also guards the journal). Write the record straight into the
        journal if nothing is queued before it and there is room; False if not."""
        journal = self._journal
        if journal is None or self._backlog or not journal.try_append(kind, lease_id):
            return False
        if journal.head - self._nudged_at >= _journal.NUDGE_AT and journal.unconsumed() >= _journal.NUDGE_AT:
            self._nudged_at = journal.head
            self._wake.put(_NUDGE)
        return True

    def _unhold(self, lease_id: int, alloc_id: int) -> None:
        """Map lock held. A released lease no longer keeps its mapping in use.

        Done before the release record is written: an owner that has read the
        release and asks this process to unmap must find the mapping unused.
        """
        self._held.discard(lease_id)
        mapping = self._mappings.get(alloc_id)
        if mapping is not None:
            mapping.refs -= 1
        if self.gone is not None and not self._held and not self._retired:
            self._wake.put(_RETIRE)  # the last buffer of a gone owner: close the link (not here: maybe in gc)

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
            if _RETIRE in signals:
                self._retire_if_unused()
            if self._journal is None:
                self._send_backlog()
                continue
            if _NUDGE in signals:
                self._send_quietly(("drain",))
            # Journal full: hold the backlog, nudge, retry, until it is written or the owner is gone.
            deadline = time.monotonic() + REQUEST_TIMEOUT
            while not self._write_backlog() and self.gone is None:
                self._send_quietly(("drain",))
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
        with self._map_lock:
            journal = self._journal
            if journal is None:  # closed: the owner learns the rest from the connection's end
                return True
            while self._backlog:
                if journal.full():
                    return False
                kind, lease_id, alloc_id, accounted = self._backlog[0]
                if kind == _RELEASE and not accounted:
                    self._unhold(lease_id, alloc_id)
                journal.append(kind, lease_id)
                self._backlog.popleft()
        return True

    def _send_backlog(self) -> None:
        """No journal: send the backlog as one ``batch`` message (claims, then releases)."""
        batch = []
        while self._backlog:
            batch.append(self._backlog.popleft())
        if not batch:
            return
        with self._map_lock:
            for kind, lease_id, alloc_id, accounted in batch:
                if kind == _RELEASE and not accounted:
                    self._unhold(lease_id, alloc_id)
        claims = [lease_id for kind, lease_id, _, _ in batch if kind == _CLAIM]
        releases = [lease_id for kind, lease_id, _, _ in batch if kind == _RELEASE]
        self._send_quietly(("batch", claims, releases))

    def _send_quietly(self, message: tuple[Any, ...]) -> None:
        if self.gone is None:
            try:
                self._send(message)
            except OwnerGoneError:
                pass
