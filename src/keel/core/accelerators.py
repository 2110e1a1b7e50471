"""Accelerator catalog: dense peak FLOP/s per dtype, memory, memory bandwidth and the two network tiers,
each with its source.

Figures are dense (no 2:4 sparsity: NVIDIA's "with sparsity" rows are halved), in FLOP/s, bytes and
bytes/s. Sources as compiled in the project's reference table of accelerators (vendor datasheets and
product pages named per entry). Memory: vendors print GiB as "GB" for HBM parts (the reference table's
note; nvidia-smi shows 81,559 MiB on an H100 80GB), so capacities are taken as GiB. Link bandwidths are
one direction per device: `intra_bw` is the scale-up fabric (NVLink, xGMI, ICI; PCIe where there is none),
`inter_bw` the typical scale-out NIC share per device. The scale-up fabric joins `fabric_devices`: the
devices of a node (DGX/HGX: 8), or more than one node's where the fabric spans hosts (a GB200 NVL72 rack's
NVLink switches join 18 hosts of 4 GPUs; a TPU slice's inter-chip interconnect joins hosts of 4 chips in a
torus of up to a pod). A device that matches no entry
has no known peak: MFU is then "unknown" unless the peak is measured or given (`monitor.peak_flops`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from keel.errors import KeelError

T = 1e12
G = 1e9
GIB = 2**30
NDR = 50e9  # 400 Gb/s InfiniBand NDR, one NIC per GPU (DGX H100 / DGX B200 user guides, [ME] network chapter)


@dataclass(frozen=True)
class Accelerator:
    key: str  # short name for `keel plan --hardware`
    name: str
    match: tuple[str, ...]  # lower-case substrings of the device name, all of which must appear
    peak_flops: dict[str, float]  # dense, by dtype: bf16, fp16, fp8, tf32, fp32
    memory_bytes: float
    memory_bw: float  # bytes/s
    intra_bw: float  # bytes/s, one direction, per device, within a node (0: unknown, measure)
    inter_bw: float  # bytes/s, one direction, per device, across nodes (0: unknown, measure)
    devices_per_node: int  # devices of one host: what fails, is spared and is replaced together
    source: str
    # What the memory allocator reserves beyond the peak it has allocated, as a share of that peak: freed
    # blocks it keeps for reuse that do not fit the next request (keel plan --fragmentation).
    fragmentation: float = 0.05
    # The architecture (hopper, ampere, tpu-v4, ...): what figures published per generation, not per part, are
    # looked up by (the planner's compute efficiency and failure rates).
    generation: str = ""
    # Devices one scale-up fabric joins (0: a host's, devices_per_node): collectives within it run at intra_bw.
    fabric_devices: int = 0

    def fabric(self) -> int:
        """Devices one scale-up fabric joins."""
        return max(1, int(self.fabric_devices or self.devices_per_node))


def _nv(bf16: float, fp8: float | None, tf32: float, fp32: float) -> dict[str, float]:
    peaks = {"bf16": bf16 * T, "fp16": bf16 * T, "tf32": tf32 * T, "fp32": fp32 * T}
    if fp8 is not None:
        peaks["fp8"] = fp8 * T
    return peaks


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


# More specific entries first: "h100 pcie" before "h100".
CATALOG: tuple[Accelerator, ...] = (
    # nvidia.com/en-us/data-center/h100, NVL column (sparse 1,671 / 2); NVIDIA H100 NVL datasheet. NVLink
    # bridges join pairs only (600 GB/s bidir); a group wider than 2 talks over PCIe Gen5 x16 (64 GB/s uni).
    Accelerator("h100-nvl", "NVIDIA H100 NVL", ("h100", "nvl"), _nv(835.5, 1670.5, 417.5, 60), 94 * GIB, 3.9e12,
                64 * G, NDR, 8, "NVIDIA H100 product page (NVL column), dense = sparse / 2", generation="hopper"),
    # NVIDIA H100 PCIe product brief PB-11133-001 (sparse 1,513 / 2); PCIe Gen5 x16 128 GB/s bidir. Scale-out:
    # no reference system, one 400 Gb/s NIC per GPU assumed as on DGX H100.
    Accelerator("h100-pcie", "NVIDIA H100 PCIe", ("h100", "pcie"), _nv(756, 1513, 378, 51), 80 * GIB, 2.0e12,
                64 * G, NDR, 8, "NVIDIA H100 PCIe product brief PB-11133-001, dense = sparse / 2", generation="hopper"),
    # nvidia.com/en-us/data-center/h100, SXM column (sparse 1,979 / 2); NVLink 4 900 GB/s bidir via NVSwitch;
    # DGX H100: 8 x ConnectX-7 400 Gb/s.
    Accelerator("h100", "NVIDIA H100 SXM", ("h100",), _nv(989.5, 1979, 494.5, 67), 80 * GIB, 3.35e12,
                450 * G, NDR, 8, "NVIDIA H100 product page (SXM column), dense = sparse / 2; DGX H100 user guide",
                generation="hopper"),
    # H200 NVL: H100 NVL compute, 141 GB, 4.8 TB/s, NVLink bridge 2- or 4-way (nvidia.com/en-us/data-center/h200);
    # a group wider than the bridge talks over PCIe Gen5.
    Accelerator("h200-nvl", "NVIDIA H200 NVL", ("h200", "nvl"), _nv(835.5, 1670.5, 417.5, 60), 141 * GIB, 4.8e12,
                64 * G, NDR, 8, "NVIDIA H200 product page (NVL column)", generation="hopper"),
    # nvidia.com/en-us/data-center/h200: same compute and NVLink 4 as H100 SXM
    Accelerator("h200", "NVIDIA H200 SXM", ("h200",), _nv(989.5, 1979, 494.5, 67), 141 * GIB, 4.8e12,
                450 * G, NDR, 8, "NVIDIA H200 product page (SXM column)", generation="hopper"),
    # NVIDIA Blackwell datasheet, GB200 NVL72 per-GPU column (sparse 5 PF / 2); NVLink 5 1.8 TB/s bidir in one
    # 72-GPU domain of 18 compute trays (hosts) of 4 GPUs; 4 x ConnectX-7 400 Gb/s per tray (DGX GB200 user guide).
    Accelerator("gb200", "NVIDIA GB200", ("gb200",), _nv(2500, 5000, 1250, 80), 186 * GIB, 8.0e12,
                900 * G, NDR, 4, "NVIDIA Blackwell datasheet (GB200 NVL72 per GPU), dense = sparse / 2",
                generation="blackwell", fabric_devices=72),
    # NVIDIA Blackwell datasheet (sparse 4.5 PF / 2; 180 GB usable); NVLink 5; DGX B200: 8 x ConnectX-7 400 Gb/s.
    Accelerator("b200", "NVIDIA B200", ("b200",), _nv(2250, 4500, 1100, 75), 180 * GIB, 7.7e12,
                900 * G, NDR, 8, "NVIDIA Blackwell datasheet (B200), dense = sparse / 2; DGX B200 datasheet",
                generation="blackwell"),
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); NVLink 3 600 GB/s bidir (SXM);
    # DGX A100: 8 x ConnectX-6 HDR 200 Gb/s, one per GPU (DGX A100 datasheet).
    Accelerator("a100-40", "NVIDIA A100 40GB", ("a100", "40gb"), _nv(312, None, 156, 19.5), 40 * GIB, 1.555e12,
                300 * G, 25 * G, 8, "NVIDIA A100 datasheet; DGX A100 datasheet", generation="ampere"),
    Accelerator("a100", "NVIDIA A100 80GB", ("a100",), _nv(312, None, 156, 19.5), 80 * GIB, 2.039e12,
                300 * G, 25 * G, 8, "NVIDIA A100 datasheet; DGX A100 datasheet", generation="ampere"),
    # nvidia.com/en-us/data-center/l40s; L40S datasheet: PCIe Gen4 x16 64 GB/s bidir, no NVLink. Scale-out:
    # AWS g6e.48xlarge, 8 x L40S with 400 Gb/s EFA per instance (50 Gb/s per GPU).
    Accelerator("l40s", "NVIDIA L40S", ("l40s",), _nv(362.05, 733, 183, 91.6), 48 * GIB, 0.864e12,
                32 * G, 6.25 * G, 8, "NVIDIA L40S datasheet; AWS g6e instance page", generation="ada"),
    # amd.com Instinct MI300X / MI325X / MI355X product pages (dense figures). xGMI is a mesh of 7 links: the
    # all-to-all aggregate (448 / 535.5 GB/s uni) is what ring collectives over all 8 GPUs see; one peer pair
    # gets only 64 / 76.5 GB/s. Scale-out: Azure ND MI300X v5, 8 x 400 Gb/s NDR per VM.
    Accelerator("mi355x", "AMD Instinct MI355X", ("mi355x",), {"bf16": 2500 * T, "fp16": 2500 * T,
                                                              "fp8": 5000 * T, "fp32": 157.3 * T},
                288 * GIB, 8.0e12, 535.5 * G, NDR, 8, "AMD Instinct MI355X product page; [ME] network chapter",
                generation="cdna4"),
    Accelerator("mi325x", "AMD Instinct MI325X", ("mi325x",), _nv(1307.4, 2614.9, 653.7, 163.4), 256 * GIB, 6.0e12,
                448 * G, NDR, 8, "AMD Instinct MI325X product page; [ME] network chapter", generation="cdna3"),
    Accelerator("mi300x", "AMD Instinct MI300X", ("mi300x",), _nv(1307.4, 2614.9, 653.7, 163.4), 192 * GIB, 5.3e12,
                448 * G, NDR, 8, "AMD Instinct MI300X product page; [ME] network chapter; Azure ND MI300X v5",
                generation="cdna3"),
    # docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e (bf16 MXU peaks); 4 chips per host VM. ICI is the
    # "intra" fabric of a slice, the data-centre network (DCN) the "inter" one between slices. A slice is at most
    # a pod: 4,096 chips (v4), 8,960 (v5p), 256 (v5e, v6e); a smaller slice is the cluster file's fabric_devices.
    # v4: ICI per chip is not published; 1.1 PB/s all-reduce bandwidth per 4,096-chip pod = 268 GB/s per chip.
    # DCN per chip not published either: v5p's 50 Gb/s assumed.
    Accelerator("tpu-v4", "Google TPU v4", ("tpu v4",), {"bf16": 275 * T}, 32 * GIB, 1.2e12,
                1.1e15 / 4096, 6.25 * G, 4, "Google Cloud TPU v4 docs (all-reduce bandwidth per pod / 4,096)",
                generation="tpu-v4", fabric_devices=4096),
    # v5e: ICI 400 GB/s bidir per chip; DCN 2 x 100 Gb/s NICs per 8 chips.
    Accelerator("tpu-v5e", "Google TPU v5e", ("tpu v5e",), {"bf16": 197 * T}, 16 * GIB, 0.819e12,
                200 * G, 3.125 * G, 4, "Google Cloud TPU v5e docs", generation="tpu-v5e", fabric_devices=256),
    # v5p: 95 GiB, ICI 1,200 GB/s bidir per chip, DCN 50 Gb/s per chip.
    Accelerator("tpu-v5p", "Google TPU v5p", ("tpu v5p",), {"bf16": 459 * T}, 95 * GIB, 2.765e12,
                600 * G, 6.25 * G, 4, "Google Cloud TPU v5p docs", generation="tpu-v5p", fabric_devices=8960),
    # v6e: ICI 800 GB/s bidir per chip; DCN not published, v5p's per-chip figure assumed.
    Accelerator("tpu-v6e", "Google TPU v6e", ("tpu v6e",), {"bf16": 918 * T}, 32 * GIB, 1.638e12,
                400 * G, 6.25 * G, 4, "Google Cloud TPU v6e docs", generation="tpu-v6e", fabric_devices=256),
    # A CPU has no published training peak or bandwidth: they are measured on the machine (matmul probe,
    # STREAM). Memory is this host's DRAM; keel runs up to one process per core on one host.
    Accelerator("cpu", "CPU host", ("cpu",), {}, _host_memory(), 0.0, 0.0, 0.0, os.cpu_count() or 1,
                "this host (os.sysconf); peaks must be measured", generation="cpu"),
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


def by_key(key: str) -> Accelerator:
    """The catalog entry of a short key ("h100", "mi300x", "tpu-v5p", "cpu" ...)."""
    for accelerator in CATALOG:
        if accelerator.key == key.lower():
            return accelerator
    raise KeelError(f"unknown hardware {key!r}: expected one of {', '.join(a.key for a in CATALOG)}")
