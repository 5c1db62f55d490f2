"""The shared-memory region behind gpushare's Queue: a byte ring of messages, two locks, futex wake-ups.

One anonymous file (``memfd_create``; an unlinked temporary file elsewhere) holds the region.
Children get it as an fd: inherited under fork, passed while spawning otherwise. Layout:

- The producers' side: a commit word ``pseq`` and two copies of their state (``tail``, the
  messages put, the tasks put); the consumers' side likewise (``cseq``; ``head``, the messages
  taken, the tasks done). ``seq & 1`` names the current copy of a side.
- Waiter counts (a wake costs a syscall only when someone sleeps), then two robust
  process-shared mutexes, one per side.
- The ring: records ``length, kind, payload``, 8-aligned; ``tail - head`` bytes are in use.
  A record that would not fit before the end leaves a wrap record. A payload over a quarter
  of the ring spills to a file of its own, whose path is the record.

Protocol: a side changes its state only under its own lock. It writes what it adds (a record)
first, then the new state into the spare copy, each copy framed by its sequence number at both
ends, then bumps its ``seq``: one aligned 4-byte store, the commit. A process killed before it
leaves the old state, so nothing torn is ever seen; killed after it, the change is whole. The
mutexes are robust: the next locker after a dead owner gets EOWNERDEAD and goes on. Each side
reads the other's state without its lock, retrying a copy whose two sequence numbers differ; a
stale value is safe (less room, fewer messages). ``pseq`` and ``cseq`` are also the futex words
consumers and producers sleep on. Every sleep is bounded by the caller, so a lost wake-up costs
latency, never a wedge. Where there are no robust mutexes, a POSIX record lock per side
(``lockf``, dropped by the kernel when its holder dies) and a thread lock take their place;
where there is no futex, a short sleep.
Why: docs/design.md, "Queues".
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import sys
import threading
import time
import weakref

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["FULL", "KIND_DATA", "KIND_SPILL", "NO_ROOM", "RING_BYTES", "Region", "spill_read", "spill_write"]

RING_BYTES = 1 << 20  # the ring's bytes per queue; pages are touched only as messages pass
MAGIC = b"GSQ3"
# Each side's words and copies on cache lines of their own: a put and a get write no line in common.
PSEQ, CSEQ = 64, 128
GET_WAITERS, PUT_WAITERS, JOIN_WAITERS = 192, 196, 200  # written only by those about to sleep
COPY = struct.Struct("<QQQQQ")  # seq, then three fields, then seq again
P_AT = (256, 296)
C_AT = (384, 424)
P_MUTEX, C_MUTEX = 512, 576  # 64 bytes each (a glibc pthread_mutex_t is 40)
HEADER = 640
RECORD = struct.Struct("<II")  # payload length, kind
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
        self.mm = mm = mmap.mmap(fd, os.fstat(fd).st_size)
        if created:
            mm[0:4] = MAGIC
        elif mm[0:4] != MAGIC:
            raise ValueError("this file is not a gpushare queue's region")
        self.cap = len(mm) - HEADER
        self.spill_over = self.cap // 4
        self.pseq = ctypes.c_uint32.from_buffer(mm, PSEQ)  # aligned 4-byte loads and stores
        self.cseq = ctypes.c_uint32.from_buffer(mm, CSEQ)
        self.get_waiters = ctypes.c_uint32.from_buffer(mm, GET_WAITERS)
        self.put_waiters = ctypes.c_uint32.from_buffer(mm, PUT_WAITERS)
        self.join_waiters = ctypes.c_uint32.from_buffer(mm, JOIN_WAITERS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
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
        process's ``pending``) or NO_ROOM (not in the ring now); ``task``: count a task."""
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
        for name in ("pseq", "cseq", "get_waiters", "put_waiters", "join_waiters"):
            self.__dict__.pop(name, None)
        try:
            self.mm.close()
        except BufferError:  # a view still exported: leave the mapping to the collector
            pass
        self._close_fd()


# -- spill files --------------------------------------------------------------------------------------


def spill_dir() -> str:
    if os.path.isdir("/dev/shm"):
        return "/dev/shm"
    import tempfile

    return tempfile.gettempdir()


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
