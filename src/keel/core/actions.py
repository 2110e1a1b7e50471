"""What a guard can ask of the loop, and how several requests combine: the strongest wins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Weakest first. `quarantine` rolls back like `rollback` and also records (and may exclude) a rank.
KINDS = ("continue", "skip", "rollback", "quarantine", "stop")


@dataclass(frozen=True)
class Action:
    kind: str = "continue"
    guard: str = ""
    reason: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    # rollback (and quarantine, when set): go back to the newest saved state at or before `to_step` (one
    # that passed a replica or replay check when `verified_only`), then skip `skip_batches` global
    # batches counted from that state and at least through the current one, and scale the learning
    # rate by `lr_scale` for `lr_scale_steps` steps.
    to_step: int | None = None
    verified_only: bool = False
    skip_batches: int = 0
    lr_scale: float = 1.0
    lr_scale_steps: int = 0
    ranks: tuple[int, ...] = ()  # quarantine: the suspect ranks

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown guard action {self.kind!r}; expected one of {', '.join(KINDS)}")

    @property
    def severity(self) -> int:
        return KINDS.index(self.kind)

    @property
    def rolls_back(self) -> bool:
        return self.kind in ("rollback", "quarantine") and self.to_step is not None


CONTINUE = Action()


def strongest(actions: list[Action | None]) -> Action:
    """The most severe action asked for; the first of equals. Every rank computes it from the same inputs."""
    best = CONTINUE
    for action in actions:
        if action is not None and action.severity > best.severity:
            best = action
    return best
