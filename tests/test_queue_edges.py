"""The Queue at its edges, each case one script run against multiprocessing and against gpushare.

A script takes the module to import as ``mp`` (``multiprocessing`` or ``gpushare``) as its
first argument and prints one line of JSON; the test compares the two. The cases: messages
put just before a process exits (spilled or in the backlog, from the main process and from
a child, in each start method), a bare ``os.fork()`` with a backlog, a signal handler that
puts while its thread is inside ``put()``, Ctrl-C while waiting for a lock another process
holds, timeouts while another process holds the lock, a queue whose creator drops it or
returns while others still put, ``maxsize`` and ``qsize()`` across producers, and
``get_nowait()`` on an empty queue. Every script runs in a subprocess with a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.timeout(2 * 120 + 60)  # two scripts, each bounded by T

MODULES = ("multiprocessing", "gpushare")
T = 120  # seconds a script may take


def run(script: str, module: str, *args: str, timeout: float = T, env: dict[str, str] | None = None) -> Any:
    """Run ``script`` with ``module`` as ``mp`` (and ``env``'s settings): the JSON of its last
    line of output."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), module, *args],
        env=subprocess_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"{module}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


def both(script: str, *args: str, timeout: float = T) -> tuple[Any, Any]:
    """The script's answers with multiprocessing, then with gpushare."""
    return run(script, "multiprocessing", *args, timeout=timeout), run(script, "gpushare", *args, timeout=timeout)


# -- messages put before a normal exit arrive ---------------------------------------------------

EXIT = """
import importlib, sys, time
mp = importlib.import_module(sys.argv[1])

def consume(q, path, ready):
    ready.set()
    time.sleep(1.0)  # slow: the producer exits with messages not yet written
    n = 0
    while True:
        try:
            q.get(timeout=3)
        except Exception:  # queue.Empty, or gpushare's OwnerGoneError once nobody else holds it
            break
        n += 1
    with open(path, "w") as f:
        f.write(str(n))

def produce(q):
    for i in range(28):  # 300 kB ones spill; 100 kB ones fill the 1 MiB ring and wait in the backlog
        q.put(b"x" * (300_000 if i % 4 == 0 else 100_000))

if __name__ == "__main__":
    where, method, path = sys.argv[2], sys.argv[3], sys.argv[4]
    ctx = mp.get_context(method)
    q, ready = ctx.Queue(), ctx.Event()
    ctx.Process(target=consume, args=(q, path, ready)).start()
    ready.wait(60)  # multiprocessing's child must have unpickled the queue's lock before its creator exits
    if where == "main":
        produce(q)  # then returns: the exit writes the backlog and joins the consumer
    else:
        p = ctx.Process(target=produce, args=(q,))
        p.start()
        p.join()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.parametrize("where", ["main", "child"])
def test_every_message_put_before_a_normal_exit_arrives(tmp_path, where, method) -> None:
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent(EXIT))
    counts = {}
    for module in MODULES:
        out = tmp_path / f"{module}.txt"
        done = subprocess.run(
            [sys.executable, str(script), module, where, method, str(out)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=T,
            check=False,
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        counts[module] = int(out.read_text())
    assert counts == {"multiprocessing": 28, "gpushare": 28}


# -- a bare os.fork() ---------------------------------------------------------------------------

FORK_WITH_BACKLOG = """
import collections, importlib, json, os, sys
mp = importlib.import_module(sys.argv[1])
if __name__ == "__main__":
    q = mp.Queue()
    for i in range(40_000):  # most of them still wait in this process's backlog at the fork
        q.put(("parent", i, b"y" * 100))
    pid = os.fork()
    if pid == 0:
        q.put(("child", 0, b""))
        q.close()
        q.join_thread()
        os._exit(0)
    got = collections.Counter()
    while True:
        try:
            item = q.get(timeout=3)
        except Exception:
            break
        got[item[:2]] += 1
    _, status = os.waitpid(pid, 0)
    print(json.dumps({
        "parent": sum(1 for key in got if key[0] == "parent"),
        "twice": sum(1 for n in got.values() if n > 1),
        "child": got[("child", 0)],
        "status": status,
    }))
"""


def test_a_bare_fork_starts_with_an_empty_backlog() -> None:
    stdlib, ours = both(FORK_WITH_BACKLOG)
    assert stdlib["parent"] == ours["parent"] == 40_000
    assert stdlib["twice"] == ours["twice"] == 0
    assert ours["status"] == 0
    # multiprocessing's child, whose parent's feeder had started, never sends its own item
    # (a bare fork's child has no feeder thread); gpushare's child does.
    assert ours["child"] == 1


# -- a signal handler's put -----------------------------------------------------------------------

HANDLER_PUTS = """
import importlib, json, os, random, signal, sys, threading, time
mp = importlib.import_module(sys.argv[1])
if __name__ == "__main__":
    q = mp.Queue()
    handled = []
    ran = threading.Event()
    def handler(signum, frame):
        q.put(("handler", len(handled)))
        handled.append(1)
        ran.set()
    signal.signal(signal.SIGUSR1, handler)
    stop = threading.Event()
    def poke():  # one signal at a time (a handler interrupted by the next one nests), at random moments
        rng = random.Random(len(sys.argv))
        while not stop.is_set():
            ran.clear()
            os.kill(os.getpid(), signal.SIGUSR1)
            ran.wait(5)
            time.sleep(rng.random() * 0.003)
    poker = threading.Thread(target=poke, daemon=True)
    poker.start()
    got = {"main": 0, "handler": 0}
    big = b"z" * (2 << 20)  # spilled: its put takes the region's lock in Python code
    for i in range(40):
        q.put(("main", big))
        got[q.get(timeout=60)[0]] += 1
    stop.set()
    poker.join()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    while got["main"] < 40 or got["handler"] < len(handled):
        got[q.get(timeout=60)[0]] += 1
    print(json.dumps({"main": got["main"], "all": got["handler"] == len(handled), "any": bool(handled)}))
"""


def test_a_signal_handler_that_puts_never_wedges_its_process() -> None:
    # gpushare only: multiprocessing's put() takes a thread lock that a handler interrupting its own
    # put() waits for forever (seen in this very script, on a loaded 2-core machine).
    for _ in range(5):
        assert run(HANDLER_PUTS, "gpushare", timeout=90) == {"main": 40, "all": True, "any": True}


REENTERED_GET = """
import importlib, json, signal, sys, threading, time
import gpushare as mp
from gpushare import _queues
if __name__ == "__main__":
    q = mp.Queue()
    seen = []
    def handler(signum, frame):
        try:
            q.get(timeout=5)
            seen.append("got")
        except mp.ReentrantCallError as exc:
            seen.append(type(exc).__name__)
    signal.signal(signal.SIGALRM, handler)
    lock = q._region.clock
    lock.acquire()  # as a get() of this thread holding the consumers' lock
    lock.inside = lock.holder
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    time.sleep(0.3)
    lock.release()
    q.put("after")
    print(json.dumps({"seen": seen, "quick": time.monotonic() - started < 2, "after": q.get(timeout=5)}))
"""


def test_a_reentered_get_raises_at_once_and_the_queue_goes_on() -> None:
    answer = run(REENTERED_GET, "gpushare")
    assert answer == {"seen": ["ReentrantCallError"], "quick": True, "after": "after"}


HANDLER_IN_THE_GAP = """
import json, os, queue, signal, sys, time
import gpushare as mp

def probe(q, out):  # can another process take the producers' lock within 0.3 s?
    out.put(bool(q._region.plock.acquire(time.monotonic() + 0.3)))

if __name__ == "__main__":
    q = mp.Queue(maxsize=int(sys.argv[2]))
    out = mp.Queue()
    if q._maxsize:
        q.put("first")  # full: the handler's put times out
    seen = []
    def handler(signum, frame):
        try:
            q.put(("handler", b"h" * 300_000 if not q._maxsize else b"h"), timeout=0.05)
            seen.append("put")
        except queue.Full:
            seen.append("Full")
        except Exception as exc:
            seen.append(type(exc).__name__)
    signal.signal(signal.SIGALRM, handler)
    lock = q._region.plock
    assert lock.acquire()  # as a put() of this thread that took the lock, its try: not yet entered
    signal.setitimer(signal.ITIMER_REAL, 0.02)
    time.sleep(0.3)
    p = mp.Process(target=probe, args=(q, out))
    p.start()
    taken_elsewhere = out.get(timeout=60)
    p.join(60)
    lock.inside = lock.holder  # the interrupted put goes on, under its lock, and lets go
    lock.release()
    got = [q.get(timeout=30)]  # the handler's item, or the one that filled the queue
    q.put("after")
    got.append(q.get(timeout=30))
    names = [g if isinstance(g, str) else g[0] for g in got]
    print(json.dumps({"seen": seen, "taken_elsewhere": taken_elsewhere, "got": names}))
"""


@pytest.mark.parametrize("portable", [False, True], ids=["robust-mutex", "record-lock"])
@pytest.mark.parametrize(
    ("maxsize", "expected"),
    [
        (0, {"seen": ["put"], "got": ["handler", "after"]}),
        (1, {"seen": ["Full"], "got": ["first", "after"]}),
    ],
    ids=["unbounded", "bounded-full"],
)
def test_a_handler_that_interrupts_its_thread_between_taking_the_lock_and_using_it(
    portable: bool, maxsize: int, expected: dict[str, Any]
) -> None:
    # The window the test above hits at random (its put failed with EDEADLK), here held open on purpose.
    # The handler's put works (or, full, raises queue.Full) and leaves its thread's lock held.
    answer = run(
        HANDLER_IN_THE_GAP, "gpushare", str(maxsize), env={"GPUSHARE_QUEUE_PORTABLE": "1"} if portable else None
    )
    assert answer == {**expected, "taken_elsewhere": False}


HANDLER_AFTER_COMMIT = """
import json, queue, signal, sys, time
import gpushare as mp
if __name__ == "__main__":
    side = sys.argv[2]
    q = mp.Queue()
    region = q._region
    if side != "put":
        q.put("queued" if side == "get" else "s" * (1 << 20))  # a spilled one's get gives memory back
    seen = []
    def handler(signum, frame):
        try:
            got = q.get(timeout=1.0) if side != "put" else q.put("from the handler") or "put"
            seen.append(got if len(got) < 100 else len(got))
        except Exception as exc:
            seen.append(type(exc).__name__)
    signal.signal(signal.SIGALRM, handler)
    # This thread inside a call under the other side's lock, with a waiter counted there and not
    # asleep: the handler's commit is followed by a wake-up that looks at that lock (a spilled
    # message's get, with no waiter, by the memory's give-back, under the producers' lock).
    lock, waiters = (region.clock, region.get_waiters) if side == "put" else (region.plock, region.put_waiters)
    assert lock.acquire()
    lock.inside = lock.holder
    waiters.value = int(side != "get-spilled")
    signal.setitimer(signal.ITIMER_REAL, 0.02)
    time.sleep(0.3)
    lock.release()
    left = []
    while True:
        try:
            got = q.get(timeout=1.0)
            left.append(got if len(got) < 100 else len(got))
        except queue.Empty:
            break
    print(json.dumps({"seen": seen, "left": left, "one_lock": region.plock is region.clock}))
"""


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("put", {"seen": ["put"], "left": ["from the handler"]}),  # once, not again from the backlog
        ("get", {"seen": ["queued"], "left": []}),  # taken and returned, not lost
        ("get-spilled", {"seen": [1 << 20], "left": []}),
    ],
)
def test_a_handler_call_whose_wake_up_meets_its_thread_inside_a_call_is_made_once(
    side: str, expected: dict[str, Any]
) -> None:
    # The Python path (the C calls never raise there; the portable fallback has no futex wake-up):
    # a put was made three times, a get's item lost.
    answer = run(HANDLER_AFTER_COMMIT, "gpushare", side, env={"GPUSHARE_QUEUE_NATIVE": "0"})
    if answer.pop("one_lock") and side != "put":
        # One lock for both sides (arm64, GPUSHARE_QUEUE_ONE_LOCK=1): the get cannot start, says so,
        # and the item stays queued.
        expected = {"seen": ["ReentrantCallError"], "left": expected["seen"]}
    assert answer == expected


# -- a lock another process holds: interruptible waits, timeouts ---------------------------------

HELD_LOCK = """
import importlib, json, os, queue, signal, sys, threading, time
import gpushare as mp

def hold(q, side, ready, go):
    lock = q._region.plock if side == "p" else q._region.clock
    lock.acquire()
    ready.put("holding")
    go.get(timeout=60)
    lock.release()
    ready.put("released")

def wait_in(q, call, out):
    try:
        if call == "get":
            q.get(timeout=30)
        else:
            q.put(b"x" * 100, timeout=30)
        out.put(("returned", 0.0))
    except KeyboardInterrupt:
        out.put(("KeyboardInterrupt", time.monotonic()))
    time.sleep(30)  # alive: whatever it held, it still holds unless it let go

if __name__ == "__main__":
    call = sys.argv[2]
    q = mp.Queue(maxsize=4)
    ready, go, out = mp.Queue(), mp.Queue(), mp.Queue()
    holder = mp.Process(target=hold, args=(q, "c" if call == "get" else "p", ready, go), daemon=True)
    holder.start()
    assert ready.get(timeout=60) == "holding"
    waiter = mp.Process(target=wait_in, args=(q, call, out), daemon=True)
    waiter.start()
    time.sleep(1.0)  # the waiter is waiting for the held lock
    sent = time.monotonic()
    os.kill(waiter.pid, signal.SIGINT)
    what, when = out.get(timeout=30)
    interrupted = what == "KeyboardInterrupt" and when - sent < 1.0
    go.put("release")
    assert ready.get(timeout=60) == "released"
    # The interrupted waiter is alive and holds nothing: this process's calls go through.
    started = time.monotonic()
    q.put("ok", timeout=10)
    while (item := q.get(timeout=10)) != "ok":
        pass
    print(json.dumps({"interrupted": interrupted, "free": time.monotonic() - started < 5, "alive": waiter.is_alive()}))
"""


@pytest.mark.parametrize("call", ["get", "put"])
def test_ctrl_c_interrupts_a_wait_for_a_held_lock_and_leaves_nothing_held(call) -> None:
    answer = run(HELD_LOCK, "gpushare", call)
    assert answer == {"interrupted": True, "free": True, "alive": True}


STOPPED_HOLDER = """
import importlib, json, os, queue, signal, sys, time
import gpushare as mp

def hold(q, ready):
    q._region.plock.acquire()
    ready.put("holding")
    time.sleep(60)  # stopped here (SIGSTOP), the producers' lock held

if __name__ == "__main__":
    bounded, unbounded, ready = mp.Queue(maxsize=4), mp.Queue(), mp.Queue()
    answers = {}
    for name, q in (("bounded", bounded), ("unbounded", unbounded)):
        h = mp.Process(target=hold, args=(q, ready), daemon=True)
        h.start()
        assert ready.get(timeout=60) == "holding"
        os.kill(h.pid, signal.SIGSTOP)
        for call in ("put_nowait", "put_timeout"):
            started = time.monotonic()
            try:
                if call == "put_nowait":
                    q.put_nowait(call)
                else:
                    q.put(call, timeout=0.3)
                what = "returned"
            except queue.Full:
                what = "Full"
            answers[f"{name} {call}"] = [what, round(time.monotonic() - started, 1)]
        os.kill(h.pid, signal.SIGKILL)  # its lock goes to the next taker (a robust mutex)
        h.join()
        if name == "unbounded":  # what put_nowait() accepted arrives
            answers["arrived"] = sorted(q.get(timeout=30) for _ in range(2))
    print(json.dumps(answers))
"""


def test_puts_with_a_timeout_keep_it_while_a_stopped_process_holds_the_lock() -> None:
    answer = run(STOPPED_HOLDER, "gpushare")
    assert answer["bounded put_nowait"] == ["Full", 0.0]
    assert answer["bounded put_timeout"][0] == "Full" and answer["bounded put_timeout"][1] < 1.0
    assert answer["unbounded put_nowait"] == ["returned", 0.0]
    assert answer["unbounded put_timeout"][0] == "returned" and answer["unbounded put_timeout"][1] < 1.0
    assert answer["arrived"] == ["put_nowait", "put_timeout"]


SPILL_WRITE_STOPPED = """
import json, os, queue, signal, sys, time
import gpushare as mp

def put_big(q, ready):
    real = os.pwrite
    def slow(fd, data, at):
        ready.put("writing")
        time.sleep(60)  # stopped inside the spill write
        return real(fd, data, at)
    os.pwrite = slow
    q.put(b"b" * (32 << 20))

if __name__ == "__main__":
    q, ready = mp.Queue(maxsize=4), mp.Queue()
    p = mp.Process(target=put_big, args=(q, ready), daemon=True)
    p.start()
    assert ready.get(timeout=60) == "writing"
    started = time.monotonic()
    q.put_nowait("small")
    took = time.monotonic() - started
    p.kill()
    print(json.dumps({"took": took < 0.5, "got": q.get(timeout=10)}))
"""


def test_a_large_write_holds_up_no_other_producer() -> None:
    assert run(SPILL_WRITE_STOPPED, "gpushare") == {"took": True, "got": "small"}


# -- a queue lives while anyone holds it ------------------------------------------------------------

CREATOR_LEAVES = """
import importlib, json, sys, time
mp = importlib.import_module(sys.argv[1])

def produce(q, n):
    for i in range(n):
        time.sleep(0.6)  # slower than a consumer's 0.5 s wait for more once the creator went
        q.put(i)
    q.put(None)

def consume(q, out):
    got = []
    while (item := q.get(timeout=30)) is not None:
        got.append(item)
    out.put(got)

def creator(how, out):
    q = mp.Queue()
    procs = [mp.Process(target=produce, args=(q, 6)), mp.Process(target=consume, args=(q, out))]
    for p in procs:
        p.start()
    q.put("first")
    if how == "drops":
        del q  # the creator keeps running; its children still use the queue
        time.sleep(5)
    # how == "returns": returns at once; its exit joins its children

if __name__ == "__main__":
    out = mp.Queue()
    p = mp.Process(target=creator, args=(sys.argv[2], out))
    p.start()
    got = out.get(timeout=60)
    p.join(60)
    print(json.dumps({"got": got, "exitcode": p.exitcode}))
"""


@pytest.mark.parametrize("how", ["drops", "returns"])
def test_a_queue_outlives_its_creator_while_others_use_it(how) -> None:
    stdlib, ours = both(CREATOR_LEAVES, how)
    assert stdlib == ours == {"got": ["first", *range(6)], "exitcode": 0}


EMPTY_AT_ONCE = """
import importlib, json, queue, sys, time
mp = importlib.import_module(sys.argv[1])

def take(q, out):
    first = q.get(timeout=30)
    answers = []
    for _ in range(3):
        started = time.monotonic()
        try:
            q.get_nowait()
            what = "item"
        except queue.Empty:
            what = "Empty"
        except Exception as exc:
            what = type(exc).__name__
        answers.append((what, time.monotonic() - started < 0.05))
    out.put({"first": first, "after": answers})

if __name__ == "__main__":
    q, out = mp.Queue(), mp.Queue()
    p = mp.Process(target=take, args=(q, out))
    p.start()
    q.put("only")
    del q  # its creator drops it: the child still holds it
    print(json.dumps(out.get(timeout=30)))
    p.join(30)
"""


def test_get_nowait_on_an_empty_queue_raises_empty_at_once() -> None:
    stdlib, ours = both(EMPTY_AT_ONCE)
    assert stdlib == ours == {"first": "only", "after": [["Empty", True]] * 3}


# -- maxsize and qsize() count every process --------------------------------------------------------

BOUNDED = """
import importlib, json, sys, time
mp = importlib.import_module(sys.argv[1])

def produce(q, size, accepted):
    for _ in range(10):
        q.put(b"z" * size)
        with accepted.get_lock():
            accepted.value += 1

if __name__ == "__main__":
    producers, maxsize, size = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    q = mp.Queue(maxsize=maxsize)
    accepted = mp.Value("i", 0)
    procs = [mp.Process(target=produce, args=(q, size, accepted), daemon=True) for _ in range(producers)]
    for p in procs:
        p.start()
    time.sleep(3)  # nobody reads
    answer = {"accepted": accepted.value, "qsize": q.qsize(), "full": q.full()}
    for p in procs:
        p.kill()
    print(json.dumps(answer))
"""


@pytest.mark.parametrize(
    ("producers", "maxsize", "size"),
    [(4, 6, 200_000), (3, 8, 200_000), (4, 6, 100), (2, 5, 400_000)],
    ids=["4x6-ring-full", "3x8-ring-full", "4x6-small", "2x5-spilled"],
)
def test_maxsize_and_qsize_count_every_producer(producers, maxsize, size) -> None:
    stdlib, ours = both(BOUNDED, str(producers), str(maxsize), str(size))
    assert stdlib == ours == {"accepted": maxsize, "qsize": maxsize, "full": True}


# -- memory given back -------------------------------------------------------------------------------

DRAINED_QUEUES = """
import json, os, sys
import gpushare as mp

def resident(queues):
    return sum(os.fstat(q._region.fd).st_blocks * 512 for q in queues)

if __name__ == "__main__":
    queues = [mp.Queue() for _ in range(1000)]
    chunk = b"m" * (128 << 10)
    for q in queues:  # each carries 1 MiB through its ring, then is drained
        for _ in range(8):
            q.put(chunk)
        for _ in range(8):
            assert q.get(timeout=10) == chunk
    print(json.dumps({"MiB": resident(queues) / 2**20}))
"""


def test_drained_queues_give_their_memory_back() -> None:
    answer = run(DRAINED_QUEUES, "gpushare")
    assert answer["MiB"] <= 64, answer


HOT_THEN_IDLE = """
import json, os, time
import gpushare as mp
from gpushare import _queues

punches = []
real = _queues.Region.punch
def counted(self, at, length):
    punches.append(length)
    return real(self, at, length)
_queues.Region.punch = counted

if __name__ == "__main__":
    q = mp.Queue()
    resident = lambda: os.fstat(q._region.fd).st_blocks * 512 / 1024
    message = b"m" * 200
    started = time.monotonic()
    moved = 0
    while time.monotonic() - started < 1.5:  # busy: every get empties the queue
        for _ in range(500):
            q.put(message)
            q.get(timeout=10)
        moved += 500 * len(message)
    busy = len(punches)
    try:
        q.get(timeout=0.2)  # the queue idle: this get sleeps on it
    except Exception:
        pass
    print(json.dumps({"busy_punches": busy, "moved_MiB": moved / 2**20, "idle_KiB": resident()}))
"""


def test_a_busy_queue_gives_its_ring_back_once_a_get_waits_on_it() -> None:
    """A queue emptied by every get of a busy stream punches its ring at most a few times (each
    punch makes every process fault the pages back in); the next get that sleeps on the idle
    queue gives them back all the same."""
    answer = run(HOT_THEN_IDLE, "gpushare")
    # at most RECLAIM_BURST give-backs, then RECLAIM_RATE a second; two punches each at most
    assert answer["busy_punches"] <= 2 * (4 + 2 * 1.5) + 2, answer
    assert answer["moved_MiB"] >= 4, answer  # laps of the ring: a give-back every 32 KiB would be 128 or more
    assert answer["idle_KiB"] <= 48, answer


NO_HOLES = """
import ctypes, errno, json, os, sys
import gpushare as mp
from gpushare import _queues

calls = []
def refuse(fd, mode, at, length):  # a file system without hole punching
    calls.append(length)
    ctypes.set_errno(errno.EOPNOTSUPP)
    return -1
_queues._fallocate = refuse

if __name__ == "__main__":
    q = mp.Queue()
    q._region.can_punch = True  # made before the patch could count: it would punch
    small = [os.urandom(200) for _ in range(10000)]  # 2 MiB through the ring: gives back twice or more
    got = []
    for m in small:
        q.put(m)
        got.append(q.get(timeout=10))
    big = os.urandom(4 << 20)  # spilled past the ring
    size = os.fstat(q._region.fd).st_size
    q.put(big)
    grown = os.fstat(q._region.fd).st_size
    ok_big = q.get(timeout=10) == big
    print(json.dumps({"intact": got == small and ok_big, "calls": len(calls), "can_punch": q._region.can_punch,
                      "grew": grown >= size + len(big), "shrank": os.fstat(q._region.fd).st_size < size + 8192}))
"""


def test_a_file_system_without_holes_loses_nothing_and_is_asked_once() -> None:
    """fallocate's punch refused (EOPNOTSUPP): every message arrives whole, the region stops
    asking, and an empty queue's spill area still goes back by truncation."""
    answer = run(NO_HOLES, "gpushare")
    assert answer == {"intact": True, "calls": 1, "can_punch": False, "grew": True, "shrank": True}, answer


KILLED_MID_SPILL = """
import json, os, signal, sys, time
import gpushare as mp

def put_big(q, ready):
    real = os.pwrite
    def half_then_stop(fd, data, at):
        done = real(fd, data[: len(data) // 2], at)
        ready.put("half")
        time.sleep(60)  # SIGKILLed here, its payload half written, its record never committed
        return done
    os.pwrite = half_then_stop
    q.put(b"k" * (32 << 20))

if __name__ == "__main__":
    q, ready = mp.Queue(), mp.Queue()
    blocks = lambda: os.fstat(q._region.fd).st_blocks * 512 / 2**20
    for _ in range(3):
        p = mp.Process(target=put_big, args=(q, ready))
        p.start()
        assert ready.get(timeout=60) == "half"
        p.kill()
        p.join()
    left = blocks()
    size = os.fstat(q._region.fd).st_size
    q.put(b"s" * (1 << 20))  # spilled, then taken: the queue is empty and nobody holds a spilled payload
    assert q.get(timeout=10) == b"s" * (1 << 20)
    print(json.dumps({"left_MiB": left, "after_MiB": blocks(), "shrank": os.fstat(q._region.fd).st_size < size}))
"""


def test_pages_of_puts_killed_mid_write_go_back_once_the_queue_is_empty() -> None:
    answer = run(KILLED_MID_SPILL, "gpushare")
    assert answer["left_MiB"] >= 15  # a half-written 32 MiB payload (each put's spill gave back the one before)
    assert answer["after_MiB"] <= 2 and answer["shrank"], answer


KILLED_SLEEPER = """
import json, os, signal, sys, time
import gpushare as mp

def sleep_in_get(q):
    q.get(timeout=60)

if __name__ == "__main__":
    q = mp.Queue()
    region = q._region
    p = mp.Process(target=sleep_in_get, args=(q,))
    p.start()
    deadline = time.monotonic() + 30
    while region.get_waiters.value == 0 and time.monotonic() < deadline:  # counted, asleep
        time.sleep(0.01)
    counted = region.get_waiters.value
    p.kill()
    p.join()
    q.put("a")  # wakes nobody: the count is stale
    after_first = region.get_waiters.value
    q.get(timeout=5)
    print(json.dumps({"counted": counted, "after": after_first}))
"""


@pytest.mark.skipif(
    os.environ.get("GPUSHARE_QUEUE_PORTABLE") == "1",
    reason="the portable path has no futex: its waiters poll, and a stale count costs a put nothing",
)
def test_a_waiter_killed_asleep_leaves_no_count_behind() -> None:
    assert run(KILLED_SLEEPER, "gpushare") == {"counted": 1, "after": 0}
