"""How the hooks combine the actions their callbacks ask for: the strongest wins whatever the order, and
an action that ends the step is the last one asked at that hook."""

from __future__ import annotations

import itertools

import pytest

from keel.core.actions import CONTINUE, Action, stronger
from keel.core.callbacks import Callback, Hooks, Step
from keel.core.state import TrainState

KINDS = ("skip", "pause", "rollback", "stop")  # weakest first
ENDS_STEP = ("rollback", "stop")
HOOKS = ("after_backward", "on_step_end")


class Asks(Callback):
    def __init__(self, kind: str, called: list[str]) -> None:
        self.action = Action(kind, kind, to_step=0 if kind == "rollback" else None)
        self.called = called

    def after_backward(self, step: Step) -> Action:
        self.called.append(self.action.kind)
        return self.action

    def on_step_end(self, step: Step) -> Action:
        return self.after_backward(step)


class Counts(Callback):
    """Asks nothing; counts the step-end hooks it gets."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, step: Step) -> None:
        self.steps.append(step.number)


def step(number: int = 1, last: bool = False) -> Step:
    return Step(number, TrainState(step=number - 1), last=last)


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(KINDS, 2)))
def test_the_strongest_of_two_wins_and_an_ended_step_asks_no_further(hook: str, first: str, second: str) -> None:
    called: list[str] = []
    hooks, later = Hooks(), Asks("skip", [])
    for kind in (first, second):
        hooks.add(Asks(kind, called))
    hooks.add(later)
    made = step()
    action = hooks.ask(hook, made)
    ends = first in ENDS_STEP
    strongest = first if ends else max(first, second, key=KINDS.index)
    assert action.kind == strongest and made.action is action
    assert called == ([first] if ends else [first, second])
    assert later.called == ([] if strongest in ENDS_STEP else ["skip"])


def test_an_exit_code_ends_the_step_and_wins_over_its_equal() -> None:
    paused = Action("pause", exit_code=75)
    assert paused.ends_step and not Action("pause").ends_step
    assert stronger(Action("pause"), paused) is paused
    assert stronger(paused, Action("pause")) is paused
    assert stronger(Action("stop"), paused).kind == "stop"
    assert stronger(CONTINUE, None) is CONTINUE


def test_every_k_gets_the_step_end_at_multiples_of_k_and_at_the_last() -> None:
    hooks, every_3, every_1 = Hooks(), Counts(), Counts()
    hooks.add(every_3, every=3)
    hooks.add(every_1)
    for number in range(1, 8):
        hooks.ask("on_step_end", step(number, last=number == 7))
    assert every_3.steps == [3, 6, 7] and every_1.steps == list(range(1, 8))
    hooks.ask("after_backward", step(4))  # the frequency is the step end's only


def test_only_the_configured_callbacks_are_saved_with_the_callbacks_state() -> None:
    class Kept(Callback):
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, state: dict) -> None:
            self.n = state["n"]

    class Builtin(Kept):
        builtin = True

    hooks, kept = Hooks(), Kept()
    hooks.add(Builtin())
    hooks.add(kept)
    kept.n = 4
    saved = hooks.state_dict()
    assert saved == {"0:Kept": {"n": 4}}
    kept.n = 0
    hooks.load_state_dict(saved)
    assert kept.n == 4
