"""Chaos, part one: a stateful property test of the lifetime protocol across real processes.

The test process is the model and the driver. It starts a *producer*
process (which owns a Manager, ``owner="process"`` or ``owner="server"``)
and long-lived *consumer* processes, all driven by command queues: every
command gets exactly one reply, and the driver waits for it (with a bound)
before the next step, so a kill always finds its victim idle, never in the
middle of writing to a queue another process reads.

Rules (hypothesis picks their order and arguments): allocate, write, send
a buffer to a consumer through a Queue, re-share it from one consumer to
another (A -> B -> C), release it in a consumer or in the producer, trim,
open a ring, register consumers on it, publish, get, release ring items,
close it, SIGKILL a consumer, SIGKILL the producer (and start a new one,
in either owner mode), start a new consumer.

Invariants, after every step:

* every buffer a consumer holds reads the value the producer last wrote
  (or, once its ``owner="process"`` producer was killed, OwnerGoneError
  within ``GONE_BOUND``; ``owner="server"`` memory keeps its values);
* the producer's ``stats()`` agrees with the model: live and pooled
  buffers, bytes, leases, connected consumers, nothing leaked; a lease
  held by a killed consumer is gone within ``RECLAIM_BOUND`` (the bound
  docs/reliability.md states);
* no command takes longer than ``CALL_BOUND``; a killed producer's server
  process and socket directories go within ``GONE_BOUND``, and a dead
  ``owner="server"`` producer's server goes once the last lease on its memory
  is released.

After each run: no process, ``/dev/shm`` segment or socket directory of any
process the run started is left; consumers hold no mapping; the driver's
file descriptors and threads are back where they were.

Size: ``GPUSHARE_CHAOS_EXAMPLES`` (default 3) runs of ``GPUSHARE_CHAOS_STEPS``
(default 30) steps per backend, the same schedules every time unless
``GPUSHARE_CHAOS_RANDOM=1``; ``GPUSHARE_CHAOS_SHRINK=1`` lets hypothesis
shrink a failure (slow: every attempt starts processes). The chaos run
(``test_chaos_run``, ``tests/chaos_run.py``) lasts ``GPUSHARE_CHAOS_SECONDS``
(default 20).
"""

from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker

import pytest
from chaos import CALL_BOUND, GONE_BOUND, SLOTS, existing, leftovers, snapshot, w_consumer, w_producer, wait_for
from conftest import BACKENDS, ROOT, device_for, guarded, subprocess_env
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import gpushare as mp

MAILBOXES = 8  # consumers one run may start (each gets a fresh inbox; a killed one's is never reused)
LIVE_CONSUMERS = 4
LIVE_BUFFERS = 5
PRODUCER_KILLS = 3
RECLAIM_BOUND = 1.0  # docs/reliability.md: a killed consumer's leases go "in under 1 s"

EXAMPLES = int(os.environ.get("GPUSHARE_CHAOS_EXAMPLES", "3"))
STEPS = int(os.environ.get("GPUSHARE_CHAOS_STEPS", "30"))
SHRINK = os.environ.get("GPUSHARE_CHAOS_SHRINK", "") == "1"
RANDOM = os.environ.get("GPUSHARE_CHAOS_RANDOM", "") == "1"  # default: the same schedules every run
RUN_SECONDS = float(os.environ.get("GPUSHARE_CHAOS_SECONDS", "20"))
POOL_HOLD = 64 << 20  # what the driver keeps for an imported cuda_pool pool (see test_chaos_run)


# -- the model --------------------------------------------------------------------------------


@dataclass
class Epoch:
    """One producer process and its Manager."""

    number: int
    owner: str
    pid: int
    server_pid: int
    keys: dict[int, float] = field(default_factory=dict)  # buffers the producer holds: value
    values: dict[int, float] = field(default_factory=dict)  # every live buffer's value
    pool: int = 0  # allocations back in the Manager's pool
    alive: bool = True


@dataclass
class Consumer:
    name: int
    index: int  # its mailbox
    proc: object
    out: object
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # hid -> (epoch, key)
    connected: set[int] = field(default_factory=set)  # epochs whose owner it is connected to
    ring_pending: list[int] = field(default_factory=list)  # ring item numbers published, not got
    ring_held: list[int] = field(default_factory=list)


@dataclass
class RingModel:
    epoch: int
    members: set[int] = field(default_factory=set)
    items: list[tuple[float, set[int]]] = field(default_factory=list)  # value, who has not released it

    def busy(self) -> int:
        return sum(1 for _, holders in self.items if holders)


class LifetimeMachine(RuleBasedStateMachine):
    backend = "host"

    def __init__(self) -> None:
        super().__init__()
        self.mailboxes = [mp.Queue() for _ in range(MAILBOXES)]
        self.used_mailboxes = 0
        self.consumers: dict[int, Consumer] = {}
        self.epochs: list[Epoch] = []
        self.inbox = self.out = None
        self.producer_proc = None
        self.ring: RingModel | None = None
        self.pids: set[int] = set()
        self.before = existing()  # segments and directories that are not this run's
        self.procs: list = []
        self.queues = list(self.mailboxes)
        self.next_id = 0
        self.value = 0.0
        self.epoch_steps = 0
        self.slowest = ""
        self.counts = {"steps": 0, "kills": 0, "producer_kills": 0, "calls": 0}
        self.max_wait = {"call": 0.0, "reclaim": 0.0, "gone": 0.0, "stats": 0.0}

    # -- plumbing ---------------------------------------------------------------------
    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def new_value(self) -> float:
        self.value += 1.0
        return self.value

    def wait_reply(self, out, what: str):
        started = time.monotonic()
        try:
            reply = out.get(timeout=CALL_BOUND)
        except queue.Empty:
            raise AssertionError(f"no reply within {CALL_BOUND} s to {what}") from None
        took = time.monotonic() - started
        assert reply[0] != "error", f"{what} failed:\n{reply[1]}"
        if took > self.max_wait["call"]:
            self.max_wait["call"], self.slowest = took, what
        self.counts["calls"] += 1
        return reply

    def produce(self, *cmd):
        self.inbox.put(cmd)
        reply = self.wait_reply(self.out, f"producer {cmd[0]}")
        assert reply[0] in ("ok", "bye"), reply
        return reply[1]

    def tell(self, c: Consumer, *cmd):
        self.mailboxes[c.index].put(cmd)
        return self.wait_reply(c.out, f"consumer {c.name} {cmd[0]}")

    @property
    def epoch(self) -> Epoch:
        return self.epochs[-1]

    def start_producer(self, owner: str) -> None:
        self.inbox, self.out = mp.Queue(), mp.Queue()
        self.queues += [self.inbox, self.out]
        proc = mp.Process(
            target=guarded,
            args=(w_producer, self.out, self.inbox, self.mailboxes, self.backend, owner),
            device=self.device,
        )
        proc.start()
        self.procs.append(proc)
        self.producer_proc = proc
        _, pid, server_pid = self.wait_reply(self.out, "producer start")
        self.pids |= {pid, server_pid}
        self.epochs.append(Epoch(len(self.epochs), owner, pid, server_pid))
        self.epoch_steps = 0

    @property
    def device(self):
        return device_for(self.backend)

    def holders(self, epoch: int, key: int) -> list[Consumer]:
        return [c for c in self.consumers.values() if (epoch, key) in c.held.values()]

    def maybe_pool(self, epoch: Epoch, key: int) -> None:
        """A buffer nobody holds goes back to its Manager's pool."""
        if key in epoch.keys or self.holders(epoch.number, key):
            return
        if epoch.values.pop(key, None) is not None and epoch.alive:
            epoch.pool += 1

    # -- setup ------------------------------------------------------------------------
    @initialize(owner=st.sampled_from(["process", "server"]), consumers=st.integers(1, 3))
    def setup(self, owner: str, consumers: int) -> None:
        self.start_producer(owner)
        for _ in range(consumers):
            self.start_consumer()

    @precondition(lambda self: len(self.consumers) < LIVE_CONSUMERS and self.used_mailboxes < MAILBOXES)
    @rule()
    def start_consumer(self) -> None:
        out = mp.Queue()
        self.queues.append(out)
        index = self.used_mailboxes
        self.used_mailboxes += 1
        proc = mp.Process(target=guarded, args=(w_consumer, out, index, self.mailboxes), device=self.device)
        proc.start()
        self.procs.append(proc)
        self.pids.add(proc.pid)
        name = self.fresh()
        self.consumers[name] = Consumer(name, index, proc, out)

    # -- buffers ----------------------------------------------------------------------
    @precondition(lambda self: len(self.epoch.values) < LIVE_BUFFERS)
    @rule()
    def allocate(self) -> None:
        key, value = self.fresh(), self.new_value()
        self.produce("alloc", key, value)
        e = self.epoch
        e.keys[key] = e.values[key] = value
        if e.pool:
            e.pool -= 1

    @precondition(lambda self: self.epoch.keys)
    @rule(pick=st.integers(0, 99))
    def write(self, pick: int) -> None:
        e = self.epoch
        key = sorted(e.keys)[pick % len(e.keys)]
        value = self.new_value()
        self.produce("write", key, value)
        e.keys[key] = e.values[key] = value

    @precondition(lambda self: self.epoch.keys and self.consumers)
    @rule(pick=st.integers(0, 99), to=st.integers(0, 99))
    def send(self, pick: int, to: int) -> None:
        e = self.epoch
        key = sorted(e.keys)[pick % len(e.keys)]
        c = self.pick_consumer(to)
        hid = self.fresh()
        self.produce("send", key, hid, c.index)
        reply = self.wait_reply(c.out, f"consumer {c.name} take")
        assert reply == ("took", hid, e.values[key]), reply
        c.held[hid] = (e.number, key)
        c.connected.add(e.number)

    def pick_consumer(self, pick: int) -> Consumer:
        names = sorted(self.consumers)
        return self.consumers[names[pick % len(names)]]

    def readable(self, c: Consumer) -> list[int]:
        """Handles whose owner still answers (not those of a killed owner="process" producer)."""
        return [h for h, (n, _) in c.held.items() if self.epochs[n].alive or self.epochs[n].owner == "server"]

    @precondition(lambda self: len(self.consumers) >= 2 and any(self.readable(c) for c in self.consumers.values()))
    @rule(frm=st.integers(0, 99), to=st.integers(0, 99), pick=st.integers(0, 99), release=st.booleans())
    def relay(self, frm: int, to: int, pick: int, release: bool) -> None:
        sources = [c for c in self.consumers.values() if self.readable(c)]
        a = sources[frm % len(sources)]
        targets = [c for c in self.consumers.values() if c is not a]
        b = targets[to % len(targets)]
        hids = sorted(self.readable(a))
        hid = hids[pick % len(hids)]
        number, key = a.held[hid]
        e = self.epochs[number]
        new = self.fresh()
        reply = self.tell(a, "relay", hid, new, b.index, release)
        assert reply == ("relayed",), reply
        reply = self.wait_reply(b.out, f"consumer {b.name} take (relayed)")
        assert reply == ("took", new, e.values[key]), reply
        b.held[new] = (number, key)
        b.connected.add(number)
        if release:
            del a.held[hid]

    @precondition(lambda self: any(c.held for c in self.consumers.values()))
    @rule(who=st.integers(0, 99), pick=st.integers(0, 99))
    def consumer_release(self, who: int, pick: int) -> None:
        holding = [c for c in self.consumers.values() if c.held]
        c = holding[who % len(holding)]
        hid = sorted(c.held)[pick % len(c.held)]
        assert self.tell(c, "release", hid) == ("released",)
        number, key = c.held.pop(hid)
        self.after_release(number, key)

    def after_release(self, number: int, key: int) -> None:
        e = self.epochs[number]
        self.maybe_pool(e, key)
        if not e.alive and e.owner == "server" and not e.values:
            # The last lease on a dead producer's server memory is gone: the server goes.
            self.expect_gone([e.server_pid], f"the server of dead producer {e.pid}")

    @precondition(lambda self: self.epoch.keys)
    @rule(pick=st.integers(0, 99))
    def producer_release(self, pick: int) -> None:
        e = self.epoch
        key = sorted(e.keys)[pick % len(e.keys)]
        self.produce("drop", key)
        del e.keys[key]
        self.maybe_pool(e, key)

    @rule()
    def trim(self) -> None:
        freed = self.produce("trim")
        assert freed == self.epoch.pool * mp.GRANULARITY, (freed, self.epoch.pool)
        self.epoch.pool = 0

    # -- the ring ---------------------------------------------------------------------
    @precondition(lambda self: self.ring is None)
    @rule()
    def ring_open(self) -> None:
        self.produce("ring_open")
        self.ring = RingModel(self.epoch.number)
        self.epoch.pool -= min(self.epoch.pool, 1)  # the slots are windows of one allocation

    @precondition(lambda self: self.ring is not None and any(n not in self.ring.members for n in self.consumers))
    @rule(pick=st.integers(0, 99))
    def ring_join(self, pick: int) -> None:
        outside = [c for n, c in sorted(self.consumers.items()) if n not in self.ring.members]
        c = outside[pick % len(outside)]
        self.produce("ring_send", c.index)
        reply = self.wait_reply(c.out, f"consumer {c.name} ring_take")
        assert reply == ("ring_joined", False), reply
        self.ring.members.add(c.name)
        c.connected.add(self.epoch.number)

    @precondition(lambda self: self.ring is not None and self.ring.busy() < SLOTS)
    @rule()
    def ring_publish(self) -> None:
        value = self.new_value()
        self.produce("ring_publish", value)
        self.ring.items.append((value, set(self.ring.members)))
        for name in self.ring.members:
            self.consumers[name].ring_pending.append(len(self.ring.items) - 1)

    @precondition(lambda self: self.ring is not None and any(c.ring_pending for c in self.consumers.values()))
    @rule(pick=st.integers(0, 99))
    def ring_get(self, pick: int) -> None:
        waiting = [c for c in self.consumers.values() if c.ring_pending]
        c = waiting[pick % len(waiting)]
        number = c.ring_pending.pop(0)
        value = self.ring.items[number][0]
        assert self.tell(c, "ring_get") == ("ring_got", value, value)
        c.ring_held.append(number)

    @precondition(lambda self: self.ring is not None and any(c.ring_held for c in self.consumers.values()))
    @rule(pick=st.integers(0, 99))
    def ring_release(self, pick: int) -> None:
        holding = [c for c in self.consumers.values() if c.ring_held]
        c = holding[pick % len(holding)]
        assert self.tell(c, "ring_release") == ("ring_released",)
        self.ring.items[c.ring_held.pop(0)][1].discard(c.name)

    @precondition(lambda self: self.ring is not None)
    @rule()
    def ring_close(self) -> None:
        self.produce("ring_close")
        self.drain_ring("RingClosedError")
        self.epoch.pool += 1  # the ring's allocation is free once each member has left

    def drain_ring(self, ending: str) -> None:
        assert self.ring is not None
        for name in sorted(self.ring.members):
            c = self.consumers[name]
            _, got, ended, took = self.tell(c, "ring_drain")
            self.max_wait["gone"] = max(self.max_wait["gone"], took)
            assert ended == ending, (ended, got)
            expected = [self.ring.items[i][0] for i in c.ring_pending]
            if ending == "RingClosedError":
                assert got == expected, (got, expected)
            else:  # the producer died: what was already sent may still arrive, nothing else
                assert got == expected[: len(got)], (got, expected)
            c.ring_pending.clear()
            c.ring_held.clear()
        self.ring = None

    # -- kills ------------------------------------------------------------------------
    @precondition(lambda self: self.consumers)
    @rule(pick=st.integers(0, 99))
    def kill_consumer(self, pick: int) -> None:
        c = self.pick_consumer(pick)
        os.kill(c.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        c.proc.join(timeout=CALL_BOUND)
        self.counts["kills"] += 1
        del self.consumers[c.name]
        if self.ring is not None and c.name in self.ring.members:
            self.ring.members.discard(c.name)
            for _, holders in self.ring.items:
                holders.discard(c.name)
        for number, key in c.held.values():
            self.after_release(number, key)
        if self.epoch.alive:
            stats, _ = self.produce("stats", self.expected_stats())
            took = time.monotonic() - killed
            self.check_stats(stats)
            self.max_wait["reclaim"] = max(self.max_wait["reclaim"], took)
            assert took < RECLAIM_BOUND + 0.5, f"the killed consumer's leases went after {took:.2f} s"

    # Restarting a producer costs seconds: at most PRODUCER_KILLS per run, each after a few steps.
    @precondition(lambda self: self.epoch_steps >= 4 and self.counts["producer_kills"] < PRODUCER_KILLS)
    @rule(owner=st.sampled_from(["process", "server"]))
    def kill_producer(self, owner: str) -> None:
        e = self.epoch
        os.kill(e.pid, signal.SIGKILL)
        killed = time.monotonic()
        self.producer_proc.join(timeout=CALL_BOUND)
        self.counts["producer_kills"] += 1
        e.alive = False
        e.keys.clear()
        if self.ring is not None:
            self.drain_ring("OwnerGoneError")
        for c in self.consumers.values():
            mine = [h for h, (n, _) in c.held.items() if n == e.number]
            if not mine:
                continue
            _, values = self.tell(c, "read", mine, e.owner == "process")
            for hid in mine:
                key = c.held[hid][1]
                if e.owner == "process":
                    assert values[hid] == "OwnerGoneError", values
                else:  # the memory belongs to the server, which outlives the producer
                    assert values[hid] == e.values[key], (values, e.values)
            if e.owner == "process":
                for hid in mine:
                    assert self.tell(c, "release", hid) == ("released",)
                    del c.held[hid]
        if e.owner == "process":
            e.values.clear()
            self.expect_gone([e.server_pid], f"the server of killed producer {e.pid}")
            took = wait_for(lambda: not leftovers([e.pid], self.before)["shm"], GONE_BOUND)
            assert took is not None, f"/dev/shm segments of killed producer {e.pid} remain"
        else:
            for key in list(e.values):
                self.maybe_pool(e, key)
            if not e.values:
                self.expect_gone([e.server_pid], f"the server of killed producer {e.pid}")
        self.expect_no_dirs(e.pid)
        self.max_wait["gone"] = max(self.max_wait["gone"], time.monotonic() - killed)
        self.start_producer(owner)

    def expect_gone(self, pids: list[int], what: str) -> None:
        took = wait_for(lambda: not leftovers(pids)["processes"], GONE_BOUND)
        assert took is not None, f"{what} is still alive {GONE_BOUND} s later"

    def expect_no_dirs(self, pid: int) -> None:
        took = wait_for(lambda: not leftovers([pid], self.before)["socket_dirs"], GONE_BOUND)
        assert took is not None, f"socket directories of dead pid {pid} remain: {leftovers([pid], self.before)}"

    # -- invariants -------------------------------------------------------------------
    def expected_stats(self) -> dict[str, int]:
        e = self.epoch
        ring = self.ring is not None and self.ring.epoch == e.number
        members = len(self.ring.members) if ring and self.ring else 0
        holds = sum(1 for c in self.consumers.values() for n, _ in c.held.values() if n == e.number)
        leases = holds + members * SLOTS  # a member holds a lease per slot
        connected = sum(1 for c in self.consumers.values() if e.number in c.connected)
        if e.owner == "server":  # the producer's own buffers are leases too, and it is a consumer:
            leases += len(e.keys) + (1 if ring else 0)  # the ring's slots: windows of its one allocation
            connected += 1  # it asks the server's owner for stats over its link, so it is connected

        live = len(e.values) + (1 if ring else 0)
        return {
            "live_buffers": live,
            "pooled_buffers": e.pool,
            "bytes_allocated": (live + e.pool) * mp.GRANULARITY,
            "leases": leases,
            "consumers": connected,
            "leaked_buffers": 0,
        }

    def check_stats(self, stats: dict) -> None:
        expected = self.expected_stats()
        got = {k: stats[k] for k in expected}
        assert got == expected, f"stats() {got} but the model holds {expected}"

    @invariant()
    def stats_agree(self) -> None:
        if not self.epochs:
            return
        self.counts["steps"] += 1
        self.epoch_steps += 1
        started = time.monotonic()
        stats, _ = self.produce("stats", self.expected_stats())
        self.max_wait["stats"] = max(self.max_wait["stats"], time.monotonic() - started)
        self.check_stats(stats)

    @invariant()
    def values_hold(self) -> None:
        for c in self.consumers.values():
            hids = self.readable(c)
            if not hids:
                continue
            _, values = self.tell(c, "read", hids, False)
            for hid in hids:
                number, key = c.held[hid]
                assert values[hid] == self.epochs[number].values[key], (hid, values, self.epochs[number])

    # -- the end ----------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            self.finish()
        finally:
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)
                if proc.exitcode is not None:
                    proc.close()  # its sentinel fd goes now, not at garbage collection
            for q in self.queues:
                q.close()
                q.join_thread()
        RESULTS.append(dict(self.counts, **{f"max_{k}_s": round(v, 3) for k, v in self.max_wait.items()}))
        RESULTS[-1]["slowest_call"] = self.slowest

    def finish(self) -> None:
        if not self.epochs:
            return
        if self.ring is not None:
            self.ring_close()
        for c in list(self.consumers.values()):
            for hid in sorted(c.held):
                assert self.tell(c, "release", hid) == ("released",)
                self.after_release(*c.held.pop(hid))
        for key in list(self.epoch.keys):
            self.producer_release(sorted(self.epoch.keys).index(key))
        self.trim()
        self.stats_agree()
        for c in self.consumers.values():
            # trim asked every mapper to unmap: nothing is mapped; and a consumer keeps no
            # connection to an owner that is gone (only to the live producer's, if it used it).
            links = int(self.epoch.number in c.connected)
            assert self.tell(c, "report") == ("report", 0, links), f"consumer {c.name} keeps mappings or links"
        for c in self.consumers.values():
            assert self.tell(c, "exit") == ("bye",)
        self.produce("exit")
        for proc in self.procs:
            proc.join(timeout=CALL_BOUND)
            assert proc.exitcode is not None, f"process {proc.pid} did not exit"
        took = wait_for(lambda: not any(leftovers(self.pids, self.before).values()), GONE_BOUND)
        assert took is not None, f"left behind: {leftovers(self.pids, self.before)}"


RESULTS: list[dict] = []


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("backend", BACKENDS)
def test_lifetime_state_machine(backend) -> None:
    machine = type(f"LifetimeMachine_{backend}", (LifetimeMachine,), {"backend": backend})
    resource_tracker.ensure_running()  # started by the first spawn; it stays, and is not a leak
    before = snapshot()
    RESULTS.clear()
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            derandomize=not RANDOM,
            phases=phases,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        ),
    )
    gc.collect()
    assert snapshot() == before, f"the driver's fds/threads: {before} before, {snapshot()} after"
    total = {k: sum(r.get(k, 0) for r in RESULTS) for k in ("steps", "calls", "kills", "producer_kills")}
    worst = {k: max(r[k] for r in RESULTS) for k in RESULTS[0] if k.startswith("max_")}
    worst["slowest_call"] = max(RESULTS, key=lambda r: r["max_call_s"])["slowest_call"]
    print(f"\nchaos state machine [{backend}]: {len(RESULTS)} runs, {total}, {worst}")
    assert total["steps"] > 0


@pytest.mark.timeout(int(RUN_SECONDS) + 600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_chaos_run(backend, tmp_path) -> None:
    """Chaos, part two (tests/chaos_run.py): kill consumers of a fan-out pipeline at random."""
    report_path = tmp_path / "chaos.json"
    command = [sys.executable, os.path.join(ROOT, "tests", "chaos_run.py"), "--backend", backend]
    command += ["--seconds", str(RUN_SECONDS), "--seed", "13", "--json", str(report_path)]
    done = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=RUN_SECONDS + 400)
    assert report_path.exists(), f"no report; rc {done.returncode}\n{done.stderr[-4000:]}"
    report = json.loads(report_path.read_text())
    print(f"\nchaos run [{backend}]: {json.dumps(report, sort_keys=True)}")
    raw_problems = list(report["problems"])
    # Not vacuous: consumers were killed, and both kinds of item went through.
    assert report["kills"] >= 3 and report["queue_delivered"] > 0 and report["ring_deliveries"] > 0, report
    if backend == "cuda_pool":
        # The driver's, not a leak (docs/reliability.md, tests/driver_repro/): once an exported
        # IPC pool has been imported, the driver keeps 32 MiB of the device until the exporter
        # closes the pool's handle, which the owner keeps open while the pool lives; trimming
        # does not return it. It does not grow with kills: 32-64 MiB after ~50 of them in
        # every run that showed it. A leak of ours (a buffer, mapping or event per kill)
        # would be far more, so more than POOL_HOLD is still a failure.
        delta = int(report.get("device_free_delta_bytes", 0))
        if -delta <= POOL_HOLD:
            report["problems"] = [p for p in report["problems"] if not p.startswith("device memory not given back")]
    assert report["problems"] == [], report
    # chaos_run exits 1 on any problem it found, the one excused above included.
    assert done.returncode == (1 if raw_problems else 0), done.stderr[-4000:]
