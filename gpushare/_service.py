"""Authenticated Unix sockets, and the typed messages on them: the one socket layer of gpushare's services.

**Sockets.** A service (the lease service, a fan-out's registry) listens on an AF_UNIX
socket in a private temporary directory (mode 0600), accepts on a thread, and serves each
connection on a thread of its own. Every connection starts with multiprocessing's HMAC
challenge in both directions, with the process authkey, before anything is unpickled: a
process outside the Manager's process tree cannot connect. The handshake runs with
SO_RCVTIMEO/SO_SNDTIMEO set (multiprocessing's ``Connection`` has no timeout of its own),
lifted once the peer is known. A listener's directory is ``gpushare-<name>-<pid>-<random>``;
a SIGKILLed process cannot remove its own, so the first listener of every process sweeps
those of processes that are gone and whose sockets no longer answer (:func:`sweep_dead`),
and the Manager's server does the same for its parent as soon as it dies
(:func:`remove_stale_sockets`).

**Messages.** A service declares its messages as one :class:`Protocol`: NamedTuple classes,
split by direction (what a client sends, what a server sends). On the wire a message is the
tuple ``(code, *fields)`` (its code: its place in its direction's list), pickled, in
multiprocessing's Connection framing, on an authenticated connection. Fields named by
:func:`carries_fds` travel by SCM_RIGHTS right after the frame, which says which of them
are present.

* :class:`Channel` -- one connection speaking one protocol, from one side.
* :class:`Handler` -- what an end does with a connection's messages: ``on_connect``,
  one method per message type (:func:`handles`; dispatch is a dict by type), ``on_close``.
* :class:`Server` -- listens, authenticates, and serves each connection with a Handler of
  its own on a thread of its own.
* :class:`Client` -- the connecting end: requests answered by :class:`Ok`, :class:`OkFd`
  or :class:`Err`, and a reader thread that hands every other message to its Handler.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import select
import socket
import struct
import threading
from multiprocessing import AuthenticationError, connection, parent_process, reduction
from typing import TYPE_CHECKING, Any, NamedTuple

from ._errors import WaitTimeoutError

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Concatenate, ParamSpec, TypeVar

    P = ParamSpec("P")
    M = TypeVar("M")
    # A message class as one end sees it: (code, fd fields) to send; (class, field count, fd fields) received.
    _Sent = tuple[int, tuple[int, ...] | None]
    _Received = tuple[type, int, tuple[int, ...] | None]

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "Channel",
    "Client",
    "Err",
    "Handler",
    "Ok",
    "OkFd",
    "Pending",
    "Protocol",
    "ProtocolError",
    "Server",
    "UnixListener",
    "accept",
    "carries_fds",
    "connect",
    "handles",
    "process_alive",
    "remove_stale_sockets",
    "shutdown_socket",
    "socket_timeouts",
    "sweep_dead",
]

log = logging.getLogger("gpushare")


# -- sockets: listening, connecting, the handshake both ways, leftovers of killed processes ---------

#: How long connecting, and each step of the handshake, may take.
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


# -- messages: protocols, channels, handlers, servers and clients ------------------------------------

# The pickle module's own pickler: messages hold plain values (fds travel as fd fields, not
# through ForkingPickler's fd-duplicating reducers), and copyreg's reducers still apply.
_dumps = pickle.dumps
_PICKLE = pickle.HIGHEST_PROTOCOL
_tuple_new = tuple.__new__


class ProtocolError(ValueError):
    """A frame that is no message of the protocol, from this direction (a bug or a version mismatch)."""


# -- replies: any service's answers to requests (a request's first field is ``req``) ------------
class Ok(NamedTuple):
    """Request ``req`` succeeded."""

    req: int
    value: Any


class OkFd(NamedTuple):
    """Request ``req`` succeeded; its answer is a file descriptor (SCM_RIGHTS)."""

    req: int
    fd: int | None


class Err(NamedTuple):
    """Request ``req`` failed; ``message`` says why."""

    req: int
    message: str


#: Fields of a message class that travel by SCM_RIGHTS, as positions (see carries_fds).
_FD_FIELDS: dict[type, tuple[int, ...]] = {}


def carries_fds(*names: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: these fields of a message are file descriptors (or None), sent by
    SCM_RIGHTS after the frame. The receiver gets fds of its own, and closes them."""

    def mark(cls: type[M]) -> type[M]:
        fields: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
        _FD_FIELDS[cls] = tuple(fields.index(name) for name in names)
        return cls

    return mark


carries_fds("fd")(OkFd)

#: The messages that answer a request (a Client hands them to the request that waits).
REPLIES = (Ok, OkFd, Err)


class Protocol:
    """A service's messages: ``to_server`` (what a client sends), ``to_client`` (what a server sends).

    A message's code is its place in its direction's tuple; its fields, in order, are its
    wire format. Both ends of a connection run the same code, so the codes need no registry.
    """

    def __init__(self, name: str, *, to_server: tuple[type, ...], to_client: tuple[type, ...]) -> None:
        self.name = name
        self.to_server = to_server
        self.to_client = to_client
        for cls in (*to_server, *to_client):
            if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise TypeError(f"{cls!r} is not a NamedTuple: a message of the {name} protocol must be one")
        sent = [{cls: (code, _FD_FIELDS.get(cls)) for code, cls in enumerate(d)} for d in (to_server, to_client)]
        received = [
            {code: (cls, len(cls._fields), _FD_FIELDS.get(cls)) for code, cls in enumerate(d)}  # type: ignore[attr-defined]
            for d in (to_server, to_client)
        ]
        self._server: tuple[dict[type, _Sent], dict[int, _Received]] = (sent[1], received[0])
        self._client: tuple[dict[type, _Sent], dict[int, _Received]] = (sent[0], received[1])

    def side(self, server: bool) -> tuple[dict[type, _Sent], dict[int, _Received]]:
        """What one end sends, by class, and receives, by code (with each class's fd fields)."""
        return self._server if server else self._client


class Channel:
    """One authenticated connection speaking ``protocol``, from one side (``server``).

    Sends are serialised by a lock (a message and its fds go together); one thread receives.
    ``send`` raises OSError or ValueError once the connection is broken or closed; ``recv``
    raises EOFError or OSError when it ends.
    """

    __slots__ = ("_codes", "_decode", "_lock", "_sock", "conn", "protocol")

    def __init__(self, conn: connection.Connection, protocol: Protocol, *, server: bool) -> None:
        self.conn = conn
        self.protocol = protocol
        self._codes, self._decode = protocol.side(server)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None  # the connection's socket, for SCM_RIGHTS

    def fileno(self) -> int:
        return self.conn.fileno()

    def _socket(self) -> socket.socket:
        sock = self._sock
        if sock is None:
            sock = self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        return sock

    def send(self, message: tuple[Any, ...]) -> None:
        code, where = self._codes[type(message)]  # KeyError: not a message this side sends
        if where is None:
            data = _dumps((code, *message), _PICKLE)
            with self._lock:
                self.conn.send_bytes(data)
            return
        fields = list(message)
        fds = [fields[i] for i in where if fields[i] is not None]
        for i in where:
            fields[i] = fields[i] is not None
        data = _dumps((code, *fields), _PICKLE)
        with self._lock:
            self.conn.send_bytes(data)
            if fds:
                reduction.sendfds(self._socket(), fds)

    def try_send(self, message: tuple[Any, ...]) -> bool:
        """Send; False instead of an error if the connection is broken or closed."""
        try:
            self.send(message)
            return True
        except (OSError, ValueError):
            return False

    def recv(self) -> Any:
        frame = self.conn.recv()
        try:
            cls, count, where = self._decode[frame[0]]
        except (KeyError, IndexError, TypeError):
            raise ProtocolError(f"not a message of the {self.protocol.name} protocol: {frame!r:.200}") from None
        if len(frame) != count + 1:
            raise ProtocolError(f"{cls.__name__} has {count} fields, the frame {len(frame) - 1}")
        message: Any = _tuple_new(cls, frame[1:])
        if where is None:
            return message
        present = [i for i in where if message[i]]
        if not present:
            return _tuple_new(cls, [None if i in where else v for i, v in enumerate(message)])
        with self._lock:
            sock = self._socket()
        fds = dict(zip(present, reduction.recvfds(sock, len(present)), strict=True))
        return _tuple_new(cls, [fds.get(i) if i in where else v for i, v in enumerate(message)])

    def recv_valid(self) -> Any:
        """The next message; a frame that is no message of the protocol is logged and skipped."""
        while True:
            try:
                return self.recv()
            except ProtocolError as exc:
                log.warning("gpushare: ignoring a frame: %s", exc)

    def shutdown(self) -> None:
        """Shut the socket down both ways: a thread blocked reading it returns (EOF)."""
        shutdown_socket(self.conn.fileno())

    def close(self) -> None:
        """Close the connection (idempotent). Not under the send lock: a send blocked on a
        stuck peer must not keep the connection from closing."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self.conn.close()


def handles(*types: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Method decorator: this method of a :class:`Handler` handles messages of these types."""

    def mark(method: Callable[..., Any]) -> Callable[..., Any]:
        method._gpushare_handles = types  # type: ignore[attr-defined]
        return method

    return mark


class Handler:
    """What one end does with one connection's messages.

    Each method marked with :func:`handles` handles its types (subclasses may add and
    override); :meth:`on_message` looks the message's type up in that table. A Server
    calls :meth:`on_connect`, :meth:`serve` and, however the connection ends,
    :meth:`on_close`; a Client's reader thread calls :meth:`on_message` for every
    message that is not a reply, then :meth:`on_close`.
    """

    _dispatch: dict[type, Callable[[Any, Any], object]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type, Callable[[Any, Any], object]] = {}
        for klass in reversed(cls.__mro__):  # a subclass's own methods win
            for value in vars(klass).values():
                for kind in getattr(value, "_gpushare_handles", ()):
                    table[kind] = value
        cls._dispatch = table

    def on_connect(self) -> None:
        """The connection is authenticated; nothing was received yet."""

    def on_message(self, message: Any) -> Any:
        """Handle ``message``; what its method (or :meth:`on_unknown`) returns."""
        method = self._dispatch.get(type(message))
        if method is None:
            return self.on_unknown(message)
        return method(self, message)

    def on_unknown(self, message: Any) -> Any:
        log.warning("gpushare: ignoring a message this end does not handle: %.200r", message)

    def on_close(self) -> None:
        """The connection ended (either end closed it, or the other process died)."""

    def serve(self, channel: Channel) -> None:
        """Handle ``channel``'s messages until it ends (EOFError or OSError). A handler that
        must also wait for something besides the socket overrides this."""
        while True:
            self.on_message(channel.recv_valid())


class Server:
    """An authenticated Unix-socket service: each connection is served by a handler of its own.

    ``handler(channel)`` makes the connection's :class:`Handler`, or returns None to turn
    it away (the connection is closed). Its ``on_connect`` and ``serve`` run on the
    connection's own thread; ``on_close`` runs when the connection ends, however it ends.
    """

    def __init__(
        self,
        name: str,
        authkey: bytes,
        protocol: Protocol,
        handler: Callable[[Channel], Handler | None],
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        backlog: int = 128,
    ) -> None:
        self.name = name
        self._authkey = bytes(authkey)
        self._protocol = protocol
        self._handler = handler
        self._timeout = handshake_timeout
        self._listener = UnixListener(name, self._serve, backlog)
        self.address = self._listener.address

    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = accept(sock, self._authkey, self._timeout)
        except (AuthenticationError, OSError, EOFError) as exc:
            log.warning("gpushare: the %s service refused a connection that did not authenticate: %s", self.name, exc)
            sock.close()
            return
        channel = Channel(conn, self._protocol, server=True)
        handler = None
        try:
            handler = self._handler(channel)
            if handler is None:
                return
            handler.on_connect()
            handler.serve(channel)
        except (EOFError, OSError):
            pass
        except Exception:  # a bug must not leave what the connection holds behind: end it
            log.exception("gpushare: internal error serving a connection of the %s service; dropping it", self.name)
        finally:
            try:
                if handler is not None:
                    handler.on_close()
            finally:
                channel.close()

    def close(self) -> None:
        """Stop accepting (connections already served go on until they end). Idempotent."""
        self._listener.close()


class Pending:
    """A request sent by a :class:`Client`, waiting for its reply."""

    __slots__ = ("done", "reply", "req")

    def __init__(self, req: int) -> None:
        self.req = req
        self.done = threading.Event()
        self.reply: Ok | OkFd | Err | None = None  # None: the connection ended first


class Client:
    """The connecting end of a service, with a reader thread.

    :meth:`ask` sends a request (a message whose first field is ``req``, filled in here)
    and :meth:`answer` waits for its reply; requests are served in the order they were
    sent. Every other message goes to ``handler.on_message`` on the reader thread, and
    ``handler.on_close`` runs there when the connection ends. ``ended`` says why it
    ended, once it has. Connecting raises what :func:`connect` raises.
    """

    def __init__(self, address: str, authkey: bytes, protocol: Protocol, handler: Handler, name: str) -> None:
        self.channel = Channel(connect(address, authkey), protocol, server=False)
        self.handler = handler
        self.ended: str | None = None
        self._name = name
        self._waiting: dict[int, Pending] = {}
        self._wait_lock = threading.Lock()
        self._reqs = itertools.count(1)
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start reading (once the handler is ready for its messages)."""
        self._reader = threading.Thread(target=self._read_loop, name=self._name, daemon=True)
        self._reader.start()

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message``; a broken connection ends this client and raises OSError or ValueError."""
        try:
            self.channel.send(message)
        except (OSError, ValueError) as exc:
            self.end(f"connection lost: {exc}")
            raise

    def ask(self, kind: Callable[Concatenate[int, P], tuple[Any, ...]], *args: P.args, **kwargs: P.kwargs) -> Pending:
        """Send the request ``kind(req, *args)`` without waiting for its reply."""
        pending = Pending(next(self._reqs))
        with self._wait_lock:
            self._waiting[pending.req] = pending
        try:
            self.send(kind(pending.req, *args, **kwargs))
        except BaseException:
            with self._wait_lock:
                self._waiting.pop(pending.req, None)
            raise
        return pending

    def answer(self, pending: Pending, timeout: float) -> Ok | OkFd | Err | None:
        """The reply to ``pending``, or None if the connection ended first; WaitTimeoutError (a
        TimeoutError) after ``timeout``."""
        try:
            if not pending.done.wait(timeout):
                raise WaitTimeoutError(f"no reply within {timeout:g} s")
        finally:
            with self._wait_lock:
                self._waiting.pop(pending.req, None)
        return pending.reply

    def _read_loop(self) -> None:
        channel = self.channel
        handler = self.handler
        try:
            while True:
                message = channel.recv_valid()
                if type(message) in REPLIES:
                    self._reply(message)
                else:
                    handler.on_message(message)
        except (EOFError, OSError):
            self.end("its process exited or closed the connection")
            handler.on_close()

    def _reply(self, reply: Ok | OkFd | Err) -> None:
        with self._wait_lock:
            pending = self._waiting.get(reply.req)
        if pending is not None:
            pending.reply = reply
            pending.done.set()
        elif type(reply) is OkFd and reply.fd is not None:
            os.close(reply.fd)  # the requester gave up waiting

    def end(self, reason: str) -> None:
        """Mark the connection ended (the first reason stays) and wake every request waiting."""
        if self.ended is None:
            self.ended = reason
        with self._wait_lock:
            for pending in self._waiting.values():
                pending.done.set()

    def join_reader(self, timeout: float) -> None:
        """Wait for the reader thread to end (unless it is the caller)."""
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=timeout)

    def close(self, reason: str) -> None:
        """End the connection, wait for the reader thread (unless it is the caller), close."""
        self.end(reason)
        try:
            # Shut down before closing: the reader thread is blocked reading this socket,
            # and a close alone would neither wake it nor send EOF.
            self.channel.shutdown()
        except OSError:
            pass
        self.join_reader(5.0)
        try:
            self.channel.close()
        except OSError:
            pass
