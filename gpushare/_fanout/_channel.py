"""One reader's shared-memory channel: release words, and the ring's entries.

The producer makes one per registered reader (a ``memfd``, sent by SCM_RIGHTS
at registration). Every word has one writer, so it needs no lock and no
memory barrier (dev/design-notes.md, "The channel", says why). Layout,
little-endian, byte offsets, ``n`` slots::

    0 .. 64       reserved (zero)
    64 + 8*s      release word of slot s (reader): stamp + 1 of the last hold of s
                  released (0: none yet), | RECORDED (bit 63) when it recorded its
                  release event
    entries       n entries of ENTRY bytes, 64-aligned (producer; the ring only):
                  entry i at entries + ENTRY * (i % n):
                  u64 seal | u64 sequence | u32 slot | u32 meta length | meta

``seal`` is ``((i + 1) mod 2**32) << 32 | crc32(body, seed i)`` (``+ 1``: a
never written entry matches no index); ``slot`` carries ``SLOT_RECORDED``
(bit 31) when the slot's ready event was recorded; a meta length of
``META_ON_SOCKET`` means the meta follows on the socket.
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
_ENTRY_HEAD = struct.Struct("<QQII")  # seal, sequence, slot, meta length
_BODY = struct.Struct("<QII")  # sequence, slot, meta length (what the seal's checksum covers, after i)
_WORD = struct.Struct("<Q")
INLINE_META = ENTRY - _ENTRY_HEAD.size
META_ON_SOCKET = 0xFFFFFFFF
SLOT_RECORDED = 1 << 31  # in an entry's slot field: the producer recorded the slot's ready event
RECORDED = 1 << 63  # in a release word: the reader recorded its release event
_STAMP = RECORDED - 1
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
    """Both ends of one reader's shared segment (each process maps it once)."""

    __slots__ = ("_at", "_entries", "fd", "mm", "slots")

    def __init__(self, fd: int, slots: int) -> None:
        self.fd = fd
        self.slots = slots
        self._entries = _entries_at(slots)
        self._at = [self._entries + ENTRY * i for i in range(slots)]  # each entry's offset
        self.mm = mmap.mmap(fd, _size(slots))

    @classmethod
    def create(cls, slots: int) -> Channel:
        """The producer's end: a new zeroed segment (its fd goes to the reader)."""
        fd = os.memfd_create("gpushare-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _size(slots))
            return cls(fd, slots)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, slots: int) -> Channel:
        """The reader's end, from the fd it received; checks the size first."""
        if os.fstat(fd).st_size != _size(slots):
            os.close(fd)
            raise ValueError("the fan-out's shared segment has the wrong size for its slot count")
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
        # One store for the seal and the body: the order in which they become visible
        # does not matter, since a consumer takes the entry only when the seal's
        # checksum matches what it read.
        _ENTRY_HEAD.pack_into(mm, at, ((index + 1) & 0xFFFFFFFF) << 32 | check, sequence, slot, length)

    def take(self, index: int) -> tuple[int, int, bytes | None] | None:
        """Entry ``index`` as ``(slot, sequence, meta bytes or None if on the socket)``, or
        None when it is not (completely) written yet (consumer). ``slot`` still carries
        ``SLOT_RECORDED`` if the producer set it."""
        at = self._at[index % self.slots]
        mm = self.mm
        seal, sequence, slot, length = _ENTRY_HEAD.unpack_from(mm, at)
        if seal >> 32 != (index + 1) & 0xFFFFFFFF:
            return None
        # The fields as read, packed again, are what the producer's checksum covered.
        check = zlib.crc32(_BODY.pack(sequence, slot, length), index & 0xFFFFFFFF)
        if not length or length == META_ON_SOCKET:
            if check != seal & 0xFFFFFFFF:
                return None  # torn: still being written
            return slot, sequence, None if length else b""
        start = at + _ENTRY_HEAD.size
        meta = mm[start : start + min(length, INLINE_META)]
        if zlib.crc32(meta, check) != seal & 0xFFFFFFFF:
            return None
        return slot, sequence, meta

    # -- reader -> producer: release words ----------------------------------------
    def release(self, slot: int, stamp: int, recorded: bool = False) -> None:
        _WORD.pack_into(self.mm, _RELEASES_AT + 8 * slot, stamp + 1 | (RECORDED if recorded else 0))

    def released(self, slot: int, stamp: int) -> int:
        """0 if the reader has not released its hold ``stamp`` of ``slot``; else the release
        word (test ``& RECORDED`` for its release event)."""
        word: int = _WORD.unpack_from(self.mm, _RELEASES_AT + 8 * slot)[0]
        return word if word & _STAMP == stamp + 1 else 0

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a memoryview still alive (interpreter exit): the mapping goes with the process
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
