"""Step timing and communication time: what the progress line and metrics.jsonl report about speed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from torch.profiler import ProfilerActivity, profile


class StepMeter:
    """Wall time per step and data wait, averaged over the steps since the last logged one."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, world_size: int,
                 peak_flops: float | None = None) -> None:
        self.tokens_per_step, self.flops_per_step, self.world_size = tokens_per_step, flops_per_step, world_size
        self.peak_flops = peak_flops  # per device; None when unknown
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
        flops_per_device = self.flops_per_step / step_s / self.world_size
        record = {
            "throughput/tokens_per_s": self.tokens_per_step / step_s,
            "throughput/tflops_per_device": flops_per_device / 1e12,
            "throughput/mfu": flops_per_device / self.peak_flops if self.peak_flops else None,
            "time/step_s": step_s,
            "time/data_s": self._data_s / max(1, self._steps),
        }
        self._since, self._steps, self._data_s = now, 0, 0.0
        return record


class CommProfiler:
    """Every `interval` steps one step runs under the PyTorch profiler; the time its collectives
    took (gloo or NCCL, pipeline send/recv included) and the time pipeline stages waited to receive
    from a neighbour (the exposed bubble plus the transfer) become `time/comm_s` and `time/pp_wait_s`."""

    def __init__(self, interval: int, device_type: str) -> None:
        self.interval, self.device_type = interval, device_type
        self.last: dict[str, float] = {}

    def profile(self, step: int) -> AbstractContextManager:
        """Context for the step about to run (`step` counts from 1)."""
        if not self.interval or step % self.interval:
            return nullcontext()
        return self._profiled()

    @contextmanager
    def _profiled(self) -> Iterator[None]:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            yield
        step_s = time.perf_counter() - start
        comm = wait = 0.0
        for event in prof.events():
            name = event.name.lower()
            on_device = self.device_type == "cuda" and "nccl" in name and event.device_time_total > 0
            if name.startswith("gloo:") or on_device:
                seconds = (event.device_time_total if on_device else event.cpu_time_total) / 1e6
                comm += seconds
                if "recv" in name:
                    wait += seconds
        self.last = {"time/comm_s": comm, "time/comm_share": comm / step_s, "time/pp_wait_s": wait}
