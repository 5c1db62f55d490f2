"""The Makefile's set-up: the Python it is given is checked, and a .venv left by another one is remade.

Each test runs ``make`` in a copy of the Makefile with a stand-in ``PYTHON`` whose ``-m venv``
fails at once, so nothing is installed: what is checked is what happens before that.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _stand_in(path: Path, version: str | None) -> Path:
    """A PYTHON that reports `version` (default: the real one) and refuses ``-m venv``."""
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"version = {version!r} or '%d.%d' % sys.version_info[:2]\n"
        "args = sys.argv[1:]\n"
        "if args[:2] == ['-m', 'venv']:\n"
        "    sys.exit('stand-in: venv refused')\n"
        "if args[:1] == ['-c'] and 'version_info[:2]' in args[1]:\n"
        "    print(version); sys.exit(0)\n"
        "if args[:1] == ['-c'] and 'version_info < (3, 10)' in args[1]:\n"
        "    sys.exit(tuple(map(int, version.split('.'))) < (3, 10))\n"
        "os.execv(sys.executable, [sys.executable, *args])\n"
    )
    path.chmod(0o755)
    return path


def _prerequisites() -> list[str]:
    """The set-up's prerequisites, as the Makefile's ``$(BASE):`` rule names them (the project's
    metadata and the compiled core's sources), read rather than listed here."""
    for line in (Path(ROOT) / "Makefile").read_text().splitlines():
        if line.startswith("$(BASE):"):
            return line.split(":", 1)[1].split()
    raise AssertionError("the Makefile has no $(BASE): rule")


def _make(tmp_path: Path, python: Path) -> subprocess.CompletedProcess[str]:
    for name in ("Makefile", *_prerequisites()):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(ROOT) / name, tmp_path / name)
    return subprocess.run(
        ["make", "-C", str(tmp_path), "demo", f"PYTHON={python}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_python_older_than_3_10_is_named_with_the_fix(tmp_path: Path) -> None:
    out = _make(tmp_path, _stand_in(tmp_path / "old-python", "3.9"))
    assert out.returncode != 0
    assert "needs Python >= 3.10" in out.stderr and "is 3.9" in out.stderr and "PYTHON=" in out.stderr, out.stderr
    assert "stand-in: venv refused" not in out.stderr  # stopped before making anything


def test_a_venv_made_by_another_python_is_removed_and_made_again(tmp_path: Path) -> None:
    old = tmp_path / ".venv" / "bin"
    old.mkdir(parents=True)
    _stand_in(old / "python", "3.9")  # what a failed first run with Python 3.9 leaves
    out = _make(tmp_path, _stand_in(tmp_path / "python", None))
    assert "was made by another Python" in out.stdout, out.stdout + out.stderr
    assert not (old / "python").exists()  # removed before it is made again
    assert "stand-in: venv refused" in out.stderr  # and then made again (by the stand-in, which refuses)
