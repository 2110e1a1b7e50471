"""NaN/Inf in the loss or the gradients of any rank: the update is skipped on every rank.

The check reads the step report's non-finite count, which rides on the report's one all-reduce, so
it costs no synchronisation of its own. After `max_consecutive` skips in a row the trouble is in the
state, not in one batch: the guard asks for a rollback past the data that led there.
"""

from __future__ import annotations

from keel.config import GuardConfig
from keel.core.actions import Action
from keel.core.sync import StepReport
from keel.guard.registry import guard


@guard("numerics")
class NumericsGuard:
    name = "numerics"

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.consecutive = 0

    def inspect(self, report: StepReport) -> Action | None:
        if report.finite:
            self.consecutive = 0
            return None
        self.consecutive += 1
        evidence = {"ranks": report.nonfinite_ranks, "loss": report.loss, "grad_norm": report.grad_norm,
                    "consecutive": self.consecutive}
        if self.cfg.numerics.on_nonfinite == "stop":
            return Action("stop", self.name, "non-finite loss or gradients", evidence)
        if self.consecutive >= self.cfg.numerics.max_consecutive:
            return Action("rollback", self.name, f"{self.consecutive} non-finite steps in a row", evidence,
                          to_step=report.step - self.consecutive - self.cfg.rollback_steps + 1,
                          skip_batches=self.cfg.skip_batches, lr_scale=self.cfg.lr_scale,
                          lr_scale_steps=self.cfg.lr_scale_steps)
        return Action("skip", self.name, "non-finite loss or gradients", evidence)

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = state.get("consecutive", 0)
