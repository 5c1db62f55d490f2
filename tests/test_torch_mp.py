"""gpushare.torch.multiprocessing: torch.multiprocessing's names and behaviour, with CUDA tensors
under gpushare's lifetime.

Skipped where torch is not installed. The unmarked tests run with torch's CPU build (CPU
tensors, shared as torch shares them); the ``gpu`` ones check the CUDA path: same memory,
freed once every receiver let go with no ``ipc_collect()``, a SIGKILLed receiver's tensors
back, the producer's exit, expandable segments, and (``multigpu``) the device by UUID.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import subprocess_env, wait_until

torch = pytest.importorskip("torch")

import torch.multiprocessing as tmp  # noqa: E402

import gpushare.torch.multiprocessing as mp  # noqa: E402
from gpushare import OwnerGoneError  # noqa: E402

MiB = 1 << 20


# -- children (module level: spawn imports them by name) --------------------------------------


def add_one(q, out) -> None:
    t = q.get(timeout=60)
    t.add_(1)
    if t.is_cuda:
        torch.cuda.synchronize()
    out.put("done")
    q.get(timeout=60)  # hold it until the parent has looked


def describe_tensors(q, out) -> None:
    for _ in range(int(q.get(timeout=60))):
        t = q.get(timeout=60)
        out.put(
            (type(t).__name__, tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad, t.dtype,
             t.cpu().tolist(), str(t.device))
        )  # fmt: skip


def pipe_echo(conn) -> None:
    t = conn.recv()
    conn.send(t * 2)
    conn.recv()  # a CPU tensor's fd is fetched from its sender: stay until it is received
    conn.close()


def twice(t):
    return t * 2


def hold_then_drop(q, out, n) -> None:
    held = [q.get(timeout=60) for _ in range(n)]
    out.put(sum(float(t.sum().item()) for t in held))
    q.get(timeout=60)  # the parent's signal: drop them
    del held
    out.put("dropped")
    q.get(timeout=60)


def hold_forever(q, out, n) -> None:
    held = [q.get(timeout=60) for _ in range(n)]
    torch.cuda.synchronize()
    out.put(len(held))
    time.sleep(600)


def relay(inq, outq, n) -> None:
    for _ in range(n):
        outq.put(inq.get(timeout=120))


def sink(q, out, n) -> None:
    total = 0.0
    for _ in range(n):
        total += float(q.get(timeout=120).sum().item())
    out.put(total)


def sink_in_order(q, out, n) -> None:
    """Get ``n`` tensors, the i-th ``full((4,), i)``; report the ones that differ (first 10) and how many."""
    wrong = []
    count = 0
    for i in range(n):
        values = q.get(timeout=120).tolist()
        if values != [float(i)] * 4:
            count += 1
            if len(wrong) < 10:
                wrong.append((i, values))
    out.put((count, wrong))


def add_late_then_drop(q, out) -> None:
    """Keep the first tensor; queue a long kernel, then a write to the second, and drop the
    second at once."""
    kept = q.get(timeout=60)
    t = q.get(timeout=60)
    torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU time before the write
    t.add_(1)
    del t  # the write is still queued here
    out.put("dropped")
    q.get(timeout=60)  # the parent's signal (the first tensor again): done
    del kept


def server_tensor_producer(queues, reports) -> None:
    """A tensor over a Manager(owner="server") buffer to every consumer; return once each
    has it (the process then exits, the Manager's server stays)."""
    import gpushare

    manager = gpushare.Manager(owner="server")
    buf = manager.empty((1024,), "float32", device=0)
    t = torch.from_dlpack(buf)
    t.fill_(7.0)
    for q in queues:
        q.put(t)
    while not all(os.path.exists(r + ".got") for r in reports):
        time.sleep(0.01)


def read_for(q, report, seconds) -> None:
    """Get a tensor, then read its sum every 0.2 s for ``seconds``; report the sums seen."""
    t = q.get(timeout=60)
    open(report + ".got", "w").close()
    sums, end = set(), time.monotonic() + seconds
    while time.monotonic() < end:
        sums.add(float(t.sum().item()))
        time.sleep(0.2)
    with open(report, "w") as f:
        f.write(f"{time.time()} {sorted(sums)}")


def view_then_forward(q, out) -> None:
    """Receive a gpushare Buffer, view it as a tensor, and send the tensor on."""
    out.put(torch.from_dlpack(q.get(timeout=60)))
    q.get(timeout=60)  # hold the buffer until the parent is done


def actor(weights, results, steps) -> None:
    for _ in range(steps):
        state = weights.get(timeout=60)
        results.put(float(sum(v.sum().item() for v in state.values())))


def get_each_then_count_opens(q, out, n) -> None:
    """Get ``n`` tensors, dropping each before the next; report this process's opens, then
    (once the parent let its tensor go) whether the segment was unmapped here."""
    from gpushare import _lifetime

    for _ in range(n):
        t = q.get(timeout=60)
        out.put(float(t[0].item()))
        del t
    out.put(sum(_lifetime.link_stats()["opens"].values()))
    q.get(timeout=60)
    deadline = time.monotonic() + 10
    while _lifetime.link_stats()["open_mappings"] and time.monotonic() < deadline:
        time.sleep(0.02)
    out.put(_lifetime.link_stats()["open_mappings"])


def report_first_and_last(q, out) -> None:
    """Get tensors until None, reporting each one's first and last values, then dropping it."""
    while (t := q.get(timeout=60)) is not None:
        out.put((float(t[0].item()), float(t[-1].item())))
        del t


def receive_then_get(q, report) -> None:
    """Receive a tensor (or a gpushare Buffer), read it, then wait on the queue while holding it;
    write what happened to ``report``, then let go."""
    t = q.get(timeout=60)
    with open(report + ".got", "w") as f:
        f.write(str(float(t.sum().item() if isinstance(t, torch.Tensor) else t.numpy().sum())))
    try:
        q.get(timeout=30)
        verdict = "an item"
    except OwnerGoneError:
        verdict = "OwnerGoneError"
    except Exception as exc:
        verdict = type(exc).__name__
    with open(report, "w") as f:
        f.write(f"{verdict} {time.time()}")
    del t


# -- names ---------------------------------------------------------------------------------------


#: What the drop-in does not need: the DataLoader, its workers and batches, weight sync, the trainer.
NOT_THE_DROP_IN = {
    "gpushare._loader",
    "gpushare._loader_workers",
    "gpushare._batch",
    "gpushare._fanout",
    "gpushare.torch._dataloader",
    "gpushare.torch._weights",
    "gpushare.torch._trainer",
}


def test_importing_the_drop_in_loads_neither_the_loader_nor_weight_sync() -> None:
    code = (
        "import sys, gpushare.torch.multiprocessing; "
        "print(sorted(m for m in sys.modules if m == 'gpushare' or m.startswith('gpushare.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(ast.literal_eval(done.stdout))
    assert "gpushare.torch._sharing" in loaded
    assert not NOT_THE_DROP_IN & loaded, sorted(NOT_THE_DROP_IN & loaded)
    assert not [m for m in loaded if m.startswith("gpushare._fanout.")], sorted(loaded)
    import gpushare.torch

    assert gpushare.torch.DataLoader.__module__ == "gpushare.torch._dataloader"  # loaded at its first use
    assert set(gpushare.torch.__all__) <= set(dir(gpushare.torch))


def test_it_has_every_name_of_torch_multiprocessing() -> None:
    assert set(tmp.__all__) <= set(mp.__all__)
    for name in ("spawn", "start_processes", "get_sharing_strategy", "set_sharing_strategy",
                 "get_all_sharing_strategies", "Process", "Queue", "SimpleQueue", "Pool", "Pipe", "Event",
                 "get_context"):  # fmt: skip
        assert callable(getattr(mp, name)), name
    assert mp.get_all_sharing_strategies() == tmp.get_all_sharing_strategies()
    assert mp.Queue is not tmp.Queue  # gpushare's
    # Outside torch's __all__, and used by torch's own tests: torch's objects.
    for name in ("reductions", "_set_thread_name", "_get_thread_name", "ENV_VAR_PARALLEL_START"):
        assert getattr(mp, name) is getattr(tmp, name), name
    # Its module names, torch's and multiprocessing's (it is imported as a module, not a context).
    missing = {n for n in dir(tmp) if not n.startswith("__") and not hasattr(mp, n)}
    assert missing <= {"_RT", "_all_sharing_strategies", "_atfork", "_prctl_pr_set_pdeathsig", "_sharing_strategy",
                       "multiprocessing", "sys", "torch"}, missing  # fmt: skip


# -- CPU tensors: as torch shares them ---------------------------------------------------------


def test_a_cpu_tensor_written_in_a_child_is_seen_by_the_parent(reap) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=add_one, args=(q, out))
    proc.start()
    reap.append(proc)
    t = torch.zeros(5)
    q.put(t)  # torch moves it to shared memory, as torch.multiprocessing does
    assert out.get(timeout=60) == "done"
    assert t.tolist() == [1.0] * 5
    q.put(None)
    proc.join(30)
    assert proc.exitcode == 0


def test_views_parameters_and_requires_grad_arrive_as_torch_delivers_them(reap) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=describe_tensors, args=(q, out))
    proc.start()
    reap.append(proc)
    base = torch.arange(12.0).reshape(3, 4)
    items = [base.t(), base[1:, 2:], torch.nn.Parameter(torch.ones(2)), torch.ones(3, requires_grad=True)]
    q.put(len(items))
    for item in items:
        q.put(item)
    got = [out.get(timeout=60) for _ in items]
    assert got[0][1:4] == ((4, 3), (1, 4), 0)
    assert got[0][6] == base.t().tolist()
    assert got[1][1:4] == ((2, 2), (4, 1), 6)
    assert got[2][0] == "Parameter" and got[2][4] is True
    assert got[3][4] is True
    proc.join(30)


def test_a_non_leaf_tensor_that_requires_grad_is_refused_as_torch_refuses_it() -> None:
    q = mp.Queue()
    x = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
        q.put(x)


def test_cpu_tensors_through_a_pipe_and_a_pool(reap) -> None:
    parent, child = mp.Pipe()
    proc = mp.Process(target=pipe_echo, args=(child,))
    proc.start()
    reap.append(proc)
    parent.send(torch.ones(3))
    assert parent.recv().tolist() == [2.0, 2.0, 2.0]
    parent.send(None)
    proc.join(30)
    with mp.Pool(2) as pool:
        assert [t.tolist() for t in pool.map(twice, [torch.ones(2), torch.zeros(2)])] == [[2.0, 2.0], [0.0, 0.0]]


def test_a_learner_and_actors_exchange_state_dicts_on_a_bounded_queue_without_deadlock(reap) -> None:
    weights, results = mp.Queue(maxsize=2), mp.Queue()
    steps, n_actors = 20, 2
    actors = [mp.Process(target=actor, args=(weights, results, steps)) for _ in range(n_actors)]
    for proc in actors:
        proc.start()
        reap.append(proc)
    model = torch.nn.Linear(4, 4)
    for _ in range(steps * n_actors):
        weights.put({k: v.detach().clone() for k, v in model.state_dict().items()})
    sums = [results.get(timeout=60) for _ in range(steps * n_actors)]
    assert len(sums) == steps * n_actors
    for proc in actors:
        proc.join(30)
        assert proc.exitcode == 0


# -- CUDA tensors: gpushare's lifetime ---------------------------------------------------------


def _allocated() -> int:
    return torch.cuda.memory_allocated()


def _allocated_at_rest() -> int:
    """torch's allocated memory once no segment sent before (an earlier test's) is still
    being retired: its anchor goes back only after every receiver unmapped it."""
    from gpushare.torch._sharing import sharing_owner

    wait_until(lambda: sharing_owner().stats()["bytes_allocated"] == 0, timeout=10.0)
    return _allocated()


@pytest.mark.gpu
def test_gpu_a_cuda_tensor_written_in_a_child_is_seen_by_the_parent(reap) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=add_one, args=(q, out))
    proc.start()
    reap.append(proc)
    t = torch.zeros(1000, device="cuda")
    q.put(t[10:20])
    assert out.get(timeout=60) == "done"
    assert t[10:20].tolist() == [1.0] * 10
    assert t[:10].sum().item() == 0 and t[20:].sum().item() == 0
    q.put(None)
    proc.join(30)
    assert proc.exitcode == 0


@pytest.mark.gpu
def test_gpu_views_parameters_and_stream_order_arrive_as_torch_delivers_them(reap) -> None:
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=describe_tensors, args=(q, out))
    proc.start()
    reap.append(proc)
    base = torch.arange(12.0, device="cuda").reshape(3, 4)
    late = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # the fill below runs long after put() returns
    late.fill_(3.0)
    items = [late, base.t(), base[1:, 2:], torch.nn.Parameter(torch.ones(2, device="cuda")),
             torch.empty(0, device="cuda")]  # fmt: skip
    q.put(len(items))
    for item in items:
        q.put(item)
    got = [out.get(timeout=60) for _ in items]
    assert got[0][6] == [3.0] * (1 << 20)  # ordered after the producer's queued work
    assert got[1][1:4] == ((4, 3), (1, 4), 0) and got[1][6] == base.t().tolist()
    assert got[2][1:4] == ((2, 2), (4, 1), 6) and got[2][6] == base[1:, 2:].tolist()
    assert got[3][0] == "Parameter" and got[3][4] is True
    assert got[4][1] == (0,) and got[4][7].startswith("cuda")
    proc.join(30)


@pytest.mark.gpu
def test_gpu_a_tensor_sent_to_four_consumers_that_drop_it_is_free_within_2_s(reap) -> None:
    before = _allocated_at_rest()
    t = torch.ones(64 * MiB, device="cuda")  # 256 MiB
    qs, out = [mp.Queue() for _ in range(4)], mp.Queue()
    procs = [mp.Process(target=hold_then_drop, args=(q, out, 1)) for q in qs]
    for proc in procs:
        proc.start()
        reap.append(proc)
    for q in qs:
        q.put(t)
    assert [out.get(timeout=60) for _ in procs] == [64.0 * MiB] * 4
    del t
    assert _allocated() >= before + 256 * MiB  # held by the consumers' leases
    for q in qs:
        q.put("drop")
    assert [out.get(timeout=60) for _ in procs] == ["dropped"] * 4
    start = time.monotonic()
    wait_until(lambda: _allocated() <= before, timeout=2.0)
    print(f"free {time.monotonic() - start:.3f} s after the last drop")
    for q in qs:
        q.put(None)


def test_torchs_storage_use_count_counts_what_the_sharing_reads() -> None:
    """The private function behind "opened once" (gpushare/torch/_sharing.py): if torch drops
    or changes it, this fails, and sending a tensor again would open its segment again."""
    from gpushare.torch import _sharing

    assert _sharing._use_count is not None, f"torch {torch.__version__} has no torch._C._storage_Use_Count"
    t = torch.zeros(16)
    storage = t.untyped_storage()
    view = t[4:]
    assert _sharing._used_here(storage)
    del t
    assert _sharing._used_here(storage)  # the view still uses it
    del view
    assert not _sharing._used_here(storage)
    assert not _sharing._used_here(None)


@pytest.mark.gpu
def test_gpu_a_tensor_sent_again_is_opened_once_and_unmapped_once_let_go(reap) -> None:
    before = _allocated_at_rest()
    t = torch.full((4 * MiB,), 3.0, device="cuda")  # 16 MiB, held here throughout
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=get_each_then_count_opens, args=(q, out, 50))
    proc.start()
    reap.append(proc)
    for _ in range(50):
        q.put(t)
        assert out.get(timeout=60) == 3.0  # dropped by the consumer before the next send
    assert out.get(timeout=60) == 1  # one open for 50 arrivals
    del t
    q.put("let go")
    start = time.monotonic()
    assert out.get(timeout=60) == 0  # the idle segment was retired: unmapped there
    wait_until(lambda: _allocated() <= before, timeout=2.0)
    print(f"unmapped and free {time.monotonic() - start:.3f} s after the producer let go")
    proc.join(30)


def _calls_of(monkeypatch, name: str) -> list[int]:
    """The pointers this process calls ``gpushare._cuda.<name>(ptr, ordinal)`` with from now on."""
    from gpushare import _cuda

    calls: list[int] = []
    real = getattr(_cuda, name)
    monkeypatch.setattr(_cuda, name, lambda ptr, ordinal: calls.append(ptr) or real(ptr, ordinal))
    return calls


def _start_reporter(reap) -> tuple[Any, Any, Any]:
    """A consumer that reports each tensor's first and last values: (its queue, its answers, it)."""
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=report_first_and_last, args=(q, out))
    proc.start()
    reap.append(proc)
    return q, out, proc


@pytest.mark.gpu
def test_gpu_a_segment_is_looked_up_once_and_again_once_torch_made_it_anew(reap, monkeypatch) -> None:
    from gpushare.torch._sharing import sharing_owner

    asked = _calls_of(monkeypatch, "segment_of")
    q, out, proc = _start_reporter(reap)
    t = torch.full((4 * MiB,), 1.0, device="cuda")  # 16 MiB: a segment of its own
    for _ in range(3):
        q.put(t)
        assert out.get(timeout=60) == (1.0, 1.0)
    assert len(asked) == 1, "a tensor sent again asked the driver for its segment again"
    first = t.data_ptr()
    del t
    # Its record retired (no lease, and torch no longer uses it), so torch may free the
    # segment and make a larger one at the same address: that one must be looked up anew.
    wait_until(lambda: sharing_owner().stats()["bytes_allocated"] == 0, timeout=10.0)
    torch.cuda.empty_cache()
    t = torch.full((8 * MiB,), 2.0, device="cuda")
    print(f"the second segment is {'at the same address' if t.data_ptr() == first else 'elsewhere'}")
    q.put(t)
    assert out.get(timeout=60) == (2.0, 2.0)
    assert len(asked) == 2
    q.put(None)
    proc.join(30)
    assert proc.exitcode == 0
    del t
    wait_until(lambda: sharing_owner().stats()["bytes_allocated"] == 0, timeout=10.0)


@pytest.mark.gpu
def test_gpu_a_segment_shared_anew_after_its_retire_is_not_exported_again(reap, monkeypatch) -> None:
    from gpushare.torch._sharing import sharing_owner

    exported = _calls_of(monkeypatch, "ipc_get_handle")
    q, out, proc = _start_reporter(reap)
    bases = set()
    for value in (1.0, 2.0, 3.0):
        t = torch.full((4 * MiB,), value, device="cuda")  # 16 MiB: a segment of its own
        bases.add(t.data_ptr())
        q.put(t)
        del t
        assert out.get(timeout=60) == (value, value)
        # Retired: unmapped by the consumer, the block back in torch's cache, where the
        # next tensor of this size finds it; its record is a new one, its handle is not.
        wait_until(lambda: sharing_owner().stats()["bytes_allocated"] == 0, timeout=10.0)
    print(f"{len(bases)} segment(s) for 3 sends, {len(exported)} export(s)")
    assert len(bases) < 3, "torch made a new segment for every send: nothing here tested the handle cache"
    # At most one export a segment (none for one this process exported before: an earlier test's).
    assert len(exported) <= len(bases), "a segment shared again after its retire was exported again"
    q.put(None)
    proc.join(30)
    assert proc.exitcode == 0


@pytest.mark.gpu
def test_gpu_the_current_stream_is_read_as_torch_reads_it() -> None:
    """The private function behind a cheap current stream (gpushare/torch/_sharing.py): if
    torch drops or changes it, this fails, and every CUDA tensor's send and arrival would
    make a Stream object again."""
    from gpushare.torch import _sharing

    assert _sharing._raw_stream is not None, f"torch {torch.__version__} has no torch._C._cuda_getCurrentRawStream"
    assert _sharing._current_stream(0) == torch.cuda.current_stream(0).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _sharing._current_stream(0) == side.cuda_stream != 0
    assert _sharing._current_stream(0) == torch.cuda.current_stream(0).cuda_stream


@pytest.mark.gpu
def test_gpu_a_sigkilled_consumers_tensors_are_free_within_2_s(reap) -> None:
    before = _allocated_at_rest()
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=hold_forever, args=(q, out, 8))
    proc.start()
    reap.append(proc)
    for _ in range(8):
        q.put(torch.ones(16 * MiB, device="cuda"))  # 64 MiB each, dropped here at once
    assert out.get(timeout=60) == 8
    assert _allocated() >= before + 512 * MiB
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    wait_until(lambda: _allocated() <= before, timeout=2.0)
    print(f"free {time.monotonic() - start:.3f} s after SIGKILL")


@pytest.mark.gpu
def test_gpu_a_thousand_sends_leave_memory_fds_and_threads_flat(reap) -> None:
    import threading

    q, out = mp.Queue(maxsize=8), mp.Queue()
    n = 1000
    proc = mp.Process(target=sink, args=(q, out, n + 100))
    proc.start()
    reap.append(proc)
    for _ in range(100):  # warm-up: ready events, the consumer's link, torch's pools
        q.put(torch.ones(256 * 1024, device="cuda"))
    time.sleep(0.5)
    torch.cuda.reset_peak_memory_stats()
    base_alloc, base_fds, base_threads = _allocated(), len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(n):
        q.put(torch.ones(256 * 1024, device="cuda"))  # 1 MiB, fresh each time
    assert out.get(timeout=120) == float((n + 100) * 256 * 1024)
    wait_until(lambda: _allocated() <= base_alloc, timeout=2.0)
    peak = torch.cuda.max_memory_allocated() - base_alloc
    assert peak <= 16 * MiB, f"peak {peak / MiB:.1f} MiB above the start over {n} sends"
    assert len(os.listdir("/proc/self/fd")) <= base_fds + 2
    assert threading.active_count() <= base_threads
    proc.join(30)


def relay_through_three(reap, n: int, maxsize: int, before_each=None) -> tuple[int, list]:
    """Put ``full((4,), i)`` for i < n on A -> B (relay) -> C (``sink_in_order``), each tensor
    dropped by A at once (its block is reused); ``before_each()`` runs before each write. C's
    report: how many tensors arrived with other values, and the first of them."""
    a, b, out = mp.Queue(maxsize=maxsize), mp.Queue(maxsize=maxsize), mp.Queue()
    procs = [mp.Process(target=relay, args=(a, b, n)), mp.Process(target=sink_in_order, args=(b, out, n))]
    for proc in procs:
        proc.start()
        reap.append(proc)
    for i in range(n):
        if before_each is not None:
            before_each()
        a.put(torch.full((4,), float(i), device="cuda"))
    count, wrong = out.get(timeout=300)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return count, wrong


@pytest.mark.gpu
def test_gpu_many_small_tensors_through_three_processes(reap) -> None:
    n = int(os.environ.get("GPUSHARE_TEST_SMALL_TENSORS", "20000"))
    count, wrong = relay_through_three(reap, n, 64)
    assert count == 0, f"{count} of {n} tensors arrived with other values; (index, values): {wrong}"


@pytest.mark.gpu
def test_gpu_a_dropped_tensor_goes_back_only_after_the_receivers_queued_work(reap) -> None:
    """A receiver drops a tensor while its write to it is still queued, and keeps another
    tensor of the same allocator segment (so the segment stays open and only the dropped
    tensor's block goes back): that block must not be handed out again before the write ran
    (torch waits for it too)."""
    q, out = mp.Queue(), mp.Queue()
    proc = mp.Process(target=add_late_then_drop, args=(q, out))
    proc.start()
    reap.append(proc)
    kept = torch.zeros(1024, device="cuda")
    t = torch.zeros(1024, device="cuda")  # 4 KiB each: the same 2 MiB segment of torch's small pool
    ptr = t.data_ptr()
    q.put(kept)
    q.put(t)
    del t
    assert out.get(timeout=60) == "dropped"
    q.put(kept)  # a share reads the receivers' releases at once (else housekeeping does, within 0.2 s)
    others = []
    deadline = time.monotonic() + 5
    while True:  # the block back in torch's allocator: the next tensor of its size takes it
        u = torch.full((1024,), 100.0, device="cuda")
        if u.data_ptr() == ptr:
            break
        others.append(u)
        assert time.monotonic() < deadline, "the receiver's release never reached the sender"
        time.sleep(0.01)
    time.sleep(1.0)  # the receiver's kernel has run by now, whenever it started
    assert u.min().item() == 100.0 and u.max().item() == 100.0, "the receiver's late write landed in a reused block"
    q.put("done")
    proc.join(30)
    assert proc.exitcode == 0


@pytest.mark.gpu
def test_gpu_a_relay_orders_the_sink_after_a_slow_producers_writes(reap) -> None:
    """A -> B -> C, where each of A's writes waits behind a kernel of about 1 ms: B never
    touches the tensors, so only the ready events order C's reads after A's writes."""
    n = 200
    count, wrong = relay_through_three(reap, n, 8, lambda: torch.cuda._sleep(2_000_000))  # about 1 ms
    assert count == 0, f"{count} of {n} tensors arrived before A's writes; (index, values): {wrong}"


@pytest.mark.gpu
def test_gpu_a_tensor_over_a_server_owned_buffer_outlives_its_producer(reap, tmp_path) -> None:
    """The producer sends a tensor viewing a Manager(owner="server") buffer to 4 consumers and
    exits: they keep reading the producer's values for 10 s afterwards."""
    reports = [str(tmp_path / str(i)) for i in range(4)]
    queues = [mp.Queue() for _ in reports]
    consumers = [mp.Process(target=read_for, args=(q, r, 14.0)) for q, r in zip(queues, reports, strict=True)]
    for proc in consumers:
        proc.start()
        reap.append(proc)
    producer = mp.Process(target=server_tensor_producer, args=(queues, reports))
    producer.start()
    reap.append(producer)
    producer.join(60)
    ended = time.time()
    assert producer.exitcode == 0
    for proc, report in zip(consumers, reports, strict=True):
        proc.join(60)
        assert proc.exitcode == 0
        with open(report) as f:
            last, sums = f.read().split(" ", 1)
        assert sums == "[7168.0]", f"a consumer read {sums} after its producer exited"
        assert float(last) - ended >= 10.0


@pytest.mark.gpu
def test_gpu_a_received_buffer_viewed_as_a_tensor_is_sent_on_as_that_buffer(manager, reap) -> None:
    """B views a gpushare Buffer it received as a tensor and sends the tensor to C: C's write
    lands in the Manager's buffer (it travels as the buffer, not as torch memory)."""
    buf = manager.zeros((256,), "float32", device=0)
    a, b, out = mp.Queue(), mp.Queue(), mp.Queue()
    procs = [mp.Process(target=view_then_forward, args=(a, b)), mp.Process(target=add_one, args=(b, out))]
    for proc in procs:
        proc.start()
        reap.append(proc)
    a.put(buf)
    assert out.get(timeout=60) == "done"
    assert torch.from_dlpack(buf).sum().item() == 256.0
    a.put("release")
    b.put("release")
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0


_PRODUCER = """
import os, sys, time, torch
sys.path.insert(0, {tests!r})
import gpushare.torch.multiprocessing as mp
from test_torch_mp import receive_then_get
if __name__ == "__main__":
    reports = [os.path.join({folder!r}, str(i)) for i in range(4)]
    queues = [mp.Queue() for _ in reports]
    procs = [mp.Process(target=receive_then_get, args=(q, r)) for q, r in zip(queues, reports, strict=True)]
    for p in procs:
        p.start()
    t = torch.full((1024,), 2.0, device={device!r})
    for q in queues:
        q.put(t)
    while not all(os.path.exists(r + ".got") for r in reports):
        time.sleep(0.01)
    print("ended", time.time(), flush=True)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_consumers_of_an_exited_producer_get_owner_gone_on_their_next_get(tmp_path, device) -> None:
    """The producer returns while 4 consumers hold its tensor: no crash, no hang, and each
    consumer's pending ``get`` raises OwnerGoneError soon after the producer's end."""
    script = tmp_path / "producer.py"
    script.write_text(_PRODUCER.format(tests=os.path.dirname(__file__), folder=str(tmp_path), device=device))
    proc = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ended = float(proc.stdout.split("ended")[1].split()[0])
    for i in range(4):
        assert (tmp_path / f"{i}.got").read_text() == "2048.0"
        verdict, when = (tmp_path / str(i)).read_text().split()
        assert verdict == "OwnerGoneError"
        print(f"consumer {i}: OwnerGoneError {float(when) - ended:.2f} s after the producer's main ended")
        # The producer's queues say it is exiting before its owner waits for the consumers' leases.
        assert float(when) - ended < 1.5


# A sender over the host backend: the drop-in's own owner (what a CUDA tensor's send makes)
# allocates host memory and sends it as a Buffer, so its exit runs as a CUDA sender's does.
_HOST_SENDER = """
import os, sys, time
import numpy as np
sys.path.insert(0, {tests!r})
import gpushare.torch.multiprocessing as mp
from gpushare import _backends
from gpushare._buffer import Buffer
from gpushare.torch._sharing import sharing_owner
from test_torch_mp import {consumer}
if __name__ == "__main__":
    owner = sharing_owner()
    def host_buffer(value):
        buf = Buffer(owner.allocate(_backends.get("host"), 2 << 20, None, "test"), 0, (1024,), np.dtype("float32"))
        buf.numpy()[:] = value
        return buf
    reports = [os.path.join({folder!r}, str(i)) for i in range({consumers})]
    queues = [mp.Queue() for _ in reports]
    procs = [mp.Process(target={consumer}, args=(q, r)) for q, r in zip(queues, reports, strict=True)]
    for p in procs:
        p.start()
    first = host_buffer(2.0)
    for q in queues:
        q.put(first)
    while not all(os.path.exists(r + ".got") for r in reports):
        time.sleep(0.01)
    {then}
    print("ended", time.time(), flush=True)
"""


def take_late_once(q, report) -> None:
    """Receive one buffer, let it go and exit (its connection to the sender closes)."""
    q.get(timeout=60).release()
    with open(report + ".got", "w") as f:
        f.write("first")


def take_late(q, report) -> None:
    """Receive a buffer, let it go, then take the next one a second after it was put."""
    take_late_once(q, report)
    time.sleep(1.0)
    try:
        buf = q.get(timeout=30)
        verdict = str(float(buf.numpy().sum()))
        buf.release()
    except Exception as exc:
        verdict = type(exc).__name__
    with open(report, "w") as f:
        f.write(f"{verdict} {time.time()}")


def _run_host_sender(tmp_path, consumer: str, consumers: int, then: str = "") -> tuple[float, float, str]:
    """Run a host-backend sender script; (its main's end, its process's end, its stderr)."""
    script = tmp_path / "sender.py"
    script.write_text(
        _HOST_SENDER.format(
            tests=os.path.dirname(__file__), folder=str(tmp_path), consumer=consumer, consumers=consumers, then=then
        )
    )
    proc = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    exited = time.time()
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split("ended")[1].split()[0]), exited, proc.stderr


def test_a_senders_exit_tells_receivers_blocked_on_its_queues_before_it_waits_for_their_leases(tmp_path) -> None:
    """Two receivers hold the sender's buffer and wait on its queues when it returns: each
    gets OwnerGoneError within 1.5 s (the queues' exit comes before the owner's wait for
    leases, up to 5 s), lets go, and the sender then exits with no leak."""
    ended, exited, stderr = _run_host_sender(tmp_path, "receive_then_get", 2)
    for i in range(2):
        assert (tmp_path / f"{i}.got").read_text() == "2048.0"
        verdict, when = (tmp_path / str(i)).read_text().split()
        assert verdict == "OwnerGoneError"
        assert float(when) - ended < 1.5, f"receiver {i}: OwnerGoneError {float(when) - ended:.2f} s after"
    assert "outstanding" not in stderr, stderr  # both let go within the owner's wait
    assert exited - ended < 4.5


def test_a_buffer_left_in_a_queue_nobody_reads_does_not_hold_the_senders_exit(tmp_path) -> None:
    """The sender returns with a buffer unclaimed in a queue and no receiver connected: it
    exits at once, not after the 5 s wait for leases, and warns of the unclaimed lease."""
    then = "proc_q = mp.Queue(); procs[0].join(30); proc_q.put(host_buffer(3.0))"
    ended, exited, stderr = _run_host_sender(tmp_path, "take_late_once", 1, then)
    assert exited - ended < 3.0, f"the sender took {exited - ended:.2f} s to exit"
    assert "held by an unclaimed pickle" in stderr and "with no consumer connected" in stderr, stderr
    assert "Keep the sender running" in stderr, stderr


def test_a_connected_receiver_still_takes_what_the_sender_queued_before_it_returned(tmp_path) -> None:
    """The sender queues a second buffer and returns while its receiver, still connected,
    takes it only a second later: the exit waits for it, and the receiver reads it."""
    then = "[q.put(host_buffer(3.0)) for q in queues]"
    ended, exited, stderr = _run_host_sender(tmp_path, "take_late", 1, then)
    verdict, when = (tmp_path / "0").read_text().split()
    assert verdict == "3072.0", verdict
    assert ended + 0.5 < float(when) < exited  # taken after the sender's main ended, before it exited
    assert "outstanding" not in stderr, stderr


_EXPANDABLE = """
import torch
import gpushare.torch.multiprocessing as mp
if __name__ == "__main__":
    q = mp.Queue()
    try:
        q.put(torch.ones(1024, device="cuda"))
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


@pytest.mark.gpu
def test_gpu_expandable_segments_fail_with_an_error_that_names_the_setting(tmp_path) -> None:
    script = tmp_path / "expandable.py"
    script.write_text(_EXPANDABLE)
    env = subprocess_env()
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "expandable_segments" in proc.stdout, proc.stdout + proc.stderr


def report_device(q, out) -> None:
    t = q.get(timeout=60)
    out.put((str(torch.cuda.get_device_properties(t.device).uuid), t.sum().item()))


@pytest.mark.multigpu
def test_multigpu_a_tensor_arrives_on_the_same_gpu_under_another_device_order(reap) -> None:
    uuid = str(torch.cuda.get_device_properties(1).uuid)
    q, out = mp.Queue(), mp.Queue()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    try:
        proc = mp.Process(target=report_device, args=(q, out))
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    reap.append(proc)
    q.put(torch.full((8,), 1.5, device="cuda:1"))
    assert out.get(timeout=60) == (uuid, 12.0)
    proc.join(30)
