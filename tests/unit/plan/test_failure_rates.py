"""Interruption rates by generation, how failures show, and the published runs they are checked against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from keel.config import load_config
from keel.plan.failure_rates import (
    BY_HAND_H,
    PUBLISHED_MIX,
    RUNS,
    TRIAGE_H,
    device_mtbf_hours,
    forecast,
    generation_rate,
    guard_latencies,
)
from keel.plan.report import Question, answer

REPO = Path(__file__).resolve().parents[3]
# The derived goodput of OPT-175B (33 days of compute in 56) also paid for a cluster deleted by its provider,
# loss-scale collapses restarted from earlier checkpoints and a slower start, none of which is published as a
# figure the model could take (docs/planning.md): its forecast misses by more than 10 points.
GOODPUT_MISSES = {"OPT-175B"}


def test_a_generations_rate_is_the_midpoint_of_its_runs_and_every_run_is_within_2x() -> None:
    for generation in ("hopper", "ampere"):
        rates = [r.rate for r in RUNS if r.generation == generation]
        assert len(rates) >= 3
        assert generation_rate(generation) == pytest.approx(math.sqrt(min(rates) * max(rates)))
    for run in RUNS:
        ratio = forecast(run, trials=50)["interruptions"] / run.interruptions
        assert 0.5 <= ratio <= 2.0, f"{run.name}: {ratio:.2f}x its published interruptions"


def test_llama3s_count_and_table_5_give_the_published_mix() -> None:
    assert PUBLISHED_MIX.silent == pytest.approx(6 / 419) and PUBLISHED_MIX.manual == pytest.approx(3 / 419)
    assert PUBLISHED_MIX.hang == pytest.approx(0.0994, abs=1e-4)
    llama3 = next(r for r in RUNS if r.name == "Llama 3 405B")
    assert llama3.rate * 1000 == pytest.approx(0.4736, abs=1e-4)  # per 1,000 GPU-days
    assert round(TRIAGE_H, 2) == 3.46 and round(BY_HAND_H, 2) == 10.39


def test_an_accelerator_takes_its_generations_rate_and_others_every_runs_midpoint() -> None:
    assert device_mtbf_hours("h100") == device_mtbf_hours("h200") == pytest.approx(24 / generation_rate("hopper"))
    assert device_mtbf_hours("a100") == pytest.approx(24 / generation_rate("ampere"))
    every = [r.rate for r in RUNS]
    assert device_mtbf_hours("mi300x") == pytest.approx(24 / math.sqrt(min(every) * max(every)))
    assert device_mtbf_hours("a100") < device_mtbf_hours("mi300x") < device_mtbf_hours("h100")


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_the_goodput_forecast_is_within_10_points_of_what_each_run_published(run) -> None:
    if run.goodput is None or run.name in GOODPUT_MISSES:
        pytest.skip("no published goodput" if run.goodput is None else "a documented miss")
    predicted = forecast(run, trials=200)["goodput"]
    if run.goodput_at_least:  # "over 90%": within 10 points of some figure above it
        assert predicted >= run.goodput - 0.10, f"{run.name}: {predicted:.3f} against > {run.goodput}"
    else:
        assert abs(predicted - run.goodput) <= 0.10, f"{run.name}: {predicted:.3f} against {run.goodput}"


def test_keels_guards_set_the_silent_detection_and_the_rollback_cost() -> None:
    cfg = load_config(REPO / "configs" / "tiny.toml", [])
    silent, rollback = guard_latencies(cfg, step_s=2.0)
    assert silent == (cfg.guard.sdc.replay_interval / 2 + 1) * 2.0
    assert rollback == (cfg.guard.rollback_steps + cfg.guard.snapshot_interval / 2) * 2.0
    off = load_config(REPO / "configs" / "tiny.toml", ["guard.enabled=false"])
    assert guard_latencies(off, step_s=2.0) == (3600.0, 100 * 2.0)


def test_the_plan_takes_the_generations_rate_unless_the_cluster_gives_one() -> None:
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", [])
    h100 = answer(Question(cfg, 64, "h100", 1e11, spares=0, trials=20))["question"]
    a100 = answer(Question(cfg, 64, "a100", 1e11, spares=0, trials=20))["question"]
    given = answer(Question(cfg, 64, "h100", 1e11, spares=0, trials=20, mtbf_hours=5000.0))["question"]
    assert h100["device_mtbf_hours"] == pytest.approx(device_mtbf_hours("h100")) and "Hopper" in h100["mtbf_source"]
    assert a100["device_mtbf_hours"] == pytest.approx(device_mtbf_hours("a100"))
    assert given["device_mtbf_hours"] == 5000.0 and given["mtbf_source"] == "given"
    assert h100["failure_mix"]["hang"] == PUBLISHED_MIX.hang and h100["triage_h"] == pytest.approx(TRIAGE_H)


def test_the_documented_forecasts_are_the_models_own() -> None:
    """bench/results/failure_validation.json, rendered into docs/planning.md, is what the model forecasts now."""
    results = json.loads((REPO / "bench" / "results" / "failure_validation.json").read_text())
    assert [row["run"] for row in results["runs"]] == [run.name for run in RUNS]
    for row, run in zip(results["runs"], RUNS, strict=True):
        planned = forecast(run, trials=results["trials"])
        assert row["interruptions"] == pytest.approx(planned["interruptions"])
        assert row["goodput"] == pytest.approx(planned["goodput"])
        assert row["goodput_own_count"] == pytest.approx(forecast(run, own_rate=True,
                                                                  trials=results["trials"])["goodput"])
