"""The public facade: a drop-in multiprocessing namespace plus gpushare's own names."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap

import pytest
from conftest import subprocess_env

import gpushare as mp


def test_every_multiprocessing_name_is_reachable() -> None:
    missing = [name for name in multiprocessing.__all__ if not hasattr(mp, name)]
    assert missing == []


def test_all_names_resolve_and_own_names_are_documented() -> None:
    for name in mp.__all__:
        obj = getattr(mp, name)
        if name not in multiprocessing.__all__ and callable(obj):
            assert obj.__doc__, f"gpushare.{name} has no docstring"


def test_default_start_method_is_spawn_and_independent_of_multiprocessing() -> None:
    assert mp.get_start_method() == "spawn"
    assert mp.get_context().Process.__module__.startswith("gpushare")


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_every_context_hands_out_gpushare_processes(method: str) -> None:
    ctx = mp.get_context(method)
    assert issubclass(ctx.Process, mp.Process.__mro__[1])  # GpuProcessMixin
    assert ctx.Process._start_method == method


def test_unknown_context_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="valid"):
        mp.get_context("teleport")


def test_existing_multiprocessing_script_runs_unchanged(tmp_path) -> None:
    script = tmp_path / "legacy.py"
    script.write_text(
        textwrap.dedent(
            """
            import gpushare as mp

            def square(x):
                return x * x

            def worker(q, lock, value):
                with lock:
                    value.value += 1
                q.put("hello")

            if __name__ == "__main__":
                q = mp.Queue()
                lock = mp.Lock()
                value = mp.Value("i", 0)
                a, b = mp.Pipe()
                p = mp.Process(target=worker, args=(q, lock, value))
                p.start()
                assert q.get(timeout=30) == "hello"
                p.join(30)
                assert value.value == 1
                a.send([1, 2]); assert b.recv() == [1, 2]
                with mp.Pool(2) as pool:
                    assert pool.map(square, range(5)) == [0, 1, 4, 9, 16]
                with mp.Manager() as m:
                    d = m.dict(); d["k"] = 3
                    lst = m.list([1]); lst.append(2)
                    mq = m.Queue(); mq.put(5)
                    assert dict(d) == {"k": 3} and list(lst) == [1, 2] and mq.get() == 5
                ev = mp.Event(); ev.set(); assert ev.is_set()
                print("ok", mp.cpu_count() > 0, mp.current_process().name)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=subprocess_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok True MainProcess")


def _pool_worker_class(_: int) -> str:
    return type(mp.current_process()).__module__


def test_pool_workers_are_gpushare_processes() -> None:
    with mp.Pool(1) as pool:
        # In the worker current_process() is a plain unpickled process object, but the
        # process was started through gpushare's context: check from the parent side.
        assert all(type(p).__module__.startswith("gpushare") for p in pool._pool)
        assert pool.map(_pool_worker_class, [0]) == [pool.map(_pool_worker_class, [0])[0]]


def test_set_start_method_does_not_touch_multiprocessing() -> None:
    before = multiprocessing.get_start_method(allow_none=True)
    ctx = mp.get_context("forkserver")
    assert ctx.get_start_method() == "forkserver"
    assert multiprocessing.get_start_method(allow_none=True) == before


def _undocumented(cls: type) -> list[str]:
    """The public methods and properties of ``cls`` that gpushare defines and leaves without a docstring."""
    missing = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        home = next((base for base in cls.__mro__ if name in base.__dict__), None)
        if home is None or not home.__module__.startswith("gpushare"):
            continue  # multiprocessing's, or object's: documented where they come from
        member = home.__dict__[name]
        target = member.fget if isinstance(member, property) else member
        if callable(target) and not (getattr(target, "__doc__", None) or "").strip():
            missing.append(f"{cls.__name__}.{name}")
    return missing


def test_the_core_classes_document_every_public_member() -> None:
    from gpushare._fanout import Ring

    classes = [mp.Buffer, mp.BufferManager, Ring, mp.TensorSet, mp.SlotLoader, mp.Queue]
    missing = [name for cls in classes for name in _undocumented(cls)]
    assert not missing, f"public members without a docstring: {missing}"
