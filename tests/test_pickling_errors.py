"""Only what multiprocessing pickles travels: for objects no pickler carries, gpushare raises
the stdlib's own error (cloudpickle serves functions, lambdas, closures and classes of the
main module, not a copy of an open file)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import subprocess_env

SCRIPT = """
import importlib, io, json, sys, tempfile, threading
mp = importlib.import_module(sys.argv[1])

def generator():
    yield 1

def objects():
    handle = tempfile.TemporaryFile("w+")
    return {
        "text file": handle,
        "binary file": open(sys.executable, "rb"),
        "lock": threading.Lock(),
        "generator": generator(),
        "module": json,
        "memoryview": memoryview(b"abc"),
        "StringIO": io.StringIO("kept"),
    }

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    answers = {}
    for name, obj in objects().items():
        try:
            p = ctx.Process(target=print, args=(obj,))
            p.start()
            p.join(30)
            answers[name] = ["started", p.exitcode]
        except Exception as exc:
            answers[name] = [type(exc).__name__, str(exc)]
    if sys.argv[1] == "gpushare":  # a Queue's put() pickles in the caller: the same error there
        q = mp.Queue()
        for name, obj in objects().items():
            try:
                q.put(obj)
                answers["put " + name] = ["put"]
            except Exception as exc:
                answers["put " + name] = [type(exc).__name__, str(exc)]
    print(json.dumps(answers))
"""


def _answers(module: str) -> dict[str, list[object]]:
    import json

    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, module], env=subprocess_env(), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(300)
def test_objects_multiprocessing_cannot_pickle_raise_its_own_error() -> None:
    stdlib, ours = _answers("multiprocessing"), _answers("gpushare")
    for name, answer in stdlib.items():
        assert ours[name] == answer, name
        if name != "StringIO":
            assert answer[0] == "TypeError", (name, answer)
            assert ours["put " + name] == answer, name
    assert ours["put StringIO"] == ["put"]
