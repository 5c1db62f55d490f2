"""What both sides of the lifetime service share: the log, the constants, ready events.

:class:`_ReadyEvents` are the interprocess events a sharer records at every pickling of a
CUDA buffer (the owner's own, and ``_process_ready`` for buffers this process re-shares).
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from typing import Any

from .. import _cuda, _journal

log = logging.getLogger("gpushare")

LOCAL = 0  # holder id of leases claimed inside the owner's own process
_CLAIM, _RELEASE = _journal.CLAIM, _journal.RELEASE  # kinds of the consumer's lease records
_NUDGE = -1  # the consumer's writer: tell the owner to read the journal
REQUEST_TIMEOUT = 30.0
READY_EVENTS = 4  # interprocess ready events per device and process (see _ReadyEvents)


def _warn(message: str, category: type[Warning]) -> None:
    """Warn from any thread without letting a warnings filter kill that thread."""
    log.warning(message)
    try:
        warnings.warn(message, category, stacklevel=3)
    except Warning:
        pass


class _ReadyEvents:
    """Interprocess ready events of one process: a few per device, recorded in turn.

    A sharer records one on the legacy default stream (where torch's and
    CuPy's default work runs) each time it pickles a CUDA buffer, and the
    descriptor carries its handle; the receiver waits on it. Creating and
    recording cost about 2 us, but opening one in another process a third
    of a millisecond, so each process keeps ``READY_EVENTS`` per device and
    a receiver opens each once: after that, even the first share of a new
    allocation opens no event. A receiver that waits late may find its
    event recorded again by a later share: it then waits for more of the
    sharer's work, never for less.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[int, list[tuple[Any, bytes]]] = {}
        self._turn = itertools.count()

    def record(self, device: int | None) -> bytes:
        """Record the next event of ``device`` now; return its handle."""
        assert device is not None
        with self._lock:
            events = self._events.setdefault(device, [])
            if len(events) < READY_EVENTS:
                events.append(_cuda.event_create_ipc(device))
                event, handle = events[-1]
            else:
                event, handle = events[next(self._turn) % READY_EVENTS]
            _cuda.event_record(event, device)
        return handle

    def close(self) -> None:
        with self._lock:
            events, self._events = self._events, {}
        for device, pairs in events.items():
            for event, _ in pairs:
                try:
                    _cuda.event_destroy(event, device)
                except Exception:
                    log.exception("gpushare: destroying a ready event failed")


_process_ready = _ReadyEvents()  # for buffers this process re-shares (it owns none of them)
