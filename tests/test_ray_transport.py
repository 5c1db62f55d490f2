"""gpushare as a Ray tensor transport, on a local two-node Ray cluster (CPU tensors, host memory).

As in test_ray.py, node "b" is started with ``GPUSHARE_NODE_ID`` set, so its workers are on
"another machine". The transport is registered at import, before the actor classes below name
it. Skipped when Ray or torch is not installed; the CUDA path needs Ray on a GPU machine (the
GPU machines here have none), and the CUDA sharing under it is the torch drop-in's, which the
GPU suite checks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

ray = pytest.importorskip(
    "ray",
    reason="Ray is not installed (the `ray` extra). The GPU machines have none: the CUDA tests here run only "
    "where Ray and a GPU both are",
)
torch = pytest.importorskip("torch", reason="the tensor transport carries torch tensors; torch is not installed")
pytest.importorskip("ray.experimental.rdt", reason="this Ray has no tensor transport API (Ray 2.54 or later)")
from ray.cluster_utils import Cluster  # noqa: E402

import gpushare as mp  # noqa: E402
from gpushare import ray as gray  # noqa: E402

NAME = gray.register_tensor_transport()  # before the classes below name it

pytestmark = pytest.mark.timeout(300)

ON_A = {"resources": {"node_a": 0.01}}
ON_B = {"resources": {"node_b": 0.01}}


@ray.remote(num_cpus=0)
class Source:
    def __init__(self) -> None:
        self.kept: Any = None

    @ray.method(tensor_transport=NAME)
    def make(self, n: int, value: float) -> dict[str, Any]:
        return {
            "f": torch.full((n,), value),
            "b": torch.full((3, 5), value, dtype=torch.bfloat16),
            "i": torch.arange(n, dtype=torch.int64).reshape(n // 4, 4),
            "empty": torch.empty((0, 3)),
        }

    @ray.method(tensor_transport=NAME)
    def strided(self) -> torch.Tensor:
        return torch.arange(12.0).reshape(3, 4).t()  # not contiguous: sent as its values

    def leases(self) -> tuple[int, int]:
        """(unreleased leases of this process's Owner, Ray objects the transport still shares)."""
        from ray.experimental.rdt.util import get_tensor_transport_manager

        from gpushare.torch._sharing import sharing_owner

        return len(sharing_owner().leases), get_tensor_transport_manager(NAME).outstanding()

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)  # Ray's rule for an actor that only receives
class Sink:
    def __init__(self) -> None:
        self.held: Any = None

    def take(self, got: dict[str, Any]) -> dict[str, Any]:
        self.held = got
        return {k: (tuple(t.shape), str(t.dtype), float(t.float().sum())) for k, t in got.items()}

    def take_one(self, t: torch.Tensor) -> list[list[float]]:
        return t.tolist()

    def write_first(self, value: float) -> None:
        self.held["f"][0] = value  # the shared memory itself, not a copy of it

    def first(self, got: dict[str, Any] | None = None) -> float:
        return float((got or self.held)["f"][0])

    def drop(self) -> None:
        self.held = None

    def node(self) -> str:
        return gray.node_identity()


def _wait(fn: Any, expected: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while (value := fn()) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_cpu_tensors_reach_an_actor_with_their_shapes_dtypes_and_values(cluster: Cluster) -> None:
    source, sink = Source.options(**ON_A).remote(), Sink.options(**ON_A).remote()
    got = ray.get(sink.take.remote(source.make.remote(64, 2.0)), timeout=120)
    assert got == {
        "f": ((64,), "torch.float32", 128.0),
        "b": ((3, 5), "torch.bfloat16", 30.0),
        "i": ((16, 4), "torch.int64", float(sum(range(64)))),
        "empty": ((0, 3), "torch.float32", 0.0),
    }
    assert ray.get(sink.take_one.remote(source.strided.remote()), timeout=60) == [
        [0.0, 4.0, 8.0], [1.0, 5.0, 9.0], [2.0, 6.0, 10.0], [3.0, 7.0, 11.0],
    ]  # fmt: skip
    for actor in (source, sink):
        ray.kill(actor, no_restart=True)


def test_receivers_of_one_object_map_the_same_memory(cluster: Cluster) -> None:
    source = Source.options(**ON_A).remote()
    sinks = [Sink.options(**ON_A).remote() for _ in range(3)]
    ref = source.make.remote(64, 1.0)
    results = ray.get([sink.take.remote(ref) for sink in sinks], timeout=120)
    assert [r["f"] for r in results] == [((64,), "torch.float32", 64.0)] * 3
    ray.get(sinks[0].write_first.remote(42.0), timeout=60)
    # The other receivers read the write: each mapped the one shared copy, none got a copy of its own.
    assert ray.get([sink.first.remote() for sink in sinks[1:]], timeout=60) == [42.0, 42.0]
    for actor in (source, *sinks):
        ray.kill(actor, no_restart=True)


def test_no_lease_is_left_once_ray_drops_the_object_and_the_receiver_its_tensors(cluster: Cluster) -> None:
    source, sink = Source.options(**ON_A).remote(), Sink.options(**ON_A).remote()
    ref = source.make.remote(64, 3.0)
    ray.get(sink.take.remote(ref), timeout=120)
    leases, objects = ray.get(source.leases.remote(), timeout=60)
    assert objects == 1 and leases >= 4  # the object's leases, and the receiver's through them
    del ref  # Ray drops the object: the transport gives its leases back
    assert _wait(lambda: ray.get(source.leases.remote(), timeout=60)[1], 0) == 0
    assert ray.get(sink.first.remote(), timeout=60) == 3.0  # the receiver's own leases hold the memory
    ray.get(sink.drop.remote(), timeout=60)
    assert _wait(lambda: ray.get(source.leases.remote(), timeout=60), (0, 0)) == (0, 0)
    for actor in (source, sink):
        ray.kill(actor, no_restart=True)


def test_a_killed_receiver_gives_its_leases_back(cluster: Cluster) -> None:
    source, sink = Source.options(**ON_A).remote(), Sink.options(**ON_A).remote()
    ref = source.make.remote(64, 4.0)
    ray.get(sink.take.remote(ref), timeout=120)
    del ref
    assert _wait(lambda: ray.get(source.leases.remote(), timeout=60)[1], 0) == 0
    assert ray.get(source.leases.remote(), timeout=60)[0] > 0  # the receiver holds its tensors
    ray.kill(sink, no_restart=True)
    assert _wait(lambda: ray.get(source.leases.remote(), timeout=60), (0, 0)) == (0, 0)
    ray.kill(source, no_restart=True)


def test_a_receiver_keeps_reading_after_its_source_is_killed(cluster: Cluster) -> None:
    source, sink = Source.options(**ON_A).remote(), Sink.options(**ON_A).remote()
    ray.get(sink.take.remote(source.make.remote(64, 5.0)), timeout=120)
    ray.kill(source, no_restart=True)
    time.sleep(1.0)
    assert ray.get(sink.first.remote(), timeout=60) == 5.0  # its mapping outlives the source, as torch's does
    ray.kill(sink, no_restart=True)


def test_a_receiver_on_another_node_is_told_what_to_use_instead(cluster: Cluster) -> None:
    source, sink = Source.options(**ON_A).remote(), Sink.options(**ON_B).remote()
    assert ray.get(sink.node.remote(), timeout=120) == "simulated-node-b"
    with pytest.raises(Exception, match=r"object store \(no tensor_transport\) or a collective transport") as info:
        ray.get(sink.take.remote(source.make.remote(64, 1.0)), timeout=120)
    assert "BackendUnavailableError" in str(info.value) and "another node" in str(info.value)
    for actor in (source, sink):
        ray.kill(actor, no_restart=True)


def test_an_aborted_transfer_gives_the_leases_back_and_a_late_read_says_why() -> None:
    """The transport's own calls, in this process: extract, abort, then a read is refused."""
    from gpushare.torch._ray import GpushareTransport, _receive
    from gpushare.torch._sharing import sharing_owner

    transport = GpushareTransport()
    strided = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: sent as its values
    meta = transport.extract_tensor_transport_metadata("obj", [torch.ones(8), strided])
    assert meta.tensor_device == "cpu" and len(meta.descriptors) == 2 and transport.outstanding() == 1
    received = transport.recv_multiple_tensors("obj", meta, transport.get_communicator_metadata(None, None))
    assert [t.tolist() for t in received] == [[1.0] * 8, [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]]
    transport.abort_transport("obj", None)
    assert transport.outstanding() == 0
    assert received[0].sum().item() == 8.0  # what was received keeps its own leases
    with pytest.raises(mp.DescriptorError, match="gave it back"):
        _receive(meta.descriptors[0], meta.authkey, (8,), torch.float32)
    del received
    assert _wait(lambda: len(sharing_owner().leases), 0) == 0


def test_mixed_devices_and_other_types_are_refused_before_anything_is_shared() -> None:
    from gpushare.torch._ray import GpushareTransport
    from gpushare.torch._sharing import sharing_owner

    transport = GpushareTransport()
    with pytest.raises(TypeError, match="torch tensors"):
        transport.extract_tensor_transport_metadata("x", [torch.ones(2), [1, 2]])
    assert transport.outstanding() == 0 and _wait(lambda: len(sharing_owner().leases), 0) == 0


def test_registration_is_idempotent_and_refuses_another_transports_name() -> None:
    assert gray.register_tensor_transport() == NAME == "GPUSHARE"
    with pytest.raises(ValueError, match="already registered"):
        gray.register_tensor_transport("gloo")  # Ray's own


def test_a_ray_without_the_transport_api_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.experimental

    monkeypatch.delattr(ray.experimental, "register_tensor_transport")
    with pytest.raises(mp.BackendUnavailableError, match=r"Ray 2\.54 or later"):
        gray.register_tensor_transport("another")


@pytest.mark.gpu
def test_gpu_cuda_tensors_and_a_view_travel_as_the_source_s_memory() -> None:
    """The transport's own calls on CUDA tensors, in this process (the GPU machines have no Ray
    for actors): a view keeps its offset, the receiver's tensor is the source's memory."""
    from gpushare.torch._ray import GpushareTransport

    transport = GpushareTransport()
    base = torch.arange(64.0, device="cuda")
    view = base[16:24]  # contiguous, 64 bytes into its storage
    meta = transport.extract_tensor_transport_metadata("cuda", [base, view])
    assert meta.tensor_device == "cuda" and meta.offsets == [0, 64]
    received = transport.recv_multiple_tensors("cuda", meta, transport.get_communicator_metadata(None, None))
    assert received[1].tolist() == [float(i) for i in range(16, 24)]
    base[16] = -1.0  # the same memory: the receiver sees the source's write
    torch.cuda.synchronize()
    assert received[1][0].item() == -1.0
    transport.garbage_collect("cuda", meta, [])
    assert transport.outstanding() == 0 and received[0].sum().item() == float(sum(range(64))) - 17.0
