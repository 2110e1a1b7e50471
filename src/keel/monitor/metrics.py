"""Step timing: what the progress line and metrics.jsonl report about speed."""

from __future__ import annotations

import time


class StepMeter:
    """Wall time per step and data wait, averaged over the steps since the last logged one."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, world_size: int) -> None:
        self.tokens_per_step, self.flops_per_step, self.world_size = tokens_per_step, flops_per_step, world_size
        self._since = time.perf_counter()
        self._steps = 0
        self._data_s = 0.0

    def add_data_wait(self, seconds: float) -> None:
        self._data_s += seconds

    def step_done(self) -> None:
        self._steps += 1

    def window(self) -> dict[str, float]:
        """Averages since the previous call, then start a new window."""
        now = time.perf_counter()
        step_s = (now - self._since) / max(1, self._steps)
        record = {
            "throughput/tokens_per_s": self.tokens_per_step / step_s,
            "throughput/tflops_per_device": self.flops_per_step / step_s / self.world_size / 1e12,
            "time/step_s": step_s,
            "time/data_s": self._data_s / max(1, self._steps),
        }
        self._since, self._steps, self._data_s = now, 0, 0.0
        return record
