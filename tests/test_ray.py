"""gpushare.ray on a local two-node Ray cluster (CPU, host backend).

Both Ray nodes run on this machine; node "b" is started with
``GPUSHARE_NODE_ID`` set, so its workers believe they are on another
machine and take the copy path, while node "a" (the driver's) maps the
owner's memory. One cluster serves the whole module: starting Ray costs
seconds. Skipped when Ray is not installed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

import gpushare as mp  # noqa: E402
from gpushare import ray as gray  # noqa: E402

pytestmark = pytest.mark.timeout(240)

ON_A = {"resources": {"node_a": 0.01}}
ON_B = {"resources": {"node_b": 0.01}}


@pytest.fixture
def manager(cluster: Cluster) -> Iterator[Any]:
    with mp.Manager(lease_timeout=3.0) as m:
        yield m


def _wait_leases(manager: Any, expected: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        leases = manager.stats()["leases"]
        if leases == expected or time.monotonic() > deadline:
            return leases
        time.sleep(0.2)


@ray.remote(num_cpus=0)
def describe(buf: Any) -> tuple[str, str, float]:
    return type(buf).__name__, gray.node_identity(), float(np.asarray(buf.numpy()).sum())


@ray.remote(num_cpus=0)
def fill(buf: Any, value: float) -> str:
    with buf:
        buf.numpy()[...] = value
    return type(buf).__name__


@ray.remote(num_cpus=0)
def echo(buf: Any) -> Any:
    return buf


@ray.remote(num_cpus=0)
def reput(buf: Any) -> list[Any]:
    return [ray.put(buf)]  # a worker re-sharing what it received: its lease comes through its link


@ray.remote(num_cpus=0)
class Holder:
    def __init__(self) -> None:
        self.buf: Any = None

    def hold(self, buf: Any) -> str:
        self.buf = buf
        return type(buf).__name__

    def read(self) -> str:
        try:
            return str(float(self.buf.numpy().sum()))
        except mp.GpushareError as exc:
            return type(exc).__name__

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        self.manager = mp.Manager()
        self.buf = self.manager.full((256,), 2.0, dtype="float32", device="cpu")

    def buffer(self) -> Any:
        return self.buf


@ray.remote(num_cpus=0)
class Engine:
    """An inference engine as RL frameworks run one: a Ray actor given the trainer's TensorSet."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader  # unpickled here, outside the Manager's process tree: a registered reader
        self.held: Any = None

    def follow(self, version: int) -> tuple[str, int, float]:
        with self.reader.wait(newer_than=version, timeout=60) as snap:
            return type(self.reader).__name__, snap.version, sum(float(snap[n].numpy().sum()) for n in snap)

    def hold(self) -> int:
        self.held = self.reader.latest(timeout=60)
        return int(self.held.version)

    def pid(self) -> int:
        return os.getpid()


def test_a_tensor_set_as_a_ray_actor_argument(manager: Any) -> None:
    ts = manager.tensor_set({"w": ((64,), "float32"), "b": ((8,), "bfloat16")}, device="cpu")
    engine = Engine.options(**ON_A).remote(ts)  # the set's Ray form carries the authkeys
    pid = ray.get(engine.pid.remote(), timeout=120)
    assert ts.stats()["reader_pids"] == [pid]
    for version, value in ((1, 1.5), (2, 2.5)):
        ts.publish({"w": np.full(64, value, "float32"), "b": np.full(8, version, "uint16")})
        answer = ray.get(engine.follow.remote(version - 1), timeout=120)
        assert answer == ("TensorSetReader", version, 64 * value + 8 * version)
    assert ray.get(engine.hold.remote(), timeout=120) == 2
    assert ts.stats()["held"] == {2: [pid]}
    ray.kill(engine, no_restart=True)  # its socket closes: the trainer frees what it held
    deadline = time.monotonic() + 30
    while ts.stats()["readers"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ts.stats()["readers"] == 0 and ts.stats()["held"] == {}
    ts.close()
    assert _wait_leases(manager, 0) == 0


def test_node_identity_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gray.NODE_ID_ENV, raising=False)
    assert gray.node_identity().startswith(("boot:", "host:"))
    monkeypatch.setenv(gray.NODE_ID_ENV, "elsewhere")
    assert gray.node_identity() == "elsewhere"


def test_same_node_task_maps_the_same_memory(manager: Any) -> None:
    buf = manager.zeros((1024,), dtype="float32", device="cpu")
    assert ray.get(fill.options(**ON_A).remote(buf, 5.0), timeout=120) == "Buffer"
    assert float(buf.numpy().sum()) == 5.0 * 1024  # the task wrote into the owner's memory
    assert _wait_leases(manager, 0) == 0  # the task's lease came back, the pin expired


def test_ray_put_is_read_by_many_and_round_trips(manager: Any) -> None:
    buf = manager.full((64, 64), 1.5, dtype="float64", device="cpu")
    ref = ray.put(buf)
    results = ray.get([describe.options(**ON_A).remote(ref) for _ in range(3)], timeout=120)
    assert [r[0] for r in results] == ["Buffer"] * 3
    assert all(r[2] == 1.5 * 64 * 64 for r in results)
    back = ray.get(echo.options(**ON_A).remote(ref), timeout=120)  # a return value, back in the owner
    assert isinstance(back, mp.Buffer) and back.ptr == buf.ptr
    back.release()
    assert _wait_leases(manager, 0) == 0


def test_a_worker_re_shares_a_received_buffer(manager: Any) -> None:
    buf = manager.full((128,), 4.0, dtype="float32", device="cpu")
    [ref] = ray.get(reput.options(**ON_A).remote(buf), timeout=120)
    here = ray.get([describe.options(**ON_A).remote(ref) for _ in range(2)], timeout=120)
    there = ray.get(describe.options(**ON_B).remote(ref), timeout=120)
    assert [r[0] for r in here] == ["Buffer", "Buffer"] and there[0] == "NodeCopy"
    assert {r[2] for r in [*here, there]} == {4.0 * 128}
    del ref
    assert _wait_leases(manager, 0) == 0


def test_other_node_gets_a_correct_copy(manager: Any) -> None:
    data = np.arange(4096, dtype=np.int32)
    buf = manager.from_numpy(data, device="cpu")
    kind, node, total = ray.get(describe.options(**ON_B).remote(buf), timeout=120)
    assert (kind, node, total) == ("NodeCopy", "simulated-node-b", float(data.sum()))
    assert ray.get(fill.options(**ON_B).remote(buf, 9.0), timeout=120) == "NodeCopy"
    np.testing.assert_array_equal(buf.numpy(), data)  # writes to a copy stay on its node
    assert _wait_leases(manager, 0) == 0  # the owner-node fetch released what it mapped


def test_actor_killed_while_holding_a_buffer(manager: Any) -> None:
    buf = manager.full((512,), 3.0, dtype="float32", device="cpu")
    holder = Holder.options(**ON_A).remote()
    assert ray.get(holder.hold.remote(buf), timeout=120) == "Buffer"
    assert _wait_leases(manager, 1) == 1  # the holder's lease; the pin expired
    ray.kill(holder, no_restart=True)
    assert _wait_leases(manager, 0) == 0  # its socket closed: the owner released the lease


def test_owner_exiting_gives_owner_gone(cluster: Cluster) -> None:
    producer = Producer.options(**ON_A).remote()
    ref = producer.buffer.remote()
    holder = Holder.options(**ON_A).remote()
    assert ray.get(holder.hold.remote(ref), timeout=120) == "Buffer"
    assert ray.get(holder.read.remote(), timeout=60) == str(2.0 * 256)
    ray.kill(producer, no_restart=True)
    deadline = time.monotonic() + 30
    while (answer := ray.get(holder.read.remote(), timeout=60)) != "OwnerGoneError" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert answer == "OwnerGoneError"
    # Reading the object after its owner died: Ray reports errors raised while
    # unpacking an object as a RaySystemError carrying gpushare's OwnerGoneError.
    with pytest.raises(ray.exceptions.RaySystemError, match="OwnerGoneError: cannot reach the owner"):
        ray.get(describe.options(**ON_A).remote(ref), timeout=120)
    ray.kill(holder, no_restart=True)


def test_an_unread_ray_object_expires_quietly(manager: Any, caplog: pytest.LogCaptureFixture) -> None:
    buf = manager.zeros((256,), dtype="float32", device="cpu")
    ref = ray.put(buf)
    assert manager.stats()["leases"] == 1  # the object's lease pins the memory
    del ref
    assert _wait_leases(manager, 0) == 0  # gone after lease_timeout (3 s here)...
    assert "expired" not in caplog.text  # ...with no LeaseExpiredWarning: Ray may read an object never
    ref = ray.put(buf)
    # ...and the Manager's shutdown drops a pending one without a LeakWarning.
    manager.shutdown()
    assert "outstanding" not in caplog.text
    del ref
