"""The transfer benchmark's verdict: the widest width's loss at the narrowest width's best grid rate, over its
own best loss, read off keel sweep's series."""

from __future__ import annotations

import math

import pytest

from bench.transfer import markdown, transfer_gap
from keel.sweep.analysis import summarize

LRS = [1e-3 * 2 ** i for i in range(5)]


def series(optima: dict[int, float]) -> dict:
    points = [{"group": "", "settings": {}, "parametrization": "sp", "base_dim": 0, "n_layers": 4,
               "warmup_steps": 15, "tokens": 1, "width": w, "lr": lr, "params": w * w,
               "loss": 2.0 + 0.1 * math.log(lr / best) ** 2, "diverged": False, "initial_loss": 5.5}
              for w, best in optima.items() for lr in LRS]
    (s,) = summarize(points)
    return s


def test_the_gap_is_the_widest_loss_at_the_narrowest_optimum_over_its_best() -> None:
    moving = series({64: 8e-3, 512: 1e-3})
    gap = transfer_gap(moving)
    assert gap["narrow_lr"] == 8e-3 and gap["wide_best_loss"] == pytest.approx(2.0)
    assert gap["gap"] == pytest.approx(0.1 * math.log(8) ** 2 / 2.0)
    assert transfer_gap(series({64: 4e-3, 512: 4e-3}))["gap"] == pytest.approx(0.0)


def test_the_table_shows_both_parametrizations_per_width() -> None:
    results = {"widths": [64, 512], "parametrizations": {
        "sp": {"series": series({64: 8e-3, 512: 1e-3}), "gap": transfer_gap(series({64: 8e-3, 512: 1e-3}))},
        "mup": {"series": series({64: 4e-3, 512: 4e-3}), "gap": transfer_gap(series({64: 4e-3, 512: 4e-3}))}}}
    table = markdown(results)
    assert "| sp | 0.008 | 0.001 (edge) | 8.00× (3.0) | -1.00 | +21.6% |" in table
    assert "| mup, width 512 |" in table and "**2.000**" in table
