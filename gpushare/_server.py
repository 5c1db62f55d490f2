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
The memory belongs to an :class:`~gpushare._lifetime.Owner` that lives in
the server process, made on first use. ``m.empty()`` in a client asks the
server (one manager call, :meth:`ServerBuffers.allocate`) to allocate and
to describe the memory with a lease for the caller, then claims that
lease: the caller's Buffer is a lease like any consumer's, and the server
keeps no reference of its own. So the memory lives exactly as long as
some process holds it, whether or not the process that asked for it is
still alive: a trainer can die, and inference workers keep their weights.

The client names a CUDA device by UUID (ordinals differ between processes
with different ``CUDA_VISIBLE_DEVICES``). ``m.stats()`` and ``m.trim()``
are manager calls; ``m.shutdown()`` first closes the client's own link to
the server's owner (its buffers become unusable: the memory is about to be
freed), then shuts the owner down (bounded wait for other processes'
leases, leak warnings re-raised in the client), then stops the server.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import socket
import stat
import tempfile
import threading
import time
import warnings
from multiprocessing import connection, current_process, parent_process
from typing import Any

from . import _backends
from ._backends import host
from ._buffer import Buffer, check_dtype, check_shape
from ._errors import LeakWarning
from ._lifetime import Owner
from ._reduction import descriptor_of

__all__ = ["ServerBuffers", "remove_stale_sockets", "server_buffers", "server_init"]

log = logging.getLogger("gpushare")

OWNER_MODES = ("process", "server")
POLL = 0.2  # seconds between the watchdog's checks once the parent is gone

_mode = "process"
_options: dict[str, Any] = {}
_buffers: ServerBuffers | None = None
_buffers_lock = threading.Lock()


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
        remove_stale_sockets(parent_pid, settle=5.0)
        # Its host segments: nobody else may unlink them, and consumers keep their mappings.
        host.unlink_segments_of(parent_pid)
    if _mode == "server":
        owner = _buffers.owner if _buffers is not None else None
        while owner is not None and owner.stats()["leases"]:
            time.sleep(POLL)
        if owner is not None:
            owner.shutdown(0.0)
    log.info("gpushare: the process that started this Manager (pid %s) is gone; its server exits", parent_pid)
    os._exit(0)


def _at_exit() -> None:
    # The server stops (shutdown, or its client gone): the owner's socket goes with it.
    if _buffers is not None:
        _buffers.owner.shutdown(0.0)


def remove_stale_sockets(pid: int, settle: float = 0.0) -> list[str]:
    """Remove socket directories left by process ``pid`` whose socket no longer answers.

    Only this user's directories made by gpushare's listeners (``gpushare-*-<pid>-*``
    in the temporary directory, holding nothing but ``*.sock``) are touched. A
    socket that still answers is looked at again for up to ``settle`` seconds
    (a dying process closes its files last). Returns the directories removed.
    """
    removed = []
    deadline = time.monotonic() + settle
    pending = glob.glob(os.path.join(tempfile.gettempdir(), f"gpushare-*-{int(pid)}-*"))
    while pending:
        answering = []
        for path in pending:
            try:
                info = os.lstat(path)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    continue
                entries = os.listdir(path)
                if any(not name.endswith(".sock") for name in entries):
                    continue
                if any(_answers(os.path.join(path, name)) for name in entries):
                    answering.append(path)
                    continue
                for name in entries:
                    os.unlink(os.path.join(path, name))
                os.rmdir(path)
                removed.append(path)
            except OSError:
                continue
        if not answering or time.monotonic() >= deadline:
            break
        pending = answering
        time.sleep(0.02)
    return removed


def _answers(address: str) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(1.0)
        sock.connect(address)
        return True
    except OSError:
        return False
    finally:
        sock.close()


class ServerBuffers:
    """The server's side of ``owner="server"``: reached through a manager proxy."""

    def __init__(self) -> None:
        options = dict(_options)
        self.owner = Owner(authkey=bytes(current_process().authkey), **options)

    def allocate(
        self, shape: tuple[int, ...], dtype: str, uuid: bytes | None, backend: str, nbytes: int, label: str
    ) -> bytes:
        """Allocate; return the descriptor of a lease for the caller (who claims it)."""
        dims = check_shape(shape)
        dt = check_dtype(dtype)
        chosen = _backends.get(backend)
        ordinal = None
        if uuid is not None:
            from . import _cuda

            ordinal = _cuda.ordinal_from_uuid(uuid)
            chosen.check_device(ordinal)
        buf = Buffer(self.owner.allocate(chosen, nbytes, ordinal, label), 0, dims, dt)
        try:
            return descriptor_of(buf).to_bytes()
        finally:
            buf.release()  # the caller's lease keeps the memory; the server holds no reference

    def token(self) -> bytes:
        return self.owner.token

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        return self.owner.stats()

    def trim(self) -> int:
        return self.owner.trim()

    def shutdown(self, timeout: float | None) -> list[str]:
        """Shut the owner down; return the text of any leak warning, for the client to raise."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LeakWarning)
            self.owner.shutdown(timeout)
        return [str(w.message) for w in caught if issubclass(w.category, LeakWarning)]


def server_buffers() -> ServerBuffers:
    """The server's one ServerBuffers (the manager typeid's callable)."""
    global _buffers
    with _buffers_lock:
        if _buffers is None:
            _buffers = ServerBuffers()
        return _buffers
