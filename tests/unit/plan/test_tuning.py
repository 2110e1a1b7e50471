"""`keel plan --sweep`: the learning rate a sweep's transfer line gives at the planned width, for the series of the
planned parametrization only; the warmup as the sweep's share of the run; the power law's loss at the planned
size, marked as an extrapolation with its residuals; a sweep that cannot speak for the plan refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from keel.config import load_config
from keel.errors import KeelError
from keel.plan.report import Question, answer, lines
from keel.sweep.analysis import summarize

LRS = [1e-3 * 2 ** i for i in range(6)]
WIDTHS = [64, 128, 256]


def swept(parametrization: str, optimum: dict[int, float]) -> list[dict]:
    """Points whose loss is a parabola in log(lr) around `optimum[width]`, lower for wider models."""
    return [{"group": f"model.parametrization={parametrization}",
             "settings": {"model.parametrization": parametrization}, "parametrization": parametrization,
             "base_dim": 64 if parametrization == "mup" else 0, "n_layers": 4, "warmup_steps": 20,
             "tokens": 1_638_400, "width": w, "lr": lr,
             "loss": 20.0 * (1000 * w * w) ** -0.1 + 0.1 * math.log(lr / optimum[w]) ** 2, "diverged": False,
             "params": 1000 * w * w, "initial_loss": 5.5} for w in WIDTHS for lr in LRS]


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    points = swept("sp", {w: 1.6e-2 * 64 / w for w in WIDTHS}) + swept("mup", dict.fromkeys(WIDTHS, 4e-3))
    (tmp_path / "sweep.json").write_text(json.dumps({"steps": 200, "complete": True, "series": summarize(points)}))
    return tmp_path


def plan(sweep: Path, *overrides: str) -> dict:
    cfg = load_config(None, ["model.dim=1024", *overrides])
    return answer(Question(cfg, gpus=8, hardware="h100", tokens=1e10, sweep=sweep, trials=20))


def test_the_planned_width_gets_its_series_transferred_learning_rate(sweep_dir: Path) -> None:
    sp = plan(sweep_dir, "model.parametrization=sp")["tuning"]
    assert sp["lr"] == pytest.approx(1.6e-2 * 64 / 1024, rel=1e-6) and sp["transfer"]["slope"] == pytest.approx(-1)
    mup = plan(sweep_dir, "model.parametrization=mup", "model.base_dim=64")
    assert mup["tuning"]["lr"] == pytest.approx(4e-3, rel=1e-6)
    assert mup["tuning"]["warmup_steps"] == round(0.1 * mup["model"]["steps"])  # 20 of the sweep's 200 steps


def test_the_expected_loss_is_the_power_law_at_the_planned_size_marked_as_an_extrapolation(sweep_dir: Path) -> None:
    a = plan(sweep_dir, "model.parametrization=mup", "model.base_dim=64")
    e = a["tuning"]["expected_loss"]
    params = a["model"]["parameters"]
    assert e["fit"]["exponent"] == pytest.approx(0.1) and e["loss"] == pytest.approx(20.0 * params ** -0.1)
    assert e["beyond_largest"] == pytest.approx(params / (1000 * 256 * 256))
    text = "\n".join(lines(a))
    assert "learning rate 0.004 at width 1024" in text and "EXTRAPOLATION" in text and "residuals +0.000" in text
    assert "layers, the planned one" not in text  # the same depth


@pytest.mark.parametrize(("overrides", "expect"), [
    (("model.parametrization=mup", "model.base_dim=128"), "transfers only under the same"),
])
def test_a_sweep_of_another_parametrization_or_base_width_is_refused(sweep_dir: Path, overrides: tuple[str, ...],
                                                                       expect: str) -> None:
    with pytest.raises(KeelError, match=expect):
        plan(sweep_dir, *overrides)


def test_a_directory_without_a_sweep_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeelError, match="no sweep.json there"):
        plan(tmp_path)
