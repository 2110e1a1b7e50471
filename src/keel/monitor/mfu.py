"""The peak FLOP/s that MFU divides by: from the accelerator catalog, measured, or given."""

from __future__ import annotations

import time
from collections.abc import Callable

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


def resolve_peak_flops(setting: str, device: torch.device, dtype: torch.dtype,
                       measure: Callable[[], float] | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None when unknown, where it came from). `setting` is
    monitor.peak_flops: "auto" (catalog; measured on a CPU), "measure", or a number; `measure` measures
    it (by default `measure_peak_flops` now, on every rank together)."""
    kind = matmul_dtype_name(device, dtype)
    if setting == "measure" or (setting == "auto" and device.type == "cpu"):
        peak = measure() if measure else measure_peak_flops(device, dtype)
        return peak, f"measured {peak / 1e12:.3f} TFLOP/s {kind} per process" + \
            (f" ({CPU_NOTE})" if device.type == "cpu" else "")
    if setting != "auto":
        return float(setting), f"given {float(setting) / 1e12:.1f} TFLOP/s (monitor.peak_flops)"
    name = torch.cuda.get_device_name(device)
    accelerator = lookup(name)
    if accelerator is None or kind not in accelerator.peak_flops:
        return None, f"{name}: no known {kind} peak, MFU unknown (set monitor.peak_flops to a number or 'measure')"
    peak = accelerator.peak_flops[kind]
    return peak, f"{accelerator.name} dense {kind} peak {peak / 1e12:.1f} TFLOP/s ({accelerator.source})"
