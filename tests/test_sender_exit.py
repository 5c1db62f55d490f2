"""A torch sender's exit, and a relay whose source finishes first (gpushare.torch.multiprocessing).

torch.multiprocessing's everyday pattern: a producer puts tensors and returns at once. Its
exit keeps serving its receivers, bounded by ``set_release_timeout()``, while some process
may still take what it sent (a consumer connected, a child running, another process holding
a queue it put on); receivers then keep what they hold. A relay A -> B -> C delivers every
item, with the values A wrote, whichever of A and C finishes first.

The host cases send host-memory Buffers from the drop-in's own owner (what a CUDA tensor's
send makes), so the exit runs as a CUDA sender's does; the ``gpu`` cases send CUDA tensors
and Manager buffers. ``GPUSHARE_RELAY_RUNS`` repeats each relay case (a stress run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import subprocess_env, wait_until

torch = pytest.importorskip("torch")

import gpushare.torch.multiprocessing as mp  # noqa: E402
from gpushare import _backends  # noqa: E402
from gpushare._buffer import Buffer  # noqa: E402
from gpushare.torch._sharing import get_release_timeout, set_release_timeout, sharing_owner  # noqa: E402

HOST_AND_CUDA = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


def item(value: float, where: str, n: int = 1024) -> object:
    """``n`` float32 values ``value``: a CUDA tensor, or a host Buffer of the drop-in's owner."""
    if where == "cuda":
        return torch.full((n,), value, device="cuda")
    buf = Buffer(sharing_owner().allocate(_backends.get("host"), 2 << 20, None, "test"), 0, (n,), np.dtype("float32"))
    buf.numpy()[:] = value
    return buf


def values(obj: object) -> tuple[float, float]:
    """(min, max) of a received item (a CUDA tensor or a Buffer, host or CUDA)."""
    if isinstance(obj, torch.Tensor):
        return obj.min().item(), obj.max().item()
    if obj.device == "cpu":  # type: ignore[attr-defined]
        array = obj.numpy()  # type: ignore[attr-defined]
        return float(array.min()), float(array.max())
    t = torch.from_dlpack(obj)
    return t.min().item(), t.max().item()


# -- children (module level: spawn imports them by name) --------------------------------------


def take_after(q, report, delay, count) -> None:
    """Connect only ``delay`` s after starting; take ``count`` items and write what they held."""
    time.sleep(delay)
    got = []
    for _ in range(count):
        try:
            got.append(values(q.get(timeout=60))[0])
        except Exception as exc:
            got.append(f"{type(exc).__name__}: {exc}")
    with open(report, "w") as f:
        f.write(repr(got))


def send_and_return(q, where, count, timeout, returned) -> None:
    set_release_timeout(timeout)
    for i in range(count):
        q.put(item(float(i), where))  # dropped at once
    with open(returned, "w"):
        pass


def hold_past_the_sender(q, report, ready, returned, gone, where, count) -> None:
    """Say it is ready; once the sender's target returned, take ``count`` items, hold them
    until the sender's process has gone, fill other memory, then read them."""
    if where == "cuda":
        torch.cuda.init()
    with open(ready, "w"):
        pass
    while not os.path.exists(returned):
        time.sleep(0.01)
    held = [q.get(timeout=60) for _ in range(count)]
    seen = [values(x) for x in held]
    while not os.path.exists(gone):
        time.sleep(0.01)
    if where == "cuda":  # a tensor's memory is read with no check: it must still be the sender's
        filler = torch.full((256 << 20,), 9.0, device="cuda")  # 1 GiB, in memory the sender may have freed
        torch.cuda.synchronize()
        del filler
        seen += [values(x) for x in held]
    with open(report, "w") as f:
        f.write(repr(seen))


def relay_source(q, count, kind, n, done) -> None:
    """A: put ``count`` items, the i-th all ``i``, each dropped at once, then return (or, with
    ``done``, wait for the sink's word first)."""
    if kind == "buffer":
        with mp.Manager() as manager:  # left right after the last put
            for i in range(count):
                q.put(manager.full((n,), float(i), "float32", device=0))
    else:
        for i in range(count):
            q.put(item(float(i), kind, n))
    if done is not None:
        done.get(timeout=300)


def relay_on(inq, outq, count) -> None:
    """B: send each item on without touching it."""
    for _ in range(count):
        outq.put(inq.get(timeout=120))


def relay_sink(q, out, count, done) -> None:
    """C: how many items arrived with other values than A wrote, and the first few."""
    wrong = []
    bad = 0
    for i in range(count):
        got = values(q.get(timeout=120))
        if got != (float(i), float(i)):
            bad += 1
            if len(wrong) < 10:
                wrong.append((i, got))
    if done is not None:
        done.put("done")
    out.put((bad, wrong))


# -- the everyday pattern ---------------------------------------------------------------------

_SENDER = """
import sys, time
sys.path.insert(0, {tests!r})
import gpushare.torch.multiprocessing as mp
from test_sender_exit import item, take_after
if __name__ == "__main__":
    {setup}
    q = mp.Queue()
    p = mp.Process(target=take_after, args=(q, {report!r}, {delay}, {count}))
    p.start()
    for i in range({count}):
        q.put(item(float(i), {where!r}))  # dropped at once
    print("ended", time.time(), flush=True)
"""


def _run_sender(tmp_path, where: str, delay: float, count: int = 4, setup: str = "") -> tuple[list, str]:
    report = str(tmp_path / "report")
    script = tmp_path / "sender.py"
    script.write_text(
        _SENDER.format(
            tests=os.path.dirname(__file__), setup=setup or "pass", report=report, delay=delay, count=count, where=where
        )
    )
    proc = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with open(report) as f:
        return eval(f.read()), proc.stderr


@pytest.mark.parametrize("where", HOST_AND_CUDA)
def test_a_sender_that_returns_right_after_its_puts_delivers_them(tmp_path, where) -> None:
    """The consumer connects a second after the sender's main returned: its exit waits until
    the consumer took all 4, which hold the values sent, and reports no leak. The bound is
    raised past the default 5 s: a consumer that imports torch on a loaded machine may start
    later than that, and the bound is not what this test is about."""
    got, stderr = _run_sender(tmp_path, where, delay=1.0, setup="mp.set_release_timeout(60)")
    assert got == [0.0, 1.0, 2.0, 3.0], got
    assert "outstanding" not in stderr, stderr


def test_the_wait_for_a_consumer_is_bounded_by_the_release_timeout(tmp_path) -> None:
    """The consumer comes after the sender's release_timeout (0.5 s): the sender exits with a
    warning, and the consumer's get says that the sender exited before it claimed the item."""
    got, stderr = _run_sender(tmp_path, "host", delay=3.0, count=1, setup="mp.set_release_timeout(0.5)")
    assert len(got) == 1 and got[0].startswith("OwnerGoneError"), got
    assert "before this process claimed" in got[0] and "set_release_timeout" in got[0], got
    assert "outstanding after 0.5 s" in stderr and "an unclaimed pickle" in stderr, stderr


def test_the_release_timeout_is_settable_and_checked() -> None:
    before = get_release_timeout()
    try:
        mp.set_release_timeout(2)
        assert mp.get_release_timeout() == 2.0
        with pytest.raises(ValueError, match="seconds >= 0"):
            mp.set_release_timeout(-1)
        with pytest.raises(ValueError, match="seconds >= 0"):
            mp.set_release_timeout(float("nan"))
        assert mp.get_release_timeout() == 2.0
    finally:
        set_release_timeout(before)


@pytest.mark.parametrize("where", HOST_AND_CUDA)
def test_a_sibling_sender_waits_for_its_claims_and_receivers_keep_their_items(tmp_path, reap, where) -> None:
    """The sender, a child, puts 4 items and returns before its sibling consumer takes any: its
    exit waits until they are claimed. The consumer holds them past the sender's
    release_timeout (1 s) and its exit, and still reads the values sent."""
    report, ready, returned, gone = (str(tmp_path / name) for name in ("report", "ready", "returned", "gone"))
    q = mp.Queue()
    consumer = mp.Process(target=hold_past_the_sender, args=(q, report, ready, returned, gone, where, 4))
    sender = mp.Process(target=send_and_return, args=(q, where, 4, 1.0, returned))
    reap.extend([consumer, sender])
    consumer.start()
    wait_until(lambda: os.path.exists(ready), timeout=60)  # started: it takes them at once
    sender.start()
    sender.join(60)
    assert sender.exitcode == 0
    with open(gone, "w"):
        pass
    consumer.join(60)
    assert consumer.exitcode == 0
    with open(report) as f:
        seen = eval(f.read())
    sent = [(float(i), float(i)) for i in range(4)]
    assert seen == (sent * 2 if where == "cuda" else sent)


# -- the relay --------------------------------------------------------------------------------

RELAY_RUNS = int(os.environ.get("GPUSHARE_RELAY_RUNS", "1"))
RELAY_CASES = [
    pytest.param("host", 16, 2000, id="host-16B"),
    pytest.param("cuda", 16, 20000, id="tensor-16B", marks=pytest.mark.gpu),
    pytest.param("cuda", 1 << 20, 2000, id="tensor-4MiB", marks=pytest.mark.gpu),
    pytest.param("buffer", 16, 5000, id="buffer-16B", marks=pytest.mark.gpu),
]


@pytest.mark.timeout(120 + 240 * RELAY_RUNS)
@pytest.mark.parametrize("source_first", [True, False], ids=["source-first", "source-last"])
@pytest.mark.parametrize(("kind", "n_values", "count"), RELAY_CASES)
def test_a_relay_delivers_what_its_source_sent_whichever_end_stops_first(
    reap, kind, n_values, count, source_first
) -> None:
    """A -> B -> C, B sending each item on untouched, A dropping each right after its put: C
    gets every item with the values A wrote, and every process exits, whether A returns
    right after its last put or only once C has everything."""
    n = n_values // 4
    for run in range(RELAY_RUNS):
        a, b, out = mp.Queue(maxsize=64), mp.Queue(maxsize=64), mp.Queue()
        done = None if source_first else mp.Queue()
        procs = [
            mp.Process(target=relay_source, args=(a, count, kind, n, done)),
            mp.Process(target=relay_on, args=(a, b, count)),
            mp.Process(target=relay_sink, args=(b, out, count, done)),
        ]
        for proc in procs:
            proc.start()
            reap.append(proc)
        bad, wrong = out.get(timeout=240)
        assert bad == 0, f"run {run}: {bad} of {count} items arrived with other values; (index, (min, max)): {wrong}"
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0, f"run {run}: {proc.name} exit code {proc.exitcode}"
