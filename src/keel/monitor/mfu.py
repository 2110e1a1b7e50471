"""The peak FLOP/s that MFU divides by: from the accelerator catalog, measured, or given; and whether the
progress line shows MFU against it.

A peak is shown when it is a peak: the catalog's (the vendor's dense figure) or one given in
monitor.peak_flops. A CPU has no vendor peak, and what its matmul probe measures is not one: it is the rate
one kernel reaches on cores that other work shares (the other processes of the run, anything else on the
machine), so MFU against it swings with the load and says little about the hardware. metrics.jsonl still
records it as throughput/mfu (keel plan --calibrate fits to it); the progress line leaves it out unless
monitor.peak_flops is a number, and the log says so once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from keel.core.accelerators import CPU_NOTE, lookup


def matmul_dtype_name(device: torch.device, dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


@torch.no_grad()
def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """FLOP/s of square matmuls in the training dtype on this process, averaged over all ranks (they
    measure at the same time, as they will train)."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        torch.mm(a, b)
        count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    rate = torch.tensor(2 * n**3 * count / elapsed, dtype=torch.float64, device=device)
    dist.all_reduce(rate)
    return rate.item() / dist.get_world_size()


@dataclass(frozen=True)
class Peak:
    flops: float | None  # per device; None when unknown
    source: str  # where it came from, or why it is unknown
    shown: bool  # the progress line shows MFU against it

    def note(self) -> str:
        """The log's one line about MFU at a start."""
        if self.flops is None:
            return f"MFU unknown: {self.source}"
        if self.shown:
            return f"MFU against {self.source}"
        return (f"MFU is left off the progress line: its peak is {self.source}, a rate one kernel reached on "
                f"shared cores rather than a hardware peak; metrics.jsonl keeps throughput/mfu against it. Set "
                f"monitor.peak_flops to this CPU's peak FLOP/s per process to show MFU")


def resolve_peak_flops(setting: str, device: torch.device, dtype: torch.dtype,
                       measure: Callable[[], float] | None = None) -> Peak:
    """MFU's peak per device. `setting` is monitor.peak_flops: "auto" (catalog; measured on a CPU),
    "measure", or a number; `measure` measures it (by default `measure_peak_flops` now, on every rank
    together)."""
    kind = matmul_dtype_name(device, dtype)
    if setting == "measure" or (setting == "auto" and device.type == "cpu"):
        peak = measure() if measure else measure_peak_flops(device, dtype)
        cpu = device.type == "cpu"
        return Peak(peak, f"measured {peak / 1e12:.3f} TFLOP/s {kind} per process" + (f" ({CPU_NOTE})" if cpu else ""),
                    shown=not cpu)
    if setting != "auto":
        return Peak(float(setting), f"given {float(setting) / 1e12:.3g} TFLOP/s (monitor.peak_flops)", shown=True)
    name = torch.cuda.get_device_name(device)
    accelerator = lookup(name)
    if accelerator is None or kind not in accelerator.peak_flops:
        return Peak(None, f"{name} has no known {kind} peak (set monitor.peak_flops to a number or 'measure')",
                    shown=False)
    peak = accelerator.peak_flops[kind]
    return Peak(peak, f"{accelerator.name} dense {kind} peak {peak / 1e12:.1f} TFLOP/s ({accelerator.source})",
                shown=True)
