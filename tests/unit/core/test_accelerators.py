"""The accelerator catalog: every planning key resolves, with both network tiers and a node size."""

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
