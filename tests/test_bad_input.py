"""Bad input: each case is a clear error, and the Manager is intact afterwards.

"Intact" is checked the same way every time (:func:`assert_intact`): the
counts are what they were, and the Manager still allocates, shares with a
real worker and recycles. Simple argument errors (bad dtypes, shapes,
devices, backends) are in test_buffer.py, descriptor corruption in
test_descriptor.py (including the property-based tests), the fork check
and the authkey check in test_sharing.py; this file covers what crosses
processes or exhausts memory.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import threading
import time

import numpy as np
import pytest
from conftest import BACKENDS, device_for, guarded, recv, wait_until

import gpushare as mp
from gpushare._descriptor import Descriptor

T = 60


# -- workers -------------------------------------------------------------------------------


def w_unpickle_and_sum(out, data) -> None:
    try:
        buf = pickle.loads(data)
    except mp.GpushareError as exc:
        out.put((type(exc).__name__, str(exc)))
        return
    out.put(("ok", float(buf.numpy().astype(np.float64).sum())))
    buf.release()
    buf.release()  # a second release is a no-op, not a second lease given back


def w_sum_each(out, jobs, n) -> None:
    for _ in range(n):
        buf = jobs.get(timeout=T)
        out.put(("sum", float(buf.numpy().astype(np.float64).sum())))
        buf.release()


# -- helpers ---------------------------------------------------------------------------------


def run(reap, fn, *args, device=None):
    out = mp.Queue()
    proc = mp.Process(target=guarded, args=(fn, out, *args), device=device)
    proc.start()
    reap.append(proc)
    return out


def assert_intact(m, reap, device="cpu", backend=None) -> None:
    """The Manager still allocates, shares with a worker and recycles, and its counts add up."""
    before = m.stats()
    buf = m.full((256,), 2.0, "float32", device=device, backend=backend)
    out = run(reap, w_unpickle_and_sum, pickle.dumps(buf), device=device)
    assert recv(out) == ("ok", 512.0)
    wait_until(lambda: m.stats()["leases"] == before["leases"])
    buf.release()
    after = m.stats()
    assert after["live_buffers"] == before["live_buffers"]
    assert after["leaked_buffers"] == 0 and not after["closed"]


def more_than_there_is(device: int | str) -> int:
    """Bytes that cannot fit: the device's whole memory, or all of /dev/shm, plus 1 GiB."""
    if device == "cpu":
        fs = os.statvfs("/dev/shm")
        return fs.f_frsize * fs.f_blocks + (1 << 30)
    from gpushare import _cuda

    return _cuda.device_total_memory(int(device)) + (1 << 30)


def tampered(data: bytes, **changes: object) -> bytes:
    """A pickled buffer with descriptor fields changed and its checksum made valid again."""
    rebuild, (raw,) = _reduce_of(data)
    desc = Descriptor.from_bytes(raw)._replace(**changes)
    return pickle.dumps(_Rebuild(rebuild, desc.to_bytes()))


class _Rebuild:
    def __init__(self, fn, raw) -> None:
        self.fn, self.raw = fn, raw

    def __reduce__(self):
        return (self.fn, (self.raw,))


def _reduce_of(data: bytes):
    """(rebuild function, (descriptor bytes,)) from a pickled buffer, without unpickling it."""
    captured = {}

    class Catch(pickle.Unpickler):
        def find_class(self, module, name):
            fn = super().find_class(module, name)
            if name == "rebuild_buffer":

                def catch(raw):
                    captured["raw"] = raw
                    return None

                captured["fn"] = fn
                return catch
            return fn

    Catch(io.BytesIO(data)).load()
    return captured["fn"], (captured["raw"],)


# -- descriptors that reach a worker -------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 50, 200])
def test_truncated_descriptor_in_a_worker(manager, reap, cut) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    data = pickle.dumps(buf)
    _, (raw,) = _reduce_of(data)
    bad = pickle.dumps(_Rebuild(_reduce_of(data)[0], raw[:-cut]))
    kind, message = recv(run(reap, w_unpickle_and_sum, bad))
    assert kind == "DescriptorError" and ("truncated" in message or "corrupt" in message)
    assert_intact(manager, reap)


@pytest.mark.parametrize("where", [0, 10, 40, -5])
def test_corrupted_descriptor_in_a_worker(manager, reap, where) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    fn, (raw,) = _reduce_of(pickle.dumps(buf))
    flipped = bytearray(raw)
    flipped[where] ^= 0x5A
    kind, message = recv(run(reap, w_unpickle_and_sum, pickle.dumps(_Rebuild(fn, bytes(flipped)))))
    assert kind == "DescriptorError"
    assert "corrupt" in message or "magic" in message
    assert_intact(manager, reap)


def test_descriptor_naming_another_manager(manager, reap) -> None:
    with mp.Manager() as other:
        theirs = other.full((16,), 1.0, "float32", device="cpu")
        mine = manager.full((16,), 3.0, "float32", device="cpu")
        # Our descriptor, pointed at the other Manager's socket (checksum made valid again).
        bad = tampered(pickle.dumps(mine), address=other._owner.address)
        kind, message = recv(run(reap, w_unpickle_and_sum, bad))
        assert kind == "DescriptorError" and "another Manager" in message
        assert_intact(other, reap)
        theirs.release()
    assert_intact(manager, reap)


def test_descriptor_for_a_lease_that_was_never_taken(manager, reap) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    data = pickle.dumps(buf)
    _, (raw,) = _reduce_of(data)
    lease = Descriptor.from_bytes(raw).lease_id
    kind, message = recv(run(reap, w_unpickle_and_sum, tampered(data, lease_id=lease + 1000)))
    assert kind == "DescriptorError" and "unknown" in message
    assert recv(run(reap, w_unpickle_and_sum, data)) == ("ok", 16.0)  # the real one still works
    assert_intact(manager, reap)


def test_descriptor_with_a_view_past_its_allocation(manager, reap) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    data = tampered(pickle.dumps(buf), offset=mp.GRANULARITY - 8)
    kind, message = recv(run(reap, w_unpickle_and_sum, data))
    assert kind == "DescriptorError" and "of a 2097152-byte allocation" in message
    assert_intact(manager, reap)


# -- releases -----------------------------------------------------------------------------------


def test_double_release_and_use_after_release_across_processes(manager, reap) -> None:
    buf = manager.full((16,), 1.0, "float32", device="cpu")
    view = buf.view()
    buf.release()
    buf.release()
    assert view.numpy().sum() == 16.0  # the view's own reference keeps the memory
    with pytest.raises(mp.BufferReleasedError, match="released"):
        pickle.dumps(buf)
    jobs = mp.Queue()
    with pytest.raises(mp.BufferReleasedError):
        jobs.put(buf)  # refused in the caller, and nothing half-sent
    out = run(reap, w_sum_each, jobs, 1)
    jobs.put(view)  # the queue still works
    assert recv(out) == ("sum", 16.0)
    wait_until(lambda: manager.stats()["leases"] == 0)
    view.release()
    view.release()
    assert manager.stats()["live_buffers"] == 0 and manager.stats()["pooled_buffers"] == 1
    assert_intact(manager, reap)


# -- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_memory_is_a_memory_error_and_loses_nothing(manager, reap, backend) -> None:
    device = device_for(backend)
    held = manager.full((600_000,), 4.0, "float32", device=device, backend=backend)
    jobs = mp.Queue()
    out = run(reap, w_sum_each, jobs, 3, device=device)
    jobs.put(held)  # the worker is up (its CUDA context made) before memory runs out
    assert recv(out) == ("sum", 2_400_000.0)
    pooled = manager.full((16,), 1.0, "float32", device=device, backend=backend)  # another size class
    pooled.release()  # one unused allocation in the pool
    wait_until(lambda: manager.stats()["leases"] == 0)
    before = manager.stats()
    assert before["pooled_buffers"] == 1 and before["live_buffers"] == 1
    with pytest.raises(mp.OutOfMemoryError) as info:
        manager.buffer(more_than_there_is(device), device=device, backend=backend)
    assert isinstance(info.value, MemoryError)
    if backend != "host":
        assert isinstance(info.value, mp.CUDAOutOfMemoryError) and isinstance(info.value, mp.CUDAError)
    after = manager.stats()
    # The pool was emptied to make room (and the retry still failed); nothing else moved.
    assert after["pooled_buffers"] == 0 and after["live_buffers"] == 1
    assert after["leases"] == 0 and after["leaked_buffers"] == 0
    jobs.put(held)  # the buffer in use is untouched and still shares
    assert recv(out) == ("sum", 2_400_000.0)
    again = manager.full((16,), 5.0, "float32", device=device, backend=backend)
    jobs.put(again)
    assert recv(out) == ("sum", 80.0)
    wait_until(lambda: manager.stats()["leases"] == 0)


def test_huge_shape_fails_before_touching_any_device(manager) -> None:
    with pytest.raises(mp.OutOfMemoryError, match="more than any device"):
        manager.empty((1 << 40, 1 << 20), "float64", device="cpu")
    assert manager.stats()["bytes_allocated"] == 0


# -- devices --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [64, "cuda:64"])
def test_a_device_that_does_not_exist(manager, device) -> None:
    # With GPUs: "CUDA device 64 does not exist ... ordinals 0..N-1"; without: no usable GPU.
    with pytest.raises(mp.NoDeviceError, match=r"device 64 does not exist|GPU"):
        manager.empty((4,), device=device)
    assert manager.stats()["live_buffers"] == 0


def test_queue_empty_while_another_thread_waits_in_get() -> None:
    # The queue polls its pipe with one poll object per process; a thread asking empty()
    # while another waits in get() polls it at the same time, which must still answer.
    q = mp.Queue()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(q.get(timeout=T)))
    waiter.start()
    for _ in range(300):
        assert q.empty()
        time.sleep(0.001)
    q.put("item")
    waiter.join(timeout=T)
    assert got == ["item"]


def test_queue_get_timeout_is_still_queue_empty() -> None:
    q = mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get(block=False)
