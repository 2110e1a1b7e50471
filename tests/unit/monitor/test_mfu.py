"""MFU's denominator: measured on a CPU or given, never guessed; collectives in flight together count once."""

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
