"""A trainer whose weights are the tensor set: each optimizer step publishes, with no copy.

``gpushare.torch.train_in_set(model, ts)`` moves the model's parameters into
the one version of a tensor set made with ``versions=1``. The optimizer's
step then runs inside ``weights.update()``: the version is taken back once no
engine is reading it, written in place by the step, and published when the
block ends. Engines in copy mode (here two processes) copy each version they
take into a model of their own and check it against the checksum the trainer
noted for that version; a slow engine skips versions (the latest wins).

Runs with torch on GPU 0, or on the host backend with torch's CPU build
(GPUSHARE_BACKEND=host, or no GPU).

Run: python examples/train_in_set.py [--steps N] [--engines K]
"""

from __future__ import annotations

import argparse
import os
import time

import gpushare as mp


def build_model(torch, device):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 10)
    ).to(device)


def checksum(state) -> float:  # type: ignore[no-untyped-def]
    return round(sum(float(t.double().sum()) for t in state.values()), 6)


def engine(rank, reader, sums, last, device, results) -> None:  # type: ignore[no-untyped-def]
    """Copy mode: copy every version taken into a model of this engine's own, check it."""
    import torch

    from gpushare.torch import load_state_dict

    model = build_model(torch, device).eval()
    results.put(("ready", rank))
    version, seen, wrong = 0, [], 0
    while version < last:
        with reader.wait(newer_than=version, timeout=60) as snap:  # let go at the block's end
            load_state_dict(model, snap)  # one batched copy
            version = snap.version
        wrong += checksum(model.state_dict()) != sums[version]
        seen.append(version)
    results.put((rank, seen, wrong))
    reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps, one version each (default 20)")
    parser.add_argument("--engines", type=int, default=2, help="engine processes (default 2)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        raise SystemExit("this example needs torch (its CPU build is enough)") from None
    from gpushare.torch import state_dict_layout, train_in_set

    gpu = torch.cuda.is_available() and os.environ.get("GPUSHARE_BACKEND", "").lower() != "host"
    device = "cuda:0" if gpu else "cpu"
    with mp.Manager() as manager:
        model = build_model(torch, device)
        ts = manager.tensor_set(state_dict_layout(model.state_dict()), versions=1, device=0 if gpu else "cpu")
        weights = train_in_set(model, ts, timeout=60)  # version 1: the model as it is
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # made after: the same Parameter objects
        print(f"backend: {ts.backend} on {device}; {len(ts.layout)} tensors, {ts.nbytes} bytes, one version")
        sums = manager.dict({1: checksum(model.state_dict())})  # the trainer's checksum of every version
        results = mp.Queue()
        engines = [
            mp.Process(target=engine, args=(rank, ts, sums, args.steps, device, results), device=0 if gpu else None)
            for rank in range(args.engines)
        ]
        for p in engines:
            p.start()
        for _ in engines:  # each has its model and is about to take the first version
            if results.get(timeout=120)[0] != "ready":
                raise SystemExit("an engine did not start")
        x = torch.randn(256, 32, device=device)
        y = torch.randint(0, 10, (256,), device=device)
        started = time.perf_counter()
        for _ in range(1, args.steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # reads the version while engines may be copying it
            with weights.update():  # the version back once no engine reads it
                optimizer.step()  # written in place
                sums[ts.version + 1] = checksum(model.state_dict())  # the version the block's end publishes
            optimizer.zero_grad()
            time.sleep(0.005)  # the rest of a training step
        elapsed = time.perf_counter() - started
        print(f"trainer: published {weights.version} versions in {elapsed:.3f} s, loss {loss.item():.3f}")
        reports = sorted(results.get(timeout=120) for _ in engines)
        for p in engines:
            p.join(timeout=60)
        failed = False
        for rank, seen, wrong in reports:
            ok = wrong == 0 and seen[-1] == args.steps and seen == sorted(set(seen))
            failed |= not ok
            print(
                f"engine {rank} (copy): took {len(seen)} of {args.steps} versions (last {seen[-1]}), "
                f"{wrong} checksum mismatch(es) {'[ok]' if ok else '[FAILED]'}"
            )
        weights.detach()  # the model gets memory of its own again; the set can go
        ts.close()
        print(f"leases outstanding after the engines exited: {manager.stats()['leases']}")
    if failed or any(p.exitcode != 0 for p in engines):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
