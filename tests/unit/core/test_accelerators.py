"""The accelerator catalog: every planning key resolves, with both network tiers and a node size, and device
names find their dense peak."""

from __future__ import annotations

import pytest

from keel.core.accelerators import CATALOG, by_key, lookup
from keel.errors import KeelError

PLANNING_KEYS = ("h100", "h100-pcie", "h200", "a100-40", "a100", "b200", "mi300x", "l40s", "tpu-v4", "tpu-v5p", "cpu")


@pytest.mark.parametrize("key", PLANNING_KEYS)
def test_every_planning_key_resolves(key: str) -> None:
    accelerator = by_key(key)
    assert accelerator.key == key and accelerator.source and accelerator.devices_per_node >= 1
    if key != "cpu":  # a CPU's figures are measured on the machine, not catalogued
        assert accelerator.peak_flops["bf16"] > 0 and accelerator.memory_bytes > 0
        assert accelerator.intra_bw > accelerator.inter_bw > 0


def test_keys_are_unique_and_lookup_still_matches_device_names() -> None:
    assert len({a.key for a in CATALOG}) == len(CATALOG)
    assert lookup("NVIDIA H100 80GB HBM3") is by_key("h100")
    assert lookup("NVIDIA H100 PCIe") is by_key("h100-pcie")
    assert lookup("NVIDIA A100-PCIE-40GB") is by_key("a100-40")


def test_figures_follow_the_reference_table() -> None:
    h100, tpu = by_key("h100"), by_key("tpu-v5p")
    assert h100.memory_bytes == 80 * 2**30  # "80GB" HBM is 80 GiB (nvidia-smi: 81,559 MiB)
    assert (h100.intra_bw, h100.inter_bw, h100.devices_per_node) == (450e9, 50e9, 8)  # NVLink 4 uni; NDR 400 Gb/s
    assert (tpu.intra_bw, tpu.devices_per_node) == (600e9, 4)  # ICI 1,200 GB/s bidirectional; 4 chips per host
    assert by_key("H100") is h100


def test_unknown_key_names_the_valid_ones() -> None:
    with pytest.raises(KeelError, match=r"unknown hardware 'v100': expected one of h100-nvl, .*mi300x.*, cpu"):
        by_key("v100")


@pytest.mark.parametrize(("device_name", "expected", "bf16_tflops"), [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989.5),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", "NVIDIA H200 SXM", 989.5),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB", 312),
    ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 40GB", 312),
    ("NVIDIA B200", "NVIDIA B200", 2250),
    ("NVIDIA GB200", "NVIDIA GB200", 2500),
    ("NVIDIA L40S", "NVIDIA L40S", 362.05),
    ("AMD Instinct MI300X", "AMD Instinct MI300X", 1307.4),
])
def test_device_names_find_their_dense_peak(device_name: str, expected: str, bf16_tflops: float) -> None:
    accelerator = lookup(device_name)
    assert accelerator is not None and accelerator.name == expected
    assert accelerator.peak_flops["bf16"] == pytest.approx(bf16_tflops * 1e12)


def test_unknown_device_has_no_peak() -> None:
    assert lookup("NVIDIA GeForce GTX 1080") is None


def test_every_entry_names_its_source_and_is_dense() -> None:
    for accelerator in CATALOG:
        assert accelerator.source
        # Dense FP8 is twice dense BF16 on these parts (L40S's datasheet: 733 against 2 × 362.05).
        if "fp8" in accelerator.peak_flops:
            assert accelerator.peak_flops["fp8"] == pytest.approx(2 * accelerator.peak_flops["bf16"], rel=0.02)
