"""The Manager's server process: its watchdog, and server-owned buffers.

A :class:`~gpushare.BufferManager` is a SyncManager, so ``start()`` spawns
a server process (the one that serves ``m.dict()``, ``m.Queue()`` and the
rest). gpushare runs :func:`server_init` there, before the server starts
serving, and adds two things.

Watchdog
--------
The stdlib server serves until it is told to shut down. If the process
that started it dies without doing so (SIGKILL, ``os._exit``, a crash), it
would serve forever, an orphan nobody can reach. The watchdog waits on the
parent's sentinel (or polls ``getppid()`` where there is none); when the
parent is gone it removes the parent's leftover socket directories (those
named for its pid whose socket no longer answers) and unlinks the host
segments the parent made (their names carry its pid; processes that map
one keep it until they unmap), and ends the server:

* ``owner="process"`` (the default): at once;
* ``owner="server"``: once no lease on the server's memory is held (or
  waiting to be claimed), so consumers keep their buffers for as long as
  they hold them, and not a moment longer.

Server-owned buffers (``Manager(owner="server")``)
--------------------------------------------------
The memory belongs to an :class:`~gpushare._lifetime._owner.Owner` that lives in
the server process, made on first use (:func:`owner_info`: a process-owned
Manager's server never loads the lifetime service at all). A client learns
the owner's address and token with one manager call, then talks to it like
any consumer of any owner, over its link: ``m.empty()`` is an ``Alloc``
request, answered with the descriptor of new memory under a lease for the
caller, which claims it. The caller's Buffer is a lease like any
consumer's, and the server keeps no reference of its own, so the memory
lives exactly as long as some process holds it, whether or not the process
that asked for it is still alive: a trainer can die, and inference workers
keep their weights.

The client names a CUDA device by UUID (ordinals differ between processes
with different ``CUDA_VISIBLE_DEVICES``). ``m.stats()`` and ``m.trim()``
are requests on the same link; ``m.shutdown()`` first closes the client's
own link to the server's owner (its buffers become unusable: the memory is
about to be freed), then asks the owner to shut down over a fresh link
(bounded wait for other processes' leases; its leak warnings come back and
are raised again in the client), then stops the server.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from multiprocessing import connection, current_process, parent_process

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["OWNER_MODES", "owner_info", "server_init", "shutdown_owner"]

log = logging.getLogger("gpushare")

OWNER_MODES = ("process", "server")
POLL = 0.2  # seconds between the watchdog's checks once the parent is gone

_mode = "process"
_options: dict[str, Any] = {}
_owner: Any = None  # owner="server": the server's Owner, made by the first owner_info()
_owner_lock = threading.Lock()


def server_init(mode: str, options: dict[str, Any], initializer: Any, initargs: Any) -> None:
    """Runs in the server process before it serves: remember the options, start the watchdog."""
    global _mode, _options
    _mode, _options = mode, dict(options)
    threading.Thread(target=_watch, name="gpushare-server-watchdog", daemon=True).start()
    atexit.register(_at_exit)
    if initializer is not None:
        initializer(*initargs)


def _watch() -> None:
    parent = parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is not None:
        try:
            connection.wait([sentinel])
        except OSError:
            pass
    else:
        while os.getppid() == parent_pid:
            time.sleep(POLL)
    if parent_pid is not None:
        # Its sockets close with its last thread, a little after the sentinel fires.
        from ._authsocket import remove_stale_sockets

        remove_stale_sockets(parent_pid, settle=5.0)
        # Its host segments: nobody else may unlink them, and consumers keep their mappings.
        from ._backends import host

        host.unlink_segments_of(parent_pid)
    if _mode == "server":
        owner = _owner
        while owner is not None and owner.stats()["leases"]:
            time.sleep(POLL)
        if owner is not None:
            owner.shutdown(0.0)
    log.info("gpushare: the process that started this Manager (pid %s) is gone; its server exits", parent_pid)
    os._exit(0)


def _at_exit() -> None:
    # The server stops (shutdown, or its client gone): the owner's socket goes with it.
    if _owner is not None:
        _owner.shutdown(0.0)


def owner_info() -> tuple[str, bytes]:
    """In the server: the address and token of its Owner, made on the first call (the
    manager typeid's callable; a client reads the value once)."""
    global _owner
    with _owner_lock:
        if _owner is None:
            from ._lifetime._owner import Owner

            _owner = Owner(authkey=bytes(current_process().authkey), **_options)
        return (_owner.address, _owner.token)


def shutdown_owner(address: str, token: bytes, timeout: float) -> list[str]:
    """In a client: ask the server's Owner to shut down, over a link of its own; return the
    text of the owner's leak warnings (the caller raises them again)."""
    from ._errors import OwnerGoneError
    from ._lifetime import close_link, link_for
    from ._lifetime._protocol import REQUEST_TIMEOUT, Shutdown

    close_link(token)  # this process's buffers go first: the memory is about to be freed
    try:
        link = link_for(address, token)
        messages = link.answer(link.ask(Shutdown, timeout), timeout + REQUEST_TIMEOUT)
    except OwnerGoneError:  # already gone (shut down by another client, or the server exited)
        messages = []
    finally:
        close_link(token)
    return list(messages)
