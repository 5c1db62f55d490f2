"""The suite's timing bounds (``conftest.assert_prompt``): a loaded machine passes, a hang or
a wait-out fails."""

from __future__ import annotations

import conftest
import pytest
from conftest import assert_prompt


def test_a_time_within_the_bound_passes() -> None:
    assert_prompt(0.2, 0.5, "a quick step")


def test_a_hang_fails_however_loaded_the_machine() -> None:
    with pytest.raises(AssertionError, match=r"a stuck step took 60\.00 s: over 0\.5 s"):
        assert_prompt(60.0, 0.5, "a stuck step")


def test_a_loaded_machine_scales_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(conftest, "IDLE_START", 0.0001)  # a child Python's start now looks 100x slower or more
    assert_prompt(3.0, 0.5, "a step on a loaded machine")


def test_the_cap_keeps_a_wait_out_failing(monkeypatch) -> None:
    monkeypatch.setattr(conftest, "IDLE_START", 0.0001)
    with pytest.raises(AssertionError, match=r"over 0\.90 s"):
        assert_prompt(1.0, 0.5, "a step that waited out a 1 s close", cap=0.9)
