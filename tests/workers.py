"""Worker targets that several test files start, and the sum they report.

Module level, in a module of their own: spawn pickles a target by reference,
so the child imports this module to find it. A target that one test file
starts stays in that file. Workers named ``w_*`` run under
:func:`conftest.guarded` and report on ``out`` (their first argument); the
others report on ``results``.
"""

from __future__ import annotations

import os
import pickle

import numpy as np

import gpushare as mp

T = 60  # seconds any single wait in a worker may take


def total(buf) -> float:
    """The sum of a buffer's elements, as the workers report it."""
    return float(buf.numpy().astype(np.float64).sum())


def echo_sum(jobs, results) -> None:
    buf = jobs.get(timeout=30)
    results.put((os.getpid(), float(buf.numpy().astype(np.float64).sum()), buf.shape, str(buf.dtype)))
    buf.release()


def unpickle_bytes(data, results) -> None:
    try:
        buf = pickle.loads(data)
    except mp.GpushareError as exc:
        results.put((type(exc).__name__, str(exc)))
    else:
        results.put(("ok", float(buf.numpy().sum())))


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


def w_hold_until_told(out, jobs, control) -> None:
    buf = jobs.get(timeout=T)
    out.put(("holding", total(buf)))
    control.get(timeout=T)
    out.put(("after", total(buf)))
    buf.release()
    out.put(("released",))


def w_touch_when_told(out, jobs, control) -> None:
    """Hold a buffer; on the word, read it again and report what that raised."""
    buf = jobs.get(timeout=T)
    out.put(("holding", total(buf)))
    control.get(timeout=T)
    try:
        total(buf)
    except mp.GpushareError as exc:
        out.put((type(exc).__name__, str(exc)))
    else:
        out.put(("no error", ""))
