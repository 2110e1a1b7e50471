"""Mixture-of-experts models in the planner: the shipped shapes' parameter counts against their published
figures, memory that counts every expert and splits them over expert-parallel ranks, FLOPs that count the
parameters a token uses, the all-to-all of expert parallelism, and layouts searched and given with ep."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from keel.config import ModelConfig, load_config
from keel.errors import KeelError
from keel.model.flops import (
    active_param_count,
    block_param_count,
    matmul_param_count,
    param_count,
    routed_expert_param_count,
)
from keel.plan.layout import Layout, parse_layout
from tests.conftest import REPO, run_keel


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


# ---------------------------------------------------------------- layouts searched and given

def test_a_layout_string_takes_ep_and_nothing_undocumented() -> None:
    assert parse_layout("pp=16,ep=8", 2048) == Layout(pp=16, dp_shard=128, ep=8)
    assert parse_layout(Layout(pp=2, dp_shard=4, ep=4).spec(), 8) == Layout(pp=2, dp_shard=4, ep=4)
    for bad in ("sp=false", "expert=8", "ep8"):
        with pytest.raises(KeelError) as e:
            parse_layout(bad, 64)
        message = str(e.value)
        assert "\n" not in message and "is not KEY=VALUE of tp, pp, v, dp_shard, dp_replicate, cp, ep, micro_batch, " \
            "ac, zero" in message


@pytest.mark.parametrize("config, layout, message", [
    ("qwen3_30b_a3b", "ep=3", "ep = 3 must divide dp_shard = 64: the expert-parallel ranks are borrowed"),
    ("qwen3_30b_a3b", "pp=2,cp=1,dp_shard=32,ep=64", "ep = 64 must divide dp_shard = 32"),
    ("mixtral_8x7b", "ep=16", "ep = 16 must divide the 8 routed experts of each block"),
    ("qwen3_30b_a3b", "tp=2", "tp = 2: keel runs no tensor parallelism of mixture-of-experts blocks"),
    ("llama3_8b", "ep=2", "ep = 2 splits routed experts, but the model has none"),
    ("qwen3_30b_a3b", "sp=1", "'sp=1' is not KEY=VALUE of tp, pp, v, dp_shard, dp_replicate, cp, ep,"),
])
def test_keel_plan_refuses_an_expert_layout_it_cannot_run_in_one_line(tmp_path: Path, config: str, layout: str,
                                                                       message: str) -> None:
    result = run_keel(["plan", "--config", config, "--gpus", "64", "--tokens", "1e12", "--trials", "10",
                       "--layout", layout], cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
