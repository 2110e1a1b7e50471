"""Mixture-of-experts models in the planner: the shipped shapes' parameter counts against their published
figures, memory that counts every expert and splits them over expert-parallel ranks, FLOPs that count the
parameters a token uses, the all-to-all of expert parallelism, and layouts searched and given with ep."""

from __future__ import annotations

import weakref
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch

from keel.config import ModelConfig, MoEConfig, load_config
from keel.core.accelerators import by_key
from keel.errors import KeelError
from keel.model.flops import (
    active_param_count,
    attention_flops_per_token,
    block_param_count,
    matmul_param_count,
    param_count,
    routed_expert_param_count,
)
from keel.model.llama import Block, rope_tables
from keel.plan.kernels import CAUSAL_SHARE
from keel.plan.layout import Layout, Workload, parse_layout
from keel.plan.layouts import search
from keel.plan.memory import block_activations, memory
from keel.plan.report import Question, answer, lines
from keel.plan.throughput import BASE_LATENCY, DEFAULT, HOP_INTER, HOP_INTRA, ep_exchange, step_time
from tests.conftest import REPO, run_keel

H100 = by_key("h100")


@cache
def model(name: str) -> ModelConfig:
    return load_config(REPO / "configs" / f"{name}.toml", []).model


# (total, active) as published: DeepSeek-V3 Technical Report (arXiv 2412.19437, abstract: 671B, 37B activated);
# Qwen3-30B-A3B's model card (30.5B, 3.3B activated); Mistral AI's Mixtral 8x7B announcement (46.7B in total,
# 12.9B per token).
PUBLISHED = {"deepseek_v3": (671e9, 37e9), "qwen3_30b_a3b": (30.5e9, 3.3e9), "mixtral_8x7b": (46.7e9, 12.9e9)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_shipped_expert_shapes_count_their_published_parameters(name: str) -> None:
    total, active = PUBLISHED[name]
    assert param_count(model(name)) == pytest.approx(total, rel=0.02)
    assert active_param_count(model(name)) == pytest.approx(active, rel=0.02)


def test_deepseek_v3s_attention_stands_in_for_mla_parameter_for_parameter() -> None:
    # DeepSeek-V3's weight documentation (README_WEIGHTS.md) gives 36.6B activated parameters in the main model,
    # the output head included and the embedding lookup not: keel's matmul parameters. Its attention is MLA; the
    # config's 96 query and 6 KV heads of 128 hold as many parameters as MLA's projections (+0.03%).
    cfg = model("deepseek_v3")
    assert matmul_param_count(cfg) == pytest.approx(36.6e9, rel=0.005)
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    gqa = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    assert gqa == pytest.approx(mla, rel=5e-4)


def test_qwen3_30b_a3b_holds_its_published_non_embedding_parameters() -> None:
    cfg = model("qwen3_30b_a3b")  # the model card: 29.9B without the (untied) embeddings
    assert param_count(cfg) - 2 * cfg.vocab_size * cfg.dim == pytest.approx(29.9e9, rel=0.005)


@pytest.mark.parametrize("name", [*PUBLISHED, "tiny_moe", "llama3_8b"])
def test_blocks_add_up_to_the_model_and_their_routed_experts_are_the_difference(name: str) -> None:
    cfg = model(name)
    outside = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim  # embeddings, final norm
    blocks = range(cfg.n_layers)
    assert sum(block_param_count(cfg, i) for i in blocks) + outside == param_count(cfg)
    assert sum(block_param_count(cfg, i, cfg.moe.top_k) for i in blocks) + outside == active_param_count(cfg)
    hidden = cfg.moe.expert_dim or cfg.ffn_dim
    for i in blocks:
        moe = bool(cfg.moe.experts) and i >= cfg.moe.dense_layers
        assert routed_expert_param_count(cfg, i) == (cfg.moe.experts * 3 * cfg.dim * hidden if moe else 0)


def work_of(name: str, tokens: float = 1e12) -> Workload:
    return Workload.of(load_config(REPO / "configs" / f"{name}.toml", []), tokens)


# ---------------------------------------------------------------- total parameters for memory, active for FLOPs

def test_memory_counts_every_expert_and_flops_only_the_ones_a_token_uses() -> None:
    work = work_of("deepseek_v3")
    doubled = replace(work, model=replace(work.model, moe=replace(work.model.moe, experts=512)))
    layout = Layout(dp_shard=2048, ep=8, ac="full")
    # FSDP holds 16 bytes per parameter over dp_shard × cp, every expert included: 512 experts hold about twice
    # the state; the step's FLOPs follow the top_k experts a token goes through: only the router grows, by
    # dim × 256 more logits in each of the 58 expert blocks.
    for w in (work, doubled):
        assert memory(w, layout, H100).optimizer == pytest.approx(12 * w.n_params / 2048)
    assert doubled.n_params > 1.9 * work.n_params
    assert doubled.flops_per_token - work.flops_per_token == 6 * 7168 * 256 * 58
    # The step follows the FLOPs, not the parameters: it grows by more than the router's FLOPs (the step is timed
    # with the half of the attention FLOPs a causal kernel computes, the router's whole; each expert's GEMMs get
    # half the rows; the optimizer steps twice the state) and by a few percent at most.
    skipped = (1 - CAUSAL_SHARE) * attention_flops_per_token(work.model, work.seq_len)
    grown = step_time(doubled, layout, H100).compute / step_time(work, layout, H100).compute
    assert (doubled.flops_per_token - skipped) / (work.flops_per_token - skipped) < grown < 1.05
    assert work.n_active == active_param_count(work.model) < work.n_params / 17


@pytest.mark.parametrize("name, layout", [("deepseek_v3", Layout(pp=16, dp_shard=128, ac="full")),
                                          ("qwen3_30b_a3b", Layout(dp_shard=64)),
                                          ("mixtral_8x7b", Layout(cp=2, dp_shard=32, ac="full"))])
def test_memory_per_rank_falls_as_the_experts_spread_over_more_ranks(name: str, layout: Layout) -> None:
    work = work_of(name)
    eps = [ep for ep in (1, 2, 4, 8) if work.experts % ep == 0]
    totals = [memory(work, replace(layout, ep=ep), H100).total for ep in eps]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)


def test_whole_parameters_hold_their_share_of_the_experts_and_shards_hold_all_of_them_sharded() -> None:
    """ZeRO-1 keeps the bf16 parameters whole on each rank: the experts' 1/ep and every other parameter. The
    optimizer state is sharded over dp_shard × cp: the experts over ep × the ranks left over, the same count."""
    work = work_of("qwen3_30b_a3b")
    experts = sum(work.block_experts)
    for ep in (1, 4, 16):
        mem = memory(work, Layout(dp_shard=64, ep=ep, zero=1), H100)
        assert mem.params == pytest.approx(2 * (work.n_params - experts + experts / ep))
        assert mem.optimizer == pytest.approx(12 * work.n_params / 64)


@pytest.mark.parametrize("shared, score, dtype", [(0, "softmax", "fp32"), (0, "softmax", "bf16"),
                                                  (1, "sigmoid", "bf16"), (2, "softmax", "fp32")])
def test_an_expert_blocks_activations_are_what_autograd_keeps(shared: int, score: str, dtype: str) -> None:
    """Sum the tensors a keel mixture-of-experts block still holds for its backward pass after its forward
    (weights, buffers and the RoPE table aside; the balance and z-losses' graphs, which the block drops, go
    with them)."""
    cfg = ModelConfig(dim=256, n_heads=8, n_kv_heads=2, moe=MoEConfig(
        experts=8, top_k=2, shared_experts=shared, expert_dim=96, score=score, normalize_top_k=score == "softmax"))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    block = Block(cfg, layer=1).to(torch_dtype)
    seq, batch = 128, 2
    x = torch.randn(batch, seq, cfg.dim, dtype=torch_dtype, requires_grad=True)
    rope = rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta)
    constant = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), rope)}
    saved: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(tensor))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = block(x, rope)
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for ref in saved
             if (t := ref()) is not None and t.untyped_storage().data_ptr() not in constant}
    assert out.grad_fn is not None
    kept, checkpointed = block_activations(Workload(cfg, seq, 1, param_dtype=dtype), batch, tp=1, sp=False,
                                           composite_norm=True, moe=True)
    assert sum(alive.values()) == pytest.approx(kept, rel=0.01)
    assert checkpointed == x.element_size() * seq * batch * cfg.dim


def test_the_first_pipeline_rank_with_experts_holds_its_micro_batches_in_flight() -> None:
    """DeepSeek-V3's first 3 blocks are dense: at pp = 16 the first rank holds only them, and the second, with
    four expert blocks, keeps 15 micro-batches in flight (1F1B: p − 1), the peak of the pipeline."""
    work = work_of("deepseek_v3")
    mem = memory(work, Layout(pp=16, dp_shard=128, ep=8, micro_batch=1), H100)
    assert mem.pipeline_inflight == pytest.approx(14 * mem.activations)
    assert mem.activations > block_activations(work, 1, 1, True, moe=True)[0] * 4 * 0.99


# ---------------------------------------------------------------- the all-to-all

SMALL = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=128,
                    moe=MoEConfig(experts=16, top_k=2, expert_dim=96, dense_layers=1))


def test_the_all_to_all_sends_the_top_k_rows_of_every_token_less_the_share_that_stays() -> None:
    """By hand: 3 expert blocks; 16 sequences of 128 over 4 data-parallel ranks in micro-batches of 2 make 2
    micro-batches of 256 tokens; an exchange holds top_k × 256 tokens × 64 × 2 bytes (bf16) = 65,536 bytes, of
    which 3/4 leave the rank at ep = 4; dispatch and combine forward, both reversed backward: 4 exchanges per
    block and micro-batch, 6 with full activation checkpointing (the recomputed forward exchanges again)."""
    work = Workload(SMALL, 128, 16)
    layout = Layout(dp_shard=4, ep=4, micro_batch=2)
    assert ep_exchange(work, layout) == 4 * 3 * 2 * 65_536 * 3 / 4 == 1_179_648
    assert ep_exchange(work, replace(layout, ac="full")) == 6 * 3 * 2 * 65_536 * 3 / 4
    assert ep_exchange(work, replace(layout, ep=2)) == 4 * 3 * 2 * 65_536 / 2
    assert ep_exchange(work, replace(layout, ep=1)) == 0
    # A pipeline: its busiest rank in expert blocks holds two (blocks 2 and 3); context parallelism: its half
    # of each sequence.
    assert ep_exchange(work, Layout(pp=2, dp_shard=2, ep=2, micro_batch=2)) == 4 * 2 * 4 * 65_536 / 2
    assert ep_exchange(work, Layout(cp=2, dp_shard=2, ep=4, micro_batch=2)) == 4 * 3 * 4 * 65_536 / 2 * 3 / 4


def test_the_all_to_all_runs_on_nvlink_within_a_node_and_on_the_network_across_and_is_never_hidden() -> None:
    work = Workload(SMALL, 128, 64)
    for ep, bandwidth, hop in ((8, H100.intra_bw, HOP_INTRA), (16, H100.inter_bw, HOP_INTER)):
        layout = Layout(dp_shard=16, ep=ep)  # 4 micro-batches of 128 tokens: 48 exchanges of 32,768 bytes
        step = step_time(work, layout, H100)
        one = BASE_LATENCY + hop + (ep - 1) / ep * 32_768 / (bandwidth * DEFAULT.link)
        assert step.ep_comm == pytest.approx(4 * 3 * 4 * one, rel=1e-12)
        assert step.parts()["ep_comm"] == step.ep_comm and step_time(work, replace(layout, ep=1), H100).ep_comm == 0
        assert sum(step.parts().values()) == pytest.approx(step.total)
    # Even with every bit of FSDP/DP traffic that compute can cover hidden, the all-to-all adds in full.
    qwen = work_of("qwen3_30b_a3b")
    step = step_time(qwen, Layout(dp_shard=64, ep=8), H100, replace(DEFAULT, overlap=1.0))
    hideable = step.fsdp_comm + step.dp_comm
    assert step.total == pytest.approx(step.compute + step.ep_comm + max(0.0, hideable - step.compute))


# ---------------------------------------------------------------- layouts searched and given

def test_the_search_spreads_deepseek_v3s_experts_over_ranks_on_a_large_cluster_and_fits() -> None:
    work = work_of("deepseek_v3", 14.8e12)
    candidates = search(work, 2048, H100)
    best = candidates[0]
    assert best.fits and best.layout.ep > 1 and best.layout.tp == 1
    assert best.memory.total < best.memory.usable
    assert all(c.layout.tp == 1 for c in candidates)  # tensor parallelism of expert blocks is not modelled
    assert not any(c.fits for c in candidates if c.layout.ep == 1)  # every expert on every rank never fits
    assert {c.layout.ep for c in candidates} == {1, 2, 4, 8, 16, 32, 64, 128, 256}


def test_a_dense_models_search_has_no_expert_parallelism() -> None:
    work = Workload(load_config(REPO / "configs" / "llama3_8b.toml", []).model, 8192, 512)
    assert {c.layout.ep for c in search(work, 64, H100)} == {1}
    assert not any(part.startswith("ep") for part in search(work, 64, H100)[0].layout.describe().split())


def test_a_layout_string_takes_ep_and_nothing_undocumented() -> None:
    assert parse_layout("pp=16,ep=8", 2048) == Layout(pp=16, dp_shard=128, ep=8)
    assert parse_layout(Layout(pp=2, dp_shard=4, ep=4).spec(), 8) == Layout(pp=2, dp_shard=4, ep=4)
    for bad in ("sp=false", "expert=8", "ep8"):
        with pytest.raises(KeelError) as e:
            parse_layout(bad, 64)
        message = str(e.value)
        assert "\n" not in message and "is not KEY=VALUE of tp, pp, v, dp_shard, dp_replicate, cp, ep, micro_batch, " \
            "ac, zero" in message


def test_a_given_expert_layout_is_predicted_with_its_all_to_all() -> None:
    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b.toml", [])
    a = answer(Question(cfg, 64, "h100", 1e12, layout="ep=8", spares=0, trials=20))
    assert a["given"]["layout"] == "dp_shard64 ep8 mb1"
    assert a["experts"]["ep"] == 8 and a["experts"]["link"] == "intra-node"
    assert a["experts"]["all_to_all_bytes_per_gpu"] == ep_exchange(Workload.of(cfg), Layout(dp_shard=64, ep=8))
    assert a["step"]["ep_comm"] == a["experts"]["all_to_all_s"] > 0
    text = lines(a)
    assert text[0].startswith("qwen3_30b_a3b: 30.53B parameters (3.35B active), ")
    assert any(line.startswith("experts, given layout: ep 8: 16 of 128 experts per rank, sharded over 8 ranks; "
                               "all-to-all ") for line in text)


@pytest.mark.parametrize("config, layout, message", [
    ("qwen3_30b_a3b", "ep=3", "ep = 3 must divide dp_shard = 64: the expert-parallel ranks are borrowed"),
    ("qwen3_30b_a3b", "pp=2,cp=1,dp_shard=32,ep=64", "ep = 64 must divide dp_shard = 32"),
    ("mixtral_8x7b", "ep=16", "ep = 16 must divide the 8 routed experts of each block"),
    ("qwen3_30b_a3b", "tp=2", "tp = 2: the planner does not model tensor parallelism of mixture-of-experts"),
    ("llama3_8b", "ep=2", "ep = 2 splits routed experts, but the model has none"),
    ("qwen3_30b_a3b", "sp=1", "'sp=1' is not KEY=VALUE of tp, pp, v, dp_shard, dp_replicate, cp, ep,"),
])
def test_keel_plan_refuses_an_expert_layout_it_cannot_run_in_one_line(tmp_path: Path, config: str, layout: str,
                                                                       message: str) -> None:
    result = run_keel(["plan", "--config", config, "--gpus", "64", "--tokens", "1e12", "--trials", "10",
                       "--layout", layout], cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_keel_plan_takes_an_expert_layout(tmp_path: Path) -> None:
    result = run_keel(["plan", "--config", "deepseek_v3", "--gpus", "2048", "--tokens", "14.8e12", "--trials",
                       "20", "--layout", "pp=16,ep=32,ac=full"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "given layout pp16 dp_shard128 ep32 mb1 ac=full: " in result.stdout
    assert "experts, given layout: ep 32: 8 of 256 experts per rank, sharded over 4 ranks; all-to-all " \
        in result.stdout and " s inter-node at 40 GB/s, not hidden behind compute" in result.stdout
