"""The message layer of the socket services (gpushare._service), and the protocols' tables.

Messages go through real sockets: a socketpair for one Channel's frames and fds, and a
Server with a Client for the accept-and-serve loop, the handlers and requests. The last
tests check that dev/design.md's tables of the lease service's and the fan-out's messages
are the code's.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from multiprocessing import AuthenticationError, connection
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gpushare._fanout import _registry
from gpushare._lifetime import _protocol
from gpushare._service import (
    Channel,
    Client,
    Err,
    Handler,
    Ok,
    OkFd,
    Protocol,
    ProtocolError,
    Server,
    carries_fds,
    handles,
)

DESIGN = Path(__file__).resolve().parent.parent / "dev" / "design.md"
AUTHKEY = b"test-service-authkey"


class Ask(NamedTuple):
    req: int
    text: str


class AskFd(NamedTuple):
    req: int


class Fail(NamedTuple):
    req: int


@carries_fds("first", "second")
class TwoFds(NamedTuple):
    label: str
    first: int | None
    second: int | None


class Notice(NamedTuple):
    text: str


class Empty(NamedTuple):
    pass


TOY = Protocol("toy", to_server=(Ask, AskFd, Fail, TwoFds, Empty), to_client=(Ok, OkFd, Err, Notice))


def channel_pair() -> tuple[Channel, Channel]:
    """(client end, server end) of the toy protocol over a socketpair."""
    a, b = socket.socketpair()
    client = Channel(connection.Connection(a.detach()), TOY, server=False)
    server = Channel(connection.Connection(b.detach()), TOY, server=True)
    return client, server


def same_file(fd1: int, fd2: int) -> bool:
    s1, s2 = os.fstat(fd1), os.fstat(fd2)
    return (s1.st_dev, s1.st_ino) == (s2.st_dev, s2.st_ino)


# -- one channel ---------------------------------------------------------------------------


def test_every_lease_message_goes_both_ways_unchanged() -> None:
    """Each message of the lease protocol arrives as the same typed value, from its own side."""
    a, b = socket.socketpair()
    consumer = Channel(connection.Connection(a.detach()), _protocol.LEASE, server=False)
    owner = Channel(connection.Connection(b.detach()), _protocol.LEASE, server=True)
    samples: dict[type, tuple[Any, ...]] = {
        _protocol.Hello: _protocol.Hello(123, b"t" * 16, None),
        _protocol.Claim: _protocol.Claim(1, 2, 3),
        _protocol.Drain: _protocol.Drain(),
        _protocol.Batch: _protocol.Batch([1, 2], [3]),
        _protocol.LeaseVia: _protocol.LeaseVia(4, 5, 6, 7, True),
        _protocol.ExportFd: _protocol.ExportFd(8, 9),
        _protocol.Unmapped: _protocol.Unmapped(10, True),
        _protocol.Alloc: _protocol.Alloc(11, "host", None, 2 << 20, "label", "<f4", (4, 4), False),
        _protocol.Stats: _protocol.Stats(12),
        _protocol.Trim: _protocol.Trim(13),
        _protocol.Shutdown: _protocol.Shutdown(14, 1.5),
        Ok: Ok(15, {"live_buffers": 1}),
        OkFd: OkFd(16, None),
        Err: Err(17, "why"),
        _protocol.ClaimFailed: _protocol.ClaimFailed(18, "why"),
        _protocol.Refused: _protocol.Refused("why"),
        _protocol.Unmap: _protocol.Unmap(19),
        _protocol.Bye: _protocol.Bye("why"),
    }
    assert set(samples) == {*_protocol.LEASE.to_server, *_protocol.LEASE.to_client}
    try:
        for message in samples.values():
            sender, receiver = (consumer, owner) if type(message) in _protocol.LEASE.to_server else (owner, consumer)
            sender.send(message)
            got = receiver.recv()
            assert type(got) is type(message) and got == message
    finally:
        consumer.close()
        owner.close()


def test_fd_fields_travel_by_scm_rights() -> None:
    client, server = channel_pair()
    r, w = os.pipe()
    try:
        client.send(TwoFds("both", r, w))
        got = server.recv()
        assert got.label == "both" and got.first not in (None, r, w) and got.second not in (None, r, w)
        assert same_file(got.first, r) and same_file(got.second, w)
        os.close(got.first)
        os.close(got.second)
        client.send(TwoFds("second only", None, w))
        got = server.recv()
        assert got.first is None and same_file(got.second, w)
        os.close(got.second)
        client.send(TwoFds("none", None, None))
        assert server.recv() == TwoFds("none", None, None)
    finally:
        os.close(r)
        os.close(w)
        client.close()
        server.close()


def test_a_message_goes_only_the_way_its_protocol_says() -> None:
    client, server = channel_pair()
    try:
        with pytest.raises(KeyError):
            client.send(Notice("a client does not send this"))
        with pytest.raises(KeyError):
            server.send(Ask(1, "nor a server this"))
    finally:
        client.close()
        server.close()


def test_a_frame_that_is_no_message_raises_protocol_error() -> None:
    client, server = channel_pair()
    try:
        client.conn.send((99, "no such code"))
        with pytest.raises(ProtocolError, match="toy"):
            server.recv()
        client.conn.send((0, 1))  # Ask, one field short
        with pytest.raises(ProtocolError, match="Ask has 2 fields"):
            server.recv()
        client.send(Empty())  # and the channel goes on
        assert server.recv() == Empty()
    finally:
        client.close()
        server.close()


def test_try_send_says_false_on_a_closed_connection() -> None:
    client, server = channel_pair()
    server.close()
    client.close()
    assert client.try_send(Ask(1, "gone")) is False


# -- handlers -------------------------------------------------------------------------------


class Base(Handler):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    @handles(Ask, AskFd)
    def _ask(self, message: Any) -> None:
        self.seen.append(("base", message))

    def on_unknown(self, message: Any) -> None:
        self.seen.append(("unknown", message))


class Derived(Base):
    @handles(AskFd)
    def _ask_fd(self, message: AskFd) -> None:
        self.seen.append(("derived", message))


def test_dispatch_is_by_type_and_a_subclass_overrides() -> None:
    base, derived = Base(), Derived()
    for handler in (base, derived):
        for message in (Ask(1, "x"), AskFd(2), Notice("n")):
            handler.on_message(message)
    assert base.seen == [("base", Ask(1, "x")), ("base", AskFd(2)), ("unknown", Notice("n"))]
    assert derived.seen == [("base", Ask(1, "x")), ("derived", AskFd(2)), ("unknown", Notice("n"))]


# -- a server and its clients ------------------------------------------------------------------


class Served(Handler):
    """The toy server's handler for one connection."""

    def __init__(self, channel: Channel, log: list[str]) -> None:
        self.channel = channel
        self.log = log

    def on_connect(self) -> None:
        self.log.append("connect")
        self.channel.send(Notice("welcome"))

    @handles(Ask)
    def _ask(self, message: Ask) -> None:
        self.channel.send(Ok(message.req, message.text.upper()))

    @handles(AskFd)
    def _ask_fd(self, message: AskFd) -> None:
        r, w = os.pipe()
        os.write(w, b"through the fd")
        os.close(w)
        self.channel.send(OkFd(message.req, r))
        os.close(r)

    @handles(Fail)
    def _fail(self, message: Fail) -> None:
        self.channel.send(Err(message.req, "refused, as asked"))

    def on_close(self) -> None:
        self.log.append("close")


class Listening(Handler):
    """The toy client's handler: what the server says unasked."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self.closed = threading.Event()

    @handles(Notice)
    def _notice(self, message: Notice) -> None:
        self.notices.append(message.text)

    def on_close(self) -> None:
        self.closed.set()


def wait_for(predicate: Any, timeout: float = 5.0) -> bool:
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        event.wait(0.01)
    return bool(predicate())


def test_server_and_client_requests_replies_and_notices() -> None:
    log: list[str] = []
    server = Server("toy", AUTHKEY, TOY, lambda channel: Served(channel, log))
    listening = Listening()
    client = Client(server.address, AUTHKEY, TOY, listening, "toy-reader")
    try:
        client.start()
        assert client.answer(client.ask(Ask, "hello"), 5.0) == Ok(1, "HELLO")
        reply = client.answer(client.ask(AskFd), 5.0)
        assert type(reply) is OkFd and reply.fd is not None
        with os.fdopen(reply.fd, "rb") as f:
            assert f.read() == b"through the fd"
        assert client.answer(client.ask(Fail), 5.0) == Err(3, "refused, as asked")
        assert wait_for(lambda: listening.notices == ["welcome"])
        assert log == ["connect"]
    finally:
        client.close("the test is done")
        server.close()
    assert wait_for(lambda: log == ["connect", "close"])
    assert client.ended == "the test is done"


class Mute(Handler):
    """Takes requests and never answers them."""

    def __init__(self, channel: Channel, asked: threading.Event) -> None:
        self.channel = channel
        self.asked = asked

    @handles(Ask)
    def _ask(self, message: Ask) -> None:
        self.asked.set()


def test_a_server_that_goes_ends_its_clients_and_their_requests() -> None:
    channels: list[Channel] = []
    asked = threading.Event()

    def make(channel: Channel) -> Handler:
        channels.append(channel)
        return Mute(channel, asked)

    server = Server("toy", AUTHKEY, TOY, make)
    listening = Listening()
    client = Client(server.address, AUTHKEY, TOY, listening, "toy-reader")
    try:
        client.start()
        pending = client.ask(Ask, "never answered")
        assert asked.wait(5.0)
        channels[0].shutdown()
        assert client.answer(pending, 5.0) is None  # woken by the end, with no reply
        assert listening.closed.wait(5.0)
        assert client.ended == "its process exited or closed the connection"
        with pytest.raises(OSError):
            client.send(Ask(99, "after the end"))
    finally:
        client.close("the test is done")
        server.close()


def test_a_handler_factory_may_turn_a_connection_away() -> None:
    server = Server("toy", AUTHKEY, TOY, lambda channel: None)
    listening = Listening()
    client = Client(server.address, AUTHKEY, TOY, listening, "toy-reader")
    try:
        client.start()
        assert listening.closed.wait(5.0)
    finally:
        client.close("the test is done")
        server.close()


def test_a_client_with_the_wrong_authkey_is_refused() -> None:
    server = Server("toy", AUTHKEY, TOY, lambda channel: Served(channel, []))
    try:
        with pytest.raises(AuthenticationError):
            Client(server.address, b"not the authkey", TOY, Listening(), "toy-reader")
    finally:
        server.close()


# -- the protocols, as dev/design.md lists them --------------------------------------------------


def message_rows(protocol: Protocol, client: str, server: str) -> list[str]:
    """The rows a table of ``protocol``'s messages must start with: message, direction, fields."""
    rows = []
    for classes, direction in (
        (protocol.to_server, f"{client} → {server}"),
        (protocol.to_client, f"{server} → {client}"),
    ):
        for cls in classes:
            fds = {cls._fields[i] for i in _fd_positions(cls)}
            fields = ", ".join(f"{name} (SCM_RIGHTS)" if name in fds else name for name in cls._fields) or "none"
            rows.append(f"| `{cls.__name__}` | {direction} | {fields} |")
    return rows


def _fd_positions(cls: type) -> tuple[int, ...]:
    from gpushare import _service

    return _service._FD_FIELDS.get(cls, ())


def test_design_md_lists_every_lease_message_as_the_code_defines_it() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("\n### Lease messages\n", 1)[1].split("\n### ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    expected = message_rows(_protocol.LEASE, "consumer", "owner")
    missing = [row for row in expected if not any(line.startswith(row) for line in table)]
    assert not missing, "dev/design.md's lease messages differ from the code (_lifetime/_protocol.py):\n" + "\n".join(
        missing
    )
    assert len(table) == len(expected), "dev/design.md lists messages the lease protocol does not have"


def test_design_md_lists_every_fanout_message_as_the_code_defines_it() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("\n### Fan-out messages\n", 1)[1].split("\n### ", 1)[0]
    # The messages' rows: a first cell that is one name (the frames, entries and EOF follow them).
    table = [line for line in section.splitlines() if re.match(r"\| `\w+` \|", line)]
    expected = message_rows(_registry.FANOUT, "reader", "producer")
    missing = [row for row in expected if not any(line.startswith(row) for line in table)]
    assert not missing, "dev/design.md's fan-out messages differ from the code (_fanout/_registry.py):\n" + "\n".join(
        missing
    )
    assert len(table) == len(expected), "dev/design.md lists fan-out messages the protocol does not have"
