"""What a component can ask of the training loop, and how several requests combine: the strongest wins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Weakest first. `skip`: no update this step. `pause`: save and end the run for a later resume.
# `retry`: the step is made again from the same batch (the replica groups did not commit it).
# `quarantine` rolls back like `rollback` and also records (and may exclude) a rank.
KINDS = ("continue", "skip", "pause", "retry", "rollback", "quarantine", "stop")


@dataclass(frozen=True)
class Action:
    kind: str = "continue"
    guard: str = ""
    reason: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    # rollback (and quarantine, when set): go back to the newest saved state at or before `to_step` (one
    # that passed a replica or replay check when `verified_only`), then skip `skip_batches` global
    # batches counted from that state and at least through the current one, and scale the learning
    # rate by `lr_scale` for `lr_scale_steps` steps. A stop with `to_step` abandons the steps after it (their
    # checkpoints are retired).
    to_step: int | None = None
    verified_only: bool = False
    skip_batches: int = 0
    lr_scale: float = 1.0
    lr_scale_steps: int = 0
    ranks: tuple[int, ...] = ()  # quarantine: the suspect ranks
    exit_code: int | None = None  # the run ends now with this code (set once what the action asks is done)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown guard action {self.kind!r}; expected one of {', '.join(KINDS)}")

    @property
    def severity(self) -> int:
        return KINDS.index(self.kind)

    @property
    def rolls_back(self) -> bool:
        return self.kind in ("rollback", "quarantine") and self.to_step is not None

    @property
    def updates(self) -> bool:
        """Whether the step's update is applied: not when it is skipped or undone."""
        return self.kind in ("continue", "pause")

    @property
    def ends_step(self) -> bool:
        """Whether the rest of the step is abandoned: it is made again, rolled back, or the run ends."""
        return self.exit_code is not None or self.kind in ("stop", "retry") or self.rolls_back

    @property
    def carried_out(self) -> bool:
        """Whether the loop must carry the action out (a skip is the update's, a pause the stop's)."""
        return self.kind in ("rollback", "quarantine", "stop")


CONTINUE = Action()


def stronger(current: Action, asked: Action | None) -> Action:
    """`asked` when it is more severe than `current`, or as severe and ends the run with a code (the
    component that carried out `current` says how the run ends); `current` otherwise."""
    if asked is None:
        return current
    if asked.severity > current.severity or (asked.severity == current.severity and asked.exit_code is not None
                                              and current.exit_code is None):
        return asked
    return current


def strongest(actions: list[Action | None]) -> Action:
    """The most severe action asked for; the first of equals. Every rank computes it from the same inputs."""
    best = CONTINUE
    for action in actions:
        best = stronger(best, action)
    return best
