"""gpushare.Process: what reaches a spawned child, and where and how it starts.

The process object travels as one cloudpickle stream whose dispatch table
holds every reducer registered with multiprocessing's ForkingPickler: these
tests check that a registered reducer is used (with a module-level, a lambda
and a closure target), that multiprocessing's synchronised objects
(Barrier, Value, Array: their heap Arena is one such reducer) arrive shared,
that identity between a target and its arguments survives, that a buffer is
leased once per child, and that a script's own functions still travel by
reference as multiprocessing sends them. Buffers reach Pool workers the same
way.

Also here: ``Process(device=...)`` binds the child to a device (the host
backend for ``"cpu"``, a GPU's ordinal otherwise); the fork start method is
refused once CUDA is initialised; and on a GPU, torch tensors as arguments
behave as under torch.multiprocessing (torch registers its tensor and storage
reducers with ForkingPickler, so a CUDA tensor arrives as a CUDA IPC mapping
of the same memory and a shared-memory CPU tensor as the same shared pages;
each of those tests runs the same worker under ``torch.multiprocessing``
(spawn) and under ``gpushare.Process`` and compares. torch's rule for CUDA
tensors applies to both: the producer keeps the tensor alive until the
consumer is done, here until the child has exited).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from multiprocessing import reduction
from typing import Any

import numpy as np
import pytest
from conftest import GPU_TIMEOUT, join_ok, recv, require, start, start_guarded, subprocess_env, wait_until
from workers import echo_sum

import gpushare as mp

TIMEOUT = 120.0  # seconds, the torch tensor tests' waits


# -- a type with a registered reducer --------------------------------------------------


class Token:
    """Pickles as itself by default; the registered reducer marks what it carried."""

    def __init__(self, value: int, via: str = "default") -> None:
        self.value = value
        self.via = via


def _reduce_token(token: Token) -> tuple[object, tuple[int, str]]:
    return (Token, (token.value, "registered reducer"))


@pytest.fixture
def token_reducer() -> Iterator[None]:
    reduction.register(Token, _reduce_token)
    try:
        yield
    finally:
        reduction.ForkingPickler._extra_reducers.pop(Token, None)


# -- workers (module level, so that only what a test means to send by value is) --------


def report_token(out, token: Token) -> None:
    out.put((token.value, token.via))


def count_and_wait(barrier, value, array, slot: int) -> None:
    with value.get_lock():
        value.value += 1
    array[slot] = slot + 0.5
    barrier.wait(30)


MODE = "as imported"


class Holder:
    """A target's ``self`` that is also passed as an argument."""

    @classmethod
    def report_mode(cls, out) -> None:
        out.put(MODE)

    def __init__(self, out) -> None:
        self.out = out

    def check(self, other) -> None:
        self.out.put(other is self)


def _row_sum(item) -> int:
    row, buf = item
    return int(buf.numpy()[row].sum())


def _w_device(out: Any) -> None:
    env = os.environ.get("GPUSHARE_DEVICE")
    import torch

    out.put(("device", env, torch.cuda.current_device()))


def _noop() -> None:
    pass


class SeesTheContext:
    """An argument that, while the child unpickles it, waits (at most 60 s) for the child's
    device context to be made: a worker bound to a device starts making it before it
    unpickles its target and arguments, so it is made during their imports. (A context
    took over 20 s with two GPUs shared by the whole suite's lanes.)"""

    def __reduce__(self) -> Any:
        return (_sees_the_context, ())


def _sees_the_context() -> float | None:
    """Seconds until the context was there, or None if it was not within 60 s."""
    import time

    from gpushare._cuda import _driver

    start = time.monotonic()
    while time.monotonic() < start + 60:
        if 0 in _driver._primary:
            return time.monotonic() - start
        time.sleep(0.01)
    return None


def _w_context_seen(out: Any, seen: float | None) -> None:
    out.put(("seen", seen))


def write_tensors(cuda_t: Any, cpu_t: Any, out: Any) -> None:
    """In the child: write both tensors in place and say what arrived."""
    try:
        import torch

        arrived = (cuda_t.device.type, cuda_t.is_cuda, cpu_t.is_shared(), float(cuda_t.sum()), float(cpu_t.sum()))
        cuda_t.fill_(7.0)
        cpu_t.fill_(3.0)
        torch.cuda.synchronize()  # the writes are done before the parent looks
        out.put(("ok", arrived))
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


# -- targets and arguments -------------------------------------------------------------


def test_registered_reducer_is_used_for_process_arguments(token_reducer, reap) -> None:
    out = mp.Queue()
    proc = mp.Process(target=report_token, args=(out, Token(3)))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (3, "registered reducer")
    join_ok(proc)


def test_registered_reducer_is_used_with_a_lambda_target(token_reducer, reap) -> None:
    out = mp.Queue()
    proc = mp.Process(target=lambda q, t: q.put((t.value, t.via)), args=(out, Token(4)))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (4, "registered reducer")
    join_ok(proc)


def test_registered_reducer_is_used_inside_a_closure(token_reducer, reap) -> None:
    out = mp.Queue()
    token = Token(5)

    def send() -> None:  # captures both the queue and the token: they travel by value with it
        out.put((token.value, token.via))

    proc = mp.Process(target=send)
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (5, "registered reducer")
    join_ok(proc)


def test_without_registration_the_type_pickles_as_usual(reap) -> None:
    out = mp.Queue()
    proc = mp.Process(target=report_token, args=(out, Token(6)))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (6, "default")
    join_ok(proc)


def test_barrier_value_and_array_are_shared_with_children(reap) -> None:
    barrier, value, array = mp.Barrier(3), mp.Value("i", 0), mp.Array("d", 2)
    procs = [
        mp.Process(target=count_and_wait, args=(barrier, value, array, 0)),
        # A lambda target: its arguments, and the objects it closes over, are honoured too.
        mp.Process(target=lambda: count_and_wait(barrier, value, array, 1)),
    ]
    for proc in procs:
        proc.start()
        reap.append(proc)
    barrier.wait(60)  # both children reached the same barrier
    for proc in procs:
        join_ok(proc)
    assert value.value == 2
    assert array[:] == [0.5, 1.5]


def test_lambda_target_with_arguments(reap) -> None:
    out, value = mp.Queue(), mp.Value("q", 0)
    scale = 7
    proc = mp.Process(target=lambda q, v, x: (setattr(v, "value", x * scale), q.put("done")), args=(out, value, 6))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == "done"
    join_ok(proc)
    assert value.value == 42


def test_a_target_and_its_arguments_keep_their_identity(reap) -> None:
    out = mp.Queue()
    holder = Holder(out)
    proc = mp.Process(target=holder.check, args=(holder,))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) is True
    join_ok(proc)


def test_a_classmethod_target_runs_in_the_childs_module(reap, monkeypatch) -> None:
    # By reference, as with multiprocessing: the child imports this module afresh, so the
    # parent's change to a module global is not seen (a by-value copy would carry it).
    monkeypatch.setattr(sys.modules[__name__], "MODE", "changed in the parent")
    out = mp.Queue()
    proc = mp.Process(target=Holder.report_mode, args=(out,))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == "as imported"
    join_ok(proc)


class _WithLambda:
    """A bound method's object that plain pickle cannot carry (the lambda), holding a buffer."""

    def __init__(self, buf, out) -> None:
        self.buf, self.out, self.double = buf, out, lambda x: 2 * x

    def run(self) -> None:
        self.out.put(self.double(int(self.buf.numpy().sum())))
        self.buf.release()


def test_a_buffer_in_a_by_value_target_is_leased_once(manager, reap) -> None:
    buf = manager.full((4,), 3, dtype="int64", device="cpu")
    out = mp.Queue()
    proc = mp.Process(target=_WithLambda(buf, out).run)
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == 24
    join_ok(proc)
    # Pickled once: the child's lease is the only one, and it is back (a second,
    # never-claimed lease would stay out until lease_timeout).
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=10)


def test_main_module_functions_travel_by_reference(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import gpushare as mp

            STATE = {"imported_as": __name__}

            def where(q):
                # By reference: runs in the child's re-imported main module, as with multiprocessing.
                q.put((__name__, STATE["imported_as"]))

            if __name__ == "__main__":
                q = mp.Queue()
                p = mp.Process(target=where, args=(q,))
                p.start()
                print(*q.get(timeout=60))
                p.join(60)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["__mp_main__", "__mp_main__"]


def test_unpicklable_argument_is_a_clear_error_at_start(reap) -> None:
    import threading

    proc = mp.Process(target=report_token, args=(None, threading.Lock()))
    with pytest.raises(TypeError, match="lock"):
        proc.start()


def test_copying_a_process_is_not_a_spawn() -> None:
    import copy

    proc = mp.Process(target=lambda: None, name="original")
    twin = copy.copy(proc)
    assert twin.name == "original" and twin._target is proc._target


def test_pool_map_over_buffers(manager) -> None:
    buf = manager.from_numpy(np.arange(40, dtype=np.int64).reshape(4, 10), device="cpu")
    with mp.Pool(2) as pool:
        sums = pool.map(_row_sum, [(r, buf) for r in range(4)])
    assert sums == [45, 145, 245, 345]
    wait_until(lambda: manager.stats()["leases"] == 0, timeout=5)


def test_lambda_and_closure_targets(reap) -> None:
    results = mp.Queue()
    offset = 5
    proc = start(reap, lambda q: q.put(offset + 1), results)
    assert results.get(timeout=30) == 6
    proc.join(timeout=30)
    assert proc.exitcode == 0


# -- the device a child is bound to ----------------------------------------------------


def test_process_device_cpu_binds_host_backend(reap) -> None:
    results = mp.Queue()
    proc = start(reap, lambda q: q.put(os.environ.get("GPUSHARE_BACKEND")), results, device="cpu")
    assert proc.device == "cpu"
    assert results.get(timeout=30) == "host"


@pytest.mark.gpu
@pytest.mark.parametrize("device", [0, "cuda:0"])
def test_process_device_binds_worker(reap: list[Any], device: Any) -> None:
    require("torch")
    out = mp.Queue()
    proc = start_guarded(reap, _w_device, out, device=device)
    assert proc.device == 0
    assert recv(out, proc, timeout=60) == ("device", "0", 0)
    join_ok(proc, timeout=GPU_TIMEOUT)


@pytest.mark.gpu
def test_a_device_worker_makes_its_context_while_it_unpickles(reap: list[Any]) -> None:
    out = mp.Queue()
    proc = start_guarded(reap, _w_context_seen, out, SeesTheContext(), device=0)
    tag, waited = recv(out, proc, timeout=90)
    assert tag == "seen" and waited is not None, "the context was not made within 60 s of the unpickling"
    join_ok(proc, timeout=GPU_TIMEOUT)


def test_a_device_worker_without_a_gpu_fails_saying_what_to_do(tmp_path) -> None:
    from gpushare import _cuda

    if _cuda.available():
        pytest.skip("this machine has a GPU")
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import gpushare as mp

            if __name__ == "__main__":
                p = mp.Process(target=print, args=("the target ran",), device=0)
                try:
                    p.start()  # refused here, in the parent: no child starts
                except mp.NoDeviceError as exc:
                    print("refused:", exc)
                print("pid", p.pid)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert out.returncode == 0, out.stderr
    assert "the target ran" not in out.stdout
    assert "pid None" in out.stdout
    assert "refused: cannot start a process on CUDA device 0" in out.stdout, out.stdout
    assert "device='cpu'" in out.stdout and "GPUSHARE_BACKEND" not in out.stdout, out.stdout


@pytest.mark.gpu
@pytest.mark.multigpu
def test_process_device_binds_second_gpu(reap: list[Any]) -> None:
    require("torch")
    out = mp.Queue()
    proc = start_guarded(reap, _w_device, out, device=1)
    assert recv(out, proc, timeout=60) == ("device", "1", 1)
    join_ok(proc, timeout=GPU_TIMEOUT)


# -- start methods: fork after CUDA initialisation -------------------------------------


def test_fork_refused_after_cuda_init(monkeypatch) -> None:
    # Without a GPU CUDA cannot really be initialised here; the GPU suite checks
    # the real thing. This checks the refusal and its message.
    from gpushare import _process

    monkeypatch.setattr(_process, "cuda_initialized", lambda: True)
    proc = mp.get_context("fork").Process(target=print)
    with pytest.raises(mp.StartMethodError, match="spawn"):
        proc.start()


def test_fork_allowed_without_cuda(manager, reap) -> None:
    from gpushare._process import cuda_initialized

    if cuda_initialized():
        pytest.skip("CUDA is initialised in this test process (GPU machine); TestWithCudaInitialised checks it")
    buf = manager.full((3,), 4, device="cpu")
    jobs, results = mp.Queue(), mp.Queue()
    proc = mp.get_context("fork").Process(target=echo_sum, args=(jobs, results))
    proc.start()
    reap.append(proc)
    jobs.put(buf)
    assert results.get(timeout=30)[1] == 12


class TestWithCudaInitialised:
    """The GPU run's form of the refusal above: CUDA really initialised here, by a buffer on
    device 0. (A class only so that both tests keep their name.)"""

    @pytest.mark.gpu
    def test_fork_refused_after_cuda_init(self, manager: mp.BufferManager) -> None:
        if "fork" not in mp.get_all_start_methods():
            pytest.skip("this platform has no fork start method")
        buf = manager.empty((16,), dtype="float32", device=0)
        proc = mp.get_context("fork").Process(target=_noop)
        with pytest.raises(mp.StartMethodError, match="spawn"):
            proc.start()
        assert proc.pid is None  # nothing was forked
        buf.release()


# -- GPU: torch tensors as arguments, as under torch.multiprocessing -------------------


def _round_trip(ctx: Any, process_cls: Any) -> tuple[Any, list[float], list[float]]:
    """Start ``write_tensors`` on fresh tensors; return what the child saw and what the parent sees after."""
    import torch

    cuda_t = torch.arange(8, dtype=torch.float32, device="cuda")
    cpu_t = torch.arange(8, dtype=torch.float32).share_memory_()
    torch.cuda.synchronize()
    out = ctx.Queue()
    proc = process_cls(target=write_tensors, args=(cuda_t, cpu_t, out))
    proc.start()
    try:
        msg = out.get(timeout=TIMEOUT)
        assert msg[0] == "ok", f"worker failed:\n{msg[1]}"
        proc.join(TIMEOUT)
        assert proc.exitcode == 0, f"worker exit code {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    torch.cuda.synchronize()
    # The parent still holds both tensors (torch's rule for CUDA sharing): read them now.
    return msg[1], cuda_t.cpu().tolist(), cpu_t.tolist()


@pytest.mark.gpu
def test_cuda_and_shared_cpu_tensors_as_process_arguments_match_torch_multiprocessing() -> None:
    pytest.importorskip("torch")
    import torch.multiprocessing as tmp

    torch_ctx = tmp.get_context("spawn")
    expected = _round_trip(torch_ctx, torch_ctx.Process)
    got = _round_trip(mp.get_context("spawn"), mp.Process)

    # What the child received: a CUDA tensor and a shared CPU tensor holding the parent's values.
    assert expected[0] == ("cuda", True, True, 28.0, 28.0)
    assert got[0] == expected[0]
    # What the parent sees afterwards: the child's writes, in the same memory.
    assert expected[1:] == ([7.0] * 8, [3.0] * 8)
    assert got[1:] == expected[1:]


@pytest.mark.gpu
def test_tensor_inside_a_lambda_target_is_shared_too() -> None:
    pytest.importorskip("torch")
    import torch
    import torch.multiprocessing  # registers torch's reducers with ForkingPickler

    cuda_t = torch.zeros(4, device="cuda")
    cpu_t = torch.zeros(4).share_memory_()
    torch.cuda.synchronize()
    out = mp.Queue()
    # The tensors travel inside the closure (by cloudpickle), still through torch's reducers.
    proc = mp.Process(target=lambda: write_tensors(cuda_t, cpu_t, out))
    proc.start()
    try:
        msg = out.get(timeout=TIMEOUT)
        assert msg[0] == "ok", f"worker failed:\n{msg[1]}"
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    torch.cuda.synchronize()
    assert cuda_t.cpu().tolist() == [7.0] * 4
    assert cpu_t.tolist() == [3.0] * 4
