"""Shared pieces of the chaos tests: the resources a run must give back.

Both the state machine (``test_chaos.py``) and the chaos run
(``chaos_run.py``) start many short-lived processes and kill some of them.
After a run nothing they made may be left: no process, no ``/dev/shm``
segment, no socket directory under the runtime (temporary) directory. The
names gpushare gives these carry the pid of the process that made them
(``/dev/shm/gpushare-<pid>-...``, ``<tmp>/gpushare-<service>-<pid>-...``),
so a leak is attributed to the process that made it even while other
test runs share the machine.
"""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

from gpushare._service import process_alive


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_segments(pids: Iterable[int]) -> list[str]:
    """The host backend's segments made by any of ``pids`` that still exist."""
    return sorted(p for pid in pids for p in glob.glob(f"/dev/shm/gpushare-{int(pid)}-*"))


def socket_dirs(pids: Iterable[int]) -> list[str]:
    """gpushare's socket directories (owner, ring, ...) made by any of ``pids`` that still exist."""
    root = tempfile.gettempdir()
    return sorted(p for pid in pids for p in glob.glob(os.path.join(root, f"gpushare-*-{int(pid)}-*")))


def alive(pids: Iterable[int]) -> list[int]:
    return sorted(pid for pid in pids if process_alive(pid, sentinel=False))


def leftovers(pids: Iterable[int]) -> dict[str, list]:
    """Everything the processes ``pids`` made that is still there (empty lists: nothing leaked)."""
    pids = list(pids)
    return {"processes": alive(pids), "shm": shm_segments(pids), "socket_dirs": socket_dirs(pids)}


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            return None
        time.sleep(interval)


def snapshot() -> dict[str, int]:
    """This process's own resource counts."""
    return {"fds": open_fds(), "threads": threading.active_count()}
