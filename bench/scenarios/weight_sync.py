"""``weight_sync`` and ``weight_sync_8b``: a trainer hands its new weights to N engine processes on its GPU.

The reinforcement-learning pattern (vLLM's IPC weight transfer, SGLang's
``update_weights_from_tensor``, verl, slime): after every training step the
trainer gives its new weights to every inference engine on its GPU. Two
layouts of Llama-shaped bf16 state dicts: TinyLlama-1.1B (22 layers, hidden 2048,
intermediate 5632, 32 heads / 4 kv heads, vocab 32000: 201 tensors, about 2.2 GB)
and Llama-3-8B (32 layers, hidden 4096, intermediate 14336, 32/8 heads, vocab
128256: 291 tensors, about 16 GB); 1, 2, 4 and 8 engines, one row each.

Systems, all in one run, each counting the trainer's own packing or copying in its
sync time; an engine copies as those frameworks do (``copy_`` per tensor) unless the
system says otherwise; one sync ends when every engine has acked:

* ``local copy`` (the floor): each engine copies from a bucket it allocated itself;
  the trainer only tells the engines to go.
* ``torch per-tensor``: ``reduce_tensor`` of every tensor every sync, sent to each
  engine, which rebuilds and copies each; the trainer calls ``torch.cuda.ipc_collect()``.
* ``torch flattened bucket``: a new ``torch.cat`` bucket per sync, one
  ``reduce_tensor``; engines rebuild it and copy each tensor out of it; the trainer
  drops it and calls ``ipc_collect()``.
* ``torch kept bucket``: one bucket, its handle sent once; the trainer packs it
  (``torch._foreach_copy_``) and synchronizes, then tells the engines.
* ``gpushare copy``: ``gpushare.torch.publish_state_dict`` (one multi-tensor copy into
  a version), engines waiting in ``reader.wait()`` take it and ``snap.copy_to`` their
  tensors (one batched copy), synchronize, release.
* ``gpushare copy, trainer's weights in the set``: the trainer's module was moved
  into a one-version set (``gpushare.torch.train_in_set``); its step writes the
  version inside ``weights.update()`` (not timed), whose end publishes it with no
  copy; engines copy it as in ``gpushare copy``. The sync is the engines' copies.
* ``gpushare zero-copy``: the same publish; an engine acks once it holds the new
  snapshot (its weights from then on) and released the one before: time from the
  trainer's publish until every engine holds the new version.
* ``gpushare in-place publish``: ``ts.draft()``, one small write, ``ts.publish(draft)``:
  the trainer's call only (engines take each version, untimed, as in zero-copy).

A cell runs only when its estimated device memory (trainer, versions, every engine's
copy, a CUDA context per process) fits in the free memory measured at plan time;
otherwise it is skipped with that reason. Device memory (``cuMemGetInfo``) is read
before a cell sets up, once every engine is ready, and after the timed syncs: the
report shows what the cell uses and how much that grew while it ran. After the timed
syncs every engine sends a checksum of the weights it ends with; a cell whose checksums
differ from the trainer's fails.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import time
import traceback
from typing import TYPE_CHECKING, Any

from ..harness import _await_ready, _check_ack, _pipes_poll, _recv_pipe, _stop, _time_loop, run_in_child
from ..peers import torch_skip
from ..results import Goal, Scenario, _bind
from ..settings import BenchError, GiB
from ..stats import Target

if TYPE_CHECKING:
    from ..runner import Bench


KEYS = ("weight_sync", "weight_sync_8b")

#: scenario key -> (model, its Llama dimensions)
MODELS: dict[str, tuple[str, dict[str, int]]] = {
    "weight_sync": (
        "TinyLlama-1.1B",
        {"layers": 22, "hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000},
    ),
    "weight_sync_8b": (
        "Llama-3-8B",
        {"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256},
    ),
}

LOCAL = "local copy"
TORCH_TENSOR = "torch per-tensor"
TORCH_FLAT = "torch flattened bucket"
TORCH_KEPT = "torch kept bucket"
GS_COPY = "gpushare copy"
GS_IN_SET = "gpushare copy, trainer's weights in the set"
GS_ZERO = "gpushare zero-copy"
GS_BOUND = "gpushare zero-copy, module bound"
GS_INPLACE = "gpushare in-place publish"
SYSTEMS = (LOCAL, TORCH_TENSOR, TORCH_FLAT, TORCH_KEPT, GS_COPY, GS_IN_SET, GS_ZERO, GS_BOUND, GS_INPLACE)
TORCH_SYSTEMS = (TORCH_TENSOR, TORCH_FLAT, TORCH_KEPT)
GS_SYSTEMS = (GS_COPY, GS_IN_SET, GS_ZERO, GS_BOUND, GS_INPLACE)
GS_COPYING = (GS_COPY, GS_IN_SET)  # engines that copy each version into weights of their own
ZERO_COPY = (GS_ZERO, GS_BOUND, GS_INPLACE)  # engines whose weights are the versions: no copy of their own
# torch keeps every storage it sent through CUDA IPC until its receivers let go, and a receiver that exits
# first leaves it kept for good: on an H100 the 8B per-tensor cell left 15 GiB held by the bench's process,
# and every later cell ran out of memory. These cells run in a trainer process of their own.
OWN_TRAINER = (TORCH_TENSOR, TORCH_FLAT)

VERSIONS = 2  # the tensor set's versions
ITERS, ITERS_QUICK = 10, 5  # timed syncs per cell
WARMUP, WARMUP_QUICK = 3, 2
# The in-place publish takes microseconds and its samples spread by 2-3x from one to the next
# (the CPU, the engines' wake-ups): its median needs more samples than a sync's, and they are cheap.
INPLACE_ITERS, INPLACE_WARMUP = 100, 10
CONTEXT_BYTES = 1 * GiB  # per process, in the fit estimate: CUDA context, allocator slack
FIT = 0.9  # a cell runs when its estimate fits in this fraction of the free device memory
TIMEOUT = 300.0  # seconds: an engine's start (torch, its weights) and any one sync
SAMPLE = 4096  # elements of each tensor in the checksums

COPY_TARGET = 1.2  # gpushare copy <= this x the local-copy floor
TORCH_SPEEDUP = 4.0  # gpushare copy >= this x faster than torch per-tensor
BEST_TORCH_SPEEDUP = 1.1  # ... and than the best torch pattern
INPLACE_US = 100.0  # in-place publish <= this

HOW = (
    "`weight_sync` / `weight_sync_8b` (a GPU and torch only): a trainer hands a Llama-shaped bf16 state dict "
    "(TinyLlama-1.1B: 201 tensors, about 2.2 GB; Llama-3-8B: 291 tensors, about 16 GB) to N engine processes "
    "on its GPU after every step, each system counting the trainer's own packing or copying. `local copy` "
    "(the floor): each engine copies from a bucket it allocated itself. `torch per-tensor`: `reduce_tensor` of "
    "every tensor every sync, engines rebuild and `copy_` each, then the trainer calls `ipc_collect()`. `torch "
    "flattened bucket`: a new `torch.cat` bucket and one `reduce_tensor` per sync. `torch kept bucket`: one "
    "bucket whose handle engines keep; the trainer packs it (`torch._foreach_copy_`) and synchronizes. "
    "`gpushare copy`: `publish_state_dict` into a version, engines `snap.copy_to` their tensors; both copy "
    "with gpushare's region-copy kernel where it could be built (one launch per 96 tensors; in the 2026-11-26 "
    "H200 runs it was, and later runs name its status in the table above), else one batched driver copy. "
    "`gpushare copy, trainer's weights in the set`: the trainer's parameters moved into a one-version set "
    "(`gpushare.torch.train_in_set`); its step writes them inside `weights.update()`, whose end publishes with "
    "no copy (timed from there); engines copy as in `gpushare copy`. `gpushare "
    "zero-copy`: the same publish; an engine acks once it holds the new snapshot (its weights). `gpushare "
    "zero-copy, module bound`: the same, and the engine binds a module's parameters to the snapshot "
    "(`gpushare.torch.bind`, what an inference engine runs) before it acks. `gpushare "
    "in-place publish`: `ts.draft()`, one small write through `gpushare.torch.draft_tensors`, "
    f"`ts.publish(draft)`, the trainer's call only (median of {INPLACE_ITERS} after {INPLACE_WARMUP}, with or "
    "without --quick). The torch patterns' and the floor's engines copy with `copy_` per tensor; every "
    "copying engine synchronizes before it acks; the trainer's update between syncs is not "
    f"timed. Median of {ITERS} syncs after {WARMUP} ({ITERS_QUICK} after {WARMUP_QUICK} with --quick). A cell "
    f"runs only if its estimated device memory (layout x copies + {CONTEXT_BYTES // GiB} GiB per process) fits "
    f"in {FIT:.0%} of the free memory, else it is skipped with the reason; the memory table is `cuMemGetInfo` "
    "before and after each cell's set-up and after its timed syncs. Engines' final checksums must match the "
    "trainer's."
)


# -- the layouts --------------------------------------------------------------------------------


def llama_shapes(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int
) -> dict[str, tuple[int, ...]]:
    """A Llama state dict's names and shapes, in Hugging Face's order (untied embeddings)."""
    kv = kv_heads * (hidden // heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes[prefix + "self_attn.q_proj.weight"] = (hidden, hidden)
        shapes[prefix + "self_attn.k_proj.weight"] = (kv, hidden)
        shapes[prefix + "self_attn.v_proj.weight"] = (kv, hidden)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[prefix + "mlp.gate_proj.weight"] = (intermediate, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (intermediate, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, intermediate)
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def layout_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of the state dict in bf16."""
    return sum(math.prod(shape) * 2 for shape in shapes.values())


def copies(system: str, engines: int) -> int:
    """How many layout-sized allocations a cell makes on the GPU (trainer and engines together)."""
    if system == LOCAL:
        return 2 * engines  # each engine: its bucket and its weights (the trainer has nothing)
    if system == TORCH_TENSOR:
        return 1 + engines
    if system == TORCH_FLAT:
        # the trainer's weights, this sync's bucket and the last one, which torch keeps until the engines
        # let go of it (the 8B layout at 2 engines ran out of memory on an H100 with two counted)
        return 3 + engines
    if system == TORCH_KEPT:
        return 2 + engines  # the trainer's weights and its bucket
    if system == GS_COPY:
        return 1 + VERSIONS + engines
    if system == GS_IN_SET:
        return 1 + engines  # the trainer's weights are the set's one version
    return 1 + VERSIONS  # zero-copy engines use the versions as their weights (ZERO_COPY)


def fit_reason(system: str, engines: int, nbytes: int, free: int, device: int) -> str | None:
    """Why the cell would not fit in ``free`` bytes of device memory, or None."""
    need = copies(system, engines) * nbytes + (engines + 1) * CONTEXT_BYTES
    if need <= FIT * free:
        return None
    return (
        f"needs about {need / GiB:.1f} GiB of device memory (the {nbytes / 1e9:.1f} GB layout x "
        f"{copies(system, engines)} copies + {engines + 1} CUDA contexts), more than {FIT:.0%} of the "
        f"{free / GiB:.1f} GiB free on cuda:{device}; not attempted"
    )


def goals(rows: list[str]) -> list[Goal]:
    """The targets printed per row (issue 24)."""
    out: list[Goal] = []
    for row in rows:
        for system in GS_COPYING:  # the copy-mode targets: the state dict published, then trained in the set
            out += [
                Goal(system, row, Target("ratio_max", COPY_TARGET), f"{system} <= {COPY_TARGET:g}x {LOCAL}"),
                Goal(
                    system,
                    row,
                    Target("ratio_max", round(1 / TORCH_SPEEDUP, 4)),
                    f"{system} >= {TORCH_SPEEDUP:g}x faster than {TORCH_TENSOR}",
                    (TORCH_TENSOR,),
                ),
                Goal(
                    system,
                    row,
                    Target("ratio_max", round(1 / BEST_TORCH_SPEEDUP, 4)),
                    f"{system} >= {BEST_TORCH_SPEEDUP:g}x faster than the best torch pattern",
                    TORCH_SYSTEMS,
                ),
            ]
        out.append(Goal(GS_INPLACE, row, Target("us_max", INPLACE_US), f"{GS_INPLACE} <= {INPLACE_US:g} us"))
        if row == "1":
            for system in (GS_ZERO, GS_BOUND):  # the target, then what an engine that binds a module meets
                out.append(Goal(system, row, Target("ratio_max", 1.0), f"{system} <= the {LOCAL} floor"))
    return out


def plan(bench: Bench) -> None:
    for key in KEYS:
        model, dims = MODELS[key]
        shapes = llama_shapes(**dims)
        nbytes = layout_bytes(shapes)
        rows = bench.rows()
        title = (
            f"Weight sync, {model} ({len(shapes)} bf16 tensors, {nbytes / 1e9:.1f} GB) from a trainer to N engines "
            "on its GPU: time per sync"
        )
        if not bench.add(
            Scenario(
                key,
                title,
                "engines",
                rows,
                floor=(key, LOCAL),
                ratio_systems=[*TORCH_SYSTEMS, GS_COPY, GS_IN_SET, GS_ZERO, GS_BOUND],
                extra_ratios=[(GS_COPY, TORCH_TENSOR), (GS_COPY, TORCH_KEPT), (GS_IN_SET, TORCH_KEPT)],
                plot=False,
                goals=goals(rows),
            )
        ):
            continue
        scenario = bench.scenarios[key]
        scenario.notes.append(
            f"{GS_ZERO}: until every engine holds the new snapshot; {GS_BOUND}: until every engine has bound a "
            f"module to it; {GS_INPLACE}: the trainer's draft(), one small "
            "write and publish() only. Every other column: until every engine has the new weights in its own "
            "tensors, synchronized."
        )
        skip = torch_skip(bench)
        if skip is not None:
            scenario.skipped = skip
            continue
        from gpushare import _cuda

        device = bench.device or 0
        free = _cuda.mem_info(device)[0]
        for row in rows:
            engines = int(row)
            for system in SYSTEMS:
                reason = fit_reason(system, engines, nbytes, free, device)
                bench.task(key, system, row, _bind(measure, bench, key, system, engines), reason, cell=True)


def measure(bench: Bench, key: str, system: str, engines: int) -> list[int]:
    """One cell on the bench's GPU: its samples (ns); its memory figures go to the scenario's details."""
    quick = bench.cfg.quick
    if system == GS_INPLACE:
        iters, warmup = INPLACE_ITERS, INPLACE_WARMUP
    else:
        iters, warmup = (ITERS_QUICK, WARMUP_QUICK) if quick else (ITERS, WARMUP)
    args = (system, engines, bench.device or 0, iters, warmup)
    shapes = llama_shapes(**MODELS[key][1])
    if system in OWN_TRAINER:
        samples, memory = in_own_trainer(shapes, *args)
    else:
        samples, memory = run_cell(bench.manager(), shapes, *args)
    if memory is not None:
        details = bench.scenarios[key].details.setdefault("memory", {})
        details.setdefault(str(engines), {})[system] = memory
    return samples


def in_own_trainer(
    shapes: dict[str, tuple[int, ...]], system: str, engines: int, device: int | str, iters: int, warmup: int
) -> tuple[list[int], dict[str, int] | None]:
    """``run_cell`` in a spawned trainer process with a Manager of its own: whatever torch keeps goes with it."""
    payload = run_in_child(
        _trainer_main, (shapes, system, engines, device, iters, warmup), f"{system}: the trainer process",
        TIMEOUT + iters * TIMEOUT / 10,
    )  # fmt: skip
    samples, memory = payload
    return samples, memory


def _trainer_main(
    shapes: dict[str, tuple[int, ...]], system: str, engines: int, device: int | str, iters: int, warmup: int, conn: Any
) -> None:
    try:
        from gpushare import Manager

        with Manager() as manager:
            result = run_cell(manager, shapes, system, engines, device, iters, warmup)
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# -- one cell ------------------------------------------------------------------------------------


def _free(device: Any) -> int | None:
    if not isinstance(device, int):
        return None
    from gpushare import _cuda

    return int(_cuda.mem_info(device)[0])


def _checksums(torch: Any, tensors: list[Any]) -> list[float]:
    """A few thousand elements of each tensor, summed in float32: the same numbers for the same bf16 values."""
    return [float(t.reshape(-1)[:SAMPLE].float().sum()) for t in tensors]


def _equal(a: Any, b: Any, chunk: int = 1 << 24) -> bool:
    """``torch.equal`` a chunk at a time: comparing a whole tensor makes a temporary of its size,
    which four engines of the 8B layout, each holding two copies, have no room for."""
    x, y = a.reshape(-1), b.reshape(-1)
    if x.numel() != y.numel():
        return False
    return all(bool(x[i : i + chunk].equal(y[i : i + chunk])) for i in range(0, x.numel(), chunk))


def _module_over(torch: Any, tensors: dict[str, Any]) -> Any:
    """A module whose parameters are ``tensors`` (no copy), under their dotted names, as a
    model's would be: the engine's model, made over the first snapshot it takes."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        path, _, attribute = name.rpartition(".")
        owner = root
        for part in path.split(".") if path else ():
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(attribute, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def _packed(shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(offset, nbytes, shape) of each bf16 tensor packed back to back, as torch.cat packs them."""
    out, offset = [], 0
    for _, shape in shapes:
        nbytes = math.prod(shape) * 2
        out.append((offset, nbytes, shape))
        offset += nbytes
    return out


def run_cell(
    manager: Any,
    shapes: dict[str, tuple[int, ...]],
    system: str,
    engines: int,
    device: int | str,
    iters: int,
    warmup: int,
) -> tuple[list[int], dict[str, int] | None]:
    """Time ``iters`` syncs of ``system`` to ``engines`` engines on ``device`` (a CUDA ordinal, or "cpu" for
    the gpushare systems and the floor: the plumbing test). Returns the samples (ns) and the memory figures."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from gpushare import get_context
    from gpushare.torch import publish_state_dict, state_dict_layout

    cuda = isinstance(device, int)
    dev = torch.device(f"cuda:{device}") if cuda else torch.device("cpu")
    if not cuda and system in TORCH_SYSTEMS:
        raise BenchError(f"{system} needs CUDA (torch's IPC shares device memory only)")
    names_shapes = list(shapes.items())
    ctx = get_context("spawn")
    free_before = _free(device)
    state: dict[str, Any] = {}
    if system != LOCAL:
        for name, shape in names_shapes:
            state[name] = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    tensors = list(state.values())
    ts = None
    bucket = None
    views: list[Any] = []
    weights: Any = None  # GS_IN_SET: the trainer's module, trained in the set's one version
    update: Any = None  # ... and the update() a step runs in (entered by between(), left by step())
    if system == GS_IN_SET:
        from gpushare.torch import train_in_set

        ts = manager.tensor_set(state_dict_layout(state), versions=1, device=device)
        weights = train_in_set(_module_over(torch, state), ts, timeout=TIMEOUT)  # version 1
        params = dict(weights.module.named_parameters())
        state.update(params)  # the randn tensors go: the version is the trainer's only copy of its weights
        tensors[:] = params.values()
        if cuda:
            torch.cuda.empty_cache()  # so that the memory figures see them gone
    elif system in GS_SYSTEMS:
        ts = manager.tensor_set(state_dict_layout(state), versions=VERSIONS, device=device)
        publish_state_dict(ts, state)  # both versions written once, so an in-place draft starts from weights
        publish_state_dict(ts, state)
    if system == TORCH_KEPT:
        bucket = torch.empty(sum(n for _, n, _ in _packed(names_shapes)), dtype=torch.uint8, device=dev)
        views = [bucket[o : o + n].view(torch.bfloat16).view(s) for o, n, s in _packed(names_shapes)]
    pipes = [ctx.Pipe() for _ in range(engines)]
    parents = [parent for parent, _ in pipes]
    procs = [
        ctx.Process(target=engine, args=(system, names_shapes, device, child, ts), device=device if cuda else None)
        for _, child in pipes
    ]

    def collect() -> None:
        for parent in parents:
            _check_ack(_recv_pipe(parent, procs))

    try:
        for p in procs:
            p.start()
        for _, child in pipes:
            child.close()
        if bucket is not None:  # the kept bucket's handle, once
            handle = bytes(_dumps(reduce_tensor(bucket)))
            for parent in parents:
                parent.send_bytes(handle)
        _await_ready(_pipes_poll(parents), procs, engines)
        if ts is not None:
            collect()  # each engine took the version published before it started (its first ack)
        if cuda:
            torch.cuda.synchronize(dev)
        free_ready = _free(device)

        def between() -> None:
            nonlocal update
            if weights is not None:  # the version taken back for the step (engines let go of it after copying)
                update = weights.update(timeout=TIMEOUT)
                update.__enter__()
            if tensors:  # the trainer's step (not timed): every version differs
                with torch.no_grad():
                    torch._foreach_add_(tensors, 1.0)
            if cuda:
                torch.cuda.synchronize(dev)

        def step(_: int) -> None:
            if system == LOCAL or system == TORCH_KEPT:
                if system == TORCH_KEPT:
                    torch._foreach_copy_(views, tensors)
                    if cuda:
                        torch.cuda.synchronize(dev)  # torch's IPC has no cross-process stream order
                for parent in parents:
                    parent.send_bytes(b"s")
                collect()
            elif system == TORCH_TENSOR:
                data = bytes(_dumps([reduce_tensor(t) for t in tensors]))
                for parent in parents:
                    parent.send_bytes(data)
                collect()
                torch.cuda.ipc_collect()
            elif system == TORCH_FLAT:
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
                data = bytes(_dumps(reduce_tensor(flat)))
                for parent in parents:
                    parent.send_bytes(data)
                collect()
                del flat
                torch.cuda.ipc_collect()
            elif system == GS_IN_SET:  # the update's end publishes the version the step wrote
                update.__exit__(None, None, None)
                collect()
            else:  # gpushare copy / zero-copy: engines wait in reader.wait()
                publish_state_dict(ts, state, timeout=TIMEOUT)
                collect()

        last_slot = -1
        if system == GS_INPLACE:
            from gpushare.torch import draft_tensors

            assert ts is not None
            smallest = min(names_shapes, key=lambda item: math.prod(item[1]))[0]
            stream = torch.cuda.current_stream(dev) if cuda else None
            samples: list[int] = []
            clock = time.perf_counter_ns
            for i in range(warmup + iters):
                between()
                t0 = clock()
                draft = ts.draft(timeout=TIMEOUT, stream=stream)
                draft_tensors(draft)[smallest].fill_(float(i))  # the trainer's write, in place
                last_slot = draft.slot
                ts.publish(draft, stream=stream)
                elapsed = clock() - t0
                collect()  # engines take it (not timed)
                if i >= warmup:
                    samples.append(elapsed)
        else:
            samples = _time_loop(step, warmup, iters, between)
        if cuda:
            torch.cuda.synchronize(dev)
        free_after = _free(device)

        # What every engine ends with must be the trainer's last weights.
        if system == GS_INPLACE:
            from gpushare.torch._weights import _version_tensors

            expected = _checksums(torch, list(_version_tensors(ts, last_slot).values()))
        elif system == LOCAL:
            expected = None  # each engine compares its copy with its own bucket
        else:
            expected = _checksums(torch, tensors)
        if ts is not None:
            ts.close()  # engines waiting for a version get TensorSetClosedError and report
        else:
            for parent in parents:
                parent.send_bytes(b"")
        for parent in parents:
            answer = _recv_pipe(parent, procs)
            if not (isinstance(answer, tuple) and answer[:1] == ("check",)):
                raise BenchError(f"an engine answered {answer!r} instead of its checksums")
            if answer[1] is not True and answer[1] != expected:
                raise BenchError(f"{system}: an engine ends with other weights than the trainer's (checksums differ)")
        memory = None
        if free_before is not None and free_ready is not None and free_after is not None:
            memory = {
                "used_mib": (free_before - free_ready) // (1 << 20),
                "growth_mib": (free_ready - free_after) // (1 << 20),
            }
        return samples, memory
    finally:
        _stop(procs, lambda: None)
        for parent in parents:
            parent.close()
        if ts is not None:
            ts.close()
        update = weights = None  # the module trained in the set: its parameters hold the version
        state.clear()  # the trainer's tensors go before the next cell allocates
        tensors.clear()
        views.clear()
        bucket = None
        gc.collect()
        if cuda:
            torch.cuda.ipc_collect()  # what engines let go of; what a gone receiver held stays (OWN_TRAINER)
            torch.cuda.empty_cache()
        manager.trim()  # the versions' memory back to the device for the next cell


def _dumps(obj: Any) -> Any:
    from multiprocessing.reduction import ForkingPickler

    return ForkingPickler.dumps(obj)


# -- an engine (module level: spawn imports it by name) -------------------------------------------


def engine(
    system: str, names_shapes: list[tuple[str, tuple[int, ...]]], device: int | str, conn: Any, reader: Any
) -> None:
    """One engine process: sets up its weights, acks "ready", then one ack per sync (see the module docstring)."""
    prev = None
    try:
        import torch

        from gpushare import TensorSetClosedError
        from gpushare.torch import as_tensor, bind

        cuda = isinstance(device, int)
        dev = torch.device(f"cuda:{device}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(dev)
        packed = _packed(names_shapes)
        mine: dict[str, Any] = {}
        if system not in ZERO_COPY:
            mine = {name: torch.empty(shape, dtype=torch.bfloat16, device=dev) for name, shape in names_shapes}
        targets = list(mine.values())
        sources: list[Any] = []
        kept = None
        if system == LOCAL:  # the floor: a bucket of this engine's own
            kept = torch.empty(sum(n for _, n, _ in packed), dtype=torch.uint8, device=dev)
            sources = [kept[o : o + n].view(torch.bfloat16).view(s) for o, n, s in packed]
            for source in sources:
                source.normal_()
        if system == TORCH_KEPT:  # the trainer's bucket, its handle opened once
            fn, args = pickle.loads(conn.recv_bytes())
            kept = fn(*args)
            sources = [kept[o : o + n].view(torch.bfloat16).view(s) for o, n, s in packed]
        if cuda:
            torch.cuda.synchronize(dev)
        conn.send(("ready", os.getpid()))

        def finish() -> None:
            if cuda:
                torch.cuda.synchronize(dev)
            conn.send(1)

        if system in GS_SYSTEMS:
            version = 0
            module = None
            while True:
                try:
                    snap = reader.wait(newer_than=version, timeout=TIMEOUT)
                except TensorSetClosedError:
                    break
                version = snap.version
                if system in GS_COPYING:
                    snap.copy_to(mine)  # one batched copy, after the version's ready event
                    if cuda:
                        torch.cuda.synchronize(dev)
                    snap.release()
                    conn.send(1)
                elif system == GS_BOUND:  # the module's parameters view the snapshot; bind releases the last
                    if module is None:
                        module = _module_over(torch, {name: as_tensor(snap[name]) for name, _ in names_shapes})
                    bind(module, snap)
                    conn.send(1)
                else:  # zero-copy: the snapshot is this engine's weights now
                    if prev is not None:
                        prev.release()
                    prev = snap
                    conn.send(1)
            held: Any = prev
            if system in GS_COPYING:
                final = targets
            elif system == GS_BOUND:
                assert module is not None
                final = [module.get_parameter(name) for name, _ in names_shapes]
            else:
                final = [as_tensor(held[name]) for name, _ in names_shapes]
            conn.send(("check", _checksums(torch, final)))
        else:
            while True:
                data = conn.recv_bytes()
                if not data:
                    break
                if system in (LOCAL, TORCH_KEPT):
                    for dst, src in zip(targets, sources, strict=True):
                        dst.copy_(src)
                elif system == TORCH_TENSOR:
                    rebuilt = [fn(*args) for fn, args in pickle.loads(data)]
                    for dst, src in zip(targets, rebuilt, strict=True):
                        dst.copy_(src)
                    del rebuilt
                else:  # TORCH_FLAT
                    fn, args = pickle.loads(data)
                    flat = fn(*args)
                    for dst, (o, n, s) in zip(targets, packed, strict=True):
                        dst.copy_(flat[o : o + n].view(torch.bfloat16).view(s))
                    del flat
                finish()
            if system == LOCAL:
                same = all(_equal(dst, src) for dst, src in zip(targets, sources, strict=True))
                conn.send(("check", True if same else [0.0]))
            else:
                conn.send(("check", _checksums(torch, targets)))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise
    finally:
        if prev is not None:
            prev.release()
        if reader is not None:
            reader.close()
