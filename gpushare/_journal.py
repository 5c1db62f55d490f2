"""The lease journal: a consumer's claims and releases, in shared memory.

A buffer handed over in steady state (an allocation the consumer already
maps) needs the owner to learn two things eventually: the consumer claimed
the lease, and later released it. Sending a socket message for each wakes
a writer thread in the consumer and a service thread in the owner per
handoff; on a busy producer that costs more than the handoff itself. So
each consumer link keeps a journal instead:

* the consumer makes an anonymous shared-memory file (``memfd_create``),
  maps it, and sends its descriptor to the owner once, with SCM_RIGHTS,
  right after its ``Hello``;
* it appends one record per claim or release, in the order they happen;
* the owner consumes the records whenever it needs current lease state:
  before it allocates, shares, reports stats, expires leases (every
  0.2 s), shuts down, handles any socket message from that consumer, and
  when the consumer's connection closes (so a consumer that dies leaves
  no record unread).

Layout (little-endian)
----------------------
offset 0: ``u64 tail``, written only by the owner: how many records it
has consumed. Offset 64: ``CAPACITY`` records of ``u64 value | u64 check``;
record *n* lives at ``64 + 16 * (n % CAPACITY)``. ``value`` is
``lease_id << 1 | kind`` (kind 0 = claim, 1 = release) and ``check`` is
``value ^ stamp(n)``, where ``stamp(n) = (n * K ^ SALT) mod 2**64`` for
an odd 64-bit ``K``: one multiplication, since every record costs it twice
(written by the consumer, checked by the owner).

Why no head counter and no memory barrier
-----------------------------------------
Only the consumer writes records and only the owner writes ``tail``. The
owner consumes record ``tail`` only if its check matches its sequence
number ``tail``: a record still being written, or left from the previous
lap round the file, does not match and is read again later. So a record
is published by being complete, not by a separate counter that another
CPU might see before the record itself. The consumer writes record *n*
only while ``n - tail < CAPACITY`` (it never overwrites a record the owner
has not consumed); the owner stores the new ``tail`` only after reading
and checking the records it covers (a store that depends on those loads),
so the consumer cannot see the slot as free before it was read.

What the owner can find in slot *n* instead of record *n*, and why the
check refuses it (each 8-byte half is stored whole):

* record *n - CAPACITY*, whole: its check holds ``stamp(n - CAPACITY)``,
  which differs from ``stamp(n)`` because ``CAPACITY * K`` is not 0
  modulo 2**64 (K is odd);
* the new value beside the old check: it would pass only if the two values
  differed by ``stamp(n) ^ stamp(n - CAPACITY)``, which is ``x ^ (x - CAPACITY
  * K)`` for ``x = n * K``. Modulo 2**64, subtracting ``CAPACITY * K`` adds a
  number between 2**60 and 2**61, which always changes bits 60-63: the two
  values would differ by at least 2**60, a lease id of 2**59;
* the old value beside the new check: it passes only if the two values are
  equal, and then it is the right value;
* zeros (the first lap): ``stamp(n)`` is at least 2**49 for every *n* below
  ``CAPACITY``, so neither an empty slot nor a new value beside a zero
  check passes (tests/test_journal.py checks these bounds).

Back-pressure
-------------
When a quarter of the journal is unconsumed the consumer nudges the owner
with a ``("drain",)`` socket message (at most once per quarter). When it
is full, the consumer's writer thread holds the records back, nudges and
retries; nothing is dropped and nothing is written out of order.

Where ``memfd_create`` is missing, the link falls back to sending the same
records as batched socket messages.
"""

from __future__ import annotations

import mmap
import os
import struct

__all__ = ["CAPACITY", "CLAIM", "NUDGE_AT", "RELEASE", "JournalReader", "JournalWriter", "create_writer"]

CLAIM, RELEASE = 0, 1
CAPACITY = 8192  # records: 128 KiB of shared memory per consumer link
NUDGE_AT = CAPACITY // 4
ENABLED = True  # a link made while False uses socket messages (the fallback path; tests turn it off)

_TAIL = struct.Struct("<Q")
_RECORD = struct.Struct("<QQ")
_RECORDS_AT = 64
_STRIDE = _RECORD.size
_SIZE = _RECORDS_AT + CAPACITY * _STRIDE
_MASK = (1 << 64) - 1


# stamp(n) = (n * _K ^ _SALT) & _MASK (see "Layout"); written out where records are.
_K = 0x9E3779B97F4A7C15  # odd; 2**64 - CAPACITY * _K mod 2**64 lies in [2**60, 2**61)
_SALT = 0x6770757368617265  # so that no stamp of the first lap is 0 or small
_CHUNK = 256  # records the owner copies out of the mapping at a time


def stamp(seq: int) -> int:
    """What record ``seq``'s check is XORed with (see "Layout")."""
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
        out: list[tuple[int, int]] = []
        append = out.append
        n = start = self._tail
        mm = self._mm
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

    def close(self) -> None:
        self._mm.close()


def create_writer() -> JournalWriter | None:
    """A new journal, or None where shared-memory files are unavailable (use messages)."""
    if not ENABLED or not hasattr(os, "memfd_create"):
        return None
    try:
        return JournalWriter()
    except OSError:
        return None
