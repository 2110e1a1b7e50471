"""The callback contract: how every feature (guards, checkpointing, health, monitoring, evaluation, fault
injectors, users' code) attaches to the training loop.

The loop calls each hook of every registered callback in the order of their declared `priority` (higher
first; equal priorities in registration order) and never knows which callbacks exist. keel's own components
declare theirs on their classes; a configured callback has 0, which runs it after every built-in component
of the step but the watchdog's phases and the step's end mark. The step hooks see the step being made
(`Step`); `after_backward` and `on_step_end` may ask for an `Action`, and the strongest asked wins. Once a
callback asks for an action that ends the step (a rollback, a stop, an exit code), the later callbacks of
that hook are not called for this step.
A callback registered with `every=k` gets `on_step_end` only at steps divisible by k, and at the last.
A callback that keeps state implements `state_dict`/`load_state_dict` and is saved with the run. A
callback with an `inspect(report) -> Action | None` method is also a guard (keel.guard.engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keel.core.actions import CONTINUE, Action, stronger
from keel.core.state import TrainState
from keel.core.sync import StepReport

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Build:
    """What a callback may hold on to from the start: this rank's model parts and optimizers, where the
    run writes, and how it reports."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    rank: int
    world_size: int
    run_dir: Path
    emit: Callable[..., None]  # an event: emit(kind, step, action, **detail)
    say: Callable[[str], None]


@dataclass
class Step:
    """The step being made, as the hooks see it. `number` is 1-based: `state.step` becomes `number` once
    the update is applied."""

    number: int
    state: TrainState
    last: bool  # the run's final step
    lr: float = 0.0
    micro_batches: MicroBatches = field(default_factory=list)
    batch: int = 0  # the global batch number of `micro_batches`
    data_s: float = 0.0  # the wait for the batch
    own_s: float = 0.0  # forward, backward and their hooks, before the step's first reduction
    compute_s: float = 0.0  # forward and backward, until the report
    updated: bool = False  # the update was applied (not skipped, not undone)
    update_s: float = 0.0  # the optimizer's update, or the clearing of the gradients of a skipped step
    loss: torch.Tensor | None = None  # this rank's mean loss (no host synchronisation)
    grad_norm: torch.Tensor | None = None
    report: StepReport | None = None  # the step's one reduction, from `after_backward` on
    action: Action = CONTINUE  # the strongest asked so far
    save_due: bool = False  # a checkpoint of this step will be written (set before the guards' check)
    save_waits: bool = False  # ... and written to the end before the step ends (the last step, before a pause)
    metrics: dict[str, Any] = field(default_factory=dict)  # what this step logs
    # Tallies this rank's forwards made in the step (a mixture of experts' loads, drops and router entropy), which
    # replica groups sum in place across the groups with the gradients' average: a group lost then leaves the step
    # uncommitted.
    tallies: list[torch.Tensor] = field(default_factory=list)


class Callback:
    priority = 0  # hooks run in decreasing priority; a configured callback's place among keel's components

    def on_build(self, build: Build) -> None: ...
    def on_start(self, state: TrainState) -> None: ...
    def before_step(self, state: TrainState) -> None: ...  # before the step is made: it may change the state
    def on_step_start(self, step: Step) -> None: ...  # before the batch is read
    def on_batch(self, step: Step) -> None: ...  # the batch is read, before the forward pass
    # Gradients exist, nothing is reduced yet. Called again after a replay's recomputation.
    def on_backward(self, step: Step, replaying: bool) -> None: ...
    def after_backward(self, step: Step) -> Action | None: ...  # the report is in, the update not applied
    def on_step_end(self, step: Step) -> Action | None: ...  # the update is applied (or skipped)
    # Once the step's hooks have run: the component that carries out the step's action (a rollback, a stop, a
    # pause asked after the stop's turn) does it here; an exit code ends the run.
    def carry_out(self, step: Step) -> int | None: ...
    def on_checkpoint_saved(self, state: TrainState, path: str) -> None: ...
    def on_checkpoint_failed(self, state: TrainState, step: int, error: str) -> None: ...
    # Runs on the checkpoint writer thread, after this rank wrote its files and before the commit.
    def on_checkpoint_write(self, step: int, staging_path: str) -> None: ...
    def on_checkpoint_loaded(self, state: TrainState, path: str) -> None: ...
    def on_eval(self, state: TrainState, val_loss: float) -> None: ...
    def on_end(self, state: TrainState) -> None: ...


class Hooks:
    """The registered callbacks, kept in decreasing priority (stable for equal ones)."""

    def __init__(self) -> None:
        self.callbacks: list[Callback] = []
        self.every: dict[int, int] = {}  # id(callback) -> its on_step_end frequency

    def add(self, callback: Callback, every: int = 1) -> None:
        after = [i for i, cb in enumerate(self.callbacks) if cb.priority >= callback.priority]
        self.callbacks.insert(after[-1] + 1 if after else 0, callback)
        self.every[id(callback)] = max(1, every)

    def notify(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def ask(self, hook: str, step: Step) -> Action:
        """Each callback's answer to `hook`, combined into `step.action`; stops at one that ends the step."""
        for callback in self.callbacks:
            if hook == "on_step_end" and not (step.number % self.every[id(callback)] == 0 or step.last):
                continue
            step.action = stronger(step.action, getattr(callback, hook)(step))
            if step.action.ends_step:
                break
        return step.action

    def carry_out(self, step: Step) -> int | None:
        """What the step's action asks once its hooks have run: the first exit code a component's `carry_out`
        gives, else the code the action itself holds (None: the run goes on)."""
        for callback in self.callbacks:
            if (code := callback.carry_out(step)) is not None:
                return code
        return step.action.exit_code

    def of_type(self, kind: type) -> list[Any]:
        return [cb for cb in self.callbacks if isinstance(cb, kind)]

    def state_dict(self) -> dict:
        return {f"{i}:{type(cb).__name__}": cb.state_dict() for i, cb in enumerate(self.users)
                if hasattr(cb, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for i, cb in enumerate(self.users):
            key = f"{i}:{type(cb).__name__}"
            if hasattr(cb, "load_state_dict") and key in state:
                cb.load_state_dict(state[key])

    @property
    def users(self) -> list[Callback]:
        """The configured callbacks (`[[callbacks]]`): those saved under the train state's `callbacks`."""
        return [cb for cb in self.callbacks if not getattr(cb, "builtin", False)]
