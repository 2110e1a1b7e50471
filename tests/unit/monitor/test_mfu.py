"""MFU's denominator: catalog peaks picked from the device name, measured on a CPU, never guessed."""

from __future__ import annotations

import pytest
import torch

from keel.core.accelerators import CATALOG, lookup
from keel.monitor.mfu import resolve_peak_flops
from keel.parallel.mesh import destroy_distributed, init_distributed


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


@pytest.fixture
def process_group() -> None:
    init_distributed(torch.device("cpu"))
    yield
    destroy_distributed()


def test_cpu_peak_is_measured_and_plausible(process_group: None) -> None:
    peak, note = resolve_peak_flops("auto", torch.device("cpu"), torch.float32)
    assert peak is not None and 1e8 < peak < 1e13, peak
    assert note.startswith("measured")


def test_given_peak_is_used_as_is(process_group: None) -> None:
    peak, note = resolve_peak_flops("989e12", torch.device("cpu"), torch.float32)
    assert peak == 989e12 and "given" in note


def test_overlapping_collectives_count_once() -> None:
    from keel.monitor.metrics import _covered

    # Two collectives in flight together for 1-3 ms, a third alone at 5-6 ms: 4 ms covered, not 5.
    assert _covered([(0.0, 3000.0), (1000.0, 3000.0), (5000.0, 6000.0)]) == pytest.approx(0.004)
    assert _covered([]) == 0.0
