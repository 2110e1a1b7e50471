"""`Trainer.fit` in this process, on a one-process gloo group: the real loop and its built-in components on
the small test corpus, with components defined here asking for a skip, a pause, a rollback or a stop."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import keel
from keel.config import CallbackSpec
from keel.core.actions import Action
from keel.core.callbacks import Build, Callback, Step
from keel.core.state import TrainState
from keel.errors import EXIT_GUARD_STOP, EXIT_PAUSED
from keel.rundir.events import read_jsonl
from keel.rundir.status import read_status
from keel.train.trainer import Trainer
from keel.train.worker import ENDED
from tests.unit.train.conftest import STEPS

HERE = "tests.unit.train.test_trainer"


class Asks(Callback):
    """Asks for `kind` at `hook` of step `at`, the first time that step is made; records what every step
    hook saw: (hook, step number, state.step, batch, the parameters)."""

    def __init__(self, kind: str = "continue", hook: str = "after_backward", at: int = 0, to_step: int | None = None,
                 exit_code: int | None = None) -> None:
        self.asked = Action(kind, "test", f"{kind} asked at {hook}", to_step=to_step, exit_code=exit_code)
        self.hook, self.at, self.done = hook, at, False
        self.seen: list[tuple[str, int, int, int, torch.Tensor]] = []
        self.parts: list[torch.nn.Module] = []

    def on_build(self, build: Build) -> None:
        self.parts = build.parts

    def _see(self, hook: str, step: Step) -> Action | None:
        params = torch.cat([p.detach().flatten().clone() for part in self.parts for p in part.parameters()])
        self.seen.append((hook, step.number, step.state.step, step.batch, params))
        if hook == self.hook and step.number == self.at and not self.done:
            self.done = True
            return self.asked
        return None

    def on_step_start(self, step: Step) -> None:
        self._see("on_step_start", step)

    def after_backward(self, step: Step) -> Action | None:
        return self._see("after_backward", step)

    def on_step_end(self, step: Step) -> Action | None:
        return self._see("on_step_end", step)

    def at_step(self, hook: str, number: int) -> list[tuple[int, int, torch.Tensor]]:
        """(state.step, batch, parameters) each time `hook` of step `number` was called."""
        return [(done, batch, params) for h, n, done, batch, params in self.seen if h == hook and n == number]


class Signals(Callback):
    """Sends this process a real SIGUSR1 (a pause, as `kill -USR1` is) when step `at` starts."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_start(self, step: Step) -> None:
        if step.number == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)


KEEL_SOURCES = str(Path(keel.__file__).parent)
SYNCHRONISING = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class CountsHostSyncs(Callback):
    """Counts, from `before_step` of step `first` to `before_step` of step `first + steps`, the calls of the
    Tensor methods that read a value on the host which keel's own code makes (where each came from).
    The methods are wrapped, not replaced: each call still does what it did."""

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps = first, steps
        self.calls: Counter[str] = Counter()
        self.counting = False
        for name in SYNCHRONISING:
            setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))

    def _counted(self, name: str, method: Callable) -> Callable:
        def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            caller = sys._getframe(1).f_code
            if self.counting and caller.co_filename.startswith(KEEL_SOURCES):
                self.calls[f"{name} in {caller.co_qualname}"] += 1
            return method(tensor, *args, **kwargs)
        return counted

    def before_step(self, state: TrainState) -> None:
        self.counting = self.first <= state.step + 1 < self.first + self.steps


def spec(name: str, **args: object) -> CallbackSpec:
    return CallbackSpec(path=f"{HERE}:{name}", args=args)


@pytest.fixture
def fit(build: Callable[..., Trainer]) -> Callable[..., tuple[int, Trainer]]:
    """Builds a Trainer with `callbacks` and fits it: (exit code, trainer)."""
    def run(callbacks: list[CallbackSpec], *overrides: str) -> tuple[int, Trainer]:
        trainer = build(callbacks, *overrides)
        code = trainer.fit()
        trainer.monitor.close(ENDED.get(code, "failed"))
        return code, trainer

    return run


def users(trainer: Trainer) -> list[Asks]:
    return trainer.hooks.of_type(Asks)


def test_a_skipped_update_leaves_the_parameters_bitwise_and_the_step_counts(fit) -> None:
    code, trainer = fit([spec("Asks", kind="skip", at=3)])
    (asks,) = users(trainer)
    assert code == 0 and trainer.state.step == STEPS
    [(_, _, before)] = asks.at_step("after_backward", 3)
    [(done, _, after)] = asks.at_step("on_step_end", 3)
    assert done == 3, "the skipped step still counts"
    assert torch.equal(before, after), "the skipped update was applied"
    [(_, _, before_4)] = asks.at_step("after_backward", 4)
    [(_, _, after_4)] = asks.at_step("on_step_end", 4)
    assert not torch.equal(before_4, after_4), "the next step's update is applied"
    assert trainer.state.tokens_seen == STEPS * trainer.tokens_per_step


def test_a_rollback_puts_back_the_state_and_the_data_cursor(fit) -> None:
    # Checkpoints every 2 steps: at step 5 the newest state at or before step 2 is step 2's.
    code, trainer = fit([spec("Asks", kind="rollback", at=5, to_step=2)])
    (asks,) = users(trainer)
    assert code == 0 and trainer.state.step == STEPS
    [(done, _, end_of_2)] = asks.at_step("on_step_end", 2)
    [(_, _, first), (again, _, restored)] = asks.at_step("on_step_start", 3)
    assert done == 2 and torch.equal(first, end_of_2)
    assert again == 2 and torch.equal(restored, end_of_2), "the parameters did not go back to step 2's"
    [(_, batch, _), (_, batch_again, _)] = asks.at_step("after_backward", 3)
    assert batch_again == batch, "the data cursor did not go back to step 2's"
    [(done_5, _, _)] = asks.at_step("on_step_end", 5)  # the step rolled back did not end; made again, it did
    assert done_5 == 5
    assert [n for h, n, *_ in asks.seen if h == "on_step_start"] == [1, 2, 3, 4, 5, 3, 4, 5, 6]
    assert trainer.guards.counts["rollbacks"] == 1


def test_a_signal_pauses_with_exit_75_after_a_checkpoint_of_that_step(fit) -> None:
    code, trainer = fit([spec("Signals", at=3), spec("Asks")])
    assert code == EXIT_PAUSED and trainer.state.step == 3
    assert trainer.manager.latest().endswith("step-000003")
    status = read_status(trainer.run_dir)
    assert status["state"] == "paused" and status["reason"] == "SIGUSR1"
    assert [n for h, n, *_ in users(trainer)[0].seen if h == "on_step_start"] == [1, 2, 3]


def test_a_pause_asked_after_the_backward_saves_that_step_and_exits_75(fit) -> None:
    code, trainer = fit([spec("Asks", kind="pause", at=3)])
    assert code == EXIT_PAUSED and trainer.state.step == 3
    assert trainer.manager.latest().endswith("step-000003")
    (asks,) = users(trainer)
    [(_, _, before)] = asks.at_step("after_backward", 3)
    after = torch.cat([p.detach().flatten() for part in trainer.parts for p in part.parameters()])
    assert not torch.equal(before, after), "a pause keeps the step's update"
    # The pause's exit ends the step: the step-end hooks after the one that carried it out are not called.
    assert not asks.at_step("on_step_end", 3)


def test_a_pause_asked_at_the_step_end_saves_that_step_and_exits_75(fit) -> None:
    code, trainer = fit([spec("Asks", kind="pause", hook="on_step_end", at=3)])
    assert code == EXIT_PAUSED and trainer.state.step == 3
    assert trainer.manager.latest().endswith("step-000003")


@pytest.mark.parametrize("exit_code", [None, 9])
def test_a_stop_ends_the_run_with_its_exit_code_and_no_later_hook(fit, exit_code: int | None) -> None:
    code, trainer = fit([spec("Asks", kind="stop", at=4, exit_code=exit_code), spec("Asks")])
    first, later = users(trainer)
    assert code == (EXIT_GUARD_STOP if exit_code is None else exit_code)
    assert trainer.state.step == 3, "the stopped step was counted"
    assert first.at_step("after_backward", 4) and not later.at_step("after_backward", 4)
    assert not first.at_step("on_step_end", 4) and not later.at_step("on_step_end", 4)
    events = [e for e in read_jsonl(trainer.run_dir / "events.jsonl") if e.get("kind") == "finish"]
    assert not events, "a stopped run wrote its finish"


@pytest.mark.parametrize("order", [("skip", "stop"), ("stop", "skip")])
def test_the_stronger_of_two_asked_actions_wins_in_either_order(fit, order: tuple[str, str]) -> None:
    code, trainer = fit([spec("Asks", kind=order[0], at=2), spec("Asks", kind=order[1], at=2)])
    first, second = users(trainer)
    assert code == EXIT_GUARD_STOP and trainer.state.step == 1
    # A stop asked first ends the step there: the second is not asked at all.
    assert bool(second.at_step("after_backward", 2)) == (order[0] == "skip")
    assert not first.at_step("on_step_end", 2) and not second.at_step("on_step_end", 2)


def test_a_steady_state_step_reads_one_value_on_the_host(fit, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SYNCHRONISING:  # put back after the test whatever the counter wraps
        monkeypatch.setattr(torch.Tensor, name, getattr(torch.Tensor, name))
    # Steps 2 to 4 log nothing, save nothing, evaluate and profile nothing; the guards run as configured.
    code, trainer = fit([spec("CountsHostSyncs", first=2, steps=3)], "monitor.interval=100", "checkpoint.interval=100",
                        "monitor.profile_interval=0")
    (counter,) = trainer.hooks.of_type(CountsHostSyncs)
    assert code == 0
    assert counter.calls == {"tolist in StepSync.reduce": 3}, "one host synchronisation a step, the step sync's"
