"""The timing harness and the worker management every scenario uses.

``_time_loop`` times one step per iteration (after a warm-up, garbage collector off);
the rest bounds every wait: readiness (``_await_ready``), acks on a Queue or a Pipe, and
``_stop`` (sentinel, join with a timeout, terminate, kill). A consumer that dies or hangs
raises ``BenchError``: its cell fails, the run goes on.
"""

from __future__ import annotations

import contextlib
import gc
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from .settings import ACK_TIMEOUT, JOIN_TIMEOUT, READY_TIMEOUT, BenchError


def _time_loop(
    step: Callable[[int], None], warmup: int, iters: int, between: Callable[[], None] | None = None
) -> list[int]:
    """Run ``step`` ``warmup`` times, then time it ``iters`` times (``between`` runs untimed before each)."""
    for i in range(warmup):
        if between is not None:
            between()
        step(i)
    samples: list[int] = []
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(iters):
            if between is not None:
                between()
            t0 = clock()
            step(i)
            samples.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _check_ack(ack: Any) -> None:
    if ack != 1:
        if isinstance(ack, tuple) and len(ack) == 2 and ack[0] == "error":
            raise BenchError(f"a consumer failed: {ack[1]}")
        raise BenchError(f"a consumer sent {ack!r} instead of an ack")


def _check_alive(procs: list[Any]) -> None:
    dead = [p for p in procs if p.exitcode is not None]
    if dead:
        raise BenchError(f"a consumer (pid {dead[0].pid}) exited with code {dead[0].exitcode}")


def _get_ack(acks: Any, procs: list[Any], timeout: float = ACK_TIMEOUT) -> Any:
    """The next ack; a consumer that died or hangs fails the cell instead of the run."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return acks.get(timeout=1.0)  # the fast path pays no more for a timeout than without one
        except queue.Empty:
            _check_alive(procs)
            if time.monotonic() > deadline:
                raise BenchError(f"no answer from a consumer within {timeout:g} s") from None


def _wait_pipe(conn: Any, procs: list[Any]) -> None:
    deadline = time.monotonic() + ACK_TIMEOUT
    while not conn.poll(1.0):
        _check_alive(procs)
        if time.monotonic() > deadline:
            raise BenchError(f"no ack from a consumer within {ACK_TIMEOUT:g} s")


def _recv_pipe(conn: Any, procs: list[Any]) -> Any:
    """The next message on ``conn`` (bounded wait); a consumer's ("error", text) fails the cell."""
    _wait_pipe(conn, procs)
    try:
        message = conn.recv()
    except (EOFError, OSError) as exc:
        for p in procs:
            p.join(timeout=0.5)  # a consumer that closed its end has usually exited: name it
        _check_alive(procs)
        raise BenchError(f"a consumer closed its pipe ({type(exc).__name__}) without answering") from None
    if isinstance(message, tuple) and len(message) == 2 and message[0] == "error":
        raise BenchError(f"a consumer failed: {message[1]}")
    return message


def _pipes_poll(conns: Sequence[Any]) -> Callable[[float], Any]:
    """A poll for _await_ready over one Pipe end per consumer (one "ready" each)."""
    pending = list(conns)

    def poll(timeout: float) -> Any:
        for conn in list(pending):
            if conn.poll(timeout / max(1, len(pending))):
                pending.remove(conn)
                return conn.recv()
        return None

    return poll


def _await_ready(poll: Callable[[float], Any], procs: list[Any], n: int) -> None:
    """Wait for ``n`` ("ready", pid) messages, failing fast when a consumer dies."""
    deadline = time.monotonic() + READY_TIMEOUT
    ready = 0
    while ready < n:
        if time.monotonic() > deadline:
            raise BenchError(f"only {ready} of {n} consumers were ready after {READY_TIMEOUT:g} s")
        message = poll(0.25)
        if message is None:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                raise BenchError(
                    f"a consumer (pid {dead[0].pid}) exited with code {dead[0].exitcode} before it was ready"
                )
            continue
        if isinstance(message, tuple) and message[:1] == ("ready",):
            ready += 1
        else:
            raise BenchError(f"a consumer did not start: {message[1] if isinstance(message, tuple) else message!r}")


def _queue_poll(q: Any) -> Callable[[float], Any]:
    def poll(timeout: float) -> Any:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            return None

    return poll


def run_in_child(target: Callable[..., None], args: tuple[Any, ...], who: str, timeout: float) -> Any:
    """Run ``target(*args, conn)`` in a spawned process of its own and return what it sends on
    ``conn``: ``("ok", payload)``, or ``("error", traceback)``, which raises BenchError, as does
    no answer within ``timeout`` seconds or the process exiting without one. ``who`` names it
    in messages ("gpushare: the trainer process")."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))  # not daemonic: it may start children
    try:
        proc.start()
        child.close()
        deadline = time.monotonic() + timeout
        while not parent.poll(0.5):
            if proc.exitcode is not None and not parent.poll(0):
                raise BenchError(f"{who} exited with code {proc.exitcode} before it answered")
            if time.monotonic() > deadline:
                raise BenchError(f"{who} sent nothing within {timeout:g} s")
        try:
            status, payload = parent.recv()
        except EOFError:
            proc.join(5)
            raise BenchError(f"{who} died (exit code {proc.exitcode})") from None
    finally:
        parent.close()
        _stop([proc], lambda: None)
    if status != "ok":
        raise BenchError(f"{who} failed:\n{payload}")
    return payload


def _stop(procs: list[Any], send_stop: Callable[[], None], queues: Sequence[Any] = ()) -> None:
    """Tell consumers to stop, join with a timeout, then terminate and kill survivors."""
    try:
        send_stop()
    except Exception:
        pass
    deadline = time.monotonic() + JOIN_TIMEOUT
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    for q in queues:
        # Whatever is left unread must not keep this process waiting at exit.
        with contextlib.suppress(Exception):
            q.cancel_join_thread()
            q.close()
