"""A script fed on standard input (``python - <<EOF``), against multiprocessing and gpushare.

multiprocessing's default on Linux (fork) never imports the main module again; gpushare's
spawn does, and a child cannot run ``'<stdin>'`` again. Its children start as from an
interactive session instead: the script's functions and classes travel by value.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import subprocess_env

SCRIPT = """
import importlib, sys
mp = importlib.import_module(sys.argv[1])

def square(x):
    return x * x

class Box:
    def __init__(self, value):
        self.value = value

def boxed(x):
    return Box(x)

if __name__ == "__main__":
    with mp.Pool(2) as pool:
        print(pool.map(square, range(5)), [box.value for box in pool.map(boxed, range(3))])
    q = mp.Queue()
    p = mp.Process(target=q.put, args=(square(7),))
    p.start()
    print(q.get(timeout=30))
    p.join(30)
    print(p.exitcode)
"""


@pytest.mark.parametrize("module", ["multiprocessing", "gpushare"])
def test_a_script_read_from_stdin_starts_workers(module) -> None:
    done = subprocess.run(
        [sys.executable, "-", module],
        input=SCRIPT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["[0, 1, 4, 9, 16] [0, 1, 2]", "49", "0"], done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
