"""Which gpushare modules one buffer handoff runs through: a runtime trace.

The handoff: ``Manager.full`` and ``Queue.put`` in the owner, ``get``, a read and
``release()`` in a spawned child, on the host backend. A profile hook on each
process's main thread records every gpushare function called (module bodies left
out: importing is not the handoff), after one warm-up handoff so that first-use
work (imports, the child's connection to the owner) is not counted. The figure is
the number of distinct modules over both processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gpushare as mp

PACKAGE = str(Path(mp.__file__).resolve().parent)

#: The most gpushare modules one handoff runs through, both processes together
#: (the Queue's shared-memory ring, ``_shmring``, is one of them).
HANDOFF_LIMIT = 13


class _Trace:
    """A ``sys.setprofile`` hook: the gpushare modules whose functions run, and the
    number of hops (a call into another module than the previous call's)."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.hops = 0
        self._last = ""

    def __call__(self, frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE) or code.co_name == "<module>":
            return
        module = os.path.relpath(code.co_filename, PACKAGE)
        self.modules.add(module)
        if module != self._last:
            self.hops += 1
            self._last = module

    def __enter__(self) -> _Trace:
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def _traced_receiver(jobs, go, out) -> None:
    jobs.get(timeout=60).release()  # the warm-up handoff
    out.put("warm")
    go.get(timeout=60)  # the traced buffer is on the queue now
    with _Trace() as trace:
        buf = jobs.get(timeout=60)
        total = float(buf.numpy().sum())
        buf.release()
    out.put((total, sorted(trace.modules), trace.hops))


def handoff_modules(reap: list) -> tuple[list[str], list[str], int]:
    """(modules run in the owner, modules run in the child, hops in both) for one handoff."""
    with mp.Manager() as manager:
        jobs, go, out = mp.Queue(), mp.Queue(), mp.Queue()
        proc = mp.Process(target=_traced_receiver, args=(jobs, go, out))
        proc.start()
        reap.append(proc)
        jobs.put(manager.full((4,), 1.0, dtype="float32", device="cpu"))
        assert out.get(timeout=60) == "warm"
        with _Trace() as trace:
            buf = manager.full((4,), 1.0, dtype="float32", device="cpu")
            jobs.put(buf)
            del buf
        go.put(None)
        total, child, child_hops = out.get(timeout=60)
        proc.join(timeout=30)
    assert total == 4.0
    return sorted(trace.modules), child, trace.hops + child_hops


def test_one_handoff_runs_through_few_modules(reap) -> None:
    owner, child, hops = handoff_modules(reap)
    both = sorted(set(owner) | set(child))
    assert len(both) <= HANDOFF_LIMIT, (len(both), hops, owner, child)
    # The child runs nothing of the owner side (the records module holds the owner's pool too).
    owner_side = ("_manager", "_lifetime/_owner", "_lifetime/_lease", "_lifetime/_records")
    assert not [m for m in child if m.startswith(owner_side)], child
