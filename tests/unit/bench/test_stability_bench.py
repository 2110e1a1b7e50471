"""The stability benchmark's LR sensitivity is Wortsman et al.'s: the mean over the grid of the final loss,
capped at the loss at initialisation (a diverged run counts as that), less the best final loss."""

from __future__ import annotations

import pytest

from bench.stability import sensitivity


def test_lr_sensitivity_caps_each_run_at_the_initial_loss_and_subtracts_the_best() -> None:
    runs = [{"first_loss": 5.5, "final_loss": 2.0}, {"first_loss": 5.5, "final_loss": 2.5},
            {"first_loss": 5.5, "final_loss": None}, {"first_loss": 5.5, "final_loss": 7.0}]
    assert sensitivity(runs) == pytest.approx((2.0 + 2.5 + 5.5 + 5.5) / 4 - 2.0)
    assert sensitivity(runs[:1]) == 0.0
