"""Ready events: how a receiver of a CUDA buffer waits for the sharer's work on it.

A sharer (the owner, or a process re-sharing a buffer it received) records
one interprocess event on its legacy default stream -- where torch's and
CuPy's default work runs -- each time it pickles a CUDA buffer, and the
descriptor carries the event's 64-byte handle; the receiver orders its use
after that event. Creating and recording one is cheap; opening one in
another process costs far more (more than a steady handoff), so each
process keeps :data:`READY_EVENTS` per device and records them in turn,
and a receiver opens each handle once: after the first few handoffs even
a new allocation arrives with no event to open (the `handoff_fresh`
benchmark scenario hands a new allocation every time). A receiver that waits late may find its
event recorded again by a later share: it then waits for more of the
sharer's work, never for less. Nothing is recorded when the stream is idle
(every piece of work queued before is finished): the descriptor then
carries no event and the receiver waits for nothing.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from .. import _cuda
from ._protocol import log

__all__ = ["READY_EVENTS", "ReadyEvents", "process_ready"]

#: Interprocess ready events per device and process.
READY_EVENTS = 4


class ReadyEvents:
    """The ready events of one sharer: a few per device, recorded in turn."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[int, list[tuple[Any, bytes]]] = {}
        self._turn = itertools.count()

    def record(self, device: int | None, stream: int = 0) -> bytes:
        """Record the next event of ``device`` on ``stream`` (0: the legacy default stream)
        now and return its handle; b"" when that stream is idle (the receiver then has
        nothing to wait for)."""
        assert device is not None
        if _cuda.stream_idle(device, stream):
            return b""
        with self._lock:
            events = self._events.setdefault(device, [])
            if len(events) < READY_EVENTS:
                events.append(_cuda.event_create_ipc(device))
                event, handle = events[-1]
            else:
                event, handle = events[next(self._turn) % READY_EVENTS]
            _cuda.event_record(event, device, stream)
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


#: This process's events for the buffers it re-shares (it owns none of them).
process_ready = ReadyEvents()
