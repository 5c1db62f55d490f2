"""The fan-out's socket side: what travels on it, and the registration of readers.

The producer listens on an authenticated Unix socket (a :class:`gpushare._service.Server`:
multiprocessing's HMAC challenge both ways before anything is unpickled). The messages are
:data:`FANOUT`, one :mod:`gpushare._service` protocol for both fan-outs: NamedTuples whose
fields, in order, are the wire format; fds travel as SCM_RIGHTS fields. Each unpickling of the
producer's handle connects and registers one reader, on the producer's side in
:meth:`Registrant.on_connect`, on the reader's in :func:`register`::

    reader -> producer   Hello(pid, key)
    producer -> reader   SlotBuffers(buffers, ready event handles; by SCM_RIGHTS the
                         reader's channel, the release eventfd, the ring's item eventfd)
    reader -> producer   Ready(release event handles)
    producer -> reader   Registered, sent under the lock the policy reads its readers under

Any producer message may be ``Closed`` instead. After that the connection is
the policy's (its Registrant's ``serve``): a tensor set's carries ``Take`` and
its answers; a ring's carries only *frames*, ``u8 kind | body`` in the
Connection's framing, written and read without it (they cost one write per
consumer on the publishing thread): ``META`` (a meta too long for its entry,
just before the entry) and ``CLOSED`` (the end, after the last item).
dev/design.md has the tables ("Fan-out messages").
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import typing
import weakref
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _cuda, _service
from .._errors import OwnerGoneError
from .._service import carries_fds, connect, socket_timeouts
from . import _channel
from ._channel import Channel
from ._slots import ReaderEnd, Slots, destroy_events
from ._wire import REGISTER_TIMEOUT, SEND_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "CLOSED",
    "FANOUT",
    "META",
    "RING",
    "TENSOR_SET",
    "Closed",
    "Frames",
    "Grant",
    "Hello",
    "Kind",
    "Owner",
    "Reader",
    "Ready",
    "Registered",
    "Registrant",
    "Registry",
    "SlotBuffers",
    "Take",
    "TimedOut",
    "closed_frame",
    "expect",
    "meta_frame",
    "read_frame",
    "register",
    "send_frame",
]

log = logging.getLogger("gpushare")


# -- messages ------------------------------------------------------------------------------------
class Hello(NamedTuple):
    """Reader -> producer: register. ``key`` names the reader's end, for a reader in the
    producer's own process (it hands its release events over directly)."""

    pid: int
    key: int


@carries_fds("channel_fd", "release_fd", "item_fd")
class SlotBuffers(NamedTuple):
    """Producer -> reader: the slot buffers (one lease each, claimed by the reader) and, on
    CUDA, the slots' ready events; by SCM_RIGHTS the reader's channel, the release eventfd
    and (the ring's) the item eventfd."""

    buffers: list[Any]
    handles: list[bytes]
    channel_fd: int | None
    release_fd: int | None
    item_fd: int | None


class Ready(NamedTuple):
    """Reader -> producer: mapped; on CUDA, one release event per slot."""

    handles: list[bytes]


class Registered(NamedTuple):
    """Producer -> reader: registration done."""


class Closed(NamedTuple):
    """Producer -> reader, instead of any other answer: closed. A tensor set offers its last
    ``version`` (in ``slot``; -1: none) to take still."""

    reason: str
    version: int = 0
    slot: int = -1
    recorded: bool = False


class Take(NamedTuple):
    """Reader -> trainer: the latest version, once it is newer than ``newer_than``."""

    newer_than: int
    timeout: float | None


class Grant(NamedTuple):
    """Trainer -> reader: ``version`` is in ``slot``, held under ``grant`` (recorded as held before
    this answer); ``recorded``: its ready event was recorded."""

    version: int
    slot: int
    grant: int
    recorded: bool


class TimedOut(NamedTuple):
    """Trainer -> reader: no newer version within the take's timeout."""

    message: str


#: Both fan-outs' protocol: the registration, then a tensor set's takes (a ring's socket
#: carries only frames once its consumer registered).
FANOUT = _service.Protocol(
    "fan-out", to_server=(Hello, Ready, Take), to_client=(SlotBuffers, Registered, Closed, Grant, TimedOut)
)


def expect(channel: _service.Channel, *kinds: type) -> Any:
    """The next message on ``channel``, which must be one of ``kinds``; else EOFError (the
    peer broke the protocol)."""
    try:
        message = channel.recv()
    except _service.ProtocolError as exc:
        raise EOFError(f"expected {kinds[0].__name__}: {exc}") from None
    if type(message) not in kinds:
        raise EOFError(f"expected {kinds[0].__name__}, got {type(message).__name__}")
    return message


# -- the ring's frames, after registration (producer -> consumer) ------------------------
META = 1
CLOSED = 2
_META = bytes([META])
_CLOSED = bytes([CLOSED])
_LENGTH = struct.Struct("!i")  # multiprocessing.connection's message header
_LONG_LENGTH = struct.Struct("!Q")


def meta_frame(payload: bytes) -> bytes:
    """A pickled meta that did not fit its entry."""
    return _META + payload


def closed_frame(reason: str) -> bytes:
    return _CLOSED + reason.encode()


def read_frame(frame: bytes) -> tuple[int, bytes]:
    """``(kind, body)`` of a frame; an unknown kind comes back as it is, for the caller to refuse."""
    return frame[0] if frame else -1, frame[1:]


def send_frame(fd: int, message: bytes) -> None:
    """Write one message in multiprocessing's Connection framing (what ``send_bytes``
    writes, without its per-call overhead); raises OSError like it."""
    data = memoryview(_LENGTH.pack(len(message)) + message)
    while data:
        data = data[os.write(fd, data) :]


class Frames:
    """Messages in multiprocessing's Connection framing, read with one ``os.read`` per wakeup.

    Only used after registration, which goes through the Connection itself
    (it buffers nothing, so no byte is lost).
    """

    __slots__ = ("buf", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def read(self) -> bool:
        """Read what is available (blocks until something is); False at EOF."""
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)

    def pop(self) -> bytes | None:
        """The next complete message, or None."""
        buf = self.buf
        if len(buf) < 4:
            return None
        (size,) = _LENGTH.unpack_from(buf)
        start = 4
        if size == -1:  # Connection's header for messages over 2 GiB
            if len(buf) < 12:
                return None
            (size,) = _LONG_LENGTH.unpack_from(buf, 4)
            start = 12
        end = start + size
        if len(buf) < end:
            return None
        message = bytes(buf[start:end])
        del buf[:end]
        return message


# -- registration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """What differs between the two fan-outs' registration."""

    listener: str  # the name in the socket's path
    reader: str  # what the producer's log calls a reader
    producer: str  # what a reader's errors call the producer
    refused: str  # why authentication can fail
    unreachable: str  # why registration can fail otherwise
    item_wake: bool  # the reader gets its item eventfd (the ring); else the eventfd stays here
    share_local: bool  # a reader in the producer's process uses its ready events (else none)


RING = Kind(
    "ring",
    "ring consumer",
    "the ring's producer",
    "A ring is shared only with processes started from the producer's process tree (same multiprocessing authkey)",
    "it closed the ring or exited",
    item_wake=True,
    share_local=False,
)
TENSOR_SET = Kind(
    "tensors",
    "tensor set reader",
    "the tensor set's trainer",
    "A tensor set is shared with processes started from the trainer's process tree (same multiprocessing "
    "authkey), or through Ray, whose form of it carries the authkey",
    "it closed the set or exited, or runs on another machine (a tensor set is shared within one machine)",
    item_wake=False,
    share_local=True,
)

#: Slots of this process's producers by address, for readers in the same process: the
#: driver refuses to open a process's own interprocess events, so they use these as they are.
_LOCAL_SLOTS: weakref.WeakValueDictionary[str, Slots] = weakref.WeakValueDictionary()
#: Release events of readers in the producer's own process, by the key their Hello carried.
_LOCAL_RELEASE_EVENTS: dict[int, list[Any]] = {}


@dataclass(eq=False)
class Reader:
    """One registered reader, as its producer keeps it (a policy adds its own fields)."""

    rid: int
    conn: _service.Channel  # its connection: closed by the Server when the reader's handler ends
    pid: int
    channel: Channel
    wake: int  # an eventfd per reader: the ring's item eventfd, or a tensor set reader's thread's
    events: list[Any]  # its per-slot release events (CUDA)
    own_events: bool  # whether they were opened here (and are destroyed here)
    dead: bool = False

    def close(self, device: int | str) -> None:
        """Close its channel and eventfd; destroy its release events if they are ours. A wait
        already queued on one completes normally (the driver defers the destroy). The
        connection is its handler's thread's to close (see :class:`Registrant`)."""
        self.channel.close()
        wake, self.wake = self.wake, -1
        if wake >= 0:
            os.close(wake)
        events, self.events = self.events, []
        if self.own_events:
            destroy_events(events, device)


class Owner(typing.Protocol):
    """The policy a :class:`Registry` registers readers for."""

    closed: str | None

    def closed_message(self) -> Closed: ...

    def admit(self, reader: Any) -> None:
        """A reader registered: called under the slots' lock, right after ``Registered`` went."""


class Registrant(_service.Handler):
    """One connection to the producer, on its own thread (the Server's): :meth:`on_connect`
    registers its reader (the exchange above); :meth:`serve` is then the policy's.

    This one serves nothing, and the thread ends, closing its connection: a ring's producer
    reads its consumers' sockets itself, through a descriptor of its own (``_ring_producer``).
    """

    def __init__(self, registry: Registry, conn: _service.Channel) -> None:
        self.registry = registry
        self.conn = conn
        self.reader: Any = None

    def on_connect(self) -> None:
        self.reader = self.registry.register(self.conn)
        if self.reader is None:
            raise EOFError("not registered")  # the Server closes the connection

    def serve(self, channel: _service.Channel) -> None:
        """After registration: the policy's."""


class Registry:
    """The producer's socket side: a :class:`~gpushare._service.Server` whose handlers
    (``handler_type``, a :class:`Registrant`) register readers, and the table of readers
    (``readers``, under the slots' lock)."""

    def __init__(
        self,
        kind: Kind,
        slots: Slots,
        authkey: bytes,
        owner: Owner,
        reader_type: Callable[..., Reader],
        handler_type: Callable[[Registry, _service.Channel], Registrant] = Registrant,
    ) -> None:
        self.kind = kind
        self.slots = slots
        self.readers: dict[int, Any] = {}
        self._owner = owner
        self._reader_type = reader_type
        self._ids = itertools.count(1)
        self._server = _service.Server(
            kind.listener,
            authkey,
            FANOUT,
            lambda conn: handler_type(self, conn),
            handshake_timeout=REGISTER_TIMEOUT,
            backlog=64,
        )
        self.address = self._server.address
        if kind.share_local:
            _LOCAL_SLOTS[self.address] = slots

    def close(self) -> None:
        """Stop registering readers (the ones registered stay the policy's)."""
        self._server.close()
        _LOCAL_SLOTS.pop(self.address, None)

    def register(self, conn: _service.Channel) -> Reader | None:
        """The producer's half of the exchange, on the connection's thread: the reader, or None."""
        owner, slots = self._owner, self.slots
        channel: Channel | None = None
        wake = -1
        events: list[Any] = []
        own = True
        try:
            socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
            hello: Hello = expect(conn, Hello)
            if owner.closed is not None:
                conn.send(owner.closed_message())
                return None
            channel = Channel.create(slots.n)
            wake = _channel.eventfd()
            # One lease per slot, claimed by the reader (it maps each once); then its fds.
            item = wake if self.kind.item_wake else None
            conn.send(SlotBuffers(slots.buffers, slots.handles, channel.fd, slots.release_fd, item))
            os.close(channel.fd)  # the mapping stays; the reader has its own fd
            channel.fd = -1
            ready: Ready = expect(conn, Ready)
            own = self._release_events(hello, ready.handles, events)
            socket_timeouts(conn.fileno(), 0, SEND_TIMEOUT)
        except Exception as exc:  # e.g. closed while the slots were being pickled
            log.warning("gpushare: a %s failed to register: %r", self.kind.reader, exc)
            self._discard(channel, wake, events if own else [])
            return None
        with slots.lock:
            if owner.closed is None:
                try:
                    # Under the lock the policy reads its readers under, with admit(): nothing
                    # reaches the reader before this, and all that starts after reaches it.
                    conn.send(Registered())
                except OSError as exc:
                    log.warning("gpushare: a %s failed to register: %s", self.kind.reader, exc)
                else:
                    reader = self._reader_type(next(self._ids), conn, hello.pid, channel, wake, events, own)
                    self.readers[reader.rid] = reader
                    owner.admit(reader)
                    return reader
            closed = owner.closed is not None
        if closed:  # closed while this reader registered
            try:
                conn.send(owner.closed_message())
            except OSError:
                pass
        self._discard(channel, wake, events if own else [])
        return None

    def _release_events(self, hello: Hello, handles: list[bytes], events: list[Any]) -> bool:
        """Open the reader's release events into ``events``; whether they are ours to destroy."""
        slots = self.slots
        if not slots.cuda:
            return True
        if hello.pid == os.getpid():  # a reader in this process: its events, as they are
            events.extend(_LOCAL_RELEASE_EVENTS.pop(hello.key, []))
            return False
        for handle in handles:
            events.append(_cuda.event_open(handle, slots.device))  # type: ignore[arg-type]
        return True

    def _discard(self, channel: Channel | None, wake: int, events: list[Any]) -> None:
        """What a reader that did not register got here (its connection is the Server's to close)."""
        if channel is not None:
            channel.close()
        if wake >= 0:
            os.close(wake)
        destroy_events(events, self.slots.device)


# -- the reader's side --------------------------------------------------------------------------
def register(
    end: ReaderEnd, address: str, authkey: bytes, pid: int, kind: Kind, prepare: Callable[[], None] | None = None
) -> Closed | None:
    """Connect ``end`` to the producer (process ``pid``) at ``address`` and register it: None once
    registered, or the producer's ``Closed``. ``prepare`` runs first. Raises OwnerGoneError."""
    try:
        if prepare is not None:
            prepare()
        end.conn = conn = _service.Channel(connect(address, authkey, REGISTER_TIMEOUT), FANOUT, server=False)
        end.handles.append(conn)  # its socket for SCM_RIGHTS too, if the end is collected unclosed
        socket_timeouts(conn.fileno(), REGISTER_TIMEOUT, REGISTER_TIMEOUT)
        conn.send(Hello(os.getpid(), id(end)))
        reply = expect(conn, SlotBuffers, Closed)  # maps every slot (claims one lease each)
        if type(reply) is Closed:
            return reply
        end.buffers = list(reply.buffers)
        end.lent = [False] * len(end.buffers)
        end.release_fd = reply.release_fd
        end.handles.append(end.release_fd)
        if kind.item_wake:
            end.wake = reply.item_fd
            end.handles.append(end.wake)
        try:
            end.channel = Channel.attach(reply.channel_fd, len(end.buffers))
        except ValueError as exc:
            raise OSError(str(exc)) from exc
        end.handles.append(end.channel)
        end.device = end.buffers[0].device if end.buffers else "cpu"
        conn.send(Ready(_events(end, reply.handles, kind, pid == os.getpid(), address)))
        done = expect(conn, Registered, Closed)
        if type(done) is Closed:  # closed while this reader registered
            return done
        socket_timeouts(conn.fileno(), 0, 0)
    except AuthenticationError as exc:
        raise OwnerGoneError(
            f"{kind.producer} (pid {pid}) refused this process: authentication failed. {kind.refused}"
        ) from exc
    except (OSError, EOFError) as exc:
        raise OwnerGoneError(
            f"cannot register with {kind.producer} (pid {pid}) at {address} ({exc}): {kind.unreachable}"
        ) from exc
    return None


def _events(end: ReaderEnd, handles: list[bytes], kind: Kind, local: bool, address: str) -> list[bytes]:
    """Open the producer's ready events; make ours (their handles go to the producer)."""
    device = end.device
    if not isinstance(device, int):
        return []  # host memory needs no events
    if local:
        if not kind.share_local:
            # The ring: no events at all; both ends share the context's legacy default stream.
            return []
        slots = _LOCAL_SLOTS.get(address)
        if slots is None:
            raise OSError(f"{kind.producer} closed it in this process")
        end.slot_events = list(slots.events)
        end.release_events = [_cuda.event_create(device) for _ in end.buffers]
        _LOCAL_RELEASE_EVENTS[id(end)] = end.release_events
        return []
    end.slot_events = [_cuda.event_open(h, device) for h in handles]
    mine = []
    for _ in end.buffers:
        event, handle = _cuda.event_create_ipc(device)
        end.release_events.append(event)
        mine.append(handle)
    return mine
