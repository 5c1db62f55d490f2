"""Pipe: buffers through a gpushare Connection.

A buffer sent on a Pipe is pickled in ``send()`` and arrives as the same
memory; one received in its owner's process can be sent on again. Every
worker is a spawned gpushare Process; every wait has a timeout and the
``reap`` fixture kills survivors.
"""

from __future__ import annotations

from conftest import start
from workers import echo_sum

import gpushare as mp


def test_buffer_as_process_argument_and_through_pipe(manager, reap) -> None:
    buf = manager.full((10,), 3, "int32", device="cpu")
    a, b = mp.Pipe()
    results = mp.Queue()
    q = mp.Queue()
    start(reap, echo_sum, q, results)
    a.send(buf)
    q.put(b.recv())  # received in this (owner) process, then sent on
    assert results.get(timeout=30)[1] == 30
