"""cuda_vmm exports an allocation's fd ahead of the first request for it.

The promises are about threads and locks, not about the driver: the first
lease starts the export on a background thread and never waits for one in
progress (the caller holds the owner's lock), each allocation is exported
once however many ask, and a freed allocation is never exported. The two
driver calls involved (``vmm_export``, ``vmm_free``) are replaced here by
stand-ins that record what they were asked; the GPU suite runs the real
ones (test_gpu.py and test_faults.py on cuda_vmm).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpushare._backends import _base, cuda_vmm

pytestmark = pytest.mark.timeout(30)


class Driver:
    """Stand-ins for the driver calls: an export blocks until ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.exported: list[object] = []
        self.freed: list[object] = []
        self.started = threading.Event()

    def vmm_export(self, handle: object, ordinal: int) -> int:
        self.started.set()
        assert self.go.wait(10), "the test never let the export finish"
        self.exported.append(handle)
        return os.open(os.devnull, os.O_RDONLY)  # a real fd: free() closes it

    def vmm_free(self, ptr: int, handle: object, size: int, ordinal: int) -> None:
        self.freed.append(handle)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Driver:
    fake = Driver()
    monkeypatch.setattr(cuda_vmm._cuda, "vmm_export", fake.vmm_export)
    monkeypatch.setattr(cuda_vmm._cuda, "vmm_free", fake.vmm_free)
    return fake


def allocation(name: str) -> _base.Allocation:
    # The layout allocate() makes: [generic handle, fd, mapped size, export queued].
    return _base.Allocation("cuda_vmm", 0x1000, 2 << 20, 0, b"\0" * 16, b"", [name, None, 2 << 20, False])


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_first_lease_starts_the_export_and_never_waits_for_one(driver: Driver) -> None:
    backend = cuda_vmm.CudaVmmBackend()
    first, second = allocation("first"), allocation("second")
    assert backend.export(first) == b""
    assert driver.started.wait(10)  # the exporter thread is inside first's export
    began = time.monotonic()
    backend.export(second)  # queued behind it, without waiting for it
    backend.export(second)  # a second lease queues nothing more
    assert time.monotonic() - began < 0.5
    assert driver.exported == []
    driver.go.set()
    wait_for(lambda: driver.exported == ["first", "second"])
    assert backend.export_fd(first) == first.native[1]  # the fd made ahead, no new export
    assert driver.exported == ["first", "second"]
    backend.free(first)
    backend.free(second)


def test_requests_wait_for_the_export_in_progress_and_share_it(driver: Driver) -> None:
    backend = cuda_vmm.CudaVmmBackend()
    alloc = allocation("only")
    backend.export(alloc)
    assert driver.started.wait(10)
    fds: list[int] = []
    askers = [threading.Thread(target=lambda: fds.append(backend.export_fd(alloc))) for _ in range(3)]
    for t in askers:
        t.start()
    time.sleep(0.05)
    assert fds == []  # they wait for the export in progress
    driver.go.set()
    for t in askers:
        t.join(10)
    assert driver.exported == ["only"] and len(set(fds)) == 1 and fds[0] == alloc.native[1]
    backend.free(alloc)


def test_an_allocation_freed_before_its_export_is_never_exported(driver: Driver) -> None:
    backend = cuda_vmm.CudaVmmBackend()
    driver.go.set()
    freed, after = allocation("freed"), allocation("after")
    backend.free(freed)  # e.g. trimmed while its export waited in the queue
    backend.export(freed)
    backend.export(after)  # the queue is in order: once this one is exported, freed's turn went by
    wait_for(lambda: driver.exported == ["after"])
    assert driver.freed == ["freed"]
    with pytest.raises(ValueError, match="freed"):
        backend.export_fd(freed)
    backend.free(after)
    assert driver.freed == ["freed", "after"]
