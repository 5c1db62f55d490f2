"""The `make compat` runner's own behaviour (the suite itself runs in `make compat`, not here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from conftest import ROOT, subprocess_env

RUNNER = os.path.join(ROOT, "tests", "compat", "run.py")
_spec = importlib.util.spec_from_file_location("gpushare_compat_run", RUNNER)
assert _spec is not None and _spec.loader is not None
compat_run = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = compat_run  # its dataclasses look their module up there
_spec.loader.exec_module(compat_run)


def test_intended_differences_come_from_docs_with_a_reason() -> None:
    intended = compat_run.intended_differences()
    assert "WithProcessesTestQueue.test_queue_feeder_donot_stop_onexc" in intended
    for test_id, reason in intended.items():
        assert test_id.startswith(("WithProcesses", "WithManager")), test_id
        assert len(reason) > 40, f"{test_id}: the reason must say why a user would want the difference"


def test_without_the_test_package_it_says_so_and_passes(tmp_path) -> None:
    # A `test` package without CPython's suite in it shadows the real one, as on an
    # interpreter whose distribution ships the test suite separately.
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "__init__.py").write_text("")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    out = subprocess.run([sys.executable, RUNNER], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "SKIPPED" in out.stdout and "test._test_multiprocessing" in out.stdout


def test_an_unknown_type_is_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, RUNNER, "--types", "threads"], capture_output=True, text=True, timeout=60, env=subprocess_env()
    )
    assert out.returncode == 2
    assert "unknown type(s) ['threads']; valid: processes, manager" in out.stderr


def test_a_suite_that_cannot_load_fails_the_check(tmp_path) -> None:
    # CPython's suite is there but breaks on import: no test ran, and the check must fail
    # rather than pass by counting nothing.
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "__init__.py").write_text("")
    (tmp_path / "test" / "_test_multiprocessing.py").write_text("raise ImportError('broken on purpose')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    out = subprocess.run(
        [sys.executable, RUNNER, "--types", "manager"], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "broken on purpose" in out.stderr
    assert out.stdout.splitlines()[-1] == "0 passed, 1 failed, 0 skipped"
