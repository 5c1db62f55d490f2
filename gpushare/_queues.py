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
  What finds no room waits in this process's backlog (:class:`_Backlog`), counted in the
  region (``BACKLOGGED``), whose thread writes it as room frees: the queue is unbounded, as
  multiprocessing's. Lock waits go in slices, with the caller's deadline.
- ``get()`` takes the oldest message, sleeping on a futex word while there is none, reads a
  Buffer's descriptor straight from its bytes and unpickles the rest.
- Each process that holds the queue holds a lock on one byte of its file (an OFD lock); a
  blocking ``get()`` raises OwnerGoneError once the queue is empty and no other process
  holds it, and MainGuardError when a child of this process stopped at ``MAIN_GUARD_EXIT``.
- SimpleQueue stays multiprocessing's pipe: Pool and ProcessPoolExecutor read its connection.
Why, and who holds a queue: dev/design-notes.md, "Queues".
"""

from __future__ import annotations

import collections
import ctypes
import errno
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
from ._errors import OwnerGoneError, ReentrantCallError
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

# -- the region: records, two locks, futex wake-ups (the protocol: dev/design-notes.md, "Queues") ----

RING_BYTES = 1 << 20  # the ring's bytes per queue; pages are touched only as messages pass
MAGIC = b"GSQ5"
RING_AT = struct.Struct("<Q")  # at byte 8: the ring's size (attachers map the header and the ring only)
# Each side's words and copies on cache lines of their own: a put and a get write no line in common.
PSEQ, CSEQ = 64, 128
GET_WAITERS, PUT_WAITERS, JOIN_WAITERS = 192, 196, 200  # written only by those about to sleep
# Messages every process holds in its backlog, counted when put() accepted them and uncounted when
# written (8 bytes, under the producers' lock): maxsize and qsize() count them, whoever holds them.
BACKLOGGED = 208
SPILL_END = 216  # where the next spilled payload goes (8 bytes, under the producers' lock); 0: past the ring
RING_GIVEN_BACK = 224  # the producers' tail when the ring's pages were last given back (8 bytes, under their lock)
_SEQ = struct.Struct("<Q")
COPY = struct.Struct("<QQQQQ")  # seq, then three fields, then seq again
P_AT = (256, 296)
C_AT = (384, 424)
P_MUTEX, C_MUTEX = 512, 576  # 64 bytes each (a glibc pthread_mutex_t is 40)
HEADER = 640
RECORD = struct.Struct("<II")  # payload length, kind
SPILL = struct.Struct("<QQ")  # a spilled payload's place in the file: offset, length
PAGE = mmap.PAGESIZE
KIND_DATA, KIND_WRAP, KIND_SPILL = 0, 1, 2
DRAINED = 4  # added to a taken record's kind when it was the last one committed
#: Once a consumer took this many bytes and emptied the queue, the ring's pages go back (Region.reclaim):
#: a drained queue keeps at most this much of its ring resident.
RECLAIM_BYTES = 32 << 10
#: A process gives one queue's ring pages back at most RECLAIM_BURST times at once, then
#: RECLAIM_RATE times a second: a busy stream is not punched every RECLAIM_BYTES. A drain past
#: that gives them back when a get of this process next sleeps on the empty queue.
RECLAIM_BURST = 4
RECLAIM_RATE = 2.0
WRAP_RECORD = RECORD.pack(0, KIND_WRAP)
FULL, NO_ROOM, BUSY = 1, 2, 3  # try_put's answers besides 0 (written)
_NOW = 0.0  # a deadline already passed: the lock if free at once, else the answer BUSY
WAKE_ALL = 0x7FFFFFFF

# -- libc: futex and robust mutexes (Linux), with fallbacks ---------------------------------------

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(os.uname().machine.lower())
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not _PRIVATE: the word is shared between processes
EBUSY, EOWNERDEAD, ETIMEDOUT, EDEADLK = errno.EBUSY, errno.EOWNERDEAD, errno.ETIMEDOUT, errno.EDEADLK


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
    for name in (
        "pthread_mutexattr_setrobust",
        "pthread_mutexattr_setpshared",
        "pthread_mutexattr_settype",
        "pthread_mutex_consistent",
        "pthread_mutex_timedlock",
    )
)
POLL_SLEEP = 0.0005  # the fallback's sleep between looks
#: Each side reads the other's state without its lock, which relies on stores becoming visible
#: in program order (x86-64's). Elsewhere (arm64: Grace Hopper) both sides share one lock, whose
#: release and acquire order every access, and nothing is read without it that matters.
#: GPUSHARE_QUEUE_ONE_LOCK=1 selects it on x86-64 too (tests run it so); every user must agree.
ONE_LOCK = os.environ.get("GPUSHARE_QUEUE_ONE_LOCK") == "1" or os.uname().machine.lower() not in ("x86_64", "amd64")
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


def _futex_wake(addr: int, count: int) -> int:
    """Wake up to ``count`` sleepers on the word at ``addr``: how many woke (-1: no futex here)."""
    if _syscall is not None:
        return int(_syscall(_SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, count, None, None, 0))
    return -1


def _init_mutex(addr: int) -> None:
    attr = ctypes.create_string_buffer(64)
    for call in (
        lambda: _blocking.pthread_mutexattr_init(attr),
        lambda: _blocking.pthread_mutexattr_setpshared(attr, 1),  # PTHREAD_PROCESS_SHARED
        lambda: _blocking.pthread_mutexattr_setrobust(attr, 1),  # PTHREAD_MUTEX_ROBUST
        # ERRORCHECK: a thread locking what it holds gets EDEADLK (a signal handler's re-entry,
        # told apart), and unlocking what it does not hold gets EPERM (harmless).
        lambda: _blocking.pthread_mutexattr_settype(attr, 2),  # PTHREAD_MUTEX_ERRORCHECK
        lambda: _blocking.pthread_mutex_init(ctypes.c_void_p(addr), attr),
    ):
        err = call()
        if err:
            raise OSError(err, f"could not make the queue's mutex: {os.strerror(err)}")
    _blocking.pthread_mutexattr_destroy(attr)


#: A wait for a queue's lock goes in slices this long: between them, signal handlers run
#: (Ctrl-C ends the wait) and the caller's deadline is looked at.
LOCK_SLICE = 0.05

#: What ``acquire`` answers a signal handler's call that finds its own thread holding the lock
#: between taking it and entering its call's ``try:`` (or between leaving it and letting go):
#: nothing is half written then, so the handler's call works under that hold and leaves it held.
LENT = "lent"


class _QueueLock:
    """What both kinds of queue lock share: :meth:`run` (a call under the lock) and :meth:`unleak`.

    ``holder`` (the thread of this process that takes or holds it) is set before the lock is
    taken, and ``inside`` (the same thread) once the caller's ``try:`` is entered: a call
    interrupted in between (by a signal handler's exception) leaves ``holder`` without
    ``inside``, and :meth:`unleak` lets go of it. A signal handler's call that finds ``inside``
    its own thread's raises :class:`ReentrantCallError`; one that finds the lock held by its
    thread but not ``inside`` is :data:`LENT` it (see dev/design-notes.md, "Queues")."""

    __slots__ = ("holder", "inside")
    holder: int
    inside: int

    def acquire(self, deadline: float | None = None) -> bool | str:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def run(self, deadline: float | None, busy: Any, work: Any, *args: Any) -> Any:
        """``work(*args)`` under the lock, or ``busy`` when the lock was not had by ``deadline``
        (``time.monotonic()``; None: wait for it)."""
        got = self.acquire(deadline)
        if not got:
            return busy
        if got is LENT:  # a signal handler's call: its thread's interrupted call lets go later
            before = self.inside
            try:
                self.inside = _get_ident()
                return work(*args)
            finally:
                self.inside = before
        try:
            self.inside = self.holder
            return work(*args)
        finally:
            self.release()

    def unleak(self) -> None:
        """After an exception in a call of this thread: the lock it was taking when interrupted
        is let go."""
        me = _get_ident()
        if self.holder == me and self.inside != me:
            self.release()


class _RobustLock(_QueueLock):
    """A robust, error-checking process-shared pthread mutex in the region: the owner's death
    unlocks it. An unlock of a mutex this thread does not hold answers EPERM, harmless."""

    __slots__ = ("addr", "arg")

    def __init__(self, addr: int) -> None:
        self.addr = addr
        self.arg = ctypes.c_void_p(addr)
        self.holder = 0
        self.inside = 0

    def acquire(self, deadline: float | None = None) -> bool | str:
        """Take the lock (True), or False once ``deadline`` (``time.monotonic()``; None: none)
        passed with another holder, or LENT (see :class:`_QueueLock`). A dead holder's lock is
        taken over."""
        me = _get_ident()
        if self.inside == me:
            raise ReentrantCallError("this thread is inside a call on this queue already")
        before = self.holder
        self.holder = me
        err = _quick.pthread_mutex_trylock(self.arg)  # a robust error-checking mutex: EDEADLK if ours
        if err == EBUSY:
            err = self._wait(deadline)
        if err == EDEADLK:  # this thread holds it (a signal handler's call: see _QueueLock)
            self.holder = before
            return LENT
        if err == EOWNERDEAD:
            # Its holder died; what it left is the last commit (see the module docstring).
            _blocking.pthread_mutex_consistent(self.arg)
        elif err:
            self.holder = 0
            if err == ETIMEDOUT:
                return False
            raise OSError(err, f"the queue's lock failed: {os.strerror(err)}")
        self.holder = me
        return True

    def _wait(self, deadline: float | None) -> int:
        ts = _Timespec()
        while True:
            left = LOCK_SLICE if deadline is None else min(LOCK_SLICE, deadline - time.monotonic())
            until = time.time() + max(0.0, left)
            ts.tv_sec, ts.tv_nsec = int(until), int((until % 1.0) * 1e9)
            err = _blocking.pthread_mutex_timedlock(self.arg, ctypes.byref(ts))  # without the GIL
            if err == EDEADLK and self.inside == _get_ident():
                raise ReentrantCallError("this thread is inside a call on this queue already")
            if err != ETIMEDOUT or left <= 0:
                return int(err)
            self.holder = _get_ident()  # a re-entering handler's call may have cleared it

    def release(self) -> None:
        self.holder = 0
        self.inside = 0
        _quick.pthread_mutex_unlock(self.arg)


class _RecordLock(_QueueLock):
    """The fallback: a POSIX record lock on one byte of the file (the kernel drops it when its
    process dies), behind a thread lock (record locks belong to a process, not a thread)."""

    __slots__ = ("fd", "offset", "taking", "tlock")

    def __init__(self, fd: int, offset: int) -> None:
        self.fd = fd
        self.offset = offset
        self.tlock = threading.Lock()
        self.holder = 0
        self.inside = 0
        self.taking = 0  # the thread between wanting the thread lock and holding both (or letting go)

    def acquire(self, deadline: float | None = None) -> bool | str:
        me = _get_ident()
        if self.holder == me:
            if self.inside == me:
                raise ReentrantCallError("this thread is inside a call on this queue already")
            return LENT  # a signal handler's call (see _QueueLock)
        if self.taking == me:  # its thread was interrupted taking or letting go of it: not ours to wait for
            raise ReentrantCallError("this thread is taking this queue's lock already")
        self.taking = me
        try:
            timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.tlock.acquire(True, timeout):
                return False
            try:
                while True:
                    try:
                        fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self.offset)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EACCES, errno.EAGAIN):
                            raise
                    if deadline is not None and time.monotonic() >= deadline:
                        self.tlock.release()
                        return False
                    time.sleep(POLL_SLEEP)
            except BaseException:
                self.tlock.release()
                raise
            self.holder = me
            return True
        finally:
            self.taking = 0

    def release(self) -> None:
        self.taking = _get_ident()
        self.holder = 0
        self.inside = 0
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, self.offset)
        finally:
            self.tlock.release()
            self.taking = 0

    def after_fork(self) -> None:
        self.tlock = threading.Lock()  # another thread may have held it at fork
        self.holder = self.taking = 0


def _add_waiters(word: Any, delta: int | None) -> None:
    """Under its lock: add ``delta`` to a waiter count, or clear it (None). A count cleared as
    stale stays at 0."""
    word.value = 0 if delta is None else max(0, word.value + delta)


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


# -- who holds a queue: open file description locks (the protocol: dev/design-notes.md, "Queues") ------

HOLD_BYTE = 2  # each user holds a read lock on this byte of the region's file (0 and 1: the fallback's locks)
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux: type, whence, start, len, pid
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", None)


def _hold(fd: int) -> int:
    """A description of the region's file of this process's own, holding a read lock on
    HOLD_BYTE (the lock is the description's: it lasts while any fd of it is open, and the
    kernel drops it with the process); -1 where such locks do not exist."""
    if _OFD_SETLK is None:
        return -1
    try:
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        fcntl.fcntl(own, _OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, HOLD_BYTE, 1, 0))
    except OSError:
        os.close(own)
        return -1
    return own


class _Fds:
    """A region's two fds in this process: the file, and the description whose lock says
    that this process holds the queue (``hold``, -1 once let go or where there is none).
    Closed by the region's finalizer, never by interpreter exit: a backlog still writes then."""

    __slots__ = ("fd", "hold")

    def __init__(self, fd: int, hold: int) -> None:
        self.fd, self.hold = fd, hold

    def let_go(self) -> None:
        """This process will put no more (it closed the queue, exits, or dropped it): its hold
        ends. Closing, not unlocking: a child still starting may share the description."""
        hold, self.hold = self.hold, -1
        if hold >= 0:
            _close_quietly(hold)

    def close(self) -> None:
        self.let_go()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _close_quietly(fd)


class Region:
    """One process's view of a queue's region: the fd, the mapping, the two locks."""

    def __init__(self, fd: int | None = None, ring_bytes: int = RING_BYTES, inherited_hold: int = -1) -> None:
        created = fd is None
        if fd is None:
            fd = _new_file(HEADER + ring_bytes)
        self.fd = fd
        self.fds = _Fds(fd, _hold(fd))
        # The hold a spawning parent passed along (``inherited_hold``) kept the queue held while this
        # child started; its own is taken now.
        if inherited_hold >= 0:
            _close_quietly(inherited_hold)
        self._close_fds = weakref.finalize(self, self.fds.close)  # the mapping keeps a dup of its own
        self._close_fds.atexit = False  # at exit, a backlog may still write through the fd
        _regions.add(self)
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
                start, self.cap, self.spill_over, HEADER, (PSEQ, CSEQ, GET_WAITERS, PUT_WAITERS, BACKLOGGED),
                (P_AT, C_AT), (P_MUTEX, P_MUTEX if ONE_LOCK else C_MUTEX),
            )  # fmt: skip
        self.can_punch = _fallocate is not None  # see punch()
        self.tokens, self.tokens_at = float(RECLAIM_BURST), time.monotonic()  # give-backs allowed (drained)
        self.pending = False  # emptied past them: given back when a get here next sleeps (idle)
        self.head_seen = 0  # the consumers' head as last read: stale is safe (less room)
        self.spill_locks = 0  # spilled payloads this process has locked (writing, or reading)
        self.tail_seen = 0  # the producers' tail as last read: stale is safe (fewer messages)

    def after_fork(self) -> None:
        """In a forked child: its own locks' state, and a hold of its own (the parent's description,
        inherited, is closed here: it stays the parent's)."""
        self.pending = False
        for lock in (self.plock, self.clock):
            if isinstance(lock, _RecordLock):
                lock.after_fork()
            else:
                lock.holder = 0
        fds = self.fds
        if fds.hold >= 0:
            fds.let_go()
            fds.hold = _hold(fds.fd)

    def let_go(self) -> None:
        """This process will put no more on this queue: other processes may learn that it let go."""
        self.fds.let_go()

    def held_elsewhere(self) -> bool:
        """Whether some other process holds the queue (may still put or get); True where that
        cannot be known. Once this process let go, any hold found is another's."""
        fd = self.fds.hold if self.fds.hold >= 0 else self.fds.fd
        if fd < 0 or _OFD_GETLK is None:
            return True
        try:
            got = fcntl.fcntl(fd, _OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, HOLD_BYTE, 1, 0))
        except OSError:
            return True
        return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)

    # -- the two sides' states

    def _current(self, seq: Any, at: tuple[int, int]) -> tuple[int, int, int, int, int]:
        """A side's state, read under its lock (nothing changes it meanwhile)."""
        return COPY.unpack_from(self.mm, at[seq.value & 1])  # type: ignore[return-value]

    def _commit(self, seq: Any, at: tuple[int, int], a: int, b: int, c: int) -> None:
        new = (seq.value + 1) & 0xFFFFFFFF
        COPY.pack_into(self.mm, at[new & 1], new, a, b, c, new)
        seq.value = new  # the commit

    def _snapshot(self, seq: Any, at: tuple[int, int]) -> tuple[int, int, int]:
        """The other side's state, read without its lock: the copy's closing sequence number
        first, then the copy. A writer writes the opening one first and the closing one last,
        so a copy being rewritten under the reader shows two numbers that differ."""
        mm = self.mm
        while True:
            where = at[seq.value & 1]
            last = _SEQ.unpack_from(mm, where + 32)[0]
            first, a, b, c, _ = COPY.unpack_from(mm, where)
            if first == last:
                return a, b, c

    def producers(self) -> tuple[int, int, int]:
        """(tail, messages put, tasks put), read without the lock."""
        return self._snapshot(self.pseq, P_AT)

    def consumers(self) -> tuple[int, int, int]:
        """(head, messages taken, tasks done), read without the lock."""
        return self._snapshot(self.cseq, C_AT)

    def backlogged(self) -> int:
        return int(_SEQ.unpack_from(self.mm, BACKLOGGED)[0])

    # -- producers

    def try_put(self, payload: bytes, kind: int, task: int, maxsize: int, deadline: float | None = None) -> int:
        """Write one record and commit it (0), or FULL (``maxsize`` messages, counting every
        process's backlog), NO_ROOM (not in the ring now) or BUSY (the lock not had by
        ``deadline``); ``task``: count a task. The payload fits the ring (see :meth:`spill`)."""
        native = self.native
        if native is not None:
            done = native.put(payload, kind, task, maxsize)
            if done != NATIVE_PYTHON:
                return done  # 0, FULL or NO_ROOM
        return self._put_locked(payload, kind, task, maxsize, 0, deadline)

    def _full(self, nput: int, maxsize: int) -> bool:
        """Under the producers' lock: ``maxsize`` messages in the queue, every backlog's included."""
        return bool(maxsize) and nput + self.backlogged() - self.consumers()[1] >= maxsize

    def reserve(self, task: int, maxsize: int, deadline: float | None = None) -> int:
        """Count a message bound for this process's backlog (0), or FULL, or BUSY; ``task``:
        count a task too. Counted here, before it is written, so that ``maxsize``, ``qsize()``
        and ``join()`` see it in every process."""
        return self.plock.run(deadline, BUSY, self._reserve_locked, task, maxsize)  # type: ignore[no-any-return]

    def _reserve_locked(self, task: int, maxsize: int) -> int:
        _, tail, nput, tasks, _ = self._current(self.pseq, P_AT)
        if self._full(nput, maxsize):
            return FULL
        _SEQ.pack_into(self.mm, BACKLOGGED, self.backlogged() + 1)
        if task:
            self._commit(self.pseq, P_AT, tail, nput, tasks + task)
        return 0

    def put_reserved(self, payload: bytes, kind: int) -> int:
        """Write a message :meth:`reserve` counted (0), uncounting it in the same commit, or NO_ROOM."""
        return self._put_locked(payload, kind, 0, 0, 1, None)

    def _put_locked(self, payload: bytes, kind: int, task: int, maxsize: int, reserved: int,
                    deadline: float | None) -> int:  # fmt: skip
        done = self.plock.run(deadline, BUSY, self._write_locked, payload, kind, task, maxsize, reserved)
        if done == 0 and self.get_waiters.value:  # read after the unlock, which orders it after the commit
            self.wake(self.pseq_addr, 1, self.get_waiters, self.clock)
        return done  # type: ignore[no-any-return]

    def _write_locked(self, payload: bytes, kind: int, task: int, maxsize: int, reserved: int) -> int:
        mm, pseq = self.mm, self.pseq
        seq, tail, nput, tasks, _ = self._current(pseq, P_AT)
        if self._full(nput, maxsize):
            return FULL
        cap = self.cap
        size = len(payload)
        need = (size + 15) & ~7  # the record's 8 bytes and the payload, 8-aligned
        at = tail % cap
        skip = cap - at if cap - at < need else 0
        if (tail - self.head_seen) + skip + need > cap:
            self.head_seen = self.consumers()[0]
            if (tail - self.head_seen) + skip + need > cap:
                return NO_ROOM
        if skip:
            mm[HEADER + at : HEADER + at + 8] = WRAP_RECORD
            at = 0
        start = HEADER + at
        mm[start : start + 8 + size] = RECORD.pack(size, kind) + payload
        if reserved:
            _SEQ.pack_into(mm, BACKLOGGED, self.backlogged() - reserved)
        seq = (seq + 1) & 0xFFFFFFFF
        COPY.pack_into(mm, P_AT[seq & 1], seq, tail + skip + need, nput + 1, tasks + task, seq)
        pseq.value = seq  # the commit
        return 0

    def spill(self, payload: bytes, deadline: float | None = None) -> bytes | None:
        """Write a payload too large for the ring past the ring's end, page-aligned, and give
        the record that names it (None: the lock not had by ``deadline``). Only the place is
        taken under the producers' lock; the write is not, so a producer stopped inside a
        large write holds up nobody. A producer killed before its record is committed leaves
        those pages to the region's end."""
        at = self.plock.run(deadline, None, self._place_spill_locked, len(payload))
        if at is None:
            return None
        view = memoryview(payload)
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], at + done)
        except BaseException:
            self.drop_spill(SPILL.pack(at, len(payload)))
            raise
        return SPILL.pack(at, len(payload))

    def _place_spill_locked(self, length: int) -> int:
        """Where a spilled payload of ``length`` bytes goes: the spill area's end, moved past it."""
        if _SEQ.unpack_from(self.mm, SPILL_END)[0]:
            self._reclaim_locked()
        at = _SEQ.unpack_from(self.mm, SPILL_END)[0] or self.spill_base
        _SEQ.pack_into(self.mm, SPILL_END, at + -(-length // PAGE) * PAGE)
        self.lock_spill(at, length)  # before the lock goes: a reclaim would see it
        return int(at)

    # A spilled payload's pages are locked (an OFD read lock through this process's hold) from its
    # place's taking until its record is committed, and again from its record's taking until it
    # is read: the spill area is given back only while nobody holds such a lock (Region.reclaim).

    def lock_spill(self, at: int, length: int) -> None:
        if self.fds.hold >= 0 and _OFD_SETLK is not None:
            fcntl.fcntl(self.fds.hold, _OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, at, length, 0))
            self.spill_locks += 1

    def spill_done(self, record: bytes) -> None:
        """The spilled payload ``record`` names is committed (a producer) or read (a consumer)."""
        hold = self.fds.hold
        if hold >= 0 and _OFD_SETLK is not None:
            at, length = SPILL.unpack(record)
            fcntl.fcntl(hold, _OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, at, length, 0))
            self.spill_locks = max(0, self.spill_locks - 1)

    def drop_spill(self, record: bytes) -> None:
        """A spilled payload that will not be committed (its put failed): its pages go back."""
        self.punch(*SPILL.unpack(record))
        self.spill_done(record)

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
        self.spill_done(record)
        self.reclaim()
        return data

    def punch(self, at: int, length: int) -> bool:
        """Give the pages of ``length`` bytes at ``at`` back (the file keeps its size); False
        where they stay. A file system that cannot punch holes (``EOPNOTSUPP``, a portable
        queue's file elsewhere than tmpfs) is not asked again; an empty queue's spill area
        still goes back by truncation (:meth:`_reclaim_locked`)."""
        if not self.can_punch or length <= 0 or _fallocate is None:
            return False
        if _fallocate(self.fd, PUNCH_HOLE, at, -(-length // PAGE) * PAGE) == 0:
            return True
        if ctypes.get_errno() in (errno.EOPNOTSUPP, errno.ENOSYS):
            self.can_punch = False
        return False

    @property
    def spill_base(self) -> int:
        return -(-(HEADER + self.cap) // PAGE) * PAGE

    def drained(self) -> bool:
        """A get here emptied the queue after RECLAIM_BYTES taken: give the ring's pages back now,
        unless this process used up its give-backs (RECLAIM_BURST, RECLAIM_RATE): a busy queue
        would fault them straight back in, in every process that maps it. Then a get here gives
        them back when it next sleeps on the empty queue (:meth:`idle`). True once that is
        settled; False to be asked again."""
        now = time.monotonic()
        tokens = min(float(RECLAIM_BURST), self.tokens + (now - self.tokens_at) * RECLAIM_RATE)
        self.tokens_at = now
        if tokens < 1.0:
            self.tokens = tokens
            self.pending = True
            return True
        done = self.reclaim()
        self.tokens = tokens - 1.0 if done else tokens
        if done:
            self.pending = False
        return done

    def idle(self) -> None:
        """A get here is about to sleep on the empty queue: give back what :meth:`drained` left."""
        self.pending = False
        self.reclaim()

    def reclaim(self, deadline: float | None = _NOW) -> bool:
        """Give memory back if the queue is empty (True; False when it was not, or the
        producers' lock was busy, or this thread is inside a call under it: a signal handler's
        get, whose item is taken already and must not be lost): see :meth:`_reclaim_locked`."""
        try:
            return bool(self.plock.run(deadline, False, self._reclaim_locked))
        except ReentrantCallError:
            return False

    def _give_back_ring(self, tail: int) -> None:
        """Punch the ring's pages, all dead (the queue is empty), but the one the next record
        starts in: a stream of small messages would fault it straight back in, in every
        process. Neither the header's page nor the ring's last, partial one is punched."""
        keep = (HEADER + tail % self.cap) // PAGE
        end = (HEADER + self.cap) // PAGE  # whole ring pages: [1, end)
        self.punch(PAGE, (keep - 1) * PAGE)
        self.punch((keep + 1) * PAGE, (end - keep - 1) * PAGE)

    def _reclaim_locked(self) -> bool:
        """Under the producers' lock, with no message left to take: the ring's pages go back
        once RECLAIM_BYTES passed through it since the last time, and the spill area (pages
        of payloads killed mid-put included; the file shrinks to the ring) once no process
        holds a spilled payload's lock. Nothing reads the ring's bytes of a taken record, and
        nothing writes the ring without this lock."""
        mm = self.mm
        tail = self._current(self.pseq, P_AT)[1]
        if self.consumers()[0] < tail:  # a stale head only says "not empty"
            return False
        if tail - _SEQ.unpack_from(mm, RING_GIVEN_BACK)[0] >= RECLAIM_BYTES:
            self._give_back_ring(tail)
            _SEQ.pack_into(mm, RING_GIVEN_BACK, tail)
        hold = self.fds.hold
        if _SEQ.unpack_from(mm, SPILL_END)[0] and hold >= 0 and _OFD_GETLK is not None and not self.spill_locks:
            base = self.spill_base
            got = fcntl.fcntl(hold, _OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, base, 0, 0))
            if _FLOCK.unpack(got)[0] == fcntl.F_UNLCK:  # nobody writes or reads a spilled payload
                os.ftruncate(self.fd, base)
                _SEQ.pack_into(mm, SPILL_END, 0)
        return True

    # -- consumers

    def try_get(self, deadline: float | None = None) -> tuple[int, bytes] | None:
        """Take the oldest record and commit (its kind and payload), or None when empty, or
        when the lock was not had by ``deadline``."""
        native = self.native
        if native is not None:
            got = native.get()
            if got.__class__ is tuple:
                return got
            if got == NATIVE_EMPTY:
                return None
        # Empty, as far as can be seen without the lock? (A stale tail only says so sooner.)
        if self.consumers()[0] >= self.tail_seen:
            self.tail_seen = self.producers()[0]
            if self.consumers()[0] >= self.tail_seen:
                return None
        got = self.clock.run(deadline, None, self._take_locked)
        if got is not None and self.put_waiters.value:
            self.wake(self.cseq_addr, WAKE_ALL, self.put_waiters, self.plock)
        return got  # type: ignore[no-any-return]

    def _take_locked(self) -> tuple[int, bytes] | None:
        mm, cseq = self.mm, self.cseq
        seq, head, nget, done, _ = self._current(cseq, C_AT)
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
        if kind == KIND_SPILL:  # locked before it is taken: a reclaim would see it
            self.lock_spill(*SPILL.unpack(payload))
        head += (length + 15) & ~7
        if head >= self.tail_seen:
            kind |= DRAINED
        seq = (seq + 1) & 0xFFFFFFFF
        COPY.pack_into(mm, C_AT[seq & 1], seq, head, nget + 1, done, seq)
        cseq.value = seq  # the commit
        return kind, payload

    def task_done(self) -> None:
        self.clock.run(None, None, self._task_done_locked)
        if self.join_waiters.value:
            self.wake(self.cseq_addr, WAKE_ALL, self.join_waiters, self.clock)

    def _task_done_locked(self) -> None:
        _, head, nget, done, _ = self._current(self.cseq, C_AT)
        if done >= self.producers()[2]:
            raise ValueError("task_done() called too many times")
        self._commit(self.cseq, C_AT, head, nget, done + 1)

    def unfinished(self) -> int:
        return int(self.producers()[2] - self.consumers()[2])

    def count(self) -> int:
        """Messages put and not yet taken, those waiting in any process's backlog included."""
        return int(self.producers()[1] - self.consumers()[1] + self.backlogged())

    def empty(self) -> bool:
        return bool(self.consumers()[0] >= self.producers()[0])

    # -- sleeping

    @staticmethod
    def wake(addr: int, count: int, waiters: Any, lock: Any) -> None:
        """Wake sleepers on a commit word after a commit. When none was asleep, a counted waiter
        not asleep yet sees the commit and will not sleep: the count is stale (a waiter killed
        while asleep) and is cleared, under the ``lock`` it is kept under if that is free at once,
        so that later commits make no system call for it. Its thread inside a call under that
        lock (a signal handler's put or get): the count stays, for a later commit to clear; the
        commit is made, so nothing may raise here (a put would be made again)."""
        if _futex_wake(addr, count) == 0:
            try:
                lock.run(_NOW, None, _add_waiters, waiters, None)
            except ReentrantCallError:
                pass

    def count_waiter(self, side: str, word: Any, delta: int) -> None:
        """Add ``delta`` to a waiter count, under the lock of the side that owns it."""
        (self.clock if side == "c" else self.plock).run(None, None, _add_waiters, word, delta)

    def unleak(self) -> None:
        """After an exception: a lock this thread was taking when interrupted is let go."""
        self.plock.unleak()
        self.clock.unleak()

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
        self._close_fds()


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


WATCH_INTERVAL = 0.5  # seconds a blocking get() waits between looks whether any other process holds the queue
# At exit, a process's queues let go of the queue (once its backlog is written) after the Manager's
# shutdown (priority 12) and before the torch drop-in's owner waits for its receivers (CLOSE_PRIORITY - 1).
CLOSE_PRIORITY = 9
# Before a get() sleeps it looks at the ring, yielding the CPU between looks, for at most
# SPIN_SECONDS, and only while this handle's previous wait was shorter than that
# (gpushare._spin.SpinPolicy): a stream of items closer together costs no sleep and no
# wake-up (a consumer of a fan-out to 8 waits about 80 us between items), sparse items cost
# no spinning (dev/performance.md, "Spinning before a get() sleeps").
SPIN_SECONDS = 200e-6


def _no_yield() -> None:
    time.sleep(0)


class _Backlog:
    """One process's messages that were not written at once, oldest first, and the thread
    that writes them (multiprocessing's feeder, for the overflow only). An item is
    ``(data, kind, task, counted)``: ``counted`` once :meth:`Region.reserve` counted it (a
    bounded queue's always are); an uncounted one (the lock was busy, or a signal handler's
    put met its own thread's lock) is spilled and counted by the thread.

    Holds no reference to its queue: a queue collected with a backlog still delivers it. Once
    closed and written out, it lets go of the region (:meth:`Region.let_go`).
    """

    __slots__ = ("__weakref__", "closing", "cond", "items", "region", "thread", "writing")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.items: collections.deque[tuple[bytes, int, int, bool]] = collections.deque()
        # Reentrant: a signal handler's put() may push while its thread is inside push().
        self.cond = threading.Condition(threading.RLock())
        self.writing = threading.Lock()  # one writer at a time, should a re-entered push start a second
        self.closing = False
        self.thread: threading.Thread | None = None

    def push(self, data: bytes, kind: int, task: int, counted: bool) -> None:
        """Append, starting the thread if it is not running."""
        with self.cond:
            self.items.append((data, kind, task, counted))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._feed, name="QueueFeederThread", daemon=True)
                self.thread.start()
            self.cond.notify()

    def close(self) -> None:
        """No more pushes: the thread ends once it wrote everything, and the region is let go."""
        with self.cond:
            self.closing = True
            idle = not self.items and (self.thread is None or not self.thread.is_alive())
            self.cond.notify()
        if idle:
            self.region.let_go()

    def join(self) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _feed(self) -> None:
        region, items = self.region, self.items
        with self.writing:
            while True:
                with self.cond:
                    while not items and not self.closing:
                        self.cond.wait()
                    if not items:
                        break
                    data, kind, task, counted = items.popleft()
                if not counted:
                    if kind == KIND_DATA and len(data) > region.spill_over:
                        data, kind = region.spill(data), KIND_SPILL  # type: ignore[assignment]
                    region.reserve(task, 0)
                while True:
                    seen = region.cseq.value  # before the try: a get after it wakes the wait below
                    if not region.put_reserved(data, kind):
                        if kind == KIND_SPILL:
                            region.spill_done(data)
                        break
                    region.count_waiter("p", region.put_waiters, 1)
                    region.wait_for_get(seen, WATCH_INTERVAL)
                    region.count_waiter("p", region.put_waiters, -1)
        region.let_go()  # closing, and everything written


def _finalize_close(backlog: _Backlog) -> None:
    backlog.close()


def _finalize_join(ref: Any) -> None:
    backlog = ref()
    if backlog is not None:
        backlog.join()


_live: weakref.WeakSet[Queue] = weakref.WeakSet()  # this process's queues, for a fork's child
_regions: weakref.WeakSet[Region] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """Any fork (multiprocessing's or a bare ``os.fork()``): the child starts with empty backlogs
    and no feeder of its parent's, and holds each queue with a hold of its own."""
    for region in list(_regions):
        region.after_fork()
    for q in list(_live):
        q._setup()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def put_on_and_held_elsewhere() -> bool:
    """Whether another process holds a queue this process put on (at its exit: may still get
    what this process put there)."""
    return any(q._put_any and q._region.held_elsewhere() for q in list(_live))


class Queue:
    """``multiprocessing.Queue`` over a shared-memory ring: ``put()`` pickles the item and
    writes it into the ring itself (a thread only for what is not written at once), and
    ``get()`` raises OwnerGoneError instead of waiting forever once no other process holds
    the queue."""

    __module__ = "gpushare.queues"  # its public home (help, tracebacks); pickled as this module's

    _joinable = 0
    __class_getitem__: Any = classmethod(types.GenericAlias)

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        self._maxsize = max(0, int(maxsize))
        self._region = Region()
        self._opid = os.getpid()
        self._setup()
        util.register_after_fork(self, Queue._on_exit)

    def _setup(self) -> None:
        self._closed = False
        self._joincancelled = False
        self._spin = SpinPolicy(SPIN_SECONDS, adaptive=True)  # how a blocking get() waits
        self._backlog = _Backlog(self._region)
        self._put_any = False  # this process put on it (then it never decides that nobody can put)
        self._bytes_taken = 0  # bytes this process took from the ring since it last gave memory back
        self._jointhread: Any = None
        self._close: Any = None
        self._on_exit()
        _live.add(self)

    def _on_exit(self) -> None:
        """At exit, or when collected: the backlog is written, then the queue is let go. Made
        again once a child's bootstrap cleared the finalizers made while it unpickled its
        arguments (multiprocessing's after-fork hooks run after that)."""
        self._close = util.Finalize(self, _finalize_close, [self._backlog], exitpriority=CLOSE_PRIORITY)

    def __getstate__(self) -> tuple[Any, ...]:
        context.assert_spawning(self)
        # One fd passed per child, however often the child's pickle is made (gpushare's
        # dumps may pickle twice: its dry run, then ForkingPickler) or names the queue.
        # The hold goes along so that the queue stays held until the child holds it itself.
        passed = vars(context.get_spawning_popen()).setdefault("_gpushare_queue_fds", {})
        fds = self._region.fds
        for fd in (fds.fd, fds.hold):
            if fd >= 0 and fd not in passed:
                passed[fd] = DupFd(fd)
        return (self._maxsize, passed[fds.fd], passed.get(fds.hold), self._opid)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt(self)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._maxsize, fd, hold, self._opid = state
        self._region = Region(fd.detach(), inherited_hold=-1 if hold is None else hold.detach())
        self._setup()
        util.register_after_fork(self, Queue._on_exit)

    # -- putting

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` on the queue, as ``multiprocessing.Queue.put``.

        The item is pickled here, in the caller (lambdas and closures too), so an
        unpicklable item raises here and the caller may change or release it as soon
        as this returns. A buffer put here is leased to whichever process gets it.

        Parameters
        ----------
        obj : object
            The item.
        block : bool
            On a full bounded queue, wait for room (default) or raise ``queue.Full`` at once.
        timeout : float, optional
            With ``block``, seconds to wait for room; None waits for as long as it takes.

        Raises
        ------
        queue.Full
            If a bounded queue had no room in time.
        ValueError
            If the queue was closed in this process.
        ReentrantCallError
            If a signal handler puts on a bounded queue while its own thread is inside a
            call on it.
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        data = _pickle(obj)
        region = self._region
        if not self._backlog.items and len(data) <= region.spill_over:
            try:
                if not region.try_put(data, KIND_DATA, self._joinable, self._maxsize, _NOW):
                    self._put_any = True
                    return
            except ReentrantCallError:  # a signal handler's put, its thread inside a call on this queue
                pass
            except BaseException:
                region.unleak()
                raise
        self._put_slowly(data, block, timeout)

    def _put_slowly(self, data: bytes, block: bool, timeout: float | None) -> None:
        """Spill, wait for room in a bounded queue, or leave the message to the backlog."""
        region, backlog, maxsize, task = self._region, self._backlog, self._maxsize, self._joinable
        self._put_any = True
        now = time.monotonic()
        deadline = now if not block else None if timeout is None else now + max(0.0, timeout)
        # How long to wait for the producers' lock: a bounded queue's put until its deadline; an
        # unbounded one's a moment (LOCK_PATIENCE), then the backlog's thread waits instead.
        patience = deadline if maxsize else now + LOCK_PATIENCE if block else _NOW
        kind = KIND_DATA
        try:
            while True:
                seen = region.cseq.value  # before the try: a get after it wakes the wait below
                if len(data) > region.spill_over and kind == KIND_DATA:
                    spilled = region.spill(data, patience)
                    if spilled is None:  # the lock busy: the backlog's thread spills it, or Full
                        answer = BUSY
                    else:
                        data, kind = spilled, KIND_SPILL
                        continue
                else:
                    # Behind this process's backlog, or into the ring now.
                    answer = NO_ROOM if backlog.items else region.try_put(data, kind, task, maxsize, patience)
                    if not answer:
                        if kind == KIND_SPILL:
                            region.spill_done(data)
                        break
                    if answer == NO_ROOM:  # the backlog's thread writes it, counted now
                        answer = region.reserve(task, maxsize, patience)
                        if not answer:
                            backlog.push(data, kind, task, True)
                            break
                if answer == BUSY and not maxsize:
                    # Unbounded: never wait for another process's lock (a stopped one may hold it);
                    # the backlog's thread counts and writes it.
                    backlog.push(data, kind, task, False)
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Full
                if answer == FULL:
                    region.count_waiter("p", region.put_waiters, 1)
                    region.wait_for_get(seen, WATCH_INTERVAL if left is None else min(left, WATCH_INTERVAL))
                    region.count_waiter("p", region.put_waiters, -1)
        except ReentrantCallError:
            if maxsize:
                raise ReentrantCallError(
                    "put() on a bounded queue was called by a signal handler while its thread was inside a "
                    "call on the same queue; it cannot wait for its own thread. Set a flag in the handler "
                    "and put from the main code, or use an unbounded queue (its put() from a handler works)"
                ) from None
            backlog.push(data, kind, task, False)
        except BaseException as exc:
            if kind == KIND_SPILL:  # not queued: its pages go back
                region.drop_spill(data)
            # A lock half taken by this call goes (queue.Full is raised with none held; a signal
            # handler's put that raises it may have been lent its thread's lock, which stays held).
            if exc.__class__ is not queue.Full:
                region.unleak()
            raise
        if backlog.thread is not None and self._jointhread is None and not self._joincancelled:
            self._watch_backlog()

    def _watch_backlog(self) -> None:
        """The backlog's thread started: at exit (or when collected) this process writes
        the backlog out before it ends, as multiprocessing's feeder does."""
        self._jointhread = util.Finalize(self._backlog, _finalize_join, [weakref.ref(self._backlog)], exitpriority=-5)

    def put_nowait(self, obj: Any) -> None:
        """``put(obj, False)``: raise ``queue.Full`` at once on a full bounded queue.

        Parameters
        ----------
        obj : object
            The item.
        """
        self.put(obj, False)

    # -- getting

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return the next item, as ``multiprocessing.Queue.get``.

        Parameters
        ----------
        block : bool
            On an empty queue, wait for an item (default) or raise ``queue.Empty`` at once.
        timeout : float, optional
            With ``block``, seconds to wait; None waits for as long as it takes.

        Returns
        -------
        object
            The item, unpickled here (buffers arrive mapped, with no copy).

        Raises
        ------
        queue.Empty
            If no item came in time.
        OwnerGoneError
            Instead of waiting forever: the queue is empty and no other process holds
            it, so none can ever put on it.
        DescriptorError
            If a buffer in the item can no longer be claimed (its lease expired or its
            owner shut down with it unclaimed).
        ValueError
            If the queue was closed in this process.
        ReentrantCallError
            If a signal handler gets while its own thread is inside a call on the queue.
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        try:
            got = self._region.try_get(_NOW)  # the fast path: a message is there
        except ReentrantCallError:
            raise _reentered_get() from None
        except BaseException:
            self._region.unleak()
            raise
        if got is not None:
            kind, payload = got
            if kind:
                if kind != DRAINED:  # spilled
                    return _restore(self._taken(got))
                # _taken's accounting, inline: every get of a round trip empties the queue
                taken = self._bytes_taken + len(payload)
                self._bytes_taken = 0 if taken >= RECLAIM_BYTES and self._region.drained() else taken
                return _restore(payload)
            self._bytes_taken += len(payload)
            return _restore(payload)
        if not block:
            raise queue.Empty
        return self._get(timeout)

    def get_nowait(self) -> Any:
        """``get(False)``: the next item, or ``queue.Empty`` at once.

        Returns
        -------
        object
            The item.
        """
        return self.get(False)

    def _get(self, timeout: float | None) -> Any:
        """The next item; a blocking wait looks every WATCH_INTERVAL whether any other process
        still holds the queue."""
        deadline = None if timeout is None else time.monotonic() + timeout
        region = self._region
        while True:
            wait = WATCH_INTERVAL if deadline is None else min(WATCH_INTERVAL, max(0.0, deadline - time.monotonic()))
            try:
                return _restore(self._receive(wait))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            except ReentrantCallError:  # raised before this call took a lock: nothing to let go
                raise _reentered_get() from None
            except BaseException:  # a signal handler's exception (Ctrl-C) may leave a lock half taken
                region.unleak()
                raise
            # Nobody else holds it (decided first, then the ring looked at once more): nothing can come.
            if not self._put_any and self._opid != os.getpid() and not region.held_elsewhere():
                got = region.try_get()
                if got is not None:
                    return _restore(self._taken(got))
                raise OwnerGoneError(
                    f"no other process holds this queue any more: its creator (pid {self._opid}) and every "
                    "process it was passed to have exited or closed it, and it is empty, so nothing more "
                    "can arrive. End this worker; buffers from a Manager(owner='server') outlive their producer"
                )
            child = stopped_by_main_guard()
            if child is not None:  # nothing it was to put will come, nor from any child started alike
                raise main_guard_error(f"child process {child.name}", child.pid)

    def _receive(self, timeout: float) -> bytes | bytearray:
        """One message's bytes (unpickled by ``_restore`` outside the lock); raises queue.Empty."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        region = self._region
        deadline = time.monotonic() + timeout
        got = region.try_get(deadline)
        if got is None:
            got = self._wait(region, deadline)
        if got is None:
            raise queue.Empty
        return self._taken(got)

    def _taken(self, got: tuple[int, bytes]) -> bytes | bytearray:
        """A taken record's message: a spilled one read back; once the queue is empty after
        RECLAIM_BYTES taken here, its memory is given back (:meth:`Region.reclaim`)."""
        kind, payload = got
        if kind == KIND_SPILL or kind == KIND_SPILL | DRAINED:
            return self._region.unspill(payload)  # which gives back too
        self._bytes_taken += len(payload)
        if kind and self._bytes_taken >= RECLAIM_BYTES and self._region.drained():
            self._bytes_taken = 0
        return payload

    def _wait(self, region: Region, deadline: float) -> tuple[int, bytes] | None:
        """Spin a moment if the last wait was as short (a reply is often that near), then
        sleep on the producers' word."""
        pseq = region.pseq
        seen = pseq.value
        got = region.try_get(deadline)  # a put may have come between the caller's try and ``seen``
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
            got = region.try_get(deadline)
            now = clock()
            if got is not None or now >= deadline:  # an item, or the timeout: a wait too
                self._spin.waited(now - start)
                return got
            if region.pending:  # the queue is idle: now its pages may go
                region.idle()
                continue
            region.count_waiter("c", region.get_waiters, 1)
            region.wait_for_put(seen, deadline - now)
            region.count_waiter("c", region.get_waiters, -1)

    # -- the rest of multiprocessing.Queue's interface

    def qsize(self) -> int:
        """How many items are in the queue now, put by any process and not yet got.

        Returns
        -------
        int
        """
        return self._region.count()

    def empty(self) -> bool:
        """Whether the queue holds no item now (any process may put one the next moment).

        Returns
        -------
        bool
        """
        return self._region.empty()

    def full(self) -> bool:
        """Whether a bounded queue holds ``maxsize`` items now, counted across every process.

        Returns
        -------
        bool
        """
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def close(self) -> None:
        """No more puts or gets in this process; what it put is still written (see :meth:`join_thread`)."""
        self._closed = True
        close = self._close
        if close:
            self._close = None
            close()

    def join_thread(self) -> None:
        """After :meth:`close`: wait until everything this process put is in the queue."""
        assert self._closed, f"Queue {self!r} not closed"
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        """Let this process exit without waiting to write what it put and has not written yet."""
        self._joincancelled = True
        try:
            self._jointhread.cancel()
        except AttributeError:
            pass


LOCK_PATIENCE = 0.01  # seconds an unbounded queue's put() waits for the producers' lock, then leaves it to the backlog


def _reentered_get() -> ReentrantCallError:
    return ReentrantCallError(
        "get() was called by a signal handler while its thread was inside a call on the same queue; "
        "it cannot wait for its own thread. Set a flag in the handler and get from the main code"
    )


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``, with the same changes as :class:`Queue`; the count
    of unfinished tasks lives in the region, committed with the message that adds one."""

    __module__ = "gpushare.queues"
    _joinable = 1

    def task_done(self) -> None:
        """Say that an item got earlier is processed, as ``multiprocessing.JoinableQueue.task_done``.

        Raises
        ------
        ValueError
            If called more times than items were put.
        """
        self._region.task_done()

    def join(self) -> None:
        """Wait until every item put by any process has been got and marked :meth:`task_done`."""
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

    __module__ = "gpushare.queues"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt(self)

    def put(self, obj: Any) -> None:
        """Put ``obj`` on the queue, pickled here as a Process's arguments are.

        Parameters
        ----------
        obj : object
            The item (lambdas and closures travel by value).
        """
        # Pickled before taking the lock, as the stdlib's does; a plain value (a Pool's None
        # sentinel, put even at interpreter exit) by ForkingPickler alone, the same bytes.
        data = ForkingPickler.dumps(obj) if _settled(obj) else dumps(obj, None)
        if self._wlock is None:  # type: ignore[attr-defined]
            self._writer.send_bytes(data)  # type: ignore[attr-defined]
        else:
            with self._wlock:  # type: ignore[attr-defined]
                self._writer.send_bytes(data)  # type: ignore[attr-defined]


# The queues' public home is gpushare.queues (help() and tracebacks say so), but a queue pickled
# for a child names this module, so that the child imports nothing more to rebuild it.
_OURS = {cls.__name__: cls for cls in (Queue, JoinableQueue, SimpleQueue)}


def _rebuilt(q: Any) -> tuple[Any, ...]:
    """A queue's reduce value: the class by its name here when it is one of ours, else itself."""
    cls = type(q)
    return (_rebuild, (cls.__name__ if _OURS.get(cls.__name__) is cls else cls, q.__getstate__()))


def _rebuild(cls: Any, state: Any) -> Any:
    if isinstance(cls, str):
        cls = _OURS[cls]
    q = cls.__new__(cls)
    q.__setstate__(state)
    return q
