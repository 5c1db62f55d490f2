"""One consumer's shared-memory channel: the hot path of the ring.

The producer makes one channel per registered consumer: an anonymous
shared-memory file (``memfd_create``) and an eventfd that wakes the
consumer, both sent once, by SCM_RIGHTS, during registration, together
with the ring's one *release* eventfd that wakes the producer. After that
a handoff writes a few bytes of shared memory and one eventfd counter;
no socket message, no pickle.

Layout (little-endian, offsets in bytes; ``n`` = slots)
------------------------------------------------------
``0 .. 64``        reserved (zero).
``64 + 8*s``       *release word* of slot ``s``: ``sequence + 1`` of the
                   last publication of ``s`` this consumer released (0:
                   none yet), plus ``RECORDED`` (bit 63) when the consumer
                   recorded its release event for it (CUDA: its reads were
                   still queued). Written only by the consumer.
``entries``        ``n`` entries of ``ENTRY`` bytes (64-aligned): entry
                   ``i`` (the ``i``-th item published to this consumer)
                   lives at ``entries + ENTRY * (i % n)``. Written only by
                   the producer::

                       u64 stamp | u64 sequence | u32 slot | u32 meta length | meta

                   ``slot`` carries ``SLOT_RECORDED`` (bit 31) when the producer
                   recorded the slot's ready event for this publication
                   (CUDA: its writes were still queued); without it the
                   consumer waits for nothing.
                   ``stamp`` is ``((i + 1) mod 2**32) << 32 | crc32(body, seed i)``
                   (``+ 1``: a zeroed, never written entry matches no index); a
                   meta length of ``META_ON_SOCKET`` means the pickled meta was
                   too long to go inline and follows on the socket instead.

Why no lock, no head counter and no memory barrier
--------------------------------------------------
Every word has one writer. The consumer takes entry ``i`` only when its
stamp matches ``i`` *and* the checksum of what it read: an entry still
being written, or one left from the previous lap, fails the check and is
read again later (the same rule as the lease journal, ``_journal``). The
producer never overwrites an entry the consumer has not read: entry
``i + n`` is published into a slot this consumer does not hold, so at
most ``n - 1`` of the entries ``i + 1 .. i + n - 1`` are unreleased, so
one of them was released, so (items are taken in order and released only
after they are taken) entry ``i`` was read. A release word is one aligned
8-byte store; the producer frees a slot for a consumer only when the word
equals the publication's ``sequence + 1`` exactly.

Waking
------
Eventfd counters never lose a wakeup: the producer writes the entry and
then adds 1 to the consumer's eventfd (a system call, after the stores);
the consumer looks at the entry, and only if it is not there yet waits in
``poll`` on that eventfd *and* its socket (so a producer that dies wakes
it too), reads the counter, and looks again. The same in the other
direction with the release eventfd, which the producer polls together
with every consumer socket. A side that spins (``spin=``, see the package's
docstring) checks the shared words in a loop first and polls only when its
spin time is over;
the other side still writes the eventfd every time, so a spinner that has
just given up and gone to sleep is woken.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib

__all__ = [
    "ENTRY",
    "INLINE_META",
    "META_ON_SOCKET",
    "RECORDED",
    "SLOT_RECORDED",
    "Channel",
    "available",
    "eventfd",
    "poke",
    "soak",
]

ENTRY = 256
_ENTRY_HEAD = struct.Struct("<QQII")  # stamp, sequence, slot, meta length
_BODY = struct.Struct("<QII")  # sequence, slot, meta length (what the stamp's checksum covers, after i)
_WORD = struct.Struct("<Q")
INLINE_META = ENTRY - _ENTRY_HEAD.size
META_ON_SOCKET = 0xFFFFFFFF
SLOT_RECORDED = 1 << 31  # in an entry's slot field: the producer recorded the slot's ready event
RECORDED = 1 << 63  # in a release word: the consumer recorded its release event
_SEQUENCE = RECORDED - 1
_RELEASES_AT = 64


def available() -> bool:
    """Whether this platform has what a channel needs (Linux: memfd and eventfd)."""
    return hasattr(os, "memfd_create") and hasattr(os, "eventfd")


def eventfd() -> int:
    """A non-blocking, close-on-exec eventfd (counter semantics: wakeups add up)."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def poke(fd: int) -> None:
    """Wake whoever polls ``fd`` (never blocks: a full counter is already a wakeup)."""
    try:
        os.eventfd_write(fd, 1)
    except OSError:  # counter saturated (already readable) or closed during shutdown
        pass


def soak(fd: int) -> None:
    """Reset ``fd``'s counter after a wakeup (nothing there is fine)."""
    try:
        os.eventfd_read(fd)
    except OSError:
        pass


def _size(slots: int) -> int:
    return _entries_at(slots) + ENTRY * slots


def _entries_at(slots: int) -> int:
    return (_RELEASES_AT + 8 * slots + 63) // 64 * 64


class Channel:
    """Both ends of one consumer's shared segment (each process maps it once)."""

    __slots__ = ("_at", "_entries", "fd", "mm", "slots")

    def __init__(self, fd: int, slots: int) -> None:
        self.fd = fd
        self.slots = slots
        self._entries = _entries_at(slots)
        self._at = [self._entries + ENTRY * i for i in range(slots)]  # each entry's offset
        self.mm = mmap.mmap(fd, _size(slots))

    @classmethod
    def create(cls, slots: int) -> Channel:
        """The producer's end: a new zeroed segment (its fd goes to the consumer)."""
        fd = os.memfd_create("gpushare-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _size(slots))
            return cls(fd, slots)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, slots: int) -> Channel:
        """The consumer's end, from the fd it received; checks the size first."""
        if os.fstat(fd).st_size != _size(slots):
            os.close(fd)
            raise ValueError("the ring's shared segment has the wrong size for its slot count")
        return cls(fd, slots)

    # -- producer -> consumer: entries ----------------------------------------------
    def put(self, index: int, slot: int, sequence: int, meta: bytes | None, recorded: bool = False) -> None:
        """Write entry ``index`` (producer). ``meta`` None: it follows on the socket;
        ``recorded``: the slot's ready event was recorded for this publication."""
        at = self._at[index % self.slots]
        mm = self.mm
        length = META_ON_SOCKET if meta is None else len(meta)
        if recorded:
            slot |= SLOT_RECORDED
        # The index seeds the checksum, so a stale entry of an earlier lap fails it;
        # crc32 runs on, so head and meta need not be joined first.
        check = zlib.crc32(_BODY.pack(sequence, slot, length), index & 0xFFFFFFFF)
        if meta:
            mm[at + _ENTRY_HEAD.size : at + _ENTRY_HEAD.size + len(meta)] = meta
            check = zlib.crc32(meta, check)
        # One store for the stamp and the body: the order in which they become visible
        # does not matter, since a consumer takes the entry only when the stamp's
        # checksum matches what it read.
        _ENTRY_HEAD.pack_into(mm, at, ((index + 1) & 0xFFFFFFFF) << 32 | check, sequence, slot, length)

    def take(self, index: int) -> tuple[int, int, bytes | None] | None:
        """Entry ``index`` as ``(slot, sequence, meta bytes or None if on the socket)``, or
        None when it is not (completely) written yet (consumer). ``slot`` still carries
        ``SLOT_RECORDED`` if the producer set it."""
        at = self._at[index % self.slots]
        mm = self.mm
        stamp, sequence, slot, length = _ENTRY_HEAD.unpack_from(mm, at)
        if stamp >> 32 != (index + 1) & 0xFFFFFFFF:
            return None
        # The fields as read, packed again, are what the producer's checksum covered.
        check = zlib.crc32(_BODY.pack(sequence, slot, length), index & 0xFFFFFFFF)
        if not length or length == META_ON_SOCKET:
            if check != stamp & 0xFFFFFFFF:
                return None  # torn: still being written
            return slot, sequence, None if length else b""
        start = at + _ENTRY_HEAD.size
        meta = mm[start : start + min(length, INLINE_META)]
        if zlib.crc32(meta, check) != stamp & 0xFFFFFFFF:
            return None
        return slot, sequence, meta

    # -- consumer -> producer: release words ----------------------------------------
    def release(self, slot: int, sequence: int, recorded: bool = False) -> None:
        _WORD.pack_into(self.mm, _RELEASES_AT + 8 * slot, sequence + 1 | (RECORDED if recorded else 0))

    def released(self, slot: int, sequence: int) -> int:
        """0 if the consumer has not released publication ``sequence`` of ``slot``; else
        the release word (test ``& RECORDED`` for its release event)."""
        word: int = _WORD.unpack_from(self.mm, _RELEASES_AT + 8 * slot)[0]
        return word if word & _SEQUENCE == sequence + 1 else 0

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a memoryview still alive (interpreter exit): the mapping goes with the process
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
