"""The Manager's server process: its watchdog, and server-owned buffers.

:func:`server_init` runs in the server before it serves.

- Watchdog: when the process that started the server dies without shutting it down, it
  removes that process's leftovers and ends the server (at once, or with ``owner="server"``
  once no lease on its memory is held).
- ``owner="server"``: the server's Owner, made on first use (:func:`owner_info`), allocates for
  clients by ``Alloc`` requests; each client Buffer is a lease, and the server keeps no reference.
- Retire: a server-owned Manager collected, or left open at its process's exit, asks its server
  to exit once no lease is held (:func:`retire`, called by :func:`ask_to_retire`).
Protocol: dev/design-notes.md, "Who owns the memory".
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

__all__ = ["OWNER_MODES", "ask_to_retire", "owner_info", "retire", "server_init", "shutdown_owner"]

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
        from ._service import remove_stale_sockets

        remove_stale_sockets(parent_pid, settle=5.0)
        # Its host segments: nobody else may unlink them, and consumers keep their mappings.
        from ._backends import host

        host.unlink_segments_of(parent_pid)
    _exit_once_idle(f"the process that started this Manager (pid {parent_pid}) is gone")


def _exit_once_idle(reason: str) -> None:
    """End the server: with owner="server", once no lease on its memory is held or waiting
    to be claimed."""
    if _mode == "server":
        owner = _owner
        while owner is not None and owner.stats()["leases"]:
            time.sleep(POLL)
        if owner is not None:
            owner.shutdown(0.0)
    log.info("gpushare: %s; its server exits", reason)
    os._exit(0)


def retire() -> None:
    """In the server (a manager call): the client that started it let go of its server-owned
    Manager (collected, or its process exiting); the server exits once its memory is free."""
    reason = "the process that started this Manager let go of it"
    threading.Thread(target=_exit_once_idle, args=(reason,), name="gpushare-server-retire", daemon=True).start()


def _at_exit() -> None:
    # The server stops (shutdown, or its client gone): the owner's socket goes with it.
    if _owner is not None:
        _owner.shutdown(0.0)


def owner_info() -> Any:
    """In the server: where its Owner listens, an :class:`~gpushare._lifetime._protocol.OwnerAddress`;
    the Owner is made on the first call (the manager typeid's callable; a client reads the
    value once)."""
    global _owner
    from ._lifetime._protocol import OwnerAddress

    with _owner_lock:
        if _owner is None:
            from ._lifetime._owner import Owner

            _owner = Owner(authkey=bytes(current_process().authkey), **_options)
        return OwnerAddress(_owner.address, _owner.token)


def shutdown_owner(where: Any, timeout: float) -> list[str]:
    """In a client: ask the server's Owner (``where``, an ``OwnerAddress``) to shut down, over a
    link of its own; return the text of the owner's leak warnings (the caller raises them again)."""
    from ._errors import OwnerGoneError
    from ._lifetime import close_link, link_for
    from ._lifetime._protocol import REQUEST_TIMEOUT, Shutdown

    close_link(where.token)  # this process's buffers go first: the memory is about to be freed
    try:
        link = link_for(where.address, where.token)
        messages = link.answer(link.ask(Shutdown, timeout), timeout + REQUEST_TIMEOUT)
    except OwnerGoneError:  # already gone (shut down by another client, or the server exited)
        messages = []
    finally:
        close_link(where.token)
    return list(messages)


def ask_to_retire(address: Any, authkey: bytes, client: Any) -> bool:
    """In the client that started the server: call :func:`retire` there (a manager call on a
    connection of its own, made without the Manager, which is being collected). False when
    the server refused the call: the caller then shuts it down instead."""
    from multiprocessing import managers

    try:
        conn = client(address, authkey=authkey)
    except OSError:  # the server is gone already
        return True
    try:
        ident, _ = managers.dispatch(conn, None, "create", ("_gpushare_retire",), {})  # type: ignore[attr-defined]
        managers.dispatch(conn, None, "decref", (ident,))  # type: ignore[attr-defined]
    except (OSError, EOFError):  # the server, with nothing held, exited at once
        pass
    except Exception as exc:  # a RemoteError: the server could not take the call
        log.warning("gpushare: the Manager's server did not take the request to retire (%s); stopping it", exc)
        return False
    finally:
        conn.close()
    return True
