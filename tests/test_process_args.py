"""How a Process's target and arguments reach a spawned child.

The process object travels as one cloudpickle stream whose dispatch table
holds every reducer registered with multiprocessing's ForkingPickler: these
tests check that a registered reducer is used (with a module-level, a lambda
and a closure target), that multiprocessing's synchronised objects
(Barrier, Value, Array: their heap Arena is one such reducer) arrive shared,
that identity between a target and its arguments survives, that a buffer is
leased once per child, and that a script's own functions still travel by
reference as multiprocessing sends them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from multiprocessing import reduction

import pytest
from conftest import subprocess_env, wait_until

import gpushare as mp

# -- a type with a registered reducer ------------------------------------------------


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


# -- tests ---------------------------------------------------------------------------


def _join(proc, timeout: float = 60.0) -> None:
    proc.join(timeout)
    assert proc.exitcode == 0, f"worker exit code {proc.exitcode}"


def test_registered_reducer_is_used_for_process_arguments(token_reducer, reap) -> None:
    out = mp.Queue()
    proc = mp.Process(target=report_token, args=(out, Token(3)))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (3, "registered reducer")
    _join(proc)


def test_registered_reducer_is_used_with_a_lambda_target(token_reducer, reap) -> None:
    out = mp.Queue()
    proc = mp.Process(target=lambda q, t: q.put((t.value, t.via)), args=(out, Token(4)))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (4, "registered reducer")
    _join(proc)


def test_registered_reducer_is_used_inside_a_closure(token_reducer, reap) -> None:
    out = mp.Queue()
    token = Token(5)

    def send() -> None:  # captures both the queue and the token: they travel by value with it
        out.put((token.value, token.via))

    proc = mp.Process(target=send)
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (5, "registered reducer")
    _join(proc)


def test_without_registration_the_type_pickles_as_usual(reap) -> None:
    out = mp.Queue()
    proc = mp.Process(target=report_token, args=(out, Token(6)))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == (6, "default")
    _join(proc)


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
        _join(proc)
    assert value.value == 2
    assert array[:] == [0.5, 1.5]


def test_lambda_target_with_arguments(reap) -> None:
    out, value = mp.Queue(), mp.Value("q", 0)
    scale = 7
    proc = mp.Process(target=lambda q, v, x: (setattr(v, "value", x * scale), q.put("done")), args=(out, value, 6))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == "done"
    _join(proc)
    assert value.value == 42


def test_a_target_and_its_arguments_keep_their_identity(reap) -> None:
    out = mp.Queue()
    holder = Holder(out)
    proc = mp.Process(target=holder.check, args=(holder,))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) is True
    _join(proc)


def test_a_classmethod_target_runs_in_the_childs_module(reap, monkeypatch) -> None:
    # By reference, as with multiprocessing: the child imports this module afresh, so the
    # parent's change to a module global is not seen (a by-value copy would carry it).
    monkeypatch.setattr(sys.modules[__name__], "MODE", "changed in the parent")
    out = mp.Queue()
    proc = mp.Process(target=Holder.report_mode, args=(out,))
    proc.start()
    reap.append(proc)
    assert out.get(timeout=60) == "as imported"
    _join(proc)


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
    _join(proc)
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
