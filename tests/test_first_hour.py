"""What a multiprocessing user meets in the first hour, each with real processes.

* **Submodules.** ``gpushare.connection``, ``gpushare.pool`` ... exist for
  every public submodule of multiprocessing, as attributes (loaded on first
  use, not by ``import gpushare``) and by import; each has the stdlib
  module's public names, and gpushare's objects where gpushare changes
  behaviour (``gpushare._mirror`` states the rule).
* **Lambdas and closures.** ``Process``, ``Pool`` and a
  ``ProcessPoolExecutor`` given gpushare's context accept the same functions:
  lambdas and closures as targets, tasks, arguments and results. So do
  gpushare's queues. A Pipe is multiprocessing's and does not; what it
  refuses, ``gpushare.reduction.dumps`` carries.
* **No main guard.** A script that starts a Process, a Pool, a Manager or
  an executor at its top level stops at once with one MainGuardError that
  names the line and the fix, instead of a stream of tracebacks: the child
  prints it and exits; a parent waiting for the child (a Pool, a Manager, a
  queue's ``get()``) raises it too, and a Process's parent sees exit code 78.
* **A device that is not there.** ``Process(device=N).start()`` raises
  NoDeviceError in the parent, before any child starts, with a hint that
  is true for an explicit device.
* **Messages true in their case.** A buffer whose Manager was shut down
  says so (its process lives on); one whose owner's process died says that.
  Shapes must be integers. A CUDA backend without a GPU says how to get
  host memory.

Host backend only: every case here is about processes, not devices. Every
child has a timeout and the ``reap`` fixture kills survivors.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import reduction
from typing import Any

import numpy as np
import pytest
from conftest import clean_up_after, join_ok, recv, start_guarded, subprocess_env, wait_until
from workers import w_touch_when_told

import gpushare as mp
from gpushare import _cuda
from gpushare._queues import WATCH_INTERVAL

T = 60  # seconds any single wait in a worker or for a worker may take
N = 1024

SUBMODULES = sorted(mp._SUBMODULES)

#: Per submodule, the names where gpushare's object stands in the stdlib's place or is added.
REPLACED: dict[str, dict[str, Any]] = {
    "connection": {},
    "context": {
        "Process": mp.Process,
        "DefaultContext": type(mp.get_context.__self__),  # type: ignore[attr-defined]
        "SpawnContext": type(mp.get_context("spawn")),
        "ForkServerContext": type(mp.get_context("forkserver")),
        "ForkContext": type(mp.get_context("fork")),
        "SpawnProcess": mp.get_context("spawn").Process,
        "ForkServerProcess": mp.get_context("forkserver").Process,
        "ForkProcess": mp.get_context("fork").Process,
    },
    "dummy": {},
    "managers": {"BufferManager": mp.BufferManager},
    "pool": {},  # Pool and get_context: checked below (a class, a bound method)
    "process": {"Process": mp.Process},
    "queues": {},  # Queue, JoinableQueue, SimpleQueue: checked below
    "reduction": {},  # dumps: checked below
    "shared_memory": {},
    "sharedctypes": {},  # Value, Array, synchronized, get_context: checked below
    "synchronize": {},
    "util": {},
}
OWN_NAMES = {
    "pool": {"Pool", "get_context"},
    "managers": {"get_context"},
    "queues": {"Queue", "JoinableQueue", "SimpleQueue"},
    "reduction": {"dumps"},
    "sharedctypes": {"Value", "Array", "synchronized", "get_context"},
}


def public_names(module: types.ModuleType) -> set[str]:
    return {n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}


# -- workers (module level: spawn pickles them by reference) ---------------------------


def w_call_each(out: Any, jobs: Any, count: int) -> None:
    """Get ``count`` callables from ``jobs`` and send back what each returns."""
    for _ in range(count):
        out.put(("called", jobs.get(timeout=T)()))


def w_add_to_value(out: Any, value: Any, amount: int) -> None:
    with value.get_lock():
        value.value += amount
    out.put(("added", amount))


def w_own_and_share(out: Any, jobs: Any) -> None:
    """Own a Manager, share one of its buffers, then wait to be killed."""
    m = mp.Manager(release_timeout=0.5)
    jobs.put(m.full((N,), 3.0, "float32", device="cpu"))
    out.put(("owner", m._process.pid, os.path.dirname(m._owner.address)))
    time.sleep(T)


def double(x: int) -> int:
    return 2 * x


# -- 1. submodules -----------------------------------------------------------------------


def test_import_gpushare_loads_no_submodule_and_attribute_access_does() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        import gpushare as mp
        names = {SUBMODULES!r}
        assert not [n for n in names if "gpushare." + n in sys.modules], "loaded by import gpushare"
        for name in names:
            module = getattr(mp, name)
            assert module is sys.modules["gpushare." + name], name
            assert name in dir(mp), name
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("name", SUBMODULES)
def test_a_submodule_has_the_stdlibs_names_and_gpushares_objects(name: str) -> None:
    module = importlib.import_module(f"gpushare.{name}")
    stdlib = importlib.import_module(f"multiprocessing.{name}")
    assert getattr(mp, name) is module
    assert module.__doc__ and "gpushare._mirror" in module.__doc__
    missing = public_names(stdlib) - public_names(module)
    assert not missing, f"gpushare.{name} lacks {sorted(missing)}"
    assert set(getattr(stdlib, "__all__", ())) <= set(module.__all__)
    assert all(hasattr(module, n) for n in module.__all__)
    replaced = REPLACED[name]
    own = OWN_NAMES.get(name, set()) | set(replaced)
    for attr in public_names(stdlib) - own:
        ours, theirs = getattr(module, attr), getattr(stdlib, attr)
        if attr in multiprocessing.__all__ and getattr(multiprocessing, attr) is theirs:
            assert ours == getattr(mp, attr), f"gpushare.{name}.{attr} is not gpushare.{attr}"
        else:
            assert ours is theirs, f"gpushare.{name}.{attr} is not multiprocessing's"
    for attr, expected in replaced.items():
        assert getattr(module, attr) is expected, f"gpushare.{name}.{attr}"


def test_from_import_gives_gpushares_replacements() -> None:
    from gpushare.connection import Connection, Pipe, wait
    from gpushare.managers import BufferManager, SyncManager
    from gpushare.pool import Pool, ThreadPool
    from gpushare.queues import JoinableQueue, Queue, SimpleQueue
    from gpushare.reduction import ForkingPickler, dumps, register

    assert (wait, Pipe, Connection) == (multiprocessing.connection.wait, multiprocessing.connection.Pipe,
                                        multiprocessing.connection.Connection)  # fmt: skip
    assert BufferManager is mp.BufferManager and issubclass(BufferManager, SyncManager)
    assert Pool.__module__ == "gpushare._pool" and issubclass(Pool, multiprocessing.pool.Pool)
    assert ThreadPool is multiprocessing.pool.ThreadPool
    assert isinstance(mp.Queue(), Queue) and isinstance(mp.JoinableQueue(), JoinableQueue)
    assert isinstance(mp.SimpleQueue(), SimpleQueue) and issubclass(SimpleQueue, multiprocessing.queues.SimpleQueue)
    assert (ForkingPickler, register) == (reduction.ForkingPickler, reduction.register)  # one registry
    assert dumps.__module__ == "gpushare._process"
    assert mp.pool.get_context() is mp.get_context() and mp.managers.get_context("spawn") is mp.get_context("spawn")


def test_dummy_connection_is_importable() -> None:
    import gpushare.dummy.connection as dummy_connection

    assert dummy_connection is multiprocessing.dummy.connection is mp.dummy.connection


@pytest.mark.parametrize("name", sorted(mp._LEFT_OUT))
def test_a_left_out_submodule_says_where_it_is(name: str) -> None:
    with pytest.raises(AttributeError, match=rf"no attribute '{name}' \(multiprocessing\.{name} .* from there\)"):
        getattr(mp, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"gpushare.{name}")


def test_an_unknown_attribute_is_a_plain_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'gpushare' has no attribute 'nonesuch'$"):
        mp.nonesuch  # noqa: B018


def test_sharedctypes_value_made_without_ctx_goes_to_a_gpushare_process(reap) -> None:
    # multiprocessing.sharedctypes.Value would lock with multiprocessing's default context
    # (fork on Linux before 3.14): such a lock cannot go to a spawned process.
    value = mp.sharedctypes.Value("i", 1)
    out = mp.Queue()
    proc = start_guarded(reap, w_add_to_value, out, value, 41)
    assert recv(out, proc, timeout=T) == ("added", 41)
    join_ok(proc, timeout=T)
    assert value.value == 42
    array = mp.sharedctypes.Array("d", 3)
    assert array.get_lock() is not None and len(array) == 3


def test_pool_from_the_submodule_uses_gpushares_context() -> None:
    with mp.pool.Pool(1) as pool:
        assert pool._ctx is mp.get_context()
        assert all(type(w).__module__.startswith("gpushare") for w in pool._pool)
        assert pool.map(double, [1, 2]) == [2, 4]


# -- 2. lambdas and closures -------------------------------------------------------------


def test_pool_accepts_lambdas_and_closures_as_tasks_and_results() -> None:
    offset = 10
    with mp.Pool(2) as pool:
        assert pool.map(lambda x: x + offset, range(4)) == [10, 11, 12, 13]
        assert pool.apply(lambda a, b: a * b, (6, 7)) == 42
        assert sorted(pool.imap_unordered(lambda x: -x, range(3))) == [-2, -1, 0]
        assert pool.starmap(lambda a, b: a - b, [(3, 1), (5, 2)]) == [2, 3]
        adders = pool.map(lambda x: lambda y: x + y + offset, range(3))  # closures as results
        assert [add(1) for add in adders] == [11, 12, 13]
        assert pool.map(double, range(3)) == [0, 2, 4]  # module-level functions as before


def test_pool_reports_an_unpicklable_task_and_keeps_working() -> None:
    with mp.Pool(1) as pool:
        with pytest.raises(TypeError, match="pickle"):
            pool.map(double, [threading.Lock()])
        assert pool.map(double, [4]) == [8]


def test_process_pool_executor_with_gpushares_context_accepts_lambdas() -> None:
    scale = 3
    with ProcessPoolExecutor(2, mp_context=mp.get_context()) as executor:
        assert list(executor.map(lambda x: x * scale, range(4))) == [0, 3, 6, 9]
        assert executor.submit(lambda: "submitted").result(timeout=T) == "submitted"
        make = executor.submit(lambda: lambda: scale + 1).result(timeout=T)  # a closure as the result
        assert make() == 4
        assert executor.submit(double, 21).result(timeout=T) == 42


def test_process_and_gpushares_queue_carry_the_same_closures(reap) -> None:
    base = 100
    jobs, out = mp.Queue(), mp.Queue()
    jobs.put(lambda: base + 1)  # a queue item, pickled in put()
    proc = start_guarded(reap, lambda o, j: w_call_each(o, j, 2), out, jobs)  # a lambda target
    jobs.put(lambda: [base] * 2)
    assert recv(out, proc, timeout=T) == ("called", 101)
    assert recv(out, proc, timeout=T) == ("called", [100, 100])
    join_ok(proc, timeout=T)


def test_a_pipe_is_multiprocessings_and_dumps_carries_what_it_refuses() -> None:
    a, b = mp.Pipe()
    try:
        with pytest.raises((pickle.PicklingError, AttributeError)):
            a.send(lambda: 1)
        a.send_bytes(mp.reduction.dumps(lambda: "through a pipe"))
        assert pickle.loads(b.recv_bytes())() == "through a pipe"
    finally:
        a.close()
        b.close()


class Counted:
    """A type whose registered reducer counts its runs: a side effect, like taking a lease."""

    runs = 0


def _reduce_counted(obj: Counted) -> tuple[Any, tuple[Any, ...]]:
    Counted.runs += 1
    return (Counted, ())


def test_dumps_is_forkingpicklers_pickle_and_runs_each_reducer_once() -> None:
    plain = {"a": [1, 2.5, "x"], "f": double, "t": (None, b"y")}
    expected = io.BytesIO()
    reduction.ForkingPickler(expected, None).dump(plain)
    assert mp.reduction.dumps(plain, None) == expected.getvalue()
    reduction.register(Counted, _reduce_counted)
    try:
        for obj in ([Counted(), 1], [Counted(), lambda: 1]):  # by reference, then by value (cloudpickle)
            before = Counted.runs
            assert isinstance(pickle.loads(mp.reduction.dumps(obj))[0], Counted)
            assert Counted.runs == before + 1, obj
    finally:
        reduction.ForkingPickler._extra_reducers.pop(Counted, None)  # type: ignore[attr-defined]


# -- 3. a script without the main guard ----------------------------------------------------

#: Each script, and the line of it that starts a process.
NO_GUARD = {
    "process": """
        import gpushare as mp
        p = mp.Process(target=print, args=("the target ran",))
        p.start()
        p.join(60)
        print("child exit code", p.exitcode)
        """,
    "process, then a queue": """
        import gpushare as mp
        q = mp.Queue()
        p = mp.Process(target=q.put, args=("the target ran",))
        p.start()
        print(q.get())
        """,
    "pool": """
        import gpushare as mp
        with mp.Pool(2) as pool:
            print(pool.map(abs, [-1, -2]))
        """,
    "manager": """
        import gpushare as mp
        with mp.Manager() as m:
            print(m.dict())
        """,
    "executor": """
        from concurrent.futures import ProcessPoolExecutor
        import gpushare as mp
        with ProcessPoolExecutor(2, mp_context=mp.get_context()) as ex:
            print(list(ex.map(abs, [-1, -2])))
        """,
}


NO_GUARD_LINE = {"process": 4, "process, then a queue": 5, "pool": 3, "manager": 3, "executor": 5}


@pytest.mark.parametrize("kind", sorted(NO_GUARD))
def test_a_script_without_the_main_guard_stops_at_once_with_one_error(tmp_path, kind: str) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(NO_GUARD[kind]))
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=subprocess_env())  # fmt: skip
    took = time.monotonic() - started
    assert took < 30, f"took {took:.1f} s"
    # Each child that ran the script's top level says so once, naming the line and the fix ...
    children = out.stderr.count("gpushare.MainGuardError: line ")
    assert 1 <= children <= 2, out.stderr
    assert f"line {NO_GUARD_LINE[kind]} of {script}" in out.stderr, out.stderr
    assert 'if __name__ == "__main__":' in out.stderr
    assert "An attempt has been made to start a new process" not in out.stderr  # not multiprocessing's
    assert "the target ran" not in out.stdout
    if kind == "process":  # ... the parent of a Process goes on, and sees the child's exit code
        assert out.returncode == 0, out.stderr
        assert "child exit code 78" in out.stdout
    else:  # ... and a parent that waited for the child fails once, with the same fix
        assert out.returncode != 0
        assert out.stderr.count("Traceback") == 1, out.stderr
        if kind == "executor":
            assert "BrokenProcessPool" in out.stderr
        else:
            assert "MainGuardError: " in out.stderr.split("Traceback")[1]
            assert "stopped at once" in out.stderr


def test_the_main_guard_error_is_a_start_method_error() -> None:
    assert issubclass(mp.MainGuardError, mp.StartMethodError)
    assert issubclass(mp.MainGuardError, RuntimeError)  # what multiprocessing raises there
    assert "MainGuardError" in mp.__all__


# -- 4. a device that is not there ---------------------------------------------------------


def _absent_device() -> int:
    return _cuda.device_count() if _cuda.available() else 0


def test_process_on_a_missing_device_fails_in_the_parent_before_starting() -> None:
    device = _absent_device()
    proc = mp.Process(target=print, args=("the target ran",), device=device)
    with pytest.raises(mp.NoDeviceError, match=rf"cannot start a process on CUDA device {device}") as info:
        proc.start()
    message = str(info.value)
    assert "device='cpu'" in message and "GPUSHARE_BACKEND" not in message
    assert proc.pid is None and proc.exitcode is None  # no child was started
    assert not isinstance(info.value.__cause__, mp.NoDeviceError)  # not chained to itself


def test_the_device_check_of_a_parent_without_cuda_loads_no_driver(tmp_path) -> None:
    """A parent that never used CUDA reads what the kernel driver lists: it stays free to fork."""
    script = tmp_path / "check.py"
    script.write_text(
        textwrap.dedent(
            """
            import gpushare as mp
            from gpushare import _cuda

            if __name__ == "__main__":
                p = mp.Process(target=print, args=("ran",), device=64)  # past any machine's devices
                try:
                    p.start()
                except mp.NoDeviceError as exc:
                    print("refused:", exc)
                else:
                    p.join()
                print("driver loaded:", _cuda.initialized())
                q = mp.get_context("fork").Process(target=print, args=("forked",))
                q.start(); q.join(30)
                print("fork exit code:", q.exitcode)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert out.returncode == 0, out.stderr
    assert "refused: cannot start a process on CUDA device 64" in out.stdout, out.stdout + out.stderr
    assert "driver loaded: False" in out.stdout and "fork exit code: 0" in out.stdout, out.stdout


def test_no_device_error_is_not_chained_to_itself() -> None:
    if _cuda.available():
        pytest.skip("this machine has a GPU")
    errors = []
    for _ in range(2):  # the first load fails; the second raises from what was kept
        with pytest.raises(mp.NoDeviceError) as info:
            _cuda.device_count()
        errors.append(info.value)
    assert str(errors[0]) == str(errors[1])
    for error in errors:
        assert not isinstance(error.__cause__, mp.NoDeviceError)
        assert "GPUSHARE_BACKEND" not in str(error)


def test_a_child_with_other_visible_devices_is_left_to_decide(monkeypatch) -> None:
    try:
        _cuda.device_count()  # the driver loads (or fails to) with this environment
    except mp.NoDeviceError:
        pass
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "") + ",99")
    assert _cuda.child_device_count() is None


# -- 5. messages true in their case --------------------------------------------------------


def test_a_buffer_of_a_shut_down_manager_says_so(reap) -> None:
    jobs, control, out = mp.Queue(), mp.Queue(), mp.Queue()
    proc = start_guarded(reap, w_touch_when_told, out, jobs, control)
    m = mp.Manager(release_timeout=0.3)
    jobs.put(m.full((N,), 1.0, "float32", device="cpu"))
    assert recv(out, proc, timeout=T) == ("holding", float(N))
    with pytest.warns(mp.LeakWarning):
        m.shutdown()
    control.put("go")
    kind, message = recv(out, proc, timeout=T)
    assert kind == "OwnerGoneError", message
    assert "Manager that owns this buffer was shut down" in message
    assert "process that owns this buffer is gone" not in message
    join_ok(proc, timeout=T)


def test_a_buffer_whose_owner_died_says_its_process_is_gone(reap) -> None:
    jobs, out = mp.Queue(), mp.Queue()
    owner = start_guarded(reap, w_own_and_share, out, jobs)
    _, server_pid, socket_dir = recv(out, owner, timeout=T)
    buf = jobs.get(timeout=T)
    try:
        assert float(buf.numpy().sum()) == 3.0 * N
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(T)

        def refused() -> str | None:
            try:
                buf.numpy()
            except mp.OwnerGoneError as exc:
                return str(exc)
            return None

        wait_until(lambda: refused() is not None, timeout=15)
        message = refused()
        assert message is not None and "process that owns this buffer is gone" in message, message
        assert "shut down" not in message
    finally:
        buf.release()
        clean_up_after(owner.pid, server_pid, [socket_dir])


@pytest.mark.parametrize(
    ("shape", "dimension"),
    [((2.5, 3), "dimension 0 is 2.5"), ((2, 3.0), "dimension 1 is 3.0"), ((True, 3), "dimension 0 is True"),
     ((2, np.True_), "dimension 1 is"), (4.0, "dimension 0 is 4.0"), (("2", 3), "dimension 0 is '2'")],
)  # fmt: skip
def test_a_shape_that_is_not_integers_is_refused_naming_the_dimension(manager, shape: Any, dimension: str) -> None:
    with pytest.raises(ValueError, match=rf"{dimension}.*dimensions are integers") as info:
        manager.empty(shape, device="cpu")
    assert "bool" in str(info.value) or "float" in str(info.value) or "str" in str(info.value)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((2, 3), (2, 3)), ([np.int64(2), np.int32(3)], (2, 3)), (np.array([2, 3]), (2, 3)), (np.uint8(6), (6,)),
     (6, (6,)), ((), ())],
)  # fmt: skip
def test_integer_shapes_still_work(manager, shape: Any, expected: tuple[int, ...]) -> None:
    buf = manager.empty(shape, device="cpu")
    assert buf.shape == expected
    buf.release()


def test_a_negative_dimension_is_refused(manager) -> None:
    with pytest.raises(ValueError, match="negative dimension"):
        manager.empty((2, -1), device="cpu")


def test_an_explicit_device_without_a_gpu_names_a_fix_that_works(manager) -> None:
    if _cuda.available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(mp.NoDeviceError, match=r"device=0 asks for CUDA device 0") as info:
        manager.empty((2,), device=0)
    assert "device='cpu'" in str(info.value) and "GPUSHARE_BACKEND" not in str(info.value)
    with pytest.raises(mp.NoDeviceError, match="without backend=") as info:
        manager.empty((2,), backend="cuda_ipc")
    buf = manager.empty((2,), device="cpu")  # what the hints say works
    buf.release()


def test_the_fork_refusal_names_a_call_that_works(monkeypatch) -> None:
    from gpushare import _process

    monkeypatch.setattr(_process, "cuda_initialized", lambda: True)
    with pytest.raises(mp.StartMethodError, match=r"set_start_method\('spawn', force=True\)"):
        mp.get_context("fork").Process(target=print).start()


def test_a_closed_child_does_not_break_a_queue_get(reap) -> None:
    """A process close()d after it ended is skipped when a get() looks for a guard failure."""
    p = mp.Process(target=print, args=("ran",))
    p.start()
    p.join(30)
    p.close()
    q = mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=3 * WATCH_INTERVAL)
