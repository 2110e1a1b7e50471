"""When to save: every N steps, every T seconds, or the Young/Daly optimum.

Young (1974) and Daly (2006): with a blocking checkpoint cost δ and a mean time between failures M,
the interval that loses the least time to checkpoints and to recomputation after a failure is
τ = √(2δM)·[1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ for δ < 2M, and τ = M otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keel.config import CheckpointConfig


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's optimum compute time between checkpoints, in seconds."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


@dataclass
class IntervalPolicy:
    """Decides at which steps to save. Every input is a value all ranks share (the step, seconds
    averaged over ranks, the blocking cost reduced over ranks), so every rank decides alike."""

    cfg: CheckpointConfig
    every_s: float = math.inf  # seconds of training between saves (policies seconds and auto)

    def __post_init__(self) -> None:
        if self.cfg.policy == "seconds":
            self.every_s = self.cfg.every_seconds

    def due_by_step(self, step: int) -> bool:
        """policy = steps saves every `interval`; auto takes its first save there too, to measure δ."""
        if self.cfg.policy == "steps" or (self.cfg.policy == "auto" and math.isinf(self.every_s)):
            return step % self.cfg.interval == 0
        return False

    def due_by_time(self, seconds_since_save: float) -> bool:
        return seconds_since_save >= self.every_s

    def update(self, blocking_s: float, train_s: float, interruptions: int) -> dict | None:
        """Re-derive the auto interval from a measured blocking cost; returns the decision and its inputs."""
        if self.cfg.policy != "auto":
            return None
        if interruptions > 0 and train_s > 0:
            mtbf_s, source = train_s / interruptions, f"observed ({interruptions} interruptions)"
        else:
            mtbf_s, source = self.cfg.mtbf_hours * 3600, "checkpoint.mtbf_hours"
        self.every_s = max(daly_interval(blocking_s, mtbf_s), 1e-3)
        return {"policy": "auto", "delta_s": round(blocking_s, 4), "mtbf_s": round(mtbf_s, 1), "mtbf_source": source,
                "interval_s": round(self.every_s, 2)}
