"""Queue and JoinableQueue over a shared-memory ring (:class:`Region`); SimpleQueue on a pipe.

- The region: one anonymous file (``memfd_create``) mapped by every user, inherited under
  fork and passed as an fd while spawning; a byte ring of records ``length, kind, payload``,
  and past the mapped ring the spill area, where a payload too large for the ring is
  written at the file's end and read with ``pread`` (its pages punched out once read),
  each side's state in two copies framed by a sequence number and committed by one aligned
  4-byte store (its futex word), one robust process-shared mutex per side. A killed writer
  leaves the last commit; a dead lock holder's lock is taken over (EOWNERDEAD).
- ``put()`` pickles the item (a Buffer's wire form, or :func:`gpushare._process.dumps`'s
  bytes) and writes it into the region under the producers' lock.
  What finds no room waits in this process's backlog (:class:`_Backlog`), whose thread
  writes it as room frees: the queue is unbounded, as multiprocessing's.
- ``get()`` takes the oldest message, sleeping on a futex word while there is none, reads a
  Buffer's descriptor straight from its bytes and unpickles the rest.
- ``get()`` raises OwnerGoneError once the creator is gone and everything it put is received,
  and MainGuardError when a child of this process stopped at ``MAIN_GUARD_EXIT``.
- SimpleQueue stays multiprocessing's pipe: Pool and ProcessPoolExecutor read its connection.
Why, and the end-of-queue protocol: docs/design.md, "Queues".
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import os
import pickle
import queue
import struct
import sys
import threading
import time
import types
import weakref
from multiprocessing import context, queues, util
from multiprocessing.reduction import DupFd, ForkingPickler

from ._buffer import QUEUE_HEAD, Buffer, from_queue_pickle, queue_pickle
from ._errors import OwnerGoneError
from ._native import EMPTY as NATIVE_EMPTY
from ._native import PYTHON as NATIVE_PYTHON
from ._native import region_ops
from ._process import dumps, main_guard_error, pickled_directly, stopped_by_main_guard
from ._spin import SpinPolicy

# typing is not imported at run time: it is a measurable share of a child's start (see gpushare._seams).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["JoinableQueue", "Queue", "SimpleQueue"]

HIGHEST = pickle.HIGHEST_PROTOCOL
_dumps, _loads = pickle.dumps, pickle.loads  # ForkingPickler.loads is pickle.loads
_BUFFER_HEAD = QUEUE_HEAD

# -- the region: records, two locks, futex wake-ups (the protocol: docs/design.md, "Queues") ----

RING_BYTES = 1 << 20  # the ring's bytes per queue; pages are touched only as messages pass
MAGIC = b"GSQ4"
RING_AT = struct.Struct("<Q")  # at byte 8: the ring's size (attachers map the header and the ring only)
# Each side's words and copies on cache lines of their own: a put and a get write no line in common.
PSEQ, CSEQ = 64, 128
GET_WAITERS, PUT_WAITERS, JOIN_WAITERS = 192, 196, 200  # written only by those about to sleep
COPY = struct.Struct("<QQQQQ")  # seq, then three fields, then seq again
P_AT = (256, 296)
C_AT = (384, 424)
P_MUTEX, C_MUTEX = 512, 576  # 64 bytes each (a glibc pthread_mutex_t is 40)
HEADER = 640
RECORD = struct.Struct("<II")  # payload length, kind
SPILL = struct.Struct("<QQ")  # a spilled payload's place in the file: offset, length
PAGE = mmap.PAGESIZE
KIND_DATA, KIND_WRAP, KIND_SPILL = 0, 1, 2
WRAP_RECORD = RECORD.pack(0, KIND_WRAP)
FULL, NO_ROOM = 1, 2  # try_put's answers besides 0 (written)
WAKE_ALL = 0x7FFFFFFF

# -- libc: futex and robust mutexes (Linux), with fallbacks ---------------------------------------

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(os.uname().machine.lower())
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not _PRIVATE: the word is shared between processes
EBUSY, EOWNERDEAD = 16, 130


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


#: Set to 1 to use the portable fallbacks on Linux too (record locks, sleeping waits): tests
#: run them so. Every process using a queue must agree, so it is read from the environment.
PORTABLE = os.environ.get("GPUSHARE_QUEUE_PORTABLE") == "1"


def _libc() -> tuple[Any, Any]:
    """libc through ctypes twice: calls that may block (the GIL let go) and quick ones (kept)."""
    if not sys.platform.startswith("linux") or PORTABLE:
        return None, None
    try:
        return ctypes.CDLL(None, use_errno=True), ctypes.PyDLL(None)
    except OSError:
        return None, None


_blocking, _quick = _libc()
_fallocate = None
if sys.platform.startswith("linux"):  # punches a read spill out of the region, portable mode too
    try:
        _fallocate = ctypes.CDLL(None, use_errno=True).fallocate
        _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    except (OSError, AttributeError):
        _fallocate = None
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_syscall = None
if _blocking is not None and _SYS_FUTEX is not None and hasattr(_blocking, "syscall"):
    _syscall = _blocking.syscall
    _syscall.restype = ctypes.c_long
FUTEX = _syscall is not None
ROBUST = _blocking is not None and all(
    hasattr(_blocking, name)
    for name in ("pthread_mutexattr_setrobust", "pthread_mutexattr_setpshared", "pthread_mutex_consistent")
)
POLL_SLEEP = 0.0005  # the fallback's sleep between looks
#: Each side reads the other's state without its lock, which relies on stores becoming visible
#: in program order (x86-64's). Elsewhere (arm64: Grace Hopper) both sides share one lock, whose
#: release and acquire order every access, and nothing is read without it that matters.
#: GPUSHARE_QUEUE_ONE_LOCK=1 selects it on x86-64 too (tests run it so); every user must agree.
ONE_LOCK = os.environ.get("GPUSHARE_QUEUE_ONE_LOCK") == "1" or os.uname().machine.lower() not in ("x86_64", "amd64")
if ROBUST:
    _trylock, _unlock = _quick.pthread_mutex_trylock, _quick.pthread_mutex_unlock
_get_ident = threading.get_ident


def _futex_wait(addr: int, word: Any, value: int, timeout: float) -> None:
    """Sleep while ``word`` (at ``addr``) holds ``value``, at most ``timeout`` seconds."""
    if timeout <= 0:
        return
    if _syscall is not None:
        ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAIT, ctypes.c_uint32(value), ctypes.byref(ts), None, 0)
        return
    deadline = time.monotonic() + timeout
    while word.value == value and time.monotonic() < deadline:
        time.sleep(POLL_SLEEP)


def _futex_wake(addr: int, count: int) -> None:
    if _syscall is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, count, None, None, 0)


def _init_mutex(addr: int) -> None:
    attr = ctypes.create_string_buffer(64)
    for call in (
        lambda: _blocking.pthread_mutexattr_init(attr),
        lambda: _blocking.pthread_mutexattr_setpshared(attr, 1),  # PTHREAD_PROCESS_SHARED
        lambda: _blocking.pthread_mutexattr_setrobust(attr, 1),  # PTHREAD_MUTEX_ROBUST
        lambda: _blocking.pthread_mutex_init(ctypes.c_void_p(addr), attr),
    ):
        err = call()
        if err:
            raise OSError(err, f"could not make the queue's mutex: {os.strerror(err)}")
    _blocking.pthread_mutexattr_destroy(attr)


class _RobustLock:
    """A robust process-shared pthread mutex in the region: the owner's death unlocks it."""

    __slots__ = ("addr", "arg", "holder")

    def __init__(self, addr: int) -> None:
        self.addr = addr
        self.arg = ctypes.c_void_p(addr)
        self.holder = 0  # the thread of this process holding it, else 0

    def acquire(self) -> None:
        err = _quick.pthread_mutex_trylock(self.arg)
        if err:
            self.wait(err)
        self.holder = threading.get_ident()

    def wait(self, err: int) -> None:
        """After a trylock that did not simply succeed: wait for the lock, or take over a dead holder's."""
        if err == EBUSY:
            err = _blocking.pthread_mutex_lock(self.arg)  # lets go of the GIL while it waits
        if err == EOWNERDEAD:
            # Its holder died; what it left is the last commit (see the module docstring).
            _blocking.pthread_mutex_consistent(self.arg)
        elif err:
            raise OSError(err, f"the queue's lock failed: {os.strerror(err)}")

    def release(self) -> None:
        self.holder = 0
        _quick.pthread_mutex_unlock(self.arg)


class _RecordLock:
    """The fallback: a POSIX record lock on one byte of the file (the kernel drops it when its
    process dies), behind a thread lock (record locks belong to a process, not a thread)."""

    __slots__ = ("fd", "holder", "offset", "tlock")

    def __init__(self, fd: int, offset: int) -> None:
        self.fd = fd
        self.offset = offset
        self.tlock = threading.Lock()
        self.holder = 0

    def acquire(self) -> None:
        self.tlock.acquire()
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, self.offset)
        except BaseException:
            self.tlock.release()
            raise
        self.holder = threading.get_ident()

    def release(self) -> None:
        self.holder = 0
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, self.offset)
        finally:
            self.tlock.release()

    def after_fork(self) -> None:
        self.tlock = threading.Lock()  # another thread may have held it at fork
        self.holder = 0


# -- the region ---------------------------------------------------------------------------------------


def _new_file(size: int) -> int:
    try:
        fd = os.memfd_create("gpushare-queue", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        import tempfile

        with tempfile.TemporaryFile() as f:  # unlinked: gone with the last process holding it
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Region:
    """One process's view of a queue's region: the fd, the mapping, the two locks."""

    def __init__(self, fd: int | None = None, ring_bytes: int = RING_BYTES) -> None:
        created = fd is None
        if fd is None:
            fd = _new_file(HEADER + ring_bytes)
        self.fd = fd
        self._close_fd = weakref.finalize(self, _close_quietly, fd)  # the mapping keeps a dup of its own
        if created:
            self.mm = mm = mmap.mmap(fd, HEADER + ring_bytes)
            mm[0:4] = MAGIC
            RING_AT.pack_into(mm, 8, ring_bytes)
        else:
            head = os.pread(fd, 16, 0)
            if len(head) < 16 or head[0:4] != MAGIC:
                raise ValueError("this file is not a gpushare queue's region")
            self.mm = mm = mmap.mmap(fd, HEADER + RING_AT.unpack_from(head, 8)[0])
        self.cap = len(mm) - HEADER
        self.spill_over = self.cap // 4
        self.pseq = ctypes.c_uint32.from_buffer(mm, PSEQ)  # aligned 4-byte loads and stores
        self.cseq = ctypes.c_uint32.from_buffer(mm, CSEQ)
        self.get_waiters = ctypes.c_uint32.from_buffer(mm, GET_WAITERS)
        self.put_waiters = ctypes.c_uint32.from_buffer(mm, PUT_WAITERS)
        self.join_waiters = ctypes.c_uint32.from_buffer(mm, JOIN_WAITERS)
        start = ctypes.c_char.from_buffer(mm)  # an export: the mapping stays while the C calls may use it
        base = ctypes.addressof(start)
        self.pseq_addr, self.cseq_addr = base + PSEQ, base + CSEQ
        self.plock: Any
        self.clock: Any
        if ROBUST:
            if created:
                _init_mutex(base + P_MUTEX)
                _init_mutex(base + C_MUTEX)
            self.plock, self.clock = _RobustLock(base + P_MUTEX), _RobustLock(base + C_MUTEX)
        else:
            self.plock, self.clock = _RecordLock(fd, 0), _RecordLock(fd, 1)
        if ONE_LOCK:
            self.clock = self.plock
        # The plain put and get in C where it can be built (gpushare._native): one call each.
        self.native: Any = None
        if ROBUST:
            self.native = region_ops(
                start, self.cap, self.spill_over, HEADER, (PSEQ, CSEQ, GET_WAITERS, PUT_WAITERS),
                (P_AT, C_AT), (P_MUTEX, P_MUTEX if ONE_LOCK else C_MUTEX),
            )  # fmt: skip
        # This process's last commit on each side, as (seq, the three fields): while the side's
        # seq still reads so, the state is known without reading it. seq -1: none yet.
        self.p_mine: tuple[int, int, int, int] = (-1, 0, 0, 0)
        self.c_mine: tuple[int, int, int, int] = (-1, 0, 0, 0)
        self.head_seen = 0  # the consumers' head as last read: stale is safe (less room)
        self.tail_seen = 0  # the producers' tail as last read: stale is safe (fewer messages)

    def after_fork(self) -> None:
        for lock in (self.plock, self.clock):
            if isinstance(lock, _RecordLock):
                lock.after_fork()
            else:
                lock.holder = 0

    # -- the two sides' states

    def _current(self, seq: Any, at: tuple[int, int]) -> tuple[int, int, int, int, int]:
        return COPY.unpack_from(self.mm, at[seq.value & 1])  # type: ignore[return-value]

    def _commit(self, seq: Any, at: tuple[int, int], a: int, b: int, c: int) -> None:
        new = (seq.value + 1) & 0xFFFFFFFF
        COPY.pack_into(self.mm, at[new & 1], new, a, b, c, new)
        seq.value = new  # the commit

    def _snapshot(self, seq: Any, at: tuple[int, int]) -> tuple[int, int, int]:
        """The other side's state, read without its lock."""
        mm = self.mm
        while True:
            s1, a, b, c, s2 = COPY.unpack_from(mm, at[seq.value & 1])
            if s1 == s2:
                return a, b, c

    def producers(self) -> tuple[int, int, int]:
        """(tail, messages put, tasks put), read without the lock."""
        return self._snapshot(self.pseq, P_AT)

    def consumers(self) -> tuple[int, int, int]:
        """(head, messages taken, tasks done), read without the lock."""
        return self._snapshot(self.cseq, C_AT)

    # -- producers

    def try_put(self, payload: bytes, kind: int, task: int, maxsize: int, pending: int) -> int:
        """Write one record and commit it (0), or FULL (``maxsize`` messages, counting this
        process's ``pending``) or NO_ROOM (not in the ring now); ``task``: count a task. A
        payload over ``spill_over`` goes to the spill area, and its record says where."""
        native = self.native
        if native is not None:
            done = native.put(payload, kind, task, maxsize, pending)
            if done != NATIVE_PYTHON:
                return done  # 0, FULL or NO_ROOM
        lock, mm, pseq = self.plock, self.mm, self.pseq
        if ROBUST:
            err = _trylock(lock.arg)
            if err:
                lock.wait(err)
            lock.holder = _get_ident()
        else:
            lock.acquire()
        try:
            seq = pseq.value
            if seq == self.p_mine[0]:  # this process made the last commit: no need to read it
                seq, tail, nput, tasks = self.p_mine
            else:
                _, tail, nput, tasks, _ = COPY.unpack_from(mm, P_AT[seq & 1])
            if maxsize and nput + pending - self.consumers()[1] >= maxsize:
                return FULL
            cap = self.cap
            size = len(payload)
            spill = size > self.spill_over
            if spill:
                size = SPILL.size
            need = (size + 15) & ~7  # the record's 8 bytes and the payload, 8-aligned
            at = tail % cap
            skip = cap - at if cap - at < need else 0
            if (tail - self.head_seen) + skip + need > cap:
                self.head_seen = self.consumers()[0]
                if (tail - self.head_seen) + skip + need > cap:
                    return NO_ROOM
            if spill:
                payload, kind = self._spill(payload), KIND_SPILL
            if skip:
                mm[HEADER + at : HEADER + at + 8] = WRAP_RECORD
                at = 0
            start = HEADER + at
            mm[start : start + 8 + size] = RECORD.pack(size, kind) + payload
            seq = (seq + 1) & 0xFFFFFFFF
            tail, nput, tasks = tail + skip + need, nput + 1, tasks + task
            COPY.pack_into(mm, P_AT[seq & 1], seq, tail, nput, tasks, seq)
            pseq.value = seq  # the commit
            self.p_mine = (seq, tail, nput, tasks)
        finally:
            if ROBUST:
                lock.holder = 0
                _unlock(lock.arg)
            else:
                lock.release()
        if self.get_waiters.value:  # read after the unlock, which orders it after the commit
            _futex_wake(self.pseq_addr, 1)
        return 0

    def _spill(self, payload: bytes) -> bytes:
        """Write ``payload`` at the file's end, page-aligned (under the producers' lock, which
        makes the end a bump pointer every producer shares); its SPILL record. A producer
        killed before its commit leaves those pages to the region's end."""
        fd = self.fd
        at = -(-max(os.fstat(fd).st_size, HEADER + self.cap) // PAGE) * PAGE
        view = memoryview(payload)
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(fd, view[done:], at + done)
        except BaseException:
            self.punch(at, done)
            raise
        return SPILL.pack(at, len(payload))

    def unspill(self, record: bytes) -> bytearray:
        """Read the payload a SPILL record names, then punch its pages out of the file."""
        at, length = SPILL.unpack(record)
        data = bytearray(length)
        view = memoryview(data)
        done = 0
        while done < length:
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise EOFError(f"a spilled message of {length} bytes ends after {done}")
            done += got
        self.punch(at, length)
        return data

    def punch(self, at: int, length: int) -> None:
        """Give the pages of ``length`` bytes at ``at`` back (the file keeps its size)."""
        if _fallocate is not None and length > 0:
            _fallocate(self.fd, PUNCH_HOLE, at, -(-length // PAGE) * PAGE)

    def add_task(self) -> None:
        """Count a task whose message waits in this process's backlog."""
        self.plock.acquire()
        try:
            _, tail, nput, tasks, _ = self._current(self.pseq, P_AT)
            self._commit(self.pseq, P_AT, tail, nput, tasks + 1)
        finally:
            self.plock.release()

    # -- consumers

    def try_get(self) -> tuple[int, bytes] | None:
        """Take the oldest record and commit (its kind and payload), or None when empty."""
        native = self.native
        if native is not None:
            got = native.get()
            if got.__class__ is tuple:
                return got
            if got == NATIVE_EMPTY:
                return None
        lock, mm, cseq = self.clock, self.mm, self.cseq
        # Empty, as far as can be seen without the lock? (A stale tail only says so sooner.)
        mine = self.c_mine
        if (mine[1] if cseq.value == mine[0] else self.consumers()[0]) >= self.tail_seen:
            self.tail_seen = self.producers()[0]
            if (mine[1] if cseq.value == mine[0] else self.consumers()[0]) >= self.tail_seen:
                return None
        if ROBUST:
            err = _trylock(lock.arg)
            if err:
                lock.wait(err)
            lock.holder = _get_ident()
        else:
            lock.acquire()
        try:
            seq = cseq.value
            if seq == self.c_mine[0]:  # this process made the last commit: no need to read it
                seq, head, nget, done = self.c_mine
            else:
                _, head, nget, done, _ = COPY.unpack_from(mm, C_AT[seq & 1])
            if head >= self.tail_seen:
                self.tail_seen = self.producers()[0]
                if head >= self.tail_seen:
                    return None
            cap = self.cap
            at = head % cap
            length, kind = RECORD.unpack_from(mm, HEADER + at)
            if kind == KIND_WRAP:
                head += cap - at
                at = 0
                length, kind = RECORD.unpack_from(mm, HEADER)
            start = HEADER + at + 8
            payload = mm[start : start + length]
            seq = (seq + 1) & 0xFFFFFFFF
            head, nget = head + ((length + 15) & ~7), nget + 1
            COPY.pack_into(mm, C_AT[seq & 1], seq, head, nget, done, seq)
            cseq.value = seq  # the commit
            self.c_mine = (seq, head, nget, done)
        finally:
            if ROBUST:
                lock.holder = 0
                _unlock(lock.arg)
            else:
                lock.release()
        if self.put_waiters.value:
            _futex_wake(self.cseq_addr, WAKE_ALL)
        return kind, payload

    def task_done(self) -> None:
        self.clock.acquire()
        try:
            _, head, nget, done, _ = self._current(self.cseq, C_AT)
            if done >= self.producers()[2]:
                raise ValueError("task_done() called too many times")
            self._commit(self.cseq, C_AT, head, nget, done + 1)
        finally:
            self.clock.release()
        if self.join_waiters.value:
            _futex_wake(self.cseq_addr, WAKE_ALL)

    def unfinished(self) -> int:
        return int(self.producers()[2] - self.consumers()[2])

    def count(self) -> int:
        return int(self.producers()[1] - self.consumers()[1])

    def empty(self) -> bool:
        return bool(self.consumers()[0] >= self.producers()[0])

    # -- sleeping

    def count_waiter(self, side: str, word: Any, delta: int) -> None:
        """Add ``delta`` to a waiter count, under the lock of the side that owns it."""
        lock = self.clock if side == "c" else self.plock
        lock.acquire()
        try:
            word.value = (word.value + delta) & 0xFFFFFFFF
        finally:
            lock.release()

    def wait_for_put(self, value: int, timeout: float) -> None:
        _futex_wait(self.pseq_addr, self.pseq, value, timeout)

    def wait_for_get(self, value: int, timeout: float) -> None:
        _futex_wait(self.cseq_addr, self.cseq, value, timeout)

    def close(self) -> None:
        """Unmap and close this process's view (other processes keep theirs)."""
        self.native = None
        for name in ("pseq", "cseq", "get_waiters", "put_waiters", "join_waiters"):
            self.__dict__.pop(name, None)
        try:
            self.mm.close()
        except BufferError:  # a view still exported: leave the mapping to the collector
            pass
        self._close_fd()


# -- the queues -------------------------------------------------------------------------------

_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
pickled_directly(Buffer)  # a Buffer put on a SimpleQueue: one pass (a Queue writes its own form)


def _settled(obj: Any, depth: int = 0) -> bool:
    """True for a plain value, which ForkingPickler and pickle write alike."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    return kind is tuple and depth < 2 and len(obj) <= 16 and all(_settled(item, depth + 1) for item in obj)


def _pickle(obj: Any) -> bytes:
    """What put() writes for ``obj``: its pickle, as a Process's arguments are pickled."""
    kind = type(obj)
    if kind is Buffer:  # first: the item a gpushare queue is for
        return queue_pickle(obj)
    if kind in _ATOMS or _settled(obj):
        return _dumps(obj, HIGHEST)
    return dumps(obj, None)


def _restore(data: bytes | bytearray) -> Any:
    """get(): the item ``data`` is the pickle of (a bytearray: a spilled one)."""
    if isinstance(data, bytes) and data.endswith(b"\x85R.") and data.startswith(_BUFFER_HEAD):  # a Buffer's?
        buf = from_queue_pickle(data)
        if buf is not None:
            return buf
    return _loads(data)


def _process_alive(pid: int) -> bool:
    from ._service import process_alive

    return process_alive(pid)


WATCH_INTERVAL = 0.5  # seconds a blocking get() waits between checks that the creator lives
EXIT_GRACE = 0.5  # after the end-of-queue marker, seconds get() waits for items other processes put
# The end-of-queue marker goes out at exit after the Manager's shutdown (priority 12) and
# before the backlog's close (CLOSE_PRIORITY), whose thread then writes it behind the rest.
EXIT_PRIORITY = 10
CLOSE_PRIORITY = 9
# Before a get() sleeps it looks at the ring, yielding the CPU between looks, for at most
# SPIN_SECONDS, and only while this handle's previous wait was shorter than that
# (gpushare._spin.SpinPolicy): a stream of items closer together costs no sleep and no
# wake-up (a consumer of a fan-out to 8 waits about 80 us between items), sparse items cost
# no spinning (dev/performance.md, "Spinning before a get() sleeps").
SPIN_SECONDS = 200e-6


def _no_yield() -> None:
    time.sleep(0)


class _CreatorExited:
    """The end-of-queue marker: the creating process exited after putting what came before."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_CreatorExited, (self.pid,))


class _Backlog:
    """One process's messages that found no room in the ring, oldest first, and the thread
    that writes them as room frees (multiprocessing's feeder, for the overflow only).

    Holds no reference to its queue: a queue collected with a backlog still delivers it.
    """

    __slots__ = ("__weakref__", "closing", "cond", "items", "region", "thread")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.items: collections.deque[tuple[bytes, int]] = collections.deque()
        self.cond = threading.Condition(threading.Lock())
        self.closing = False
        self.thread: threading.Thread | None = None

    def push(self, data: bytes, kind: int) -> bool:
        """Append; True when this started the thread."""
        started = False
        with self.cond:
            self.items.append((data, kind))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._feed, name="QueueFeederThread", daemon=True)
                self.thread.start()
                started = True
            self.cond.notify()
        return started

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()

    def join(self) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _feed(self) -> None:
        region, items = self.region, self.items
        while True:
            with self.cond:
                while not items and not self.closing:
                    self.cond.wait()
                if not items:
                    return
            data, kind = items[0]
            while True:
                seen = region.cseq.value  # before the try: a get after it wakes the wait below
                if not region.try_put(data, kind, 0, 0, 0):
                    items.popleft()
                    break
                region.count_waiter("p", region.put_waiters, 1)
                region.wait_for_get(seen, WATCH_INTERVAL)
                region.count_waiter("p", region.put_waiters, -1)


def _finalize_close(backlog: _Backlog) -> None:
    backlog.close()


def _finalize_join(ref: Any) -> None:
    backlog = ref()
    if backlog is not None:
        backlog.join()


def _announce_exit(region: Region, backlog: _Backlog, maxsize: int, pid: int) -> None:
    """The creator exits, or drops the queue: the marker goes behind everything it put.

    A full bounded queue gets no marker (this must not block); its consumers
    notice the creator's death by watching it instead. Nor does a queue collected while
    this thread is inside its own put() (the lock is not reentrant).
    """
    if region.plock.holder == threading.get_ident():
        return
    _send(region, backlog, maxsize, pickle.dumps(_CreatorExited(pid), HIGHEST), False, None, 0)


def _send(region: Region, backlog: _Backlog, maxsize: int, data: bytes, block: bool, timeout: float | None,
          task: int) -> bool:  # fmt: skip
    """Write one message, behind this process's backlog; False when a bounded queue stayed full."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seen = region.cseq.value  # before the try: a get after it wakes the wait below
        if backlog.items:
            answer = FULL if maxsize and region.count() + len(backlog.items) >= maxsize else NO_ROOM
        else:
            answer = region.try_put(data, KIND_DATA, task, maxsize, 0)
            if not answer:
                return True
        if answer == NO_ROOM:  # no room in the ring now: the backlog's thread writes it later
            if task:
                region.add_task()
            backlog.push(data, KIND_DATA)
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if not block or (left is not None and left <= 0):
            return False
        region.count_waiter("p", region.put_waiters, 1)
        region.wait_for_get(seen, WATCH_INTERVAL if left is None else min(left, WATCH_INTERVAL))
        region.count_waiter("p", region.put_waiters, -1)


class Queue:
    """``multiprocessing.Queue`` over a shared-memory ring: ``put()`` pickles the item and
    writes it into the ring itself (a thread only for what finds no room), and ``get()``
    raises OwnerGoneError instead of waiting forever for a creator that is gone."""

    _joinable = 0
    __class_getitem__: Any = classmethod(types.GenericAlias)

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        self._maxsize = max(0, int(maxsize))
        self._region = Region()
        self._opid = os.getpid()
        self._setup()

    def _setup(self) -> None:
        self._closed = False
        self._joincancelled = False
        self._exit_checked = False  # put() looked whether this process must announce its exit
        self._spin = SpinPolicy(SPIN_SECONDS, adaptive=True)  # how a blocking get() waits
        self._backlog = _Backlog(self._region)
        self._close: Any = None
        self._jointhread: Any = None
        util.register_after_fork(self, Queue._after_fork)

    def _after_fork(self) -> None:
        self._region.after_fork()
        self._setup()

    def __getstate__(self) -> tuple[Any, ...]:
        context.assert_spawning(self)
        # One fd passed per child, however often the child's pickle is made (gpushare's
        # dumps may pickle twice: its dry run, then ForkingPickler) or names the queue.
        passed = vars(context.get_spawning_popen()).setdefault("_gpushare_queue_fds", {})
        fd = self._region.fd
        if fd not in passed:
            passed[fd] = DupFd(fd)
        return (self._maxsize, passed[fd], self._opid)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._maxsize, fd, self._opid = state
        self._region = Region(fd.detach())
        self._setup()

    # -- putting

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data = _pickle(obj)
        region, backlog = self._region, self._backlog
        if backlog.items or region.try_put(data, 0, self._joinable, self._maxsize, 0):
            # Not written at once: behind this process's backlog, full, or no room.
            had_thread = backlog.thread
            if not _send(region, backlog, self._maxsize, data, block, timeout, self._joinable):
                raise queue.Full
            if backlog.thread is not had_thread:
                self._watch_backlog()
        if not self._exit_checked:
            self._exit_checked = True
            if self._opid == os.getpid():  # only the creator announces its exit
                util.Finalize(
                    self,
                    _announce_exit,
                    args=(self._region, backlog, self._maxsize, self._opid),
                    exitpriority=EXIT_PRIORITY,
                )

    def _watch_backlog(self) -> None:
        """The backlog's thread started: at exit (or when collected) this process writes
        the backlog out before it ends, as multiprocessing's feeder does."""
        if self._close is None:
            self._close = util.Finalize(self, _finalize_close, [self._backlog], exitpriority=CLOSE_PRIORITY)
        if not self._joincancelled and self._jointhread is None:
            self._jointhread = util.Finalize(
                self._backlog, _finalize_join, [weakref.ref(self._backlog)], exitpriority=-5
            )

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    # -- getting

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        got = self._region.try_get()  # the fast path: a message is there
        if got is not None:
            kind, payload = got
            item = _restore(self._region.unspill(payload) if kind == KIND_SPILL else payload)
        else:
            item = self._get(block, timeout)
        if type(item) is not _CreatorExited:
            return item
        # The creator exited. Other processes may still be putting: go on while items
        # keep coming, and leave the marker behind them for the next consumer.
        try:
            after = self._get(True, EXIT_GRACE)
        except queue.Empty:
            after = item
        self._pass_on(item)
        if type(after) is not _CreatorExited:
            return after
        raise OwnerGoneError(
            f"the process that created this queue (pid {item.pid}) exited, and nothing more came "
            f"within {EXIT_GRACE:g} s; its buffers' memory is gone with it. End this worker, or use "
            "Manager(owner='server') for buffers that outlive their producer"
        )

    def get_nowait(self) -> Any:
        return self.get(False)

    def _pass_on(self, marker: _CreatorExited) -> None:
        """Leave the marker in the queue for the next consumer."""
        _send(self._region, self._backlog, self._maxsize, pickle.dumps(marker, HIGHEST), False, None, 0)

    def _get(self, block: bool, timeout: float | None) -> Any:
        """The next item; a blocking wait checks every WATCH_INTERVAL that the creator lives."""
        if not block:
            return _restore(self._receive(False, None))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = WATCH_INTERVAL if deadline is None else min(WATCH_INTERVAL, max(0.0, deadline - time.monotonic()))
            try:
                return _restore(self._receive(True, wait))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            if self._opid != os.getpid() and not _process_alive(self._opid):
                try:
                    return _restore(self._receive(False, None))  # what it put before it died comes first
                except queue.Empty:
                    raise OwnerGoneError(
                        f"the process that created this queue (pid {self._opid}) is gone and the queue is "
                        "empty; nothing more will come from it. Its buffers' memory may be gone too; "
                        "end this worker, or use Manager(owner='server') for buffers that outlive it"
                    ) from None
            child = stopped_by_main_guard()
            if child is not None:  # nothing it was to put will come, nor from any child started alike
                raise main_guard_error(f"child process {child.name}", child.pid)

    def _receive(self, block: bool, timeout: float | None) -> bytes | bytearray:
        """One message's bytes (unpickled by ``_restore`` outside the lock); raises queue.Empty."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        region = self._region
        got = region.try_get()
        if got is None and block:
            got = self._wait(region, time.monotonic() + (timeout or 0.0))
        if got is None:
            raise queue.Empty
        kind, payload = got
        return region.unspill(payload) if kind == KIND_SPILL else payload

    def _wait(self, region: Region, deadline: float) -> tuple[int, bytes] | None:
        """Spin a moment if the last wait was as short (a reply is often that near), then
        sleep on the producers' word."""
        pseq = region.pseq
        seen = pseq.value
        got = region.try_get()  # a put may have come between the caller's try and ``seen``
        if got is not None:
            return got
        clock = time.monotonic
        start = clock()
        spin = self._spin.budget()
        if spin:
            yield_ = getattr(os, "sched_yield", _no_yield)
            until = min(start + spin, deadline)
            while pseq.value == seen and clock() < until:  # a commit: one word, on a line of its own
                yield_()  # a producer waiting for this CPU runs first
        while True:
            seen = region.pseq.value  # before the try: a put after it wakes the wait below
            got = region.try_get()
            now = clock()
            if got is not None or now >= deadline:  # an item, or the timeout: a wait too
                self._spin.waited(now - start)
                return got
            region.count_waiter("c", region.get_waiters, 1)
            region.wait_for_put(seen, deadline - now)
            region.count_waiter("c", region.get_waiters, -1)

    # -- the rest of multiprocessing.Queue's interface

    def qsize(self) -> int:
        return self._region.count() + len(self._backlog.items)

    def empty(self) -> bool:
        return self._region.empty()

    def full(self) -> bool:
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def close(self) -> None:
        self._closed = True
        close = self._close
        if close:
            self._close = None
            close()

    def join_thread(self) -> None:
        assert self._closed, f"Queue {self!r} not closed"
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        self._joincancelled = True
        try:
            self._jointhread.cancel()
        except AttributeError:
            pass


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``, with the same changes as :class:`Queue`; the count
    of unfinished tasks lives in the region, committed with the message that adds one."""

    _joinable = 1

    def task_done(self) -> None:
        self._region.task_done()

    def join(self) -> None:
        region = self._region
        while True:
            seen = region.cseq.value
            if region.unfinished() <= 0:
                return
            region.count_waiter("c", region.join_waiters, 1)
            region.wait_for_get(seen, WATCH_INTERVAL)
            region.count_waiter("c", region.join_waiters, -1)


class SimpleQueue(queues.SimpleQueue):
    """``multiprocessing.SimpleQueue`` whose ``put()`` pickles as a Process's arguments are
    (lambdas and closures by value): Pool's and ProcessPoolExecutor's tasks and results."""

    def put(self, obj: Any) -> None:
        # Pickled before taking the lock, as the stdlib's does; a plain value (a Pool's None
        # sentinel, put even at interpreter exit) by ForkingPickler alone, the same bytes.
        data = ForkingPickler.dumps(obj) if _settled(obj) else dumps(obj, None)
        if self._wlock is None:  # type: ignore[attr-defined]
            self._writer.send_bytes(data)  # type: ignore[attr-defined]
        else:
            with self._wlock:  # type: ignore[attr-defined]
                self._writer.send_bytes(data)  # type: ignore[attr-defined]
