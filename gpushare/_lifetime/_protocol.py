"""The lease service's wire: what both sides agree on.

Messages. :data:`LEASE` is the service's protocol (:mod:`gpushare._service`): each message
below is a NamedTuple whose fields, in order, are its wire format. A request's first field
is ``req``; the owner answers it with ``Ok``, ``OkFd`` or ``Err`` carrying the same ``req``.
The owner reads a consumer's journal before it handles any message from it, so records
always count before whatever the consumer sent after them.

The lease journal: a consumer link's claims and releases, in shared memory (``memfd``).

- The consumer (:class:`JournalWriter`) appends one record per claim or release, in order;
  the fd goes to the owner once, by SCM_RIGHTS, right after the link's ``Hello``.
- The owner (:class:`JournalReader`) reads the records whenever it needs current lease
  state, and alone writes ``tail`` and ``dropped``.
- ``dropped``: unclaimed leases up to this id may be dropped (expired) when the owner reads
  the journals some time later (half the lease timeout, at least :data:`DROP_GRACE`). A
  consumer that claims one of them asks the owner (``Claim``, answered once the record is
  read) before it uses the memory; a claim of any other lease is read before it can go.
- Layout (little-endian): ``u64 tail`` at 0, ``u64 dropped`` at 8; from 64, ``CAPACITY`` records
  ``u64 value | u64 check``, ``value = lease_id << 1 | kind``, ``check = value ^ stamp(n)``.
- A record counts once its check matches its sequence number: no head counter, no barrier.
  Why that is safe, and back-pressure: dev/design-notes.md, "The lease journal".

The two are one protocol: a link without a journal sends the same records as ``Batch``
messages, and the owner counts both alike.

Also here: the one way either side warns from a thread, and this process's Owners by
token (the owner side registers each Owner; the consumer side looks here first, so it
does not import the owner side).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import warnings
from typing import Any, NamedTuple

from .._service import Err, Ok, OkFd, Protocol, carries_fds

__all__ = [
    "CAPACITY",
    "CLAIM",
    "DROP_GRACE",
    "JOURNAL_ENABLED",
    "LEASE",
    "LOCAL",
    "NUDGE",
    "NUDGE_AT",
    "RELEASE",
    "REQUEST_TIMEOUT",
    "RETIRE",
    "SHUT_BEFORE_CLAIM",
    "Alloc",
    "Batch",
    "Bye",
    "Claim",
    "ClaimFailed",
    "Drain",
    "ExportFd",
    "Hello",
    "JournalReader",
    "JournalWriter",
    "LeaseVia",
    "OwnerAddress",
    "Refused",
    "Shutdown",
    "Stats",
    "Trim",
    "Unmap",
    "Unmapped",
    "create_writer",
    "journal_layout",
    "log",
    "owner_for",
    "owners",
    "stamp",
    "warn",
]

log = logging.getLogger("gpushare")

#: Holder id of a lease claimed inside the owner's own process (a buffer unpickled where it was made).
LOCAL = 0
#: The kinds of a consumer's lease records (a journal record's low bit, a ``Batch``'s two lists).
CLAIM, RELEASE = 0, 1
#: Signals to a consumer's record writer thread besides "records are waiting" (1) and "stop" (None):
NUDGE = -1  # tell the owner to read this consumer's journal
RETIRE = -2  # the owner is gone and nothing here uses it any more: close the link
UNMAP = -3  # the owner asked to unmap allocations (``Unmap``): close them, answer ``Unmapped``
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


class OwnerAddress(NamedTuple):
    """Where an Owner listens and the token its links present: what a Manager's server tells
    its clients of the server's Owner (``owner="server"``), through the Manager's own call."""

    address: str
    token: bytes


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
    """A new lease on ``alloc`` for a process that holds lease ``via`` on it (answered). ``claims``:
    the asker re-shares a buffer it received under ``via``, which is its own from here on (its claim
    may still be in its journal); else it reads through an unclaimed lease (a Ray object's)."""

    req: int
    alloc: int
    generation: int
    via: int
    claims: bool


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


#: Bye's reason to a process that connects once the owner stopped serving: its share was in flight
#: while the owner waited for such shares (up to its release_timeout) and was not claimed in time.
SHUT_BEFORE_CLAIM = "shut down before this process claimed the buffer it received"


#: The lease service's messages (Ok, OkFd and Err are the answers to requests).
LEASE = Protocol(
    "lease",
    to_server=(Hello, Claim, Drain, Batch, LeaseVia, ExportFd, Unmapped, Alloc, Stats, Trim, Shutdown),
    to_client=(Ok, OkFd, Err, ClaimFailed, Refused, Unmap, Bye),
)


# -- the lease journal ---------------------------------------------------------------------------
CAPACITY = 8192  # records: 128 KiB of shared memory per consumer link
NUDGE_AT = CAPACITY // 4
JOURNAL_ENABLED = True  # a link made while False uses socket messages (the fallback path; tests turn it off)

_TAIL = struct.Struct("<Q")
_DROPPED_AT = 8
#: Seconds, at least, between the owner's announcing that leases may be dropped and its reading the
#: journals that decide which are: a claim written before a consumer read ``dropped`` shows by then.
DROP_GRACE = 0.1
_RECORD = struct.Struct("<QQ")
_RECORDS_AT = 64
_STRIDE = _RECORD.size
_SIZE = _RECORDS_AT + CAPACITY * _STRIDE
_MASK = (1 << 64) - 1


# stamp(n) = (n * _K ^ _SALT) & _MASK (see this module's docstring); written out where records are.
_K = 0x9E3779B97F4A7C15  # odd; 2**64 - CAPACITY * _K mod 2**64 lies in [2**60, 2**61)
_SALT = 0x6770757368617265  # so that no stamp of the first lap is 0 or small
_CHUNK = 256  # records the owner copies out of the mapping at a time


def journal_layout() -> tuple[int, int, int, int, int, int, int]:
    """The journal's layout for the C arrival (``gpushare._handoff.c``), which writes claims
    as :meth:`JournalWriter.try_append` does: where records start, a record's size, the
    capacity, the nudge threshold, stamp()'s multiplier and salt, and where ``dropped`` is."""
    return _RECORDS_AT, _STRIDE, CAPACITY, NUDGE_AT, _K, _SALT, _DROPPED_AT


def stamp(seq: int) -> int:
    """What record ``seq``'s check is XORed with (see this module's docstring)."""
    return (seq * _K ^ _SALT) & _MASK


class JournalWriter:
    """The consumer's end. Not thread-safe: the caller serialises appends."""

    def __init__(self) -> None:
        fd = os.memfd_create("gpushare-leases", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _SIZE)
            self._mm = mmap.mmap(fd, _SIZE)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # sent to the owner once, then closed (the mapping stays)
        self.head = 0  # records written
        self._limit = CAPACITY  # head may grow to this without reading the owner's tail again

    def unconsumed(self) -> int:
        """Records written and not yet consumed by the owner."""
        return self.head - _TAIL.unpack_from(self._mm, 0)[0]

    def full(self) -> bool:
        """Whether no record can be written now. Reads the owner's ``tail`` only when the
        room known from its last reading is used up (one shared-memory read saved per record)."""
        if self.head < self._limit:
            return False
        self._limit = _TAIL.unpack_from(self._mm, 0)[0] + CAPACITY
        return self.head >= self._limit

    def dropped(self) -> int:
        """The owner's ``dropped``: read after a claim is written, a claimed lease above it is safe."""
        return int(_TAIL.unpack_from(self._mm, _DROPPED_AT)[0])

    def try_append(self, kind: int, lease_id: int) -> bool:
        """``append`` if not ``full()``, in one call (the consumer's hot path); False if full."""
        n = self.head
        if n >= self._limit and self.full():
            return False
        value = lease_id << 1 | kind
        _RECORD.pack_into(self._mm, _RECORDS_AT + (n % CAPACITY) * _STRIDE, value, value ^ ((n * _K ^ _SALT) & _MASK))
        self.head = n + 1
        return True

    def append(self, kind: int, lease_id: int) -> None:
        """Write one record. The caller checked ``not full()``."""
        if not self.try_append(kind, lease_id):
            raise RuntimeError("the lease journal is full: check full() before append()")

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self._mm.close()


class JournalReader:
    """The owner's end. Not thread-safe: the owner reads under its lock."""

    def __init__(self, fd: int) -> None:
        try:
            if os.fstat(fd).st_size != _SIZE:
                raise ValueError("the consumer's lease journal has the wrong size")
            self._mm = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._tail = _TAIL.unpack_from(self._mm, 0)[0]

    def read(self) -> list[tuple[int, int]]:
        """Consume every complete record: ``[(kind, lease_id), ...]`` in order.

        Records are copied out ``_CHUNK`` at a time (never past the end of the
        ring) and checked in one pass over each copy."""
        n = start = self._tail
        mm = self._mm
        value, check = _RECORD.unpack_from(mm, _RECORDS_AT + (n % CAPACITY) * _STRIDE)
        if check != value ^ ((n * _K ^ _SALT) & _MASK):
            return []  # nothing new: the usual answer, with no chunk copied
        out: list[tuple[int, int]] = []
        append = out.append
        end = n + CAPACITY
        while n < end:
            at = n % CAPACITY
            count = min(_CHUNK, CAPACITY - at, end - n)
            first = _RECORDS_AT + at * _STRIDE
            for value, check in _RECORD.iter_unpack(mm[first : first + count * _STRIDE]):
                if check != value ^ ((n * _K ^ _SALT) & _MASK):
                    end = n  # not written yet: stop here
                    break
                append((value & 1, value >> 1))
                n += 1
        if n != start:
            self._tail = n
            _TAIL.pack_into(mm, 0, n)
        return out

    def announce(self, lease_id: int) -> None:
        """Unclaimed leases up to ``lease_id`` may be dropped (``dropped``; it only grows)."""
        _TAIL.pack_into(self._mm, _DROPPED_AT, lease_id)

    def close(self) -> None:
        self._mm.close()


def create_writer() -> JournalWriter | None:
    """A new journal, or None where shared-memory files are unavailable (use messages)."""
    if not JOURNAL_ENABLED or not hasattr(os, "memfd_create"):
        return None
    try:
        return JournalWriter()
    except OSError:
        return None
