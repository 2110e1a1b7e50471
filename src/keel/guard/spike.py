"""Loss and gradient-norm spikes, found by a robust score over a window of recent steps.

score = (x − median) / (1.4826 · MAD), the MAD floored at `rel_floor` of the median so that a flat
stretch of training does not turn noise into spikes. A step is a spike when its loss or gradient norm
scores above its threshold *and* rises at least `min_rise` above the median. Only steps whose update
was applied enter the window, and detection starts once `warmup` of them are in. On the steps that compute the
instability signals, an attention logit above `attn_logit_threshold` is a spike as well.
"""

from __future__ import annotations

import statistics

from keel.config import GuardConfig
from keel.core.actions import Action
from keel.core.sync import StepReport
from keel.guard.registry import guard

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation
REL_FLOOR = 0.01


def robust_score(history: list[float], x: float) -> tuple[float, float]:
    """(score, median) of `x` against `history`."""
    median = statistics.median(history)
    mad = statistics.median(abs(v - median) for v in history)
    scale = max(MAD_TO_SIGMA * mad, REL_FLOOR * abs(median), 1e-12)
    return (x - median) / scale, median


@guard("spike")
class SpikeGuard:
    name = "spike"

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg, self.spike = cfg, cfg.spike
        self.history: list[list[float]] = []  # [step, loss, grad_norm] of applied updates, oldest first

    def inspect(self, report: StepReport) -> Action | None:
        if self.spike.response == "off" or not report.finite:
            return None
        evidence = self._evidence(report)
        if evidence is None:
            self.history.append([report.step, report.loss, report.grad_norm])
            del self.history[:-self.spike.window]
            return None
        reason = " and ".join(f"{m} {evidence[m]:.4g} scores {evidence[m + '_score']:.1f} over the median "
                              f"{evidence[m + '_median']:.4g}" for m in ("loss", "grad_norm") if m in evidence)
        if self.spike.response == "skip":
            return Action("skip", self.name, reason, evidence)
        return self._respond(report.step, reason, evidence)

    def inspect_signals(self, step: int, signals: dict[str, float]) -> Action | None:
        """After the update of `step`, a sampled step's instability signals (reduced over every rank): an
        attention logit above the threshold is a spike (the loss often follows only later)."""
        threshold = self.spike.attn_logit_threshold
        value = signals.get("signals/attn_logit_max")
        if self.spike.response == "off" or not threshold or value is None or not value > threshold:
            return None
        layers = [k.rsplit("_", 1)[-1] for k, v in signals.items()
                  if k.startswith("signals/attn_logit_max/layer_") and v > threshold]
        reason = (f"the largest attention logit {value:.4g} is above guard.spike.attn_logit_threshold = "
                  f"{threshold:g} (layer {', '.join(layers)})")
        return self._respond(step, reason, {"attn_logit_max": value, "threshold": threshold, "layers": layers})

    def _respond(self, step: int, reason: str, evidence: dict) -> Action:
        if self.spike.response == "log":
            return Action("continue", self.name, reason, evidence)
        return Action("rollback", self.name, reason, evidence, to_step=step - self.cfg.rollback_steps,
                      skip_batches=max(1, self.cfg.skip_batches), lr_scale=self.cfg.lr_scale,
                      lr_scale_steps=self.cfg.lr_scale_steps)

    def _evidence(self, report: StepReport) -> dict | None:
        if len(self.history) < self.spike.warmup:
            return None
        found: dict = {}
        for i, (metric, threshold) in enumerate((("loss", self.spike.loss_threshold),
                                                 ("grad_norm", self.spike.grad_threshold)), start=1):
            x = getattr(report, metric)
            score, median = robust_score([h[i] for h in self.history], x)
            if threshold and score > threshold and x > median * (1 + self.spike.min_rise):
                found.update({metric: x, f"{metric}_score": round(score, 2), f"{metric}_median": median})
        return found or None

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.history = state.get("history", [])
