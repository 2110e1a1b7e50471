"""The metrics of a run: a registry of per-step values reduced across ranks every `monitor.interval`
steps, step timing, and the time spent in collectives."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import psutil
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

REDUCE_OPS = ("mean", "max", "sum")


class MetricsRegistry:
    """Namespaced values (`time/data_s`, `memory/peak_bytes`) that each rank adds every step, reduced
    across steps and ranks only when asked (every `monitor.interval` steps). Tensors stay on their
    device and accumulate there: adding one costs no host synchronisation. A reduction is one
    all-reduce per reduce type and one copy to the host for all metrics together.

    Every rank must add the same names the same number of times between two reductions (they take the
    same branches), so that the reduced vectors line up."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ops: dict[str, str] = {}
        self._counts: dict[str, int] = {}
        self._host: dict[str, float] = {}
        self._device: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: float | torch.Tensor, reduce: str = "mean") -> None:
        if reduce not in REDUCE_OPS:
            raise ValueError(f"metric {name}: reduce {reduce!r} is not one of {', '.join(REDUCE_OPS)}")
        self._ops[name] = reduce
        self._counts[name] = self._counts.get(name, 0) + 1
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to(torch.float64).reshape(())
            on_device = self._device.get(name)
            if on_device is not None:
                tensor = torch.maximum(on_device, tensor) if reduce == "max" else on_device + tensor
            self._device[name] = tensor
        else:
            number = float(value)
            on_host = self._host.get(name)
            if on_host is not None:
                number = max(on_host, number) if reduce == "max" else on_host + number
            self._host[name] = number

    def reduce(self) -> dict[str, float]:
        """Mean (over steps and ranks), max or sum of every metric added since the last call."""
        names = sorted(self._ops)
        if not names:
            return {}
        world = dist.get_world_size() if dist.is_initialized() else 1
        host = torch.tensor([self._host.get(n, 0.0) for n in names], dtype=torch.float64)
        values = host.to(self.device) + torch.stack(
            [self._device.get(n, torch.zeros((), dtype=torch.float64, device=self.device)) for n in names])
        is_max = torch.tensor([self._ops[n] == "max" for n in names], device=self.device)
        if world > 1:
            summed, biggest = values.clone(), values.clone()
            dist.all_reduce(summed)
            if any(self._ops[n] == "max" for n in names):  # the same names on every rank: the same branch
                dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
            values = torch.where(is_max, biggest, summed)
        out = {}
        for name, value in zip(names, values.tolist(), strict=True):
            out[name] = value / (self._counts[name] * world) if self._ops[name] == "mean" else value
        self._ops, self._counts, self._host, self._device = {}, {}, {}, {}
        return out


class StepMeter:
    """Wall time per step and data wait, averaged over the steps since the last logged one."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, world_size: int,
                 peak_flops: float | None = None) -> None:
        self.tokens_per_step, self.flops_per_step, self.world_size = tokens_per_step, flops_per_step, world_size
        self.peak_flops = peak_flops  # per device; None when unknown
        self._since = time.perf_counter()
        self._steps = 0
        self._data_s = 0.0

    def restart(self) -> None:
        """The loop begins: the first window starts here, not at set-up."""
        self._since, self._steps, self._data_s = time.perf_counter(), 0, 0.0

    def add_data_wait(self, seconds: float) -> None:
        self._data_s += seconds

    def step_done(self) -> None:
        self._steps += 1

    def window(self) -> dict[str, float | None]:
        """Averages since the previous call, then start a new window."""
        now = time.perf_counter()
        step_s = (now - self._since) / max(1, self._steps)
        flops_per_device = self.flops_per_step / step_s / self.world_size
        mfu = flops_per_device / self.peak_flops if self.peak_flops else None
        record = {
            "throughput/tokens_per_s": self.tokens_per_step / step_s,
            "throughput/tflops_per_device": flops_per_device / 1e12,
            # Above 1, the peak is wrong (a CPU's matmul probe measured while other work shared the cores):
            # no MFU rather than an impossible one.
            "throughput/mfu": mfu if mfu is None or mfu <= 1 else None,
            "time/step_s": step_s,
            "time/data_s": self._data_s / max(1, self._steps),
        }
        self._since, self._steps, self._data_s = now, 0, 0.0
        return record


class CommProfiler:
    """Every `interval` steps (0: never) one step runs under the PyTorch profiler; the wall time during
    which collectives were in flight (gloo or NCCL, pipeline send/recv included) and during which a
    stage waited to receive from a neighbour (the exposed bubble plus the transfer) become
    `time/comm_s` and `time/pp_wait_s`, and their shares of that step; the all-to-all exchanges of expert
    parallelism's dispatch and combine, among the collectives, `time/all_to_all_s`. A profiled step costs many
    times an unprofiled one, so no other feature depends on it."""

    def __init__(self, interval: int, device_type: str) -> None:
        self.interval, self.device_type = interval, device_type
        self.last: dict[str, float] = {}

    def profile(self, step: int) -> AbstractContextManager:
        """Context for the step about to run (`step` counts from 1)."""
        return self._profiled() if self.interval and step % self.interval == 0 else nullcontext()

    @contextmanager
    def _profiled(self) -> Iterator[None]:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            yield
        step_s = time.perf_counter() - start
        comm: list[tuple[float, float]] = []
        wait: list[tuple[float, float]] = []
        exchange: list[tuple[float, float]] = []
        for event in prof.events():
            name = event.name.lower()
            if name.startswith("gloo:") or (self.device_type == "cuda" and "nccl" in name):
                span = (event.time_range.start, event.time_range.end)
                comm.append(span)
                if "recv" in name:
                    wait.append(span)
                if "all_to_all" in name or "alltoall" in name:
                    exchange.append(span)
        comm_s, wait_s, exchange_s = covered(comm), covered(wait), covered(exchange)
        self.last = {"time/comm_s": comm_s, "time/comm_share": comm_s / step_s, "time/pp_wait_s": wait_s,
                     "time/pp_wait_share": wait_s / step_s, "time/all_to_all_s": exchange_s,
                     "time/all_to_all_share": exchange_s / step_s}


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds of wall time covered by the (start, end) microsecond spans: overlapping collectives
    (several in flight at once) count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


class MemoryMeter:
    """This rank's peak memory (`peak_memory`), and the part of it above what the rank held before its
    model was built: on a CPU the runtime (interpreter, libraries, communicators) is in the resident set,
    and the rest is what `keel.plan.memory` predicts. Made before the model is."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.runtime = torch.cuda.memory_allocated(device) if cuda else psutil.Process().memory_info().rss

    def peaks(self) -> tuple[int, int]:
        """(peak, peak above the runtime), in bytes."""
        peak = peak_memory(self.device)
        return peak, peak - self.runtime


def peak_memory(device: torch.device) -> int:
    """This rank's peak memory: CUDA memory allocated by tensors on a GPU, the process's peak resident
    set (runtime included) on a CPU. The registry reduces it to the largest of any rank."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
