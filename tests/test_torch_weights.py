"""Weight sync for torch modules (gpushare.torch): state dicts on a TensorSet, copy mode and zero-copy.

Skipped where torch is not installed. The unmarked tests run on the host
backend (CPU tensors viewing shared memory) with engines in spawned
processes; the ``gpu`` ones run the same on CUDA.
"""

from __future__ import annotations

import pickle

import pytest
from conftest import GPU_TIMEOUT, recv, run_guarded, wait_until

torch = pytest.importorskip("torch")

import gpushare as mp  # noqa: E402
from gpushare.torch import (  # noqa: E402
    as_tensors,
    bind,
    draft_tensors,
    load_state_dict,
    publish_state_dict,
    state_dict_layout,
)

T = 60


class Net(torch.nn.Module):  # type: ignore[misc]
    """Float32 and bfloat16 parameters, BatchNorm buffers (an int64 one among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)).to(torch.bfloat16)).float()


def tw_checksum(state: dict[str, torch.Tensor]) -> float:
    return sum(float(state[name].double().sum()) for name in sorted(state))


def tw_step(model: Net, step: int) -> None:
    """The trainer's "training": every tensor changes with the step."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(step if tensor.dtype == torch.int64 else 0.25 * step)


# -- engines ------------------------------------------------------------------------------------


def tw_copy_engine(out, reader, last, device) -> None:
    torch.manual_seed(1)
    model = Net().to(device).eval()
    version, seen = 0, []
    while version < last:
        with reader.wait(newer_than=version, timeout=T) as snap:
            load_state_dict(model, snap)
            version = snap.version
        seen.append((version, tw_checksum(model.state_dict())))
    out.put(("seen", seen))


def tw_bind_engine(out, reader, last, device) -> None:
    model = Net().to(device).eval()
    param = model.fc2.weight
    version, seen = 0, []
    x = torch.ones(2, 8, device=device)
    while version < last:
        snap = reader.wait(newer_than=version, timeout=T)
        bind(model, snap)
        version = snap.version
        view_ptr = snap["fc2.weight"].ptr
        inside = model.fc2.weight.data_ptr() == view_ptr and model.fc2.weight is param
        buffer_inside = model.norm.running_mean.data_ptr() == snap["norm.running_mean"].ptr
        y = model(x)  # runs on the published weights
        seen.append((version, tw_checksum(model.state_dict()), inside and buffer_inside, tuple(y.shape)))
        out.put(("bound", version))
    out.put(("seen", seen))


# -- host backend ------------------------------------------------------------------------------


def test_state_dict_layout_tags_what_numpy_lacks() -> None:
    layout = state_dict_layout(Net().state_dict())
    assert layout["fc1.weight"] == ((16, 8), "float32")
    assert layout["fc2.weight"] == ((4, 16), "uint16", "bfloat16")
    assert layout["norm.num_batches_tracked"] == ((), "int64")
    with pytest.raises(mp.LayoutError, match="'x' is a str"):
        state_dict_layout({"x": "not a tensor"})


def test_publish_and_load_and_bind_in_one_process(manager) -> None:
    trainer = Net()
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        tw_step(trainer, 1)
        assert publish_state_dict(ts, trainer.state_dict()) == 1
        engine = Net()
        with reader.latest(timeout=5) as snap:
            load_state_dict(engine, snap)
        assert tw_checksum(engine.state_dict()) == tw_checksum(trainer.state_dict())
        assert ts.stats()["held"] == {}  # copy mode lets the version go

        wrong = dict(trainer.state_dict(), **{"fc1.bias": torch.zeros(16, dtype=torch.float64)})
        with pytest.raises(mp.LayoutError, match=r"'fc1.bias' is \(16,\) torch.float64"):
            publish_state_dict(ts, wrong)
        with pytest.raises(mp.LayoutError, match=r"missing \['fc2.bias'\]"):
            publish_state_dict(ts, {k: v for k, v in trainer.state_dict().items() if k != "fc2.bias"})
        assert ts.stats()["writing"] == 0 and ts.version == 1  # the failed drafts went back

        bound = Net()
        snap = reader.latest(timeout=5)
        bind(bound, snap)
        views = as_tensors(snap)
        assert bound.fc1.weight.data_ptr() == views["fc1.weight"].data_ptr()
        assert tw_checksum(bound.state_dict()) == tw_checksum(trainer.state_dict())
        del snap, views
        assert ts.stats()["held"] == {1: [ts.stats()["reader_pids"][0]]}  # held through the module
        tw_step(trainer, 2)
        publish_state_dict(ts, trainer.state_dict())
        bind(bound, reader.latest(timeout=5))  # the next version; the first is released
        assert ts.stats()["held"] == {2: [ts.stats()["reader_pids"][0]]}
        assert tw_checksum(bound.state_dict()) == tw_checksum(trainer.state_dict())

        other = torch.nn.Linear(8, 16)
        with reader.latest(timeout=5) as snap:
            with pytest.raises(mp.LayoutError, match="missing"):
                load_state_dict(other, snap)
            keys = load_state_dict(other, snap, strict=False)
            assert keys.missing_keys == ["weight", "bias"] and "fc1.weight" in keys.unexpected_keys
        reader.close()


def test_a_trainer_writes_its_update_into_a_draft_through_draft_tensors(manager) -> None:
    """draft_tensors(): the draft's tensors as torch tensors (the same objects for every draft of a
    version), written in place and published with no copy; refused once the draft is spent."""
    trainer = Net()
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        seen = {}
        for step in range(1, 5):
            tw_step(trainer, step)
            draft = ts.draft(timeout=5)
            tensors = draft_tensors(draft)
            assert list(tensors) == list(ts.names) and tensors["fc2.weight"].dtype == torch.bfloat16
            assert seen.setdefault(draft.slot, tensors) is tensors  # made once per version
            with pytest.raises(TypeError):
                tensors["fc1.weight"] = torch.zeros(16, 8)  # read-only
            with torch.no_grad():
                for name, value in trainer.state_dict().items():
                    tensors[name].copy_(value)
            ts.publish(draft)
            with pytest.raises(mp.BufferReleasedError, match="already published"):
                draft_tensors(draft)
            with reader.latest(timeout=5) as snap:
                engine = Net()
                load_state_dict(engine, snap)
            assert tw_checksum(engine.state_dict()) == tw_checksum(trainer.state_dict())
        assert sorted(seen) == [0, 1]
        reader.close()


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_publish_state_dict_keeps_its_plan_and_follows_tensors_that_change(manager, where) -> None:
    """publish_state_dict works out where each tensor goes once and keeps it while the state
    dict (a new mapping each step) holds the same tensors; a tensor replaced (``.data =``),
    made strided (on a GPU: torch's copy instead of the kernel) or reshaped is seen: the
    values arrive, and a shape the layout does not have is refused as before."""
    trainer = Net().to(where)
    device = 0 if where == "cuda" else "cpu"
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device=device) as ts:
        reader = pickle.loads(pickle.dumps(ts))

        def published_matches(step: int) -> None:
            tw_step(trainer, step)
            publish_state_dict(ts, trainer.state_dict(), timeout=T)
            with reader.latest(timeout=5) as snap:
                engine = Net().to(where)
                load_state_dict(engine, snap)
            if where == "cuda":
                torch.cuda.synchronize()
            assert tw_checksum(engine.state_dict()) == tw_checksum(trainer.state_dict()), step

        published_matches(1)
        plans = ts._adapters["torch-publish"]
        first = plans[0]
        for step in (2, 3, 4):
            published_matches(step)  # a new state_dict() mapping each time, the same tensors
        assert plans == [first], "the kept plan was not used again"

        with torch.no_grad():
            trainer.fc1.weight.data = trainer.fc1.weight.data.clone() + 1  # another tensor at another address
        published_matches(5)
        assert plans[0] is not first and len(plans) == 2
        replaced = plans[0]
        with torch.no_grad():  # the same shape, strided: the kernel cannot copy it by address
            trainer.fc1.weight.data = trainer.fc1.weight.data.t().contiguous().t()
        assert not trainer.fc1.weight.is_contiguous()
        published_matches(6)
        assert plans[0] is not replaced and len(plans) == 2
        if where == "cuda":
            assert plans[0].others == ("fc1.weight",) and len(plans[0].kernel) == len(ts.names) - 1

        weight = trainer.fc2.weight
        weight.data = weight.data.view(16, 4)  # the same bytes at the same address, another shape
        with pytest.raises(mp.LayoutError, match=r"'fc2.weight' is \(16, 4\)"):
            publish_state_dict(ts, trainer.state_dict(), timeout=T)
        weight.data = weight.data.view(4, 16)
        published_matches(7)
        assert ts.stats()["writing"] == 0 and ts.version == 7
        reader.close()
    with pytest.raises(mp.TensorSetClosedError, match="was closed"):
        publish_state_dict(ts, trainer.state_dict(), timeout=T)  # a kept plan changes nothing there
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), device=device) as never_published:
        never_published.close()
        with pytest.raises(mp.TensorSetClosedError, match="was closed"):
            publish_state_dict(never_published, trainer.state_dict(), timeout=T)


def test_bind_maps_each_version_slot_once_and_shares_no_tensor_between_modules(manager) -> None:
    """bind() reuses one set of tensors per version slot of the reader (no export per tensor per
    version), still reads each new version, gives two modules tensor objects of their own, and
    the reader's close lets go of those tensors."""
    from gpushare.torch._weights import _snapshot_tensors

    trainer = Net()
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        first, second = Net(), Net()
        slots = {}
        for step in range(1, 6):  # the two versions, taken in turn
            tw_step(trainer, step)
            publish_state_dict(ts, trainer.state_dict())
            snap = reader.latest(timeout=5)
            cached = _snapshot_tensors(snap)
            assert slots.setdefault(snap.slot, cached) is cached  # made once per slot
            bind(first, snap)
            bind(second, snap)
            del snap
            assert tw_checksum(first.state_dict()) == tw_checksum(trainer.state_dict())
            assert first.fc1.weight.data_ptr() == second.fc1.weight.data_ptr()
            assert first.norm.running_mean is not second.norm.running_mean  # one object per module
        assert sorted(slots) == [0, 1] and ts.stats()["held"] == {5: [ts.stats()["reader_pids"][0]]}
        adapters = reader._core.adapters
        assert adapters["torch"].keys() == {0, 1}
        first.__dict__.pop("_gpushare_snapshot").release()  # the modules let go of version 5
        second.__dict__.pop("_gpushare_snapshot").release()
        assert ts.stats()["held"] == {}
        reader.close()
        assert adapters == {}


def test_bind_follows_a_module_whose_tensors_change_between_binds(manager) -> None:
    """bind() remembers where each tensor goes in the module; a submodule, parameter or buffer
    replaced, added or removed after a bind is seen by the next one, as by the first."""
    trainer = Net()
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        engine = Net()

        def next_version(step: int):
            tw_step(trainer, step)
            publish_state_dict(ts, trainer.state_dict(), timeout=5)
            return reader.latest(timeout=5)

        def views_it(tensor: torch.Tensor, snap, name: str) -> bool:
            return tensor.data_ptr() == as_tensors(snap)[name].data_ptr()

        snap = next_version(1)
        bind(engine, snap)
        plan = engine.__dict__["_gpushare_bind_plan"]
        snap = next_version(2)
        bind(engine, snap)
        assert engine.__dict__["_gpushare_bind_plan"] is plan  # checked, not worked out again
        assert tw_checksum(engine.state_dict()) == tw_checksum(trainer.state_dict())

        engine.fc1 = torch.nn.Linear(8, 16)  # a new submodule in an old one's place
        engine.norm.running_mean = torch.zeros(16)  # a buffer replaced
        del snap
        snap = next_version(3)
        bind(engine, snap)
        assert engine.__dict__["_gpushare_bind_plan"] is not plan
        assert views_it(engine.fc1.weight, snap, "fc1.weight")
        assert views_it(engine.norm.running_mean, snap, "norm.running_mean")
        assert tw_checksum(engine.state_dict()) == tw_checksum(trainer.state_dict())

        engine.extra = torch.nn.Parameter(torch.zeros(2))  # the snapshot has no such tensor
        del snap
        snap = next_version(4)
        with pytest.raises(mp.LayoutError, match="extra"):
            bind(engine, snap)
        keys = bind(engine, snap, strict=False)
        assert keys.missing_keys == ["extra"] and keys.unexpected_keys == []
        del engine.extra
        bind(engine, snap)  # strict again once it is gone
        assert tw_checksum(engine.state_dict()) == tw_checksum(trainer.state_dict())
        del snap
        engine.__dict__.pop("_gpushare_snapshot").release()
        assert ts.stats()["held"] == {}
        reader.close()


def test_load_state_dict_keeps_where_each_tensor_goes_and_follows_a_module_that_changes(manager) -> None:
    """load_state_dict() works out where each tensor goes once (module.state_dict() walks the module)
    and checks it after; a parameter given new memory, a submodule or buffer replaced, a parameter
    added are each seen by the next load, which copies into the module as it is then."""
    trainer = Net()
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device="cpu") as ts:
        reader = pickle.loads(pickle.dumps(ts))
        engine = Net()
        walks = 0
        real_state_dict = engine.state_dict

        def counting_state_dict(*args, **kwargs):
            nonlocal walks
            walks += 1
            return real_state_dict(*args, **kwargs)

        engine.state_dict = counting_state_dict  # type: ignore[method-assign]

        def load(step: int, **kwargs) -> object:
            tw_step(trainer, step)
            publish_state_dict(ts, trainer.state_dict(), timeout=5)
            with reader.latest(timeout=5) as snap:
                return load_state_dict(engine, snap, **kwargs)

        def same() -> bool:
            return tw_checksum(real_state_dict()) == tw_checksum(trainer.state_dict())

        load(1)
        plan = engine.__dict__["_gpushare_load_plan"]
        for step in (2, 3):
            load(step)
            assert same()
        assert walks == 1 and engine.__dict__["_gpushare_load_plan"] is plan  # checked, not worked out again
        assert "_gpushare_bind_plan" not in engine.__dict__  # bind()'s plan is its own

        engine.fc2.weight.data = engine.fc2.weight.data.clone()  # the same Parameter, new memory
        load(4)
        assert same() and walks == 1  # the copy's own checks see the new address
        engine.fc1 = torch.nn.Linear(8, 16)  # a new submodule in an old one's place
        engine.norm.running_mean = torch.zeros(16)  # a buffer replaced
        load(5)
        assert same() and walks == 2 and engine.__dict__["_gpushare_load_plan"] is not plan
        engine.extra = torch.nn.Parameter(torch.zeros(2))
        with pytest.raises(mp.LayoutError, match="extra"):
            load(6)
        assert load(7, strict=False) == (["extra"], [])
        assert same()
        reader.close()


@pytest.mark.parametrize("engine", ["copy", "bind"])
def test_engines_in_processes_follow_the_trainers_state_dict(manager, reap, engine) -> None:
    trainer = Net()
    last = 12
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device="cpu") as ts:
        target = tw_copy_engine if engine == "copy" else tw_bind_engine
        out = run_guarded(reap, target, ts, last, "cpu")
        wait_until(lambda: ts.stats()["readers"] == 1, timeout=30)
        expected = {}
        for step in range(1, last + 1):
            tw_step(trainer, step)
            version = publish_state_dict(ts, trainer.state_dict(), timeout=T)
            expected[version] = tw_checksum(trainer.state_dict())
            if engine == "bind":  # zero-copy: the engine holds one version; wait until it bound this one
                assert recv(out, timeout=T) == ("bound", version)
        tag, seen = recv(out, timeout=T)
    assert tag == "seen" and seen[-1][0] == last
    for version, total, *rest in seen:
        assert total == expected[version], version
        if rest:
            inside, shape = rest
            assert inside and shape == (2, 4)


# -- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["copy", "bind"])
def test_gpu_engines_follow_the_trainers_state_dict(manager, reap, engine) -> None:
    trainer = Net().cuda()
    last = 8
    with manager.tensor_set(state_dict_layout(trainer.state_dict()), versions=2, device=0) as ts:
        target = tw_copy_engine if engine == "copy" else tw_bind_engine
        out = run_guarded(reap, target, ts, last, "cuda")
        wait_until(lambda: ts.stats()["readers"] == 1, timeout=GPU_TIMEOUT)
        expected = {}
        for step in range(1, last + 1):
            tw_step(trainer, step)  # queued on the default stream; the copies follow it there
            version = publish_state_dict(ts, trainer.state_dict(), timeout=T)
            expected[version] = tw_checksum(trainer.state_dict())
            if engine == "bind":
                assert recv(out, timeout=120) == ("bound", version)
        tag, seen = recv(out, timeout=120)
    assert tag == "seen" and seen[-1][0] == last
    for version, total, *rest in seen:
        assert total == expected[version], version
        if rest:
            assert rest[0] and rest[1] == (2, 4)
