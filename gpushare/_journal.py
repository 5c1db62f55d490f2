"""The lease journal: a consumer link's claims and releases, in shared memory (``memfd``).

- The consumer (:class:`JournalWriter`) appends one record per claim or release, in order;
  the fd goes to the owner once, by SCM_RIGHTS, right after the link's ``Hello``.
- The owner (:class:`JournalReader`) reads the records whenever it needs current lease
  state, and alone writes ``tail``.
- Layout (little-endian): ``u64 tail`` at 0; from 64, ``CAPACITY`` records
  ``u64 value | u64 check``, ``value = lease_id << 1 | kind``, ``check = value ^ stamp(n)``.
- A record counts once its check matches its sequence number: no head counter, no barrier.
Why that is safe, and back-pressure: docs/design.md, "The lease journal".
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
