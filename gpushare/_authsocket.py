"""Authenticated Unix-socket services: the one transport of gpushare's control plane.

Both the lifetime service (``_lifetime._owner.Owner``) and the fan-out ring
(``_fanout``) listen on an AF_UNIX socket in a private temporary directory
(mode 0600), accept in a thread, and hand each connection to a handler
thread. Every connection starts with multiprocessing's HMAC challenge in
both directions, with the process authkey, before anything is unpickled:
a process outside the Manager's process tree cannot connect. The typed
messages spoken on these connections are :mod:`gpushare._service`'s.

Each listener's directory is ``gpushare-<name>-<pid>-<random>`` in the
temporary directory. A process that is SIGKILLed cannot remove its own, so
the first listener of every process sweeps the directories of processes
that are gone and whose sockets no longer answer (:func:`sweep_dead`); the
Manager's server does the same for its parent as soon as it dies
(:func:`remove_stale_sockets`).

multiprocessing's ``Connection`` reads with blocking ``os.read`` and has no
timeout of its own, so the handshake runs with SO_RCVTIMEO/SO_SNDTIMEO set
(a stuck or silent peer raises instead of hanging a thread), and the
timeouts are lifted once the peer is known.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing import connection, parent_process

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "UnixListener",
    "accept",
    "connect",
    "process_alive",
    "remove_stale_sockets",
    "shutdown_socket",
    "socket_timeouts",
    "sweep_dead",
]

HANDSHAKE_TIMEOUT = 10.0


def process_alive(pid: int, *, sentinel: bool = True) -> bool:
    """Whether process ``pid`` still runs. A zombie counts as gone: it has closed
    every file and socket it had, which is what a peer waits for.

    For this process's parent the answer comes from multiprocessing's sentinel
    (cheap, but it reports the parent gone as soon as it *starts* closing its
    files); ``sentinel=False`` asks the kernel instead.
    """
    parent = parent_process()
    if sentinel and parent is not None and parent.pid == pid:
        return parent.is_alive()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def socket_timeouts(fd: int, recv: float, send: float) -> None:
    """Bound blocking reads and writes on ``fd`` (0: unbounded) without making it non-blocking.

    A read or write that times out raises BlockingIOError (an OSError).
    """
    sock = socket.socket(fileno=os.dup(fd))
    try:
        for option, seconds in ((socket.SO_RCVTIMEO, recv), (socket.SO_SNDTIMEO, send)):
            whole = int(seconds)
            sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
    finally:
        sock.close()


def shutdown_socket(fd: int) -> None:
    """Shut a socket down both ways, so a thread blocked reading it returns (EOF)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def _authenticate(sock: socket.socket, authkey: bytes, timeout: float, *, server: bool) -> connection.Connection:
    """HMAC challenge both ways (the server challenges first), bounded by ``timeout``."""
    conn = connection.Connection(sock.detach())
    steps = (connection.deliver_challenge, connection.answer_challenge)
    try:
        socket_timeouts(conn.fileno(), timeout, timeout)
        for step in steps if server else steps[::-1]:
            step(conn, authkey)
        socket_timeouts(conn.fileno(), 0, 0)
    except BaseException:
        conn.close()
        raise
    return conn


def accept(sock: socket.socket, authkey: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> connection.Connection:
    """Server side: authenticate an accepted socket both ways (closed on error)."""
    return _authenticate(sock, authkey, timeout, server=True)


def connect(address: str, authkey: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> connection.Connection:
    """Client side: connect and authenticate both ways, each step bounded by ``timeout``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return _authenticate(sock, authkey, timeout, server=False)


def remove_stale_sockets(pid: int, settle: float = 0.0) -> list[str]:
    """Remove socket directories left by process ``pid`` whose socket no longer answers.

    Only this user's directories made by gpushare's listeners (``gpushare-*-<pid>-*``
    in the temporary directory, holding nothing but ``*.sock``) are touched. A
    socket that still answers is looked at again for up to ``settle`` seconds
    (a dying process closes its files last). Returns the directories removed.
    """
    import glob
    import tempfile

    return _remove_stale(glob.glob(os.path.join(tempfile.gettempdir(), f"gpushare-*-{int(pid)}-*")), settle)


def _remove_stale(pending: list[str], settle: float = 0.0) -> list[str]:
    """:func:`remove_stale_sockets` for directories already found."""
    import stat
    import time

    removed = []
    deadline = time.monotonic() + settle
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
    except TimeoutError:  # a listener too busy to accept in time is still there
        return True
    except OSError:
        return False
    finally:
        sock.close()


_swept = [False]  # this process has swept once (see sweep_dead)
_sweep_lock = threading.Lock()


def sweep_dead(limit: int = 256) -> list[str]:
    """Once per process: remove the socket directories of gpushare processes that are gone.

    A directory is removed only when its pid (from its name) is not a running
    process here *and* none of its sockets answers, and it holds nothing but
    sockets and belongs to this user (:func:`remove_stale_sockets`): a process
    of another PID namespace sharing this temporary directory still answers.
    At most ``limit`` pids are looked at. Returns the directories removed.
    """
    with _sweep_lock:
        if _swept[0]:
            return []
        _swept[0] = True
    import tempfile

    by_pid: dict[int, list[str]] = {}  # one listing of the directory: its paths, by the pid in their names
    try:
        with os.scandir(tempfile.gettempdir()) as entries:
            for entry in entries:
                parts = entry.name.split("-")
                if len(parts) >= 4 and parts[0] == "gpushare" and parts[2].isdigit():
                    by_pid.setdefault(int(parts[2]), []).append(entry.path)
    except OSError:
        return []
    by_pid.pop(os.getpid(), None)
    removed: list[str] = []
    for pid in sorted(by_pid)[:limit]:
        if not process_alive(pid, sentinel=False):
            removed += _remove_stale(by_pid[pid])
    return removed


class UnixListener:
    """A listening AF_UNIX socket in a private directory; each accepted socket goes
    to ``handler(sock)`` on a daemon thread of its own."""

    def __init__(self, name: str, handler: Callable[[socket.socket], None], backlog: int = 128) -> None:
        import tempfile  # here: importing it costs a few ms that a process with no service never pays

        sweep_dead()  # what killed processes left behind, once per process
        # The pid in the name lets the Manager's server, or any later process, clean up after a killed owner.
        self._dir = tempfile.mkdtemp(prefix=f"gpushare-{name}-{os.getpid()}-")
        self.address = os.path.join(self._dir, f"{name}.sock")
        self._name = name
        self._handler = handler
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        os.chmod(self.address, 0o600)
        self._sock.listen(backlog)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"gpushare-{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.2)
                if not ready:
                    continue
                sock, _ = self._sock.accept()
            except (OSError, ValueError):  # closed under us
                return
            name = f"gpushare-{self._name}-peer"
            threading.Thread(target=self._handler, args=(sock,), name=name, daemon=True).start()

    def close(self) -> None:
        """Stop accepting and remove the socket and its directory. Idempotent."""
        self._stop.set()
        self._sock.close()
        for remove, path in ((os.unlink, self.address), (os.rmdir, self._dir)):
            try:
                remove(path)
            except OSError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
