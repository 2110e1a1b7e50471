"""The throughput planner against the published runs of bench/published_runs.toml: the set is broad enough, each
run is consistent, the errors are no worse than docs/planning.md reports, and the generated table is current."""

from __future__ import annotations

import json

import pytest

from bench.plan_validation import RESULTS, fit, load, predict, runs, summary, validate
from keel.plan.throughput import GENERATIONS

# What docs/planning.md ("Held-out published runs") reports, rounded up to the next percent: the planner may
# get better, not worse. Left out: each run predicted with its generation's efficiency fitted to the others.
MEDIAN_ABS_ERROR = 0.08
MAX_ABS_ERROR = 1.34
WITHIN_10 = 48
WITHIN_25 = 71
LEFT_OUT_MEDIAN_ABS_ERROR = 0.09


@pytest.fixture(scope="module")
def published() -> list:
    return runs()


def test_the_set_spans_at_least_30_runs_from_6_sources(published: list) -> None:
    data = load()
    assert len(published) >= 30
    assert len({run.source for run in published}) >= 6
    assert {run.source for run in published} <= set(data["sources"])
    assert {run.work.software for run in published} == {"eager", "compiled", "transformer-engine",
                                                         "unfused-attention", "selective-recompute"}
    assert {run.hw.key for run in published} >= {"h100", "a100", "tpu-v4", "b200"}
    assert any(run.work.experts for run in published) and any(run.work.fp8 for run in published)


def test_every_layout_multiplies_to_its_device_count_and_splits_the_batch(published: list) -> None:
    for run in published:
        lay = run.layout
        assert lay.gpus() == run.devices, run.name
        assert run.work.global_batch % (lay.dp() * lay.micro_batch) == 0, run.name
        assert run.work.model.n_layers >= lay.pp * lay.v, run.name
        assert run.published > 0 and run.quantity in ("tokens_per_s", "mfu", "hfu", "model_tflops",
                                                      "hardware_tflops"), run.name


def test_the_errors_are_no_worse_than_documented(published: list) -> None:
    rows = [{"error": predict(run) / run.published - 1, "rank": 0} for run in published]
    s = summary(rows)
    assert s["median_abs_error"] <= MEDIAN_ABS_ERROR
    assert s["max_abs_error"] <= MAX_ABS_ERROR
    assert s["within_10"] >= WITHIN_10 and s["within_25"] >= WITHIN_25
    left_out = validate(with_rank=False)["held_out"]
    assert left_out["median_abs_error"] <= LEFT_OUT_MEDIAN_ABS_ERROR


def test_each_generations_efficiency_is_the_median_of_its_runs(published: list) -> None:
    """The one figure fitted per generation (keel.plan.throughput.GENERATIONS): its median run predicted exactly,
    as bench.plan_validation.fit finds it now."""
    fitted = fit(published)
    assert set(fitted) == set(GENERATIONS)
    for generation, value in fitted.items():
        assert GENERATIONS[generation][0] == pytest.approx(value, abs=0.001), generation


def test_the_stored_results_match_the_live_predictions(published: list) -> None:
    """bench/results/plan_validation.json renders the table in docs/planning.md: it must be what the planner
    predicts now (rerun `python -m bench.plan_validation` and `python -m bench.tables` when it is not)."""
    stored = json.loads(RESULTS.read_text())
    assert [r["name"] for r in stored["rows"]] == [run.name for run in published]
    for row, run in zip(stored["rows"], published, strict=True):
        assert row["published"] == run.published, run.name
        assert row["predicted"] == pytest.approx(predict(run), rel=1e-9), run.name
