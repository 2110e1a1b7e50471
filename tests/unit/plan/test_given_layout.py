"""`keel plan --layout` and a config's [parallel]: the exact layout predicted (memory, step, MFU), ranked among
the searched ones, the plan made for it; what cannot run or fit refused in one line; settings the planner
does not model named, never silently dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.config import load_config
from keel.core.accelerators import by_key
from keel.errors import KeelError
from keel.plan.layout import Layout, Workload, config_layout, parse_layout
from keel.plan.layouts import assess, search
from keel.plan.report import Question, answer, lines
from keel.plan.throughput import DEFAULT, efficiency_for, step_time

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "llama3_8b.toml"


def plan(*overrides: str, layout: str = "", gpus: int = 64) -> dict:
    cfg = load_config(CONFIG, list(overrides))
    return answer(Question(cfg, gpus, "h100", 1e12, layout=layout, spares=0, trials=50))


def test_a_layout_string_names_every_degree_and_dp_shard_takes_the_rest() -> None:
    assert parse_layout("tp=8,pp=2,micro_batch=2,ac=selective", 64) == \
        Layout(tp=8, pp=2, dp_shard=4, micro_batch=2, ac="selective")
    assert parse_layout("tp=2, dp_replicate=4, dp_shard=8, v=2, pp=1", 64).gpus() == 64
    layout = Layout(tp=2, pp=4, v=2, dp_shard=2, dp_replicate=2, micro_batch=4, ac="full")
    assert parse_layout(layout.spec(), 32) == layout
    zero = Layout(pp=4, v=2, dp_shard=8, schedule="interleaved_zb")
    assert parse_layout(zero.spec(), 32) == zero and zero.describe() == "pp4 dp_shard8 v2 mb1 interleaved_zb"


@pytest.mark.parametrize("text, message", [
    ("tp=8,pq=2", "'pq=2' is not KEY=VALUE of tp, pp, v"),
    ("tp=0", "tp=0: expected a positive whole number"),
    ("ac=some", "ac=some: expected one of none, selective, full"),
    ("tp=8,dp_shard=2", "uses 16 devices (tp × pp × dp_shard × dp_replicate), not --gpus 64"),
    ("tp=3", "tp × pp × dp_replicate = 3 does not divide --gpus 64"),
    ("pp=2,schedule=zb", "schedule=zb: expected one of gpipe, 1f1b, interleaved_1f1b, interleaved_zb"),
    ("pp=2,schedule=interleaved_zb", "the interleaved_zb schedule runs several stages per rank, not v = 1; raise v"),
    ("pp=2,v=2,schedule=gpipe", "the gpipe schedule runs one stage per rank, not v = 2; use interleaved_1f1b"),
])
def test_a_bad_layout_string_is_one_line(text: str, message: str) -> None:
    with pytest.raises(KeelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_layout(text, 64)


def test_the_given_layout_is_predicted_ranked_and_planned() -> None:
    a = plan(layout="tp=8,pp=2")
    g = a["given"]
    assert g["layout"] == "tp8 pp2 dp_shard4 mb1" and 1 < g["rank"] <= g["of"]
    assert g["tokens_per_s_per_gpu"] < a["layouts"][0]["tokens_per_s_per_gpu"]
    assert "against the best, " + a["layouts"][0]["layout"] in g["versus_best"] and "TP collectives" in g["versus_best"]
    # the breakdowns and the run are the given layout's, not the best one's
    assert a["step"]["total"] == pytest.approx(g["step_s"]) and a["memory"]["total"] == pytest.approx(g["memory_gib"])
    assert any(line.startswith("given layout tp8 pp2 dp_shard4 mb1: ") for line in lines(a))
    searched = plan()
    assert searched["given"] is None and searched["step"]["total"] < a["step"]["total"]
    best = plan(layout=searched["layouts"][0]["spec"])
    assert best["given"]["rank"] == 1 and best["given"]["versus_best"] == "it is the best searched layout"


def test_parallel_overrides_are_the_given_layout_and_unmodelled_settings_are_named() -> None:
    a = plan("parallel.tp=8", "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.compile=true",
             "train.micro_batch=1")
    assert a["given"]["layout"] == "tp8 pp2 dp_shard4 mb1 gpipe"
    assert a["given"]["not_modelled"] == ["parallel.compile=True"]
    assert any("not modelled by the planner: parallel.compile=True" in line for line in lines(a))
    assert config_layout(load_config(CONFIG, []), 64) == (None, [])


def test_a_given_layout_keel_cannot_run_is_refused_in_one_line() -> None:
    cfg = load_config(CONFIG, [])
    work = Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch, 1e12)
    hw = by_key("h100")
    candidates = search(work, 8, hw)
    for layout, message in [(Layout(tp=8, pp=1, dp_shard=1, micro_batch=1), "tp = 8 must divide"),
                            (Layout(pp=8, v=5, micro_batch=1), "pp × v = 40 stages need at least as many blocks, "
                                                               "not 32"),
                            (Layout(dp_shard=8, micro_batch=3), "whole micro-batches of 3")]:
        if "tp = 8" in message:
            work = Workload(load_config(CONFIG, ["model.n_kv_heads=4"]).model, cfg.train.seq_len,
                            cfg.train.global_batch, 1e12)
        with pytest.raises(KeelError, match=message) as caught:
            assess(work, layout, hw, DEFAULT, candidates)
        assert "\n" not in str(caught.value)
        work = Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch, 1e12)
    too_big = assess(work, Layout(dp_shard=8, micro_batch=64), hw, DEFAULT, candidates)
    assert not too_big.candidate.fits and too_big.row()["memory_verdict"].startswith("does not fit: needs")
    # A layout that does not fit is never ranked among those that do, however fast it would be.
    assert too_big.rank is None and too_big.of == sum(c.fits for c in candidates)


def test_a_given_layout_ranks_among_the_fitting_ones_it_is_counted_with() -> None:
    """A fitting layout the search did not list counts itself in: slowest of all, it ranks last of them, never
    past the count."""
    cfg = load_config(CONFIG, [])
    work, hw = Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch, 1e12), by_key("h100")
    fitting = [c for c in search(work, 8, hw) if c.fits]
    slowest = fitting[-1].layout
    listed = assess(work, slowest, hw, DEFAULT, fitting)
    unlisted = assess(work, slowest, hw, DEFAULT, fitting[:-1])
    assert (listed.rank, listed.of) == (unlisted.rank, unlisted.of) == (len(fitting), len(fitting))


def test_uneven_pipelines_plan_with_the_trainer_s_split_and_their_busiest_rank() -> None:
    from keel.plan.kernels import kernels_for, rank_seconds
    from keel.plan.layout import SOFTWARE, rank_blocks

    cfg = load_config(REPO / "configs" / "llama3_405b.toml", [])
    work = Workload(cfg.model, 8192, 2048)
    layout = Layout(tp=8, pp=16, v=1, dp_shard=128, micro_batch=1)
    assert rank_blocks(work, layout) == [7] + [8] * 14 + [7]
    # the last rank's 7 blocks and the output projection are lighter than a middle rank's 8 blocks, which set the pace
    hw = by_key("h100")
    loads = rank_seconds(work, layout, hw, kernels_for(hw), SOFTWARE[work.software], 0.0)
    assert loads[0] < loads[-1] < loads[1] == max(loads)
    assert rank_blocks(work, Layout(pp=16, v=4, dp_shard=1024)) == [7] + [8] * 14 + [7]  # 64 stages of 1-2 blocks


def test_a_tied_model_is_told_what_its_untied_pipeline_would_make() -> None:
    from keel.config import ModelConfig
    from keel.plan.layouts import untied_alternative

    gpt3 = ModelConfig(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, vocab_size=51200, multiple_of=256,
                       tie_embeddings=True)
    work, hw = Workload(gpt3, 2048, 1024), by_key("a100")
    found = search(work, 1024, hw)
    assert all(c.layout.pp == 1 for c in found)
    note = untied_alternative(work, 1024, hw, DEFAULT, found[0])
    assert "tied embeddings rule out pipeline layouts" in note and " pp" in note and "(+" in note
    assert untied_alternative(Workload(load_config(CONFIG, []).model, 8192, 16), 8, hw, DEFAULT, None) == ""


def test_zero_stages_shard_what_they_say_and_move_what_they_must() -> None:
    from keel.plan.memory import memory
    from keel.plan.throughput import step_time

    cfg = load_config(CONFIG, [])
    work, hw = Workload(cfg.model, 8192, 16), by_key("h100")
    by_stage = {z: memory(work, Layout(dp_shard=8, micro_batch=2, ac="selective", zero=z), hw) for z in (1, 2, 3)}
    one, two, three = by_stage[1], by_stage[2], by_stage[3]
    assert one.optimizer == two.optimizer == three.optimizer  # every stage shards the optimizer state
    assert one.grads == pytest.approx(8 * two.grads) and two.grads == three.grads  # ZeRO-2 shards the gradients
    assert two.params == pytest.approx(8 * three.params)  # only FSDP shards the parameters
    assert one.total > two.total > three.total
    # two micro-batches a step: ZeRO-2 reduces after each, ZeRO-1 once
    steps = {z: step_time(work, Layout(dp_shard=8, micro_batch=1, ac="selective", zero=z), hw) for z in (1, 2, 3)}
    # FSDP gathers the parameters twice per micro-batch; ZeRO-1/2 once per step, ZeRO-1 reduces once per step
    assert steps[1].fsdp_comm < steps[2].fsdp_comm < steps[3].fsdp_comm
    assert parse_layout("dp_shard=8,zero=1", 8) == Layout(dp_shard=8, zero=1)
    with pytest.raises(KeelError, match="zero=4: expected 1"):
        parse_layout("zero=4", 8)
    assert Layout(dp_shard=8, zero=2).describe() == "dp_shard8 mb1 zero=2"


def test_a_given_layout_is_predicted_with_the_kernels_the_config_runs() -> None:
    """torchtitan's Llama 3.1 8B layout on 8 H100 (FSDP, local batch 2 at sequence 8,192, selective AC): the plan's
    figure is the step model's for the config's workload, eager; compiled blocks fuse their element-wise kernels
    and are predicted faster (the validation table checks both against published runs)."""
    a = plan("train.global_batch=16", layout="dp_shard=8,micro_batch=2,ac=selective", gpus=8)
    assert a["given"]["layout"] == "dp_shard8 mb2 ac=selective"
    cfg = load_config(CONFIG, ["train.global_batch=16"])
    work = Workload.of(cfg, 1e12)
    assert work.software == "eager"
    layout = Layout(dp_shard=8, micro_batch=2, ac="selective")
    h100 = by_key("h100")
    eager = step_time(work, layout, h100, efficiency_for(h100)).tokens_per_s_per_device
    assert a["given"]["tokens_per_s_per_gpu"] == pytest.approx(eager, rel=1e-9)
    compiled = plan("train.global_batch=16", "parallel.compile=true", layout=layout.spec(), gpus=8)
    assert eager < compiled["given"]["tokens_per_s_per_gpu"] < 1.3 * eager


