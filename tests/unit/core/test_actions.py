"""Guard actions: the strongest of several wins, and only an action with a target step rolls back."""

from __future__ import annotations

import pytest

from keel.core.actions import CONTINUE, KINDS, Action, strongest


def test_strongest_action_wins_and_first_of_equals() -> None:
    skip_a, skip_b = Action("skip", "a"), Action("skip", "b")
    rollback = Action("rollback", "spike", to_step=3)
    assert strongest([None, CONTINUE]) is CONTINUE
    assert strongest([skip_a, rollback, skip_b]) is rollback
    assert strongest([skip_a, skip_b]) is skip_a
    assert strongest([rollback, Action("stop", "x")]).kind == "stop"
    assert [Action(k).severity for k in KINDS] == sorted(Action(k).severity for k in KINDS)
    with pytest.raises(ValueError, match="unknown guard action"):
        Action("explode")


def test_quarantine_rolls_back_only_with_a_target() -> None:
    assert Action("quarantine", ranks=(1,), to_step=5).rolls_back
    assert not Action("quarantine", ranks=(1,)).rolls_back
    assert not Action("skip").rolls_back
