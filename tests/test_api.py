"""The public facade: a drop-in multiprocessing namespace plus gpushare's own names."""

from __future__ import annotations

import importlib
import inspect
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


def _sections_missing(function: object) -> list[str]:
    """The numpy-style sections a public callable's docstring lacks: none at all, ``Parameters``
    when it takes named parameters, ``Returns`` (or ``Yields``) when it returns something."""
    doc = inspect.getdoc(function) or ""
    if not doc.strip():
        return ["a docstring"]
    try:
        signature = inspect.signature(function)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: its docstring is enough
        return []
    missing = []
    named = [p for p in signature.parameters.values()
             if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip
    if named and "Parameters\n----------" not in doc:
        missing.append("Parameters")
    returned = signature.return_annotation
    if returned not in (None, "None", "NoReturn", inspect.Signature.empty) and not (
        "Returns\n-------" in doc or "Yields\n------" in doc
    ):
        missing.append("Returns")
    return missing


def _undocumented(cls: type) -> list[str]:
    """The public methods and properties of ``cls`` that gpushare defines, each with what its
    docstring lacks (a property needs a docstring; a method, the sections above)."""
    missing = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        home = next((base for base in cls.__mro__ if name in base.__dict__), None)
        if home is None or not home.__module__.startswith("gpushare"):
            continue  # multiprocessing's, or object's: documented where they come from
        member = home.__dict__[name]
        if isinstance(member, property):
            lacks = [] if (member.__doc__ or "").strip() else ["a docstring"]
        elif isinstance(member, (staticmethod, classmethod)):
            lacks = _sections_missing(member.__func__)
        elif callable(member):
            lacks = _sections_missing(getattr(cls, name))
        else:
            continue
        missing += [f"{cls.__name__}.{name}: {what}" for what in lacks]
    return missing


def test_the_core_classes_document_every_public_member() -> None:
    # The reference (docs/reference/) is made from these docstrings, in the numpy style.
    from gpushare._fanout import Ring

    queue = mp.Queue()
    classes = [mp.Buffer, mp.BufferManager, Ring, mp.TensorSet, mp.Snapshot, mp.SlotLoader, mp.SlotWriter,
               mp.SlotArray, type(queue), type(mp.JoinableQueue()), type(mp.SimpleQueue()), mp.Process]  # fmt: skip
    missing = [name for cls in classes for name in _undocumented(cls)]
    missing += [f"gpushare.{name}: {what}" for name in ("get_context", "prepare_loaders")
                for what in _sections_missing(getattr(mp, name))]  # fmt: skip
    assert not missing, f"public members whose docstrings lack a section: {missing}"


@pytest.mark.parametrize("module", ["gpushare.torch", "gpushare.torch.multiprocessing", "gpushare.ray"])
def test_the_optional_modules_document_every_public_name(module: str) -> None:
    # Their reference pages come from these docstrings too; torch's and Ray's own objects,
    # re-exported, are documented by torch and Ray.
    pytest.importorskip(module.split(".")[1] if module != "gpushare.ray" else "ray")
    namespace = importlib.import_module(module)
    missing = []
    for name in namespace.__all__:
        obj = getattr(namespace, name)
        if not (getattr(obj, "__module__", None) or "").startswith("gpushare"):
            continue
        if inspect.isclass(obj):
            missing += _undocumented(obj)
        elif callable(obj):
            missing += [f"{module}.{name}: {what}" for what in _sections_missing(obj)]
    assert not missing, f"public names whose docstrings lack a section: {missing}"


def test_public_names_read_as_public() -> None:
    # help() and tracebacks name gpushare's objects where users find them, never a private module.
    import pydoc
    import traceback

    for name in set(mp.__all__) - set(multiprocessing.__all__):
        obj = getattr(mp, name)
        if hasattr(obj, "__module__"):
            assert obj.__module__ == "gpushare", f"gpushare.{name} says it comes from {obj.__module__}"
    for name in ("Queue", "JoinableQueue", "SimpleQueue", "Manager", "Pool", "get_context", "Process"):
        obj = getattr(mp, name)
        header = pydoc.render_doc(obj, renderer=pydoc.plaintext).splitlines()[0]  # "... in module gpushare"
        assert "gpushare._" not in header + (obj.__doc__ or ""), (name, header, obj.__doc__)
    assert type(mp.Queue()).__module__ == "gpushare.queues"
    assert type(mp.get_context()).__module__ == "gpushare.context"
    line = traceback.format_exception_only(mp.OwnerGoneError("the creator exited"))[-1]
    assert line.startswith("gpushare.OwnerGoneError: the creator exited"), line
    for cls in (mp.Buffer, mp.Ring, mp.TensorSet, mp.BufferManager):
        for member in vars(cls).values():
            assert "gpushare._" not in (getattr(member, "__doc__", None) or ""), (cls, member)


def test_public_errors_and_queues_pickle_by_their_public_names() -> None:
    # An error raised in a child reaches the parent as gpushare.X; a queue pickled for a child
    # names its private module, so that the child imports nothing more to rebuild it.
    import pickle

    error = pickle.loads(pickle.dumps(mp.DescriptorError("lease expired")))
    assert type(error) is mp.DescriptorError and str(error) == "lease expired"
    assert b"gpushare._errors" not in pickle.dumps(mp.DescriptorError("x"))
    queue = mp.Queue()
    script = textwrap.dedent("""
        import sys
        import gpushare as mp

        def child(q):
            assert "gpushare.queues" not in sys.modules, sorted(m for m in sys.modules if m.startswith("gpushare"))
            q.put(type(q).__module__)

        if __name__ == "__main__":
            for make in (mp.Queue, mp.JoinableQueue):
                q = make()
                p = mp.Process(target=child, args=(q,))
                p.start()
                print(q.get(timeout=60))
                p.join(timeout=60)
                assert p.exitcode == 0, p.exitcode
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=subprocess_env())  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gpushare.queues", "gpushare.queues"]
    del queue
