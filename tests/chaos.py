"""Shared pieces of the chaos tests: the resources a run must give back.

Both the state machine (``test_chaos.py``) and the chaos run
(``chaos_run.py``) start many short-lived processes and kill some of them.
After a run nothing they made may be left: no process, no ``/dev/shm``
segment, no socket directory under the runtime (temporary) directory. The
names gpushare gives these carry the pid of the process that made them
(``/dev/shm/gpushare-<pid>-...``, ``<tmp>/gpushare-<service>-<pid>-...``),
so a leak is attributed to the process that made it even while other
test runs share the machine.

Also here: the state machine's producer and consumer processes, each a
loop that answers every command from its inbox exactly once.
"""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable

import gpushare as mp
from gpushare import _lifetime
from gpushare._service import process_alive

N = 1024  # float32 elements per buffer: one 2 MiB allocation
SLOTS = 2  # ring slots
CALL_BOUND = 20.0  # any one command, on a loaded machine
GONE_BOUND = 5.0  # docs/reliability.md: OwnerGoneError, server and socket directory gone within 5 s
STATS_BOUND = 2.0  # releases are journal records the owner reads a moment later
T = 120  # a worker's wait for its next command


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_segments(pids: Iterable[int], before: Collection[str] = ()) -> list[str]:
    """The host backend's segments made by any of ``pids`` that still exist (not in ``before``)."""
    return sorted(p for pid in pids for p in glob.glob(f"/dev/shm/gpushare-{int(pid)}-*") if p not in before)


def socket_dirs(pids: Iterable[int], before: Collection[str] = ()) -> list[str]:
    """gpushare's socket directories (owner, ring, ...) made by any of ``pids`` that still exist
    (not in ``before``)."""
    root = tempfile.gettempdir()
    return sorted(
        p for pid in pids for p in glob.glob(os.path.join(root, f"gpushare-*-{int(pid)}-*")) if p not in before
    )


def alive(pids: Iterable[int]) -> list[int]:
    return sorted(pid for pid in pids if process_alive(pid, sentinel=False))


def existing() -> frozenset[str]:
    """Every gpushare segment and socket directory there now, whoever made it.

    A run passes these to :func:`leftovers` as ``before``: they are not its leftovers,
    even where one of its processes reuses the pid in their names (pids wrap at
    ``pid_max``). A process killed together with its whole group (its Manager's server
    too) leaves such files, because no watchdog outlives it."""
    root = tempfile.gettempdir()
    return frozenset(glob.glob("/dev/shm/gpushare-*") + glob.glob(os.path.join(root, "gpushare-*")))


def leftovers(pids: Iterable[int], before: Collection[str] = ()) -> dict[str, list]:
    """Everything the processes ``pids`` made that is still there (empty lists: nothing
    leaked), leaving out the paths in ``before`` (see :func:`existing`)."""
    pids = list(pids)
    return {
        "processes": alive(pids),
        "shm": shm_segments(pids, before),
        "socket_dirs": socket_dirs(pids, before),
    }


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.02) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            return None
        time.sleep(interval)


def snapshot() -> dict[str, int]:
    """This process's own resource counts."""
    return {"fds": open_fds(), "threads": threading.active_count()}


# -- the state machine's processes (test_chaos.py drives them) ----------------------------


def read(buf) -> float | str:
    """The value every element holds, "torn" if they differ, or the error touching it raised."""
    try:
        arr = buf.numpy()
    except mp.GpushareError as exc:
        return type(exc).__name__
    first = float(arr[0])
    return first if bool((arr == arr[0]).all()) else "torn"


def w_consumer(out, index, mailboxes) -> None:
    """A consumer: holds buffers by handle id, answers every command once."""
    inbox = mailboxes[index]
    held = {}  # hid -> Buffer
    ring = None
    ring_held = []
    while True:
        cmd = inbox.get(timeout=T)
        op = cmd[0]
        if op == "take":  # put here by the producer or by another consumer
            _, hid, buf = cmd
            held[hid] = buf
            out.put(("took", hid, read(buf)))
        elif op == "read":
            _, hids, until_gone = cmd
            values = {}
            for hid in hids:
                deadline = time.monotonic() + GONE_BOUND
                while True:
                    value = read(held[hid])
                    if not until_gone or isinstance(value, str) or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)  # the owner's death reaches this process a moment later
                values[hid] = value
            out.put(("read", values))
        elif op == "release":
            held.pop(cmd[1]).release()
            out.put(("released",))
        elif op == "relay":  # A -> B -> C: this process re-shares what it received
            _, hid, new_hid, target, release = cmd
            mailboxes[target].put(("take", new_hid, held[hid]))
            if release:
                held.pop(hid).release()
            out.put(("relayed",))
        elif op == "ring_take":
            ring = cmd[1]
            out.put(("ring_joined", ring.stats()["closed"]))
        elif op == "ring_get":
            item = ring.get(timeout=CALL_BOUND)
            ring_held.append(item)
            out.put(("ring_got", item.meta, read(item)))
        elif op == "ring_release":
            ring_held.pop(0).release()
            out.put(("ring_released",))
        elif op == "ring_drain":  # after the producer closed the ring or died
            for item in ring_held:
                item.release()
            ring_held.clear()
            got, started = [], time.monotonic()
            try:
                while True:
                    item = ring.get(timeout=GONE_BOUND)
                    got.append(item.meta)
                    item.release()
            except (mp.RingClosedError, mp.OwnerGoneError, TimeoutError) as exc:
                ended = type(exc).__name__
            ring.close()
            ring = None
            out.put(("drained", got, ended, time.monotonic() - started))
        elif op == "report":
            stats = _lifetime.link_stats()
            out.put(("report", stats["open_mappings"], stats["owners"]))
        elif op == "exit":
            for buf in held.values():
                buf.release()
            out.put(("bye",))
            return


def w_producer(out, inbox, mailboxes, backend, owner) -> None:
    """The owner of a Manager (or, with owner="server", the client that asked for its memory)."""
    device = "cpu" if backend == "host" else 0
    m = mp.Manager(owner=owner, release_timeout=2.0)
    bufs = {}
    ring = None
    out.put(("started", os.getpid(), m._process.pid))
    while True:
        cmd = inbox.get(timeout=T)
        op = cmd[0]
        if op == "alloc":
            bufs[cmd[1]] = m.full((N,), cmd[2], "float32", device=device, backend=backend)
            out.put(("ok", None))
        elif op == "write":
            bufs[cmd[1]].fill(cmd[2])
            out.put(("ok", None))
        elif op == "send":
            _, key, hid, target = cmd
            mailboxes[target].put(("take", hid, bufs[key]))
            out.put(("ok", None))
        elif op == "drop":
            bufs.pop(cmd[1]).release()
            out.put(("ok", None))
        elif op == "trim":
            out.put(("ok", m.trim()))
        elif op == "stats":  # until the counts in cmd[1] hold, or STATS_BOUND
            expected, started = cmd[1], time.monotonic()
            while True:
                stats = m.stats()
                if all(stats[k] == v for k, v in expected.items()) or time.monotonic() - started > STATS_BOUND:
                    break
                time.sleep(0.005)
            out.put(("ok", (stats, time.monotonic() - started)))
        elif op == "ring_open":
            ring = m.ring((N,), "float32", device=device, slots=SLOTS, consumers=0, backend=backend)
            out.put(("ok", None))
        elif op == "ring_send":
            mailboxes[cmd[1]].put(("ring_take", ring))
            out.put(("ok", None))
        elif op == "ring_publish":
            buf = ring.acquire(timeout=CALL_BOUND)
            buf.fill(cmd[1])
            ring.publish(buf, meta=cmd[1])
            out.put(("ok", None))
        elif op == "ring_close":
            ring.close()
            ring = None
            out.put(("ok", None))
        elif op == "exit":
            if ring is not None:
                ring.close()
            for buf in bufs.values():
                buf.release()
            m.shutdown()
            out.put(("bye", None))
            return
