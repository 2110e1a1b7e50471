"""The throughput planner against the published runs of bench/published_runs.toml: the set is broad enough, each
run is consistent, the errors are no worse than docs/planning.md reports, and the generated table is current."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.plan_validation import RESULTS, Offers, fit, load, predict, runs, summary, validate
from keel.config import ModelConfig
from keel.core.accelerators import by_key
from keel.plan.layout import Layout, Workload
from keel.plan.layouts import search
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
    rows = [{"error": predict(run) / run.published - 1, "rank": 0, "trainer_rank": 0} for run in published]
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


def test_a_trainer_without_fsdp_is_searched_over_replicas_and_its_own_optimizer_sharding() -> None:
    """A run is also ranked among the layouts its trainer offered (bench.plan_validation.Offers): keel's layouts
    it cannot run are left out, and its data-parallel sharding takes the place of keel's FSDP."""
    ddp = Offers(sharding=(), ac=("none", "full"), cp=False, ep=False)
    assert ddp.variants(Layout(dp_replicate=8)) == [Layout(dp_replicate=8)]
    assert ddp.variants(Layout(dp_shard=8)) == [] and ddp.variants(Layout(dp_replicate=8, ac="selective")) == []
    assert ddp.variants(Layout(cp=2, dp_replicate=4)) == []
    zero = Offers(sharding=(1, 2))
    assert zero.variants(Layout(tp=2, dp_shard=4)) == [Layout(tp=2, dp_shard=4, zero=1), Layout(tp=2, dp_shard=4,
                                                                                              zero=2)]
    fsdp_only = Offers(tp=False, pp=False)
    assert fsdp_only.variants(Layout(tp=2, dp_shard=4)) == [] and fsdp_only.variants(Layout(pp=2, dp_shard=4)) == []

    work = Workload(ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=32_000), 2048, 64)
    a100 = by_key("a100")
    keels = search(work, 16, a100)
    mine = search(work, 16, a100, variants=ddp.variants)
    assert any(c.layout.dp_shard > 1 for c in keels) and mine
    assert all(c.layout.dp_shard == 1 and c.layout.ac in ("none", "full") for c in mine)
    # The same layouts keel searches, less those the trainer lacks: one candidate for each it keeps.
    assert [c.layout for c in mine] == [c.layout for c in keels if ddp.variants(c.layout)]


def test_every_source_says_what_its_trainer_offered_where_it_is_not_keels() -> None:
    """The trainers before FSDP: Megatron-LM's (2021-22) whole replicas, Megatron-DeepSpeed's and Megatron-Core's
    distributed optimizer; runs keep their source's unless they name their own (DeepSpeed's ZeRO-3 rows)."""
    by_name = {run.name: run for run in runs()}
    assert by_name["Megatron-LM 1.7B, 32 A100, DP 32"].offers.sharding == ()
    assert by_name["GPT-3 175B, 384 A100, ZeRO-3 (DeepSpeed)"].offers.sharding == (1, 2, 3)
    assert by_name["MPT-70B, 64 H100, FSDP, AC"].offers == Offers(ac=("none", "full"), tp=False, pp=False, cp=False,
                                                                  ep=False)
    for run in runs():  # the published layout is one its trainer offered
        assert run.layout in run.offers.variants(replace(run.layout, zero=3)), run.name
