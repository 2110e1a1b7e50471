"""What a sweep's numbers say: the optimum (refined between grid points), Wortsman et al.'s LR sensitivity, the
optimum's drift and slope across widths, the transferred learning rate, and the power law in parameters."""

from __future__ import annotations

import math

import pytest

from keel.sweep.analysis import optimum, power_law, recommend, sensitivity, summarize

LRS = [1e-3 * 2 ** i for i in range(6)]


def bowl(lr: float, best: float, floor: float = 2.0) -> float:
    """A loss that is a parabola in log(lr) with its minimum at `best`."""
    return floor + 0.1 * math.log(lr / best) ** 2


def test_the_optimum_is_the_parabola_vertex_between_grid_points() -> None:
    true = 5.3e-3  # between grid points 4e-3 and 8e-3
    result = optimum(LRS, [bowl(lr, true) for lr in LRS])
    assert result is not None
    found, edge = result
    assert found == pytest.approx(true, rel=1e-9) and not edge


def test_an_optimum_at_the_end_of_the_grid_is_flagged_and_diverged_runs_are_skipped() -> None:
    losses: list[float | None] = [bowl(lr, 1e-1) for lr in LRS]
    assert optimum(LRS, losses) == (LRS[-1], True)
    losses = [3.0, 2.5, 2.2, None, None, None]  # the best run's right neighbour diverged: no refinement
    assert optimum(LRS, losses) == (LRS[2], False)
    assert optimum(LRS, [None] * 6) is None


def test_lr_sensitivity_counts_a_diverged_run_as_the_initial_loss() -> None:
    # min(L, L0) over the grid: 2, 3, 5 (diverged -> L0 = 5), 5 (above L0 -> clipped); best 2.
    assert sensitivity([2.0, 3.0, None, 7.0], initial=5.0) == pytest.approx((2 + 3 + 5 + 5) / 4 - 2)
    assert sensitivity([2.0, 2.0], initial=5.0) == 0.0


def points(widths: list[int], best_of: dict[int, float], group: str = "") -> list[dict]:
    return [{"group": group, "settings": {"model.parametrization": group}, "parametrization": group,
             "base_dim": 64, "n_layers": 2, "warmup_steps": 10, "tokens": 10**6, "width": w, "lr": lr,
             "loss": bowl(lr, best_of[w], floor=3.0 / math.log(w)),
             "diverged": False, "params": 1000 * w * w, "initial_loss": 5.5} for w in widths for lr in LRS]


def test_optima_that_fall_as_one_over_width_give_slope_minus_one_and_a_transferred_lr() -> None:
    widths = [64, 128, 256]
    sp = points(widths, {w: 1.6e-2 * 64 / w for w in widths}, group="sp")
    mup = points(widths, {w: 5e-3 for w in widths}, group="mup")
    series = {s["group"]: s for s in summarize(sp + mup)}
    assert series["sp"]["transfer"]["slope"] == pytest.approx(-1.0, abs=1e-6)
    assert series["sp"]["transfer"]["drift"] == pytest.approx(4.0)
    assert series["sp"]["transfer"]["grid_steps"] == pytest.approx(2.0)
    assert recommend(series["sp"], 1024) == pytest.approx(1.6e-2 * 64 / 1024, rel=1e-6)
    assert series["mup"]["transfer"]["slope"] == pytest.approx(0.0, abs=1e-6)
    assert recommend(series["mup"], 1024) == pytest.approx(5e-3, rel=1e-6)
    assert [w["width"] for w in series["mup"]["widths"]] == widths
    assert series["mup"]["settings"] == {"model.parametrization": "mup"} and series["mup"]["base_dim"] == 64


def test_a_power_law_is_recovered_with_zero_residuals() -> None:
    law = power_law([(n, 12.0 * n ** -0.08) for n in (10**5, 10**6, 10**7)])
    assert law is not None
    assert law.exponent == pytest.approx(0.08) and law.coefficient == pytest.approx(12.0)
    assert max(abs(r) for r in law.residuals) < 1e-9
    assert power_law([(10**5, 3.0)]) is None
