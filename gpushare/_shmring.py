"""The shared-memory region behind gpushare's Queue: a byte ring of messages, its lock and wake-ups.

One anonymous file (``memfd_create``; an unlinked temporary file elsewhere) holds the region.
Children get it as an fd: inherited under fork, passed while spawning otherwise. Layout:

- ``sel`` (one byte) names which of two state copies is current. A state is
  ``head, tail, count, unfinished``: byte offsets that only grow, the messages in the
  ring, JoinableQueue's unfinished tasks.
- Three futex words, bumped after each commit: ``put_event``, ``get_event``, ``task_event``;
  and how many processes sleep on each (a wake costs a syscall only when someone sleeps).
- The ring: records ``length, kind, payload``, 8-aligned. A record that would not fit before
  the end leaves a wrap record. A payload over a quarter of the ring spills to a file of its
  own, whose path is the record.

Protocol: every change happens under the lock, a POSIX record lock on the file (``lockf``),
which the kernel drops when its holder dies. A writer writes the record past ``tail``, then
the new state into the spare copy, then flips ``sel``: a one-byte store, the commit. A process
killed before the flip leaves the old state, so nothing torn is ever seen; killed after it, the
change is whole. Waits are futex waits (a bounded sleep where there is no futex), each at most
a caller-given interval, so a lost wake-up costs latency, never a wedge.
Why: docs/design.md, "Queues".
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
import sys
import tempfile
import threading
import time
import weakref

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "GET_EVENT",
    "GET_WAITERS",
    "JOIN_WAITERS",
    "KIND_DATA",
    "KIND_SPILL",
    "PUT_EVENT",
    "PUT_WAITERS",
    "RING_BYTES",
    "TASK_EVENT",
    "Region",
    "spill_read",
    "spill_write",
]

RING_BYTES = 1 << 20  # the ring's bytes per queue; pages are touched only as messages pass
HEADER = 128
MAGIC = b"GSQ1"
SEL = 8
STATE = struct.Struct("<QQQQ")  # head, tail, count, unfinished
STATE_AT = (16, 48)
PUT_EVENT, GET_EVENT, TASK_EVENT = 80, 84, 88
GET_WAITERS, PUT_WAITERS, JOIN_WAITERS = 92, 96, 100
U32 = struct.Struct("<I")
RECORD = struct.Struct("<II")  # payload length, kind
KIND_DATA, KIND_WRAP, KIND_SPILL = 0, 1, 2
WRAP_RECORD = RECORD.pack(0, KIND_WRAP)

# -- futex (Linux), with a sleeping fallback ------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not _PRIVATE: the word is shared between processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> Any:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()
FUTEX = _syscall is not None
POLL_SLEEP = 0.0005  # the fallback's sleep between looks


def _futex_wait(addr: int, mm: mmap.mmap, offset: int, value: int, timeout: float) -> None:
    """Sleep while the word at ``offset`` holds ``value``, at most ``timeout`` seconds."""
    if _syscall is not None:
        ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAIT, ctypes.c_uint32(value), ctypes.byref(ts), None, 0)
        return
    deadline = time.monotonic() + timeout
    while U32.unpack_from(mm, offset)[0] == value and time.monotonic() < deadline:
        time.sleep(POLL_SLEEP)


def _futex_wake(addr: int, count: int) -> None:
    if _syscall is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, count, None, None, 0)


# -- the region ---------------------------------------------------------------------------------------


def _new_file(size: int) -> int:
    try:
        fd = os.memfd_create("gpushare-queue", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:  # unlinked: gone with the last process holding it
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


_regions: weakref.WeakSet[Region] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A lock another thread held at fork is held forever in the child's copy; the
    # record lock itself is not inherited (POSIX record locks belong to a process).
    for region in list(_regions):
        region.tlock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Region:
    """One process's view of a queue's region: the fd, the mapping, the lock.

    Every method with ``_locked`` in its name expects :meth:`lock` held.
    """

    def __init__(self, fd: int | None = None, ring_bytes: int = RING_BYTES) -> None:
        if fd is None:
            fd = _new_file(HEADER + ring_bytes)
            self.mm = mmap.mmap(fd, HEADER + ring_bytes)
            self.mm[0:4] = MAGIC
        else:
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
            if self.mm[0:4] != MAGIC:
                raise ValueError("this file is not a gpushare queue's region")
        self.fd = fd
        self.cap = len(self.mm) - HEADER
        self.spill_over = self.cap // 4
        self.tlock = threading.Lock()  # threads of this process; lockf excludes other processes
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm)) if FUTEX else 0
        self.addr = {w: base + w for w in (PUT_EVENT, GET_EVENT, TASK_EVENT)}
        _regions.add(self)

    # -- the lock and the state

    def lock(self) -> None:
        self.tlock.acquire()
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        except BaseException:
            self.tlock.release()
            raise

    def unlock(self) -> None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        finally:
            self.tlock.release()

    def state(self) -> tuple[int, int, int, int]:
        """The current state; without the lock, a hint (two flips while reading may tear it)."""
        mm = self.mm
        return STATE.unpack_from(mm, STATE_AT[mm[SEL] & 1])  # type: ignore[return-value]

    def commit_locked(self, head: int, tail: int, count: int, unfinished: int) -> None:
        mm = self.mm
        spare = (mm[SEL] & 1) ^ 1
        STATE.pack_into(mm, STATE_AT[spare], head, tail, count, unfinished)
        mm[SEL] = spare  # the commit: one byte

    def word(self, offset: int) -> int:
        return U32.unpack_from(self.mm, offset)[0]  # type: ignore[no-any-return]

    def add_locked(self, offset: int, delta: int) -> int:
        value = (U32.unpack_from(self.mm, offset)[0] + delta) & 0xFFFFFFFF
        U32.pack_into(self.mm, offset, value)
        return value  # type: ignore[no-any-return]

    # -- records

    def write_locked(self, payload: bytes, kind: int, st: tuple[int, int, int, int], task: int) -> bool:
        """Write one record and commit it; False when the ring has no room for it now."""
        head, tail, count, unfinished = st
        cap = self.cap
        need = (RECORD.size + len(payload) + 7) & ~7
        at = tail % cap
        skip = cap - at if cap - at < need else 0
        if (tail - head) + skip + need > cap:
            return False
        mm = self.mm
        if skip:
            mm[HEADER + at : HEADER + at + RECORD.size] = WRAP_RECORD
            at = 0
        start = HEADER + at
        RECORD.pack_into(mm, start, len(payload), kind)
        mm[start + RECORD.size : start + RECORD.size + len(payload)] = payload
        self.commit_locked(head, tail + skip + need, count + 1, unfinished + task)
        self.add_locked(PUT_EVENT, 1)
        if self.word(GET_WAITERS):
            _futex_wake(self.addr[PUT_EVENT], 1)
        return True

    def read_locked(self, st: tuple[int, int, int, int]) -> tuple[int, bytes]:
        """Take the first record (the ring is not empty) and commit; its kind and payload."""
        head, tail, count, unfinished = st
        cap = self.cap
        mm = self.mm
        at = head % cap
        length, kind = RECORD.unpack_from(mm, HEADER + at)
        if kind == KIND_WRAP:
            head += cap - at
            at = 0
            length, kind = RECORD.unpack_from(mm, HEADER)
        start = HEADER + at + RECORD.size
        payload = mm[start : start + length]
        self.commit_locked(head + ((RECORD.size + length + 7) & ~7), tail, count - 1, unfinished)
        self.add_locked(GET_EVENT, 1)
        if self.word(PUT_WAITERS):
            _futex_wake(self.addr[GET_EVENT], 0x7FFFFFFF)
        return kind, payload

    # -- waiting

    def wait(self, event: int, value: int, timeout: float) -> None:
        """Sleep until the word ``event`` moves from ``value``, at most ``timeout`` seconds.

        The caller read ``value`` and counted itself a waiter under the lock, and uncounts
        itself under the lock again: a writer wakes only when someone is counted."""
        if timeout > 0:
            _futex_wait(self.addr.get(event, 0), self.mm, event, value, timeout)

    def wake(self, event: int, count: int = 0x7FFFFFFF) -> None:
        _futex_wake(self.addr[event], count)

    def close(self) -> None:
        """Unmap and close this process's view (other processes keep theirs)."""
        _regions.discard(self)
        try:
            self.mm.close()
        except BufferError:  # a ctypes view still exported: leave the mapping to the collector
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


# -- spill files --------------------------------------------------------------------------------------


def spill_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def spill_write(payload: bytes) -> bytes:
    """Write a payload too large for the ring to a file of its own; its path, as bytes."""
    path = os.path.join(spill_dir(), f"gpushare-{os.getpid()}-q{os.urandom(8).hex()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return os.fsencode(path)


def spill_read(path: bytes) -> bytes:
    """The payload a spill record names; the file goes once read."""
    with open(path, "rb") as f:
        os.unlink(path)
        return f.read()
