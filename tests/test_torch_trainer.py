"""A trainer whose weights live in a one-version tensor set (gpushare.torch.train_in_set).

Skipped where torch is not installed. The unmarked tests run on the host
backend (CPU tensors viewing shared memory), engines in spawned processes;
the ``gpu`` one runs the same on CUDA and checks the trainer's memory.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import GPU_TIMEOUT, recv, run_guarded, wait_until

torch = pytest.importorskip("torch")

import gpushare as mp  # noqa: E402
from gpushare.torch import load_state_dict, state_dict_layout, train_in_set  # noqa: E402
from gpushare.torch._weights import _version_tensors  # noqa: E402

T = 60


class TiedNet(torch.nn.Module):  # type: ignore[misc]
    """A tied embedding (one Parameter under two names), BatchNorm buffers, a bfloat16 layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 8)
        self.fc = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.mix = torch.nn.Linear(16, 8).to(torch.bfloat16)
        self.out = torch.nn.Linear(8, 12, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(self.emb(x)))
        return self.out(self.mix(h.to(torch.bfloat16)).float())


def tt_checksum(state: dict[str, torch.Tensor]) -> float:
    return sum(float(state[name].double().sum()) for name in sorted(state))


def tt_train(model: TiedNet, optimizer: torch.optim.Optimizer, weights: object, step: int) -> None:
    """One training step: forward and backward outside update() (they read), the step inside."""
    x = torch.arange(24, device=model.fc.weight.device) % 12
    loss = model(x).pow(2).mean() + 0.01 * step
    loss.backward()
    with weights.update(timeout=T):  # type: ignore[attr-defined]
        optimizer.step()
    optimizer.zero_grad()


# -- engines ----------------------------------------------------------------------------------------


def tt_copy_engine(out, reader, last, device) -> None:
    """Copy mode: copy each version it sees into a model of its own, report its checksum."""
    model = TiedNet().to(device).eval()
    version = 0
    while version < last:
        with reader.wait(newer_than=version, timeout=T) as snap:
            load_state_dict(model, snap)
            version = snap.version
        out.put(("seen", version, tt_checksum(model.state_dict())))


def tt_holding_engine(out, reader) -> None:
    """Takes the version and keeps it (a stuck engine) until killed."""
    snap = reader.latest()
    out.put(("holding", os.getpid(), snap.version))
    signal.pause()


# -- host backend -------------------------------------------------------------------------------------


def test_the_parameters_move_into_the_version_and_each_update_publishes_them(manager) -> None:
    """The same Parameter objects (an optimizer made before keeps working) now view the version;
    buffers and the tied second name are copied in at each update; every update is a version."""
    torch.manual_seed(0)
    model = TiedNet()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = tt_checksum(model.state_dict())
    with manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device="cpu") as ts:
        weights = train_in_set(model, ts)
        assert weights.version == ts.version == 1
        version = _version_tensors(ts, 0)
        assert tt_checksum(dict(version)) == start  # version 1: the weights as they were
        assert list(model.parameters()) == params
        assert all(model.get_parameter(n).data_ptr() == version[n].data_ptr() for n in ("emb.weight", "fc.bias"))
        assert model.out.weight is model.emb.weight  # still tied
        for step in range(1, 4):
            tt_train(model, optimizer, weights, step)
            assert weights.version == ts.version == step + 1
            assert tt_checksum(dict(version)) == tt_checksum(model.state_dict())
            assert torch.equal(version["out.weight"], model.emb.weight)  # the tied name, copied in
            assert torch.equal(version["norm.running_mean"], model.norm.running_mean)  # a buffer, copied in
            assert int(version["norm.num_batches_tracked"]) == step
        assert "version 4" in repr(weights)


@pytest.mark.parametrize("engines", [2])
def test_copy_engines_in_processes_get_every_version_the_trainer_trains_in_place(manager, reap, engines) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    last = 8
    with manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device="cpu") as ts:
        weights = train_in_set(model, ts)
        outs = [run_guarded(reap, tt_copy_engine, ts, last, "cpu") for _ in range(engines)]
        expected = {1: tt_checksum(model.state_dict())}
        for out in outs:  # each engine's first: the version published when the module moved in
            assert recv(out, timeout=T) == ("seen", 1, expected[1])
        for step in range(2, last + 1):
            tt_train(model, optimizer, weights, step)
            assert weights.version == step
            expected[step] = tt_checksum(model.state_dict())
            for out in outs:  # every engine copied this version before the next step writes it
                assert recv(out, timeout=T) == ("seen", step, expected[step])
    assert len(set(expected.values())) == last, "every step changed the weights"


def test_update_waits_for_an_engine_holding_the_version_and_goes_on_once_it_is_killed(manager, reap) -> None:
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device="cpu") as ts:
        weights = train_in_set(model, ts)
        out = run_guarded(reap, tt_holding_engine, ts)
        tag, pid, held = recv(out, timeout=T)
        assert tag == "holding" and held == 1
        with pytest.raises(mp.WaitTimeoutError, match=f"version 1 held by pid {pid}"):
            with weights.update(timeout=0.5):
                pytest.fail("the block ran while an engine held the version")
        assert ts.version == 1 and weights.version == 1
        os.kill(pid, signal.SIGKILL)
        tt_train(model, optimizer, weights, 2)  # the dead engine's hold is given back
        assert weights.version == ts.version == 2


def test_an_update_that_raises_publishes_nothing_and_the_next_one_publishes(manager) -> None:
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device="cpu") as ts:
        weights = train_in_set(model, ts)
        with pytest.raises(RuntimeError, match="the step failed"), weights.update(timeout=T):
            raise RuntimeError("the step failed")
        stats = ts.stats()
        assert stats["version"] == 1 and not stats["latest_available"] and stats["writing"] == 0
        tt_train(model, optimizer, weights, 2)
        assert ts.stats()["version"] == 2 and ts.stats()["latest_available"]


def test_train_in_set_refuses_sets_and_modules_it_cannot_train_in_place(manager) -> None:
    model = TiedNet()
    layout = state_dict_layout(model.state_dict())
    with manager.tensor_set(layout, versions=2, device="cpu") as two:
        with pytest.raises(mp.LayoutError, match="needs a tensor set made with versions=1"):
            train_in_set(model, two)
    other = torch.nn.Linear(3, 3)
    with manager.tensor_set(state_dict_layout(other.state_dict()), versions=1, device="cpu") as ts:
        with pytest.raises(mp.LayoutError, match=r"does not match the module's state dict: the module has \['emb"):
            train_in_set(model, ts)
    with manager.tensor_set(layout, versions=1, device="cpu") as ts:
        weights = train_in_set(model, ts)
        with weights.update(timeout=T), pytest.raises(mp.LayoutError, match="do not nest"):
            with weights.update(timeout=T):
                pass
        assert ts.version == 2  # the outer update published
        model.fc.weight.data = model.fc.weight.data.clone()  # the module given memory of its own
        with pytest.raises(mp.LayoutError, match=r"no longer view the tensor set \(\['fc.weight'\]\)"):
            with weights.update(timeout=T):
                pass
        assert ts.stats()["writing"] == 0


def test_detach_gives_each_parameter_memory_of_its_own_and_the_set_can_go(manager) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ts = manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device="cpu")
    with train_in_set(model, ts) as weights:
        tt_train(model, optimizer, weights, 1)
        version = _version_tensors(ts, 0)
        before = tt_checksum(model.state_dict())
    assert weights.detached
    assert model.fc.weight.data_ptr() != version["fc.weight"].data_ptr()
    assert model.out.weight is model.emb.weight
    assert tt_checksum(model.state_dict()) == before
    with pytest.raises(mp.LayoutError, match="detached"), weights.update():
        pass
    weights.detach()  # idempotent
    ts.close()
    x = torch.arange(24) % 12
    model(x).sum().backward()
    optimizer.step()  # the module trains on its own memory
    assert tt_checksum(model.state_dict()) != before


# -- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_copy_engines_follow_a_trainer_whose_weights_are_the_version(manager, reap) -> None:
    """As on the host, on CUDA: the engine's copies ordered after the trainer's step by the
    version's event, the trainer's next step after the engine's reads by its release event; and the
    trainer's own parameter memory freed once they moved into the version."""
    torch.manual_seed(0)
    model = TiedNet().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    last = 6
    with manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device=0) as ts:
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        weights = train_in_set(model, ts)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert torch.cuda.memory_allocated() <= allocated - params, "the parameters' own memory stayed"
        out = run_guarded(reap, tt_copy_engine, ts, last, "cuda")
        wait_until(lambda: ts.stats()["readers"] == 1, timeout=GPU_TIMEOUT)
        expected = {1: tt_checksum(model.state_dict())}
        assert recv(out, timeout=120) == ("seen", 1, expected[1])
        for step in range(2, last + 1):
            tt_train(model, optimizer, weights, step)
            expected[step] = tt_checksum(model.state_dict())
            assert recv(out, timeout=120) == ("seen", step, expected[step])
        weights.detach()
        assert model.fc.weight.is_cuda and tt_checksum(model.state_dict()) == expected[last]
