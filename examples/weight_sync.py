"""Weight sync: a trainer publishes its model after every step; four engines follow it.

The trainer keeps its weights in a tensor set (``manager.tensor_set``): two
versions of one allocation each, every tensor at its own aligned offset. After
each training step it publishes the new weights into a version no engine
holds. Engines are separate processes that received the set as a Process
argument: each takes the newest version there is (a slow engine skips
versions: the latest wins), checks it against the checksum the trainer noted
for that version, and

* in copy mode (engines 0 and 1) copies it into its own weights, in one
  batched copy, and lets the version go at once;
* in zero-copy mode (engines 2 and 3) uses the version's memory as its
  weights, holding it until it takes the next one.

With torch and a GPU the model is a small torch MLP on GPU 0 (one bfloat16
layer) and the helpers of ``gpushare.torch`` move its state dict. Without
them (or with GPUSHARE_BACKEND=host) it runs on the host backend with NumPy:
the "model" is a dict of arrays, the bfloat16 tensor kept as its bits in
uint16 with a tag, as torch's state dicts are stored.

Run: python examples/weight_sync.py [--steps N] [--engines K]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import gpushare as mp

HIDDEN, INPUTS, OUTPUTS = 64, 32, 10


def _torch_on_gpu():  # type: ignore[no-untyped-def]
    """torch with a usable GPU, or None (no torch, no GPU, or GPUSHARE_BACKEND=host)."""
    if os.environ.get("GPUSHARE_BACKEND", "").lower() == "host":
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# -- the NumPy model (host backend) -----------------------------------------------------------


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, as its 16 bits (round toward zero): what a bfloat16 tensor stores."""
    return (np.ascontiguousarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def numpy_model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "layer1.weight": rng.standard_normal((HIDDEN, INPUTS)).astype(np.float32),
        "layer1.bias": np.zeros(HIDDEN, np.float32),
        "head.weight": bf16_bits(rng.standard_normal((OUTPUTS, HIDDEN))),  # a bfloat16 tensor's bits
        "steps": np.zeros((), np.int64),
    }


NUMPY_LAYOUT = {
    "layer1.weight": ((HIDDEN, INPUTS), "float32"),
    "layer1.bias": ((HIDDEN,), "float32"),
    "head.weight": ((OUTPUTS, HIDDEN), "bfloat16"),  # stored as uint16 with the tag "bfloat16"
    "steps": ((), "int64"),
}


def numpy_step(model: dict[str, np.ndarray], step: int) -> None:
    """One "training step": every tensor changes."""
    model["layer1.weight"] *= np.float32(0.99)
    model["layer1.bias"] += np.float32(0.01 * step)
    head = (model["head.weight"].astype(np.uint32) << 16).view(np.float32) * np.float32(0.98)
    model["head.weight"] = bf16_bits(head)
    model["steps"] += 1


def checksum(tensors) -> float:  # type: ignore[no-untyped-def]
    """The same number in the trainer and in an engine for the same weights (exact float64 sums)."""
    total = 0.0
    for name in sorted(tensors):
        value = tensors[name]
        if hasattr(value, "double"):  # a torch tensor: its values, on the host
            value = value.detach().double().cpu().numpy()
        elif hasattr(value, "numpy"):  # a gpushare view
            value = value.numpy()
        total += float(np.asarray(value, dtype=np.float64).sum())
    return total


# -- the torch model (GPU) -------------------------------------------------------------------


def torch_model(torch, seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUTPUTS).to(torch.bfloat16)
    )
    return model.cuda()


def torch_step(torch, model, optimizer) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(16, INPUTS, device="cuda")
    hidden = model[1](model[0](x))
    loss = model[2](hidden.to(torch.bfloat16)).float().pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


# -- engines ------------------------------------------------------------------------------------


def engine(rank: int, reader, sums, steps: int, on_gpu: bool, results) -> None:  # type: ignore[no-untyped-def]
    zero_copy = rank >= 2
    torch = _torch_on_gpu() if on_gpu else None
    if torch is not None:
        from gpushare.torch import bind, load_state_dict

        weights = torch_model(torch, seed=100 + rank).eval()  # its own weights, about to be replaced
    else:
        weights = numpy_model(seed=100 + rank)
    seen, wrong, held = [], 0, None
    version = 0
    while version < steps:
        snap = reader.wait(newer_than=version, timeout=120)  # the newest version (latest wins)
        version = snap.version
        if zero_copy:
            if torch is not None:
                bind(weights, snap)  # the engine's parameters now view the version; the one before is released
                total = checksum(weights.state_dict())
            else:
                held, old = snap, held  # the snapshot's views are the weights
                total = checksum(held)
                if old is not None:
                    old.release()
        else:
            with snap:
                if torch is not None:
                    load_state_dict(weights, snap)  # one batched copy on the current stream
                else:
                    snap.copy_to(weights)  # one memmove per tensor into the engine's arrays
            total = checksum(weights.state_dict() if torch is not None else weights)
        wrong += total != sums[version]
        seen.append(version)
    mode = "zero-copy" if zero_copy else "copy"
    results.put((rank, mode, seen, wrong))
    if held is not None:
        held.release()
    reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps, one version each (default 20)")
    parser.add_argument("--engines", type=int, default=4, help="engine processes (default 4)")
    args = parser.parse_args()

    torch = _torch_on_gpu()
    with mp.Manager() as manager:
        if torch is not None:
            from gpushare.torch import publish_state_dict, state_dict_layout

            model = torch_model(torch, seed=0)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            ts = manager.tensor_set(state_dict_layout(model.state_dict()), versions=2, device=0)
            print(f"backend: {ts.backend} on GPU {ts.device} (torch {torch.__version__})")
        else:
            weights = numpy_model(seed=0)
            ts = manager.tensor_set(NUMPY_LAYOUT, versions=2, device="cpu")
            print(f"backend: {ts.backend} (NumPy)")
        print(f"{len(ts.layout)} tensors, {ts.nbytes} bytes per version, {ts.versions} versions")
        sums = manager.dict()  # the trainer's checksum of every version, for the engines to check
        results = mp.Queue()
        engines = [
            mp.Process(target=engine, args=(rank, ts, sums, args.steps, torch is not None, results))
            for rank in range(args.engines)
        ]
        for p in engines:
            p.start()
        deadline = time.monotonic() + 120
        while ts.stats()["readers"] < args.engines:  # each engine registers when it unpickles the set
            if time.monotonic() > deadline or not all(p.is_alive() for p in engines):
                raise SystemExit("the engines did not start")
            time.sleep(0.01)
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            if torch is not None:
                torch_step(torch, model, optimizer)
                sums[ts.version + 1] = checksum(model.state_dict())  # the version this publish makes
                publish_state_dict(ts, model.state_dict(), timeout=120)
            else:
                numpy_step(weights, step)
                sums[ts.version + 1] = checksum(weights)
                ts.publish(weights, timeout=120)  # copied into a version no engine holds
                time.sleep(0.005)  # the rest of a training step
        print(f"trainer: published {ts.version} versions in {time.perf_counter() - started:.3f} s")
        reports = sorted(results.get(timeout=120) for _ in engines)
        for p in engines:
            p.join(timeout=60)
        failed = False
        for rank, mode, seen, wrong in reports:
            ok = wrong == 0 and seen and seen[-1] == args.steps and seen == sorted(set(seen))
            failed |= not ok
            print(
                f"engine {rank} ({mode}): took {len(seen)} of {args.steps} versions "
                f"(last {seen[-1] if seen else None}), {wrong} checksum mismatch(es) {'[ok]' if ok else '[FAILED]'}"
            )
        ts.close()
        print(f"leases outstanding after the engines exited: {manager.stats()['leases']}")
    if failed or any(p.exitcode != 0 for p in engines):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
