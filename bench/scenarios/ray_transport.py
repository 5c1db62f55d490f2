"""``ray_transport``: torch CPU tensors from one Ray actor to N actors, through gpushare's tensor
transport, Ray's object store and Ray's gloo transport, in one local Ray instance.

Each cell starts its actors once (one source, N receivers), warms up, then times iterations of:
the source's method makes its result (the same tensor each time, so no system pays for creating
it) and every receiver's method reads one element of it and acks; the time is from the call on
the source to the last ack. Skipped without Ray 2.54 or later, or torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..results import Goal, Scenario, Series, _bind
from ..settings import MiB
from ..stats import Target

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("ray_transport",)
KEY = KEYS[0]

GPUSHARE_T = "gpushare transport"
OBJECT_STORE = "Ray object store"
GLOO = "Ray gloo transport"
CALLS = "Ray calls alone (no tensor)"
NOTHING = "a transport that moves nothing"
SYSTEMS = (GPUSHARE_T, OBJECT_STORE, GLOO, NOTHING, CALLS)
NOTHING_NAME = "BENCH_NOTHING"
SIZES = ((1 * MiB, "1 MiB"), (64 * MiB, "64 MiB"))
WARMUP = 3

HOW = (
    "`ray_transport` runs one local Ray instance in the bench's process (`ray.init`, a CPU per actor). Per "
    "cell, one source actor and N receiver actors; the source's method returns a float32 torch CPU tensor "
    "of the row's size, the same one each time, through gpushare's tensor transport "
    '(`gpushare.ray.register_tensor_transport()`, `@ray.method(tensor_transport="gpushare")`), through '
    "Ray's object store (no transport), or through Ray's gloo transport (a `torch_gloo` collective group "
    "of the source and its receivers); each receiver's method reads the tensor's first element and returns "
    f"it. `{CALLS}`: the same calls with the source returning a small int, what Ray's scheduling costs "
    f"every system. `{NOTHING}`: a tensor transport registered beside gpushare's whose metadata carries "
    "only the shapes and whose receiver makes empty tensors of them: what Ray's own steps of a tensor "
    "transport cost, the floor of any transport. One iteration: the call on the source, then `ray.get` "
    "of every receiver's call on its result, timed from the first call to the last answer, after "
    f"{WARMUP} untimed ones. Each cell makes its actors "
    "anew and kills them after. The goal: gpushare's transport at most half the object store's time."
)


def plan(bench: Bench) -> None:
    rows = [f"{label} to {n}" for _, label in SIZES for n in bench.cfg.consumers]
    scenario = Scenario(
        KEY,
        "torch CPU tensors from one Ray actor to N actors: gpushare's transport, Ray's object store, gloo",
        "tensor to receivers",
        rows,
        floor=None,
        ratio_systems=[],
        extra_ratios=[(GPUSHARE_T, OBJECT_STORE), (GPUSHARE_T, GLOO)],
        goals=[
            Goal(GPUSHARE_T, row, Target("ratio_max", 0.5), "at most half the object store's time", (OBJECT_STORE,))
            for row in rows
        ],
    )
    if not bench.add(scenario):
        return
    why = _unavailable()
    for nbytes, label in SIZES:
        for n in bench.cfg.consumers:
            row = f"{label} to {n}"
            if why is not None:
                bench.task(KEY, None, row, None, why)
            else:
                bench.task(KEY, None, row, _bind(run_row, bench, row, nbytes, n), None)


def _unavailable() -> str | None:
    try:
        import ray  # noqa: F401
        import torch  # noqa: F401
        from ray.experimental import register_tensor_transport  # noqa: F401
    except ImportError as exc:
        return f"needs Ray 2.54 or later and torch ({exc})"
    return None


def _ray(n: int) -> Any:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(4, n + 2), include_dashboard=False, log_to_driver=False)
    return ray


def run_row(bench: Bench, row: str, nbytes: int, n: int) -> dict[str, list[int]]:
    """Every system's samples for one row, the systems alternating cell by cell."""
    import gpushare.ray as gray

    name = gray.register_tensor_transport()  # before the classes below name it
    ray = _ray(n)
    import torch

    _register_nothing()

    iters = bench.cfg.heavy_iters if nbytes >= 64 * MiB else bench.cfg.iters
    elements = nbytes // 4

    def source_with(transport: str | None, tensor: bool = True) -> Any:
        def make(self: Any) -> Any:
            return self.tensor if tensor else 0

        class Source:
            def __init__(self) -> None:
                self.tensor = torch.ones(elements)

            def ready(self) -> bool:
                return True

        Source.make = make if transport is None else ray.method(tensor_transport=transport)(make)  # type: ignore[attr-defined]
        return ray.remote(num_cpus=0, enable_tensor_transport=transport is not None)(Source)

    class _Receiver:
        def take(self, t: Any) -> float:
            return float(t[0]) if isinstance(t, torch.Tensor) else float(t)

    receiver = ray.remote(num_cpus=0, enable_tensor_transport=True)(_Receiver)

    def measure(transport: str | None, group: bool, tensor: bool = True) -> list[int]:
        source = source_with(transport, tensor).remote()
        receivers = [receiver.remote() for _ in range(n)]
        try:
            ray.get([source.ready.remote(), *[r.take.remote(torch.ones(1)) for r in receivers]], timeout=300)
            if group:
                from ray.experimental.collective import create_collective_group

                create_collective_group([source, *receivers], backend="torch_gloo")
            samples: list[int] = []
            for i in range(WARMUP + iters):
                start = time.perf_counter_ns()
                ref = source.make.remote()
                ray.get([r.take.remote(ref) for r in receivers], timeout=300)
                if i >= WARMUP:
                    samples.append(time.perf_counter_ns() - start)
                del ref
            return samples
        finally:
            for actor in (source, *receivers):
                ray.kill(actor, no_restart=True)

    out: dict[str, list[int]] = {}
    out[GPUSHARE_T] = measure(name, False)
    out[OBJECT_STORE] = measure(None, False)
    out[CALLS] = measure(None, False, tensor=False)
    out[NOTHING] = measure(NOTHING_NAME, False)
    try:
        out[GLOO] = measure("gloo", True)
    except Exception as exc:  # gloo needs torch.distributed built with it: the cell says so, the rest stands
        bench.scenarios[KEY].systems.setdefault(GLOO, Series()).errors[row] = f"{type(exc).__name__}: {exc}"
    return out


def _register_nothing() -> None:
    """Register, once per process, the transport that moves nothing (see HOW)."""
    import torch
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util
    from ray.experimental.rdt.tensor_transport_manager import (
        CommunicatorMetadata,
        TensorTransportManager,
        TensorTransportMetadata,
    )

    if NOTHING_NAME in util.transport_manager_info:
        return

    class Nothing(TensorTransportManager):  # pickled by value into each actor Ray makes
        def tensor_transport_backend(self) -> str:
            return NOTHING_NAME

        @staticmethod
        def is_one_sided() -> bool:
            return True

        @staticmethod
        def can_abort_transport() -> bool:
            return False

        def actor_has_tensor_transport(self, actor: Any) -> bool:
            return True

        def extract_tensor_transport_metadata(self, obj_id: str, tensors: list[Any]) -> Any:
            return TensorTransportMetadata(tensor_meta=[(t.shape, t.dtype) for t in tensors], tensor_device="cpu")

        def get_communicator_metadata(self, src: Any, dst: Any, backend: str | None = None) -> Any:
            return CommunicatorMetadata()

        def recv_multiple_tensors(self, obj_id: str, meta: Any, comm: Any, target_buffers: Any = None) -> list[Any]:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in meta.tensor_meta]

        def send_multiple_tensors(self, tensors: Any, meta: Any, comm: Any) -> None:
            raise NotImplementedError

        def garbage_collect(self, obj_id: str, meta: Any, tensors: Any) -> None:
            pass

        def abort_transport(self, obj_id: str, comm: Any) -> None:
            pass

    register_tensor_transport(NOTHING_NAME, ["cpu"], Nothing, torch.Tensor)
