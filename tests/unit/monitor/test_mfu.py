"""MFU's denominator: measured on a CPU or given, never guessed, and shown only when it is a peak; collectives in
flight together count once."""

from __future__ import annotations

import pytest
import torch

from keel.monitor.mfu import resolve_peak_flops
from keel.parallel.mesh import destroy_distributed, init_distributed


@pytest.fixture
def process_group() -> None:
    init_distributed(torch.device("cpu"))
    yield
    destroy_distributed()


def test_cpu_peak_is_measured_and_plausible_but_not_shown(process_group: None) -> None:
    for setting in ("auto", "measure"):
        peak = resolve_peak_flops(setting, torch.device("cpu"), torch.float32)
        assert peak.flops is not None and 1e8 < peak.flops < 1e13, peak
        assert peak.source.startswith("measured") and not peak.shown
        assert peak.note().startswith("MFU is left off the progress line") and "monitor.peak_flops" in peak.note()


def test_given_peak_is_used_as_is_and_shown(process_group: None) -> None:
    peak = resolve_peak_flops("989e12", torch.device("cpu"), torch.float32)
    assert peak.flops == 989e12 and "given" in peak.source and peak.shown
    assert peak.note() == "MFU against given 989 TFLOP/s (monitor.peak_flops)"


def test_overlapping_collectives_count_once() -> None:
    from keel.monitor.metrics import covered

    # Two collectives in flight together for 1-3 ms, a third alone at 5-6 ms: 4 ms covered, not 5.
    assert covered([(0.0, 3000.0), (1000.0, 3000.0), (5000.0, 6000.0)]) == pytest.approx(0.004)
    assert covered([]) == 0.0
