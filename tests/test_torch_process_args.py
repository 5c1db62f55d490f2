"""torch tensors as Process arguments: gpushare behaves as torch.multiprocessing does.

torch registers its tensor and storage reducers with multiprocessing's
ForkingPickler; a gpushare Process honours them, so a CUDA tensor arrives
as a CUDA IPC mapping of the same memory and a shared-memory CPU tensor as
the same shared pages: what the child writes, the parent sees. Each test
runs the same worker under ``torch.multiprocessing`` (spawn) and under
``gpushare.Process`` and compares. torch's rule for CUDA tensors applies to
both: the producer keeps the tensor alive until the consumer is done (here:
until the child has exited).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest

import gpushare as mp

pytestmark = pytest.mark.gpu

TIMEOUT = 120.0


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
