"""Security: only authenticated peers are served (a process with the wrong
authkey included), nothing is unpickled before authentication, sockets are
private, and (on a GPU) a buffer's handle reaches that buffer and nothing
next to it, and each allocation is its own 2 MiB. docs/security.md states
the trust model."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import struct
import time
import traceback
from typing import Any

import pytest
from conftest import GPU_TIMEOUT, MiB, join_ok, recv, start_guarded, wait_until
from workers import unpickle_bytes

import gpushare as mp
from gpushare import _cuda


class Evil:
    """Unpickling this runs code: it creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def raw_attack(address: str, payload: bytes, before_reading: bool) -> bytes:
    """Connect without the authkey and send a pickle, framed as a Connection message."""
    frame = struct.pack("!i", len(payload)) + payload
    received = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(15)
        sock.connect(address)
        if before_reading:
            sock.sendall(frame * 3)
        else:
            received += sock.recv(4096)  # the server's challenge
            sock.sendall(frame * 3)
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    return received


def w_sum(out, buf) -> None:
    try:
        out.put(float(buf.numpy().sum()))
        buf.release()
    except BaseException:
        out.put(traceback.format_exc())
        raise


@pytest.mark.parametrize("before_reading", [True, False], ids=["blind", "after-challenge"])
def test_owner_never_unpickles_from_an_unauthenticated_peer(manager, reap, tmp_path, before_reading) -> None:
    marker = tmp_path / "pwned"
    received = raw_attack(manager._owner.address, pickle.dumps(Evil(str(marker))), before_reading)
    assert not marker.exists()
    assert b"#FAILURE#" in received or b"#CHALLENGE#" in received  # it was challenged, then refused
    assert manager.stats()["consumers"] == 0
    buf = manager.full((8,), 2.0, device="cpu")  # still serving real workers
    out = mp.Queue()
    proc = mp.Process(target=w_sum, args=(out, buf))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == 16.0


def test_wrong_authkey_is_refused(manager, reap) -> None:
    buf = manager.zeros((4,), device="cpu")
    desc = pickle.dumps(buf)
    results = mp.Queue()
    proc = mp.Process(target=unpickle_bytes, args=(desc, results))
    proc.authkey = b"not the manager's key"
    proc.start()
    reap.append(proc)
    kind, message = results.get(timeout=30)
    assert kind == "OwnerGoneError" and "authentication" in message
    assert manager.stats()["consumers"] == 0


def test_ring_never_unpickles_from_an_unauthenticated_peer(manager, tmp_path) -> None:
    marker = tmp_path / "pwned"
    with manager.ring((8,), "float32", device="cpu", consumers=0) as ring:
        raw_attack(ring._core._registry.address, pickle.dumps(Evil(str(marker))), True)
        assert not marker.exists()
        assert ring.stats()["consumers"] == 0


def test_a_silent_peer_cannot_stall_the_service(manager, reap) -> None:
    # Connects and says nothing: the handshake times out on its own thread while
    # real workers are served as usual.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(manager._owner.address)
        buf = manager.full((8,), 1.0, device="cpu")
        out = mp.Queue()
        proc = mp.Process(target=w_sum, args=(out, buf))
        started = time.monotonic()
        proc.start()
        reap.append(proc)
        assert out.get(timeout=60) == 8.0
        assert time.monotonic() - started < 30


def test_sockets_are_private_to_this_user(manager) -> None:
    address = manager._owner.address
    directory = os.path.dirname(address)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
    assert os.stat(directory).st_uid == os.getuid()


# -- 2 MiB isolation on the GPU -------------------------------------------------------------------


def w_probe(out, buf) -> None:
    """Map ``buf`` only; report what its mapping covers and whether the bytes just
    past it are mapped at all (where a neighbouring allocation would be)."""
    try:
        ptr = buf.ptr
        base, size = _cuda.address_range(ptr, buf.device)
        past = base + size
        try:
            _cuda.address_range(past, buf.device)
            past_mapped = True
        except mp.CUDAError:
            past_mapped = False
        out.put(("probe", ptr == base, size, buf.nbytes, past_mapped))
        buf.release()
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_ipc", "cuda_vmm"])
def test_a_handle_reaches_its_own_2mib_and_nothing_next_to_it(manager, reap, backend) -> None:
    a = manager.full((mp.GRANULARITY // 4,), 1.0, "float32", device=0, backend=backend)
    b = manager.full((mp.GRANULARITY // 4,), 2.0, "float32", device=0, backend=backend)
    out = mp.Queue()
    proc = mp.Process(target=w_probe, args=(out, a), device=0)
    proc.start()
    reap.append(proc)
    msg = out.get(timeout=60)
    assert msg[0] == "probe", msg
    _, starts_at_base, size, nbytes, past_mapped = msg
    assert starts_at_base and size == mp.GRANULARITY == nbytes  # exactly A's allocation
    assert not past_mapped  # B (or anything else) is not reachable through A's mapping
    wait_until(lambda: manager.stats()["leases"] == 0)
    b.release()


def _w_address_range(out: Any, q: Any) -> None:
    for _ in range(2):
        buf = q.get(timeout=GPU_TIMEOUT)
        base, size = _cuda.address_range(buf.ptr, buf.device)
        out.put(("range", buf.nbytes, buf.ptr, base, size))
        buf.release()


@pytest.mark.gpu
def test_allocations_are_2mib_isolated(manager: mp.BufferManager, reap: list[Any]) -> None:
    assert mp.GRANULARITY == 2 * MiB
    q, out = mp.Queue(), mp.Queue()
    proc = start_guarded(reap, _w_address_range, out, q, device=0)
    small = manager.empty((1000,), dtype="uint8", device=0)
    big = manager.empty((3 * MiB,), dtype="uint8", device=0)
    for buf, rounded in ((small, 2 * MiB), (big, 4 * MiB)):
        assert _cuda.address_range(buf.ptr, 0) == (buf.ptr, rounded)
        q.put(buf)
        tag, nbytes, ptr, base, size = recv(out, proc, timeout=GPU_TIMEOUT)
        assert tag == "range"
        assert nbytes == buf.nbytes
        assert base == ptr, "the mapped pointer is not the base of its allocation"
        assert size == rounded, f"a worker mapped {size} bytes for a {buf.nbytes}-byte buffer"
    join_ok(proc, timeout=GPU_TIMEOUT)
