"""What both sides of the lifetime service agree on: its messages, record kinds, holder ids, timeouts.

:data:`LEASE` is the service's protocol (:mod:`gpushare._service`): each message below is
a NamedTuple whose fields, in order, are its wire format. A request's first field is
``req``; the owner answers it with ``Ok``, ``OkFd`` or ``Err`` carrying the same ``req``.
The owner reads a consumer's journal before it handles any message from it, so records
always count before whatever the consumer sent after them.

This module also holds the one way either side warns from a thread, and this process's
Owners by token: the owner side registers each Owner here, and the consumer side looks
here first (a buffer unpickled in its owner's process needs no link), so the consumer
side does not import the owner side.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, NamedTuple

from .. import _journal
from .._service import Err, Ok, OkFd, Protocol, carries_fds

__all__ = [
    "CLAIM",
    "LEASE",
    "LOCAL",
    "NUDGE",
    "RELEASE",
    "REQUEST_TIMEOUT",
    "RETIRE",
    "Alloc",
    "Batch",
    "Bye",
    "Claim",
    "ClaimFailed",
    "Drain",
    "ExportFd",
    "Hello",
    "LeaseVia",
    "Refused",
    "Shutdown",
    "Stats",
    "Trim",
    "Unmap",
    "Unmapped",
    "log",
    "owner_for",
    "owners",
    "warn",
]

log = logging.getLogger("gpushare")

#: Holder id of a lease claimed inside the owner's own process (a buffer unpickled where it was made).
LOCAL = 0
#: The kinds of a consumer's lease records (the journal's own constants).
CLAIM, RELEASE = _journal.CLAIM, _journal.RELEASE
#: Signals to a consumer's record writer thread besides "records are waiting" (1) and "stop" (None):
NUDGE = -1  # tell the owner to read this consumer's journal
RETIRE = -2  # the owner is gone and nothing here uses it any more: close the link
#: Seconds a consumer waits for the owner to answer a request.
REQUEST_TIMEOUT = 30.0

#: This process's Owners by token (``_owner.Owner`` adds itself when made and removes itself at shutdown).
owners: dict[bytes, Any] = {}


def owner_for(token: bytes) -> Any:
    """This process's Owner with ``token``, or None when the owner is another process."""
    return owners.get(token)


def warn(message: str, category: type[Warning]) -> None:
    """Warn from any thread without letting a warnings filter kill that thread.

    The message also goes to the ``gpushare`` logger: a warning raised in a
    service thread is otherwise easy to miss.
    """
    log.warning(message)
    try:
        warnings.warn(message, category, stacklevel=3)
    except Warning:  # a filter turned it into an error: that must not end the thread
        pass


# -- consumer -> owner ---------------------------------------------------------------------------
@carries_fds("journal_fd")
class Hello(NamedTuple):
    """Opens a link: the token says which Manager the consumer expects; its journal's fd, if it has one."""

    pid: int
    token: bytes
    journal_fd: int | None


class Claim(NamedTuple):
    """The first arrival of an allocation in this process: claim ``lease`` (answered)."""

    req: int
    lease: int
    alloc: int


class Drain(NamedTuple):
    """Read my journal now (it is full, or transient memory was just released)."""


class Batch(NamedTuple):
    """The journal's records as a message, where ``memfd_create`` is missing: claims, then releases."""

    claims: list[int]
    releases: list[int]


class LeaseVia(NamedTuple):
    """A new lease on ``alloc`` for a process that holds lease ``via`` on it (re-sharing; answered)."""

    req: int
    alloc: int
    generation: int
    via: int


class ExportFd(NamedTuple):
    """The allocation's or its pool's fd, for an allocation the asker holds a lease on (answered by OkFd)."""

    req: int
    alloc: int


class Unmapped(NamedTuple):
    """The answer to Unmap: ``ok`` False while a buffer here still uses the memory."""

    alloc: int
    ok: bool


class Alloc(NamedTuple):
    """Allocate for the asker: answered with a descriptor under a new lease, which the asker claims."""

    req: int
    backend: str
    device_uuid: bytes | None
    nbytes: int
    label: str
    dtype: str
    shape: tuple[int, ...]
    transient: bool


class Stats(NamedTuple):
    """The owner's statistics (answered)."""

    req: int


class Trim(NamedTuple):
    """Free every pooled allocation (answered with the bytes given back)."""

    req: int


class Shutdown(NamedTuple):
    """Shut the owner down (answered with its leak warnings, just before it says Bye to everyone)."""

    req: int
    timeout: float


# -- owner -> consumer ---------------------------------------------------------------------------
class ClaimFailed(NamedTuple):
    """A claim by journal record was refused: that buffer raises DescriptorError when touched."""

    lease: int
    message: str


class Refused(NamedTuple):
    """The Hello named another Manager; the owner closes the connection."""

    message: str


class Unmap(NamedTuple):
    """Close your mapping of ``alloc`` if no buffer uses it, and answer Unmapped."""

    alloc: int


class Bye(NamedTuple):
    """The owner shut down."""

    reason: str


#: The lease service's messages (Ok, OkFd and Err are the answers to requests).
LEASE = Protocol(
    "lease",
    to_server=(Hello, Claim, Drain, Batch, LeaseVia, ExportFd, Unmapped, Alloc, Stats, Trim, Shutdown),
    to_client=(Ok, OkFd, Err, ClaimFailed, Refused, Unmap, Bye),
)
