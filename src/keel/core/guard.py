"""What a guard is to the training loop (keel.guard.engine asks every guard each step).

A guard answers the step report with an action, or None for nothing to say; it names itself in the actions
it returns (`Action.guard`: the `guard` of the decision's event and the NAME of its `guard/NAME_KIND_total`
counter). Users' guards are callbacks with an `inspect` method, their state kept as callbacks keep theirs.
keel's own guards (registered in keel.guard.registry) keep their state in the guards' state, which is
saved with each checkpoint and each in-memory snapshot and restored by a rollback.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from keel.core.actions import Action
from keel.core.sync import StepReport


@runtime_checkable
class Guard(Protocol):
    def inspect(self, report: StepReport) -> Action | None:
        """After the backward, before the update: the report is the same on every rank, and so must the
        answer be."""
        ...


class BuiltinGuard(Guard, Protocol):
    """A guard of keel's own, its state saved with the run's."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class SignalGuard(Protocol):
    """A built-in guard that also reads the instability signals, on the steps that compute them."""

    def inspect_signals(self, step: int, signals: dict[str, float]) -> Action | None:
        """After the update of `step`, the signals reduced over every rank."""
        ...
