"""The router's entropy, counted by a mixture-of-experts layer beside its tokens per expert: the entropy of each
token's scores normalised over the experts, summed over the tokens of training forwards."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from keel.model.llama import Block, rope_tables
from keel.model.moe import score_entropy
from tests.unit.model.test_moe import build_moe, hidden, moe_cfg

TOKENS = 3 * 8  # hidden()'s


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_a_router_that_cannot_tell_the_experts_apart_has_the_entropy_ln_experts(score: str) -> None:
    moe = build_moe(moe_cfg(score=score))
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # every score equal: softmax 1/4 each, sigmoid 0.5 each
    moe.train()
    moe(hidden())
    assert moe.router_entropy.item() == pytest.approx(TOKENS * math.log(4), rel=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_entropy_is_summed_over_the_tokens_of_the_normalised_scores(score: str) -> None:
    moe = build_moe(moe_cfg(score=score))
    moe.train()
    x = hidden()
    moe(x)
    scores = moe.router(x.reshape(-1, x.shape[-1]), moe.expert_bias).scores.detach().double()
    p = scores / scores.sum(-1, keepdim=True)
    expected = -(p * p.log()).sum().item()
    assert moe.router_entropy.item() == pytest.approx(expected, rel=1e-5)
    assert 0 < expected < TOKENS * math.log(4)
    assert score_entropy(scores).item() == pytest.approx(expected, rel=1e-9)


def test_a_score_of_zero_adds_no_entropy_and_no_nan() -> None:
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    assert score_entropy(scores).item() == pytest.approx(math.log(2))


def test_only_training_forwards_count_the_entropy_and_a_reset_clears_it() -> None:
    moe = build_moe(moe_cfg())
    with torch.no_grad():
        moe(hidden())
    moe.eval()
    moe(hidden())
    assert moe.router_entropy.item() == 0
    moe.train()
    moe(hidden())
    once = moe.router_entropy.item()
    moe(hidden())
    assert once > 0 and moe.router_entropy.item() == pytest.approx(2 * once)
    moe.reset_counts()
    assert moe.router_entropy.item() == 0 and not moe.tokens_per_expert.any()


def test_a_checkpointed_block_counts_its_entropy_once() -> None:
    cfg = moe_cfg()
    torch.manual_seed(0)
    block = Block(cfg, layer=2)
    assert block.moe is not None
    rope = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
    block(hidden(), rope).square().sum().backward()
    plain = block.moe.router_entropy.clone()
    block.moe.reset_counts()
    checkpoint(block, hidden(), rope, use_reentrant=False).square().sum().backward()
    assert plain > 0 and torch.equal(block.moe.router_entropy, plain)
