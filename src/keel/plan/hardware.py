"""Accelerator catalog: dense peak FLOP/s per dtype, memory and bandwidth, each with its source.

Figures are dense (no 2:4 sparsity: NVIDIA's "with sparsity" rows are halved), in FLOP/s, bytes and
bytes/s. Sources as compiled in the project's reference table of accelerators (vendor datasheets and
product pages named per entry). A device that matches no entry has no known peak: MFU is then
"unknown" unless the peak is measured or given (`monitor.peak_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass

T = 1e12


@dataclass(frozen=True)
class Accelerator:
    name: str
    match: tuple[str, ...]  # lower-case substrings of the device name, all of which must appear
    peak_flops: dict[str, float]  # dense, by dtype: bf16, fp16, fp8, tf32, fp32
    memory_bytes: float
    memory_bw: float  # bytes/s
    source: str


def _nv(bf16: float, fp8: float | None, tf32: float, fp32: float) -> dict[str, float]:
    peaks = {"bf16": bf16 * T, "fp16": bf16 * T, "tf32": tf32 * T, "fp32": fp32 * T}
    if fp8 is not None:
        peaks["fp8"] = fp8 * T
    return peaks


# More specific entries first: "h100 pcie" before "h100".
CATALOG: tuple[Accelerator, ...] = (
    # nvidia.com/en-us/data-center/h100, NVL column (sparse 1,671 / 2); NVIDIA H100 NVL datasheet
    Accelerator("NVIDIA H100 NVL", ("h100", "nvl"), _nv(835.5, 1670.5, 417.5, 60), 94e9, 3.9e12,
                "NVIDIA H100 product page (NVL column), dense = sparse / 2"),
    # NVIDIA H100 PCIe product brief PB-11133-001 (sparse 1,513 / 2)
    Accelerator("NVIDIA H100 PCIe", ("h100", "pcie"), _nv(756, 1513, 378, 51), 80e9, 2.0e12,
                "NVIDIA H100 PCIe product brief PB-11133-001, dense = sparse / 2"),
    # nvidia.com/en-us/data-center/h100, SXM column (sparse 1,979 / 2)
    Accelerator("NVIDIA H100 SXM", ("h100",), _nv(989.5, 1979, 494.5, 67), 80e9, 3.35e12,
                "NVIDIA H100 product page (SXM column), dense = sparse / 2"),
    # H200 NVL: H100 NVL compute, 141 GB, 4.8 TB/s (nvidia.com/en-us/data-center/h200)
    Accelerator("NVIDIA H200 NVL", ("h200", "nvl"), _nv(835.5, 1670.5, 417.5, 60), 141e9, 4.8e12,
                "NVIDIA H200 product page (NVL column)"),
    # nvidia.com/en-us/data-center/h200: same compute as H100 SXM
    Accelerator("NVIDIA H200 SXM", ("h200",), _nv(989.5, 1979, 494.5, 67), 141e9, 4.8e12,
                "NVIDIA H200 product page (SXM column)"),
    # NVIDIA Blackwell datasheet, GB200 NVL72 per-GPU column (sparse 5 PF / 2)
    Accelerator("NVIDIA GB200", ("gb200",), _nv(2500, 5000, 1250, 80), 186e9, 8.0e12,
                "NVIDIA Blackwell datasheet (GB200 NVL72 per GPU), dense = sparse / 2"),
    # NVIDIA Blackwell datasheet (sparse 4.5 PF / 2)
    Accelerator("NVIDIA B200", ("b200",), _nv(2250, 4500, 1100, 75), 180e9, 7.7e12,
                "NVIDIA Blackwell datasheet (B200), dense = sparse / 2"),
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)
    Accelerator("NVIDIA A100 40GB", ("a100", "40gb"), _nv(312, None, 156, 19.5), 40e9, 1.555e12,
                "NVIDIA A100 datasheet"),
    Accelerator("NVIDIA A100 80GB", ("a100",), _nv(312, None, 156, 19.5), 80e9, 2.039e12,
                "NVIDIA A100 datasheet"),
    # nvidia.com/en-us/data-center/l40s; L40S datasheet
    Accelerator("NVIDIA L40S", ("l40s",), _nv(362.05, 733, 183, 91.6), 48e9, 0.864e12, "NVIDIA L40S datasheet"),
    # amd.com Instinct MI300X / MI325X / MI355X product pages (dense figures)
    Accelerator("AMD Instinct MI355X", ("mi355x",), {"bf16": 2500 * T, "fp16": 2500 * T, "fp8": 5000 * T,
                                                     "fp32": 157.3 * T}, 288e9, 8.0e12,
                "AMD Instinct MI355X product page"),
    Accelerator("AMD Instinct MI325X", ("mi325x",), _nv(1307.4, 2614.9, 653.7, 163.4), 256e9, 6.0e12,
                "AMD Instinct MI325X product page"),
    Accelerator("AMD Instinct MI300X", ("mi300x",), _nv(1307.4, 2614.9, 653.7, 163.4), 192e9, 5.3e12,
                "AMD Instinct MI300X product page"),
    # docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e (bf16 MXU peaks)
    Accelerator("Google TPU v4", ("tpu v4",), {"bf16": 275 * T}, 32 * 2**30, 1.2e12, "Google Cloud TPU v4 docs"),
    Accelerator("Google TPU v5e", ("tpu v5e",), {"bf16": 197 * T}, 16e9, 0.819e12, "Google Cloud TPU v5e docs"),
    Accelerator("Google TPU v5p", ("tpu v5p",), {"bf16": 459 * T}, 95e9, 2.765e12, "Google Cloud TPU v5p docs"),
    Accelerator("Google TPU v6e", ("tpu v6e",), {"bf16": 918 * T}, 32e9, 1.638e12, "Google Cloud TPU v6e docs"),
)

# A CPU has no published training peak: it is measured on the machine (see `measure_peak_flops`).
CPU_NOTE = "CPU: no vendor peak; measured with a matmul probe"


def lookup(device_name: str) -> Accelerator | None:
    """The catalog entry of a device name as CUDA/ROCm report it, or None if unknown."""
    name = device_name.lower()
    for accelerator in CATALOG:
        if all(part in name for part in accelerator.match):
            return accelerator
    return None
