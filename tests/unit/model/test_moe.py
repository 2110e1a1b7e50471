"""The mixture-of-experts block: its sorted, grouped expert compute against a token-by-token reference, routing
and its balancing bias, the auxiliary losses' gradients, capacity drops, counting under activation checkpointing,
and its place in the model, the config, the init, the counts and the optimizer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from keel.config import ModelConfig, MoEConfig, OptimConfig, load_config
from keel.errors import ConfigError
from keel.model.flops import active_param_count, flops_per_token, matmul_param_count, param_count
from keel.model.init import INIT_STD, init_weights
from keel.model.llama import Block, Llama, rope_tables
from keel.model.moe import MoE, Routing, balance_loss, grouped_swiglu, looped_swiglu, scale_auxiliary_losses, z_loss
from keel.train.optim import build_optimizer
from tests.unit.model.test_model import TINY, tokens

MOE = dataclasses.replace(TINY, n_layers=3, moe=MoEConfig(experts=4, top_k=2, expert_dim=24))


def moe_cfg(**changes: object) -> ModelConfig:
    return dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, **changes))  # type: ignore[arg-type]


def build_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.1)  # larger than the init, so that routing and outputs differ clearly
    return moe


def hidden(batch: int = 3, seq: int = 8, dim: int = MOE.dim, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed))


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def reference(moe: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Each token through its chosen experts one at a time, in token order; with a capacity an expert that has
    taken `capacity` slots already gives nothing."""
    flat = x.reshape(-1, x.shape[-1])
    routing = moe.router(flat, moe.expert_bias)
    taken = [0] * moe.experts_n
    rows = []
    for t in range(flat.shape[0]):
        out = torch.zeros(flat.shape[1])
        for j in range(moe.top_k):
            e = int(routing.chosen[t, j])
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                continue
            w = moe.experts
            out = out + routing.weights[t, j] * swiglu(flat[t], w.w1[e], w.w2[e], w.w3[e])
        rows.append(out * moe.score_scale + (moe.shared(flat[t]) if moe.shared is not None else 0))
    return torch.stack(rows).view_as(x)


def grads(module: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> dict[str, torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    module.zero_grad()
    x.grad = None
    (out * weight).sum().backward()
    assert x.grad is not None
    return {"input": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()
                                        if p.grad is not None}}


def assert_same_forward_and_backward(moe: MoE, capacity: int | None = None) -> None:
    x = hidden().requires_grad_()
    out = moe(x)
    got = grads(moe, x, out)
    expected_out = reference(moe, x, capacity)
    expected = grads(moe, x, expected_out)
    assert_close_to_scale(out, expected_out, "output")
    assert got.keys() == expected.keys() and "experts.w1" in got and "router.gate.weight" in got
    for name in got:
        assert_close_to_scale(got[name], expected[name], name)


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal to 1e-6 of the largest value: fp32 sums in another order (a weight's gradient sums over the tokens)
    differ by a few units of the last place of their size."""
    error, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    assert error <= 1e-6 * max(scale, 1.0), f"{name}: off by {error:.3g} at a scale of {scale:.3g}"


# ---------------------------------------------------------------- the compute

@pytest.mark.parametrize("score,normalize", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_sorted_expert_compute_equals_each_token_through_its_experts(score: str, normalize: bool) -> None:
    moe = build_moe(moe_cfg(score=score, normalize_top_k=normalize, shared_experts=2, score_scale=2.5))
    assert_same_forward_and_backward(moe)


def test_grouped_gemm_equals_the_per_expert_loop_with_padded_and_empty_groups() -> None:
    # torch.nn.functional.grouped_mm runs on CPU in fp32 too, so the CUDA path's layout (groups padded to 16
    # rows, the slack in the last group) is checked here against the loop CPU training uses.
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 17, 3])
    x = torch.randn(int(counts.sum()), 16, generator=gen, requires_grad=True)
    weights = [torch.randn(4, 24, 16, generator=gen), torch.randn(4, 16, 24, generator=gen),
               torch.randn(4, 24, 16, generator=gen)]
    results = []
    for compute in (grouped_swiglu, looped_swiglu):
        inputs = [x.detach().clone().requires_grad_()] + [w.clone().requires_grad_() for w in weights]
        out = compute(inputs[0], counts, inputs[1], inputs[2], inputs[3])
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        results.append([out.detach()] + [t.grad for t in inputs])
    # The two sum in different orders: fp32's rounding of each, relative to the values (up to ~100 here), differs
    # with the CPU's kernels; a misplaced row or group would be off by the values themselves.
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert results[0][2] is not None and not results[0][2][1].any()  # the empty expert gets no gradient


def test_the_output_and_gradients_do_not_depend_on_the_run() -> None:
    moe = build_moe(moe_cfg())
    x = hidden().requires_grad_()
    first = grads(moe, x, moe(x))
    second = grads(moe, x, moe(x))
    assert all(torch.equal(first[name], second[name]) for name in first)


# ---------------------------------------------------------------- routing

def test_softmax_weights_are_the_chosen_scores_and_sigmoid_ones_sum_to_one() -> None:
    x = hidden().reshape(-1, MOE.dim)
    for score, normalize in [("softmax", False), ("softmax", True), ("sigmoid", False)]:
        moe = build_moe(moe_cfg(score=score, normalize_top_k=normalize))
        routing = moe.router(x, moe.expert_bias)
        assert torch.equal(routing.chosen, routing.scores.topk(2).indices)
        chosen_scores = routing.scores.gather(-1, routing.chosen)
        if score == "softmax" and not normalize:
            torch.testing.assert_close(routing.scores.sum(-1), torch.ones(x.shape[0]))
            assert torch.equal(routing.weights, chosen_scores)
        else:
            torch.testing.assert_close(routing.weights.sum(-1), torch.ones(x.shape[0]))
            torch.testing.assert_close(routing.weights, chosen_scores / chosen_scores.sum(-1, keepdim=True))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_the_bias_changes_which_experts_are_chosen_but_not_their_weights(score: str) -> None:
    moe = build_moe(moe_cfg(score=score))
    x = hidden().reshape(-1, MOE.dim)
    before = moe.router(x, moe.expert_bias)
    assert not (before.chosen == 3).any(dim=-1).all()
    moe.expert_bias[3] = 10.0
    after = moe.router(x, moe.expert_bias)
    assert (after.chosen == 3).any(dim=-1).all()  # every token now takes expert 3
    unbiased = moe.router.forward(x, torch.zeros(4))
    torch.testing.assert_close(after.scores, unbiased.scores, rtol=0, atol=0)
    chosen_scores = after.scores.gather(-1, after.chosen)
    expected = chosen_scores if score == "softmax" else chosen_scores / chosen_scores.sum(-1, keepdim=True)
    torch.testing.assert_close(after.weights, expected, rtol=0, atol=0)


def test_update_bias_raises_underloaded_experts_lowers_overloaded_ones_and_restarts_the_count() -> None:
    moe = build_moe(moe_cfg())
    moe.train()
    moe(hidden())
    assert int(moe.tokens_per_expert.sum()) == 3 * 8 * 2
    moe.update_bias(torch.tensor([10, 0, 5, 5]), rate=0.001)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.001, 0.001, 0.0, 0.0]))
    assert not moe.tokens_per_expert.any()
    moe.update_bias(torch.tensor([10, 0, 5, 5]), rate=0.001)
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.002, 0.002, 0.0, 0.0]))


def test_only_training_forwards_count_tokens() -> None:
    moe = build_moe(moe_cfg())
    with torch.no_grad():
        moe(hidden())
    moe.eval()
    moe(hidden())
    assert not moe.tokens_per_expert.any() and not moe.aux_losses


# ---------------------------------------------------------------- auxiliary losses

@pytest.mark.parametrize("which", ["balance", "z"])
def test_an_auxiliary_loss_adds_exactly_its_scaled_gradient(which: str) -> None:
    coeff, scale = 0.3, 0.25
    cfg = moe_cfg(aux_loss_coeff=coeff if which == "balance" else 0.0, z_loss_coeff=coeff if which == "z" else 0.0)
    with_loss, plain = build_moe(cfg), build_moe(moe_cfg())
    with_loss.aux_scale = scale
    x = hidden()
    with_loss(x).sum().backward()
    out = plain(x)
    routing = plain.router(x.reshape(-1, MOE.dim), plain.expert_bias)
    aux = (balance_loss if which == "balance" else z_loss)(routing, x.shape[0])
    (out.sum() + coeff * scale * aux).backward()
    for (name, got), expected in zip(with_loss.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert with_loss.router.gate.weight.grad is not None
    assert with_loss.aux_losses[which] == pytest.approx(aux.item() / x.shape[0], rel=1e-6)


def test_the_balance_loss_is_one_when_balanced_and_experts_over_top_k_when_all_pick_the_same() -> None:
    logits = torch.zeros(8, 4)
    uniform = torch.full((8, 4), 0.25)
    alternating = torch.tensor([[0, 1], [2, 3]]).repeat(4, 1)
    balanced = Routing(logits, uniform, uniform[:, :2], alternating)
    assert balance_loss(balanced, 2).item() == pytest.approx(2.0)  # two sequences of four tokens, 1 each
    concentrated = torch.tensor([[0.5, 0.5, 0.0, 0.0]]).repeat(8, 1)
    same = Routing(logits, concentrated, concentrated[:, :2], torch.tensor([[0, 1]]).repeat(8, 1))
    assert balance_loss(same, 2).item() == pytest.approx(2 * 4 / 2)


# ---------------------------------------------------------------- capacity

def test_a_full_expert_drops_the_later_slots_and_counts_them() -> None:
    moe = build_moe(moe_cfg(capacity_factor=0.5, shared_experts=1))
    moe.train()
    capacity = moe.capacity(24)
    assert capacity == math.ceil(0.5 * 24 * 2 / 4) == 6
    assert_same_forward_and_backward(moe, capacity)
    counts = moe.tokens_per_expert.clone()
    assert int(moe.dropped_tokens) == int((counts - capacity).clamp(min=0).sum()) > 0
    moe.reset_counts()
    assert not moe.dropped_tokens and not moe.tokens_per_expert.any()


# ---------------------------------------------------------------- activation checkpointing

def test_a_checkpointed_block_counts_its_tokens_once_and_gets_the_same_gradients() -> None:
    cfg = moe_cfg(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    torch.manual_seed(0)
    block = Block(cfg, layer=2)
    rope = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
    x = hidden()
    block(x, rope).square().sum().backward()
    plain = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    assert block.moe is not None
    counted = block.moe.tokens_per_expert.clone()
    block.moe.reset_counts()
    block.zero_grad()
    checkpoint(block, x, rope, use_reentrant=False).square().sum().backward()
    assert torch.equal(block.moe.tokens_per_expert, counted) and int(counted.sum()) == 3 * 8 * 2
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- the model

def test_no_experts_is_exactly_the_dense_model() -> None:
    off = dataclasses.replace(TINY, moe=MoEConfig(experts=0, top_k=3, shared_experts=2, dense_layers=1))
    dense, unused = Llama(TINY), Llama(off)
    init_weights(dense, 5)
    init_weights(unused, 5)
    assert list(dense.state_dict()) == list(unused.state_dict())
    x = tokens()
    assert torch.equal(dense(x), unused(x))
    assert param_count(off) == active_param_count(off) == param_count(TINY)
    assert flops_per_token(off, 16) == flops_per_token(TINY, 16)


def test_blocks_from_dense_layers_on_have_experts_and_only_those() -> None:
    cfg = moe_cfg(dense_layers=1, shared_experts=1)
    model = Llama(cfg)
    init_weights(model, 0)
    assert list(model.moe_layers()) == ["1", "2"]
    assert model.layers["0"].feed_forward is not None and model.layers["0"].moe is None
    assert model.layers["1"].feed_forward is None
    names = {n for n, _ in model.named_parameters() if n.startswith("layers.1.")}
    assert {"layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1", "layers.1.moe.experts.w2",
            "layers.1.moe.experts.w3", "layers.1.moe.shared.w1.weight"} <= names
    state = model.state_dict()
    assert "layers.1.moe.expert_bias" in state and "layers.1.moe.tokens_per_expert" not in state
    plan = model.parallel_plan()
    assert "moe" in plan.by_block["1"] and "feed_forward.w1" in plan.by_block["0"]
    scale_auxiliary_losses(model, 8)
    assert all(m.aux_scale == 0.125 for m in model.moe_layers().values())


def test_experts_are_name_seeded_with_the_residual_output_scaled_by_depth() -> None:
    cfg = moe_cfg(experts=16, expert_dim=64)
    a, b = Llama(cfg), Llama(cfg)
    init_weights(a, 3)
    init_weights(b, 3)
    moe = a.moe_layers()["0"]
    assert torch.equal(moe.experts.w1, b.moe_layers()["0"].experts.w1)
    assert not torch.equal(moe.experts.w1, a.moe_layers()["1"].experts.w1)
    assert moe.experts.w1.std().item() == pytest.approx(INIT_STD, rel=0.05)
    assert moe.experts.w2.std().item() == pytest.approx(INIT_STD / math.sqrt(2 * cfg.n_layers), rel=0.05)
    assert moe.router.gate.weight.std().item() == pytest.approx(INIT_STD, rel=0.2)
    moe.expert_bias.fill_(1.0)
    init_weights(a, 3)
    assert not moe.expert_bias.any()


def test_a_model_materialised_from_the_meta_device_starts_with_zero_bias_and_counts() -> None:
    cfg = moe_cfg(capacity_factor=1.0)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    expected = Llama(cfg)
    init_weights(expected, 0)
    for moe in model.moe_layers().values():
        assert not moe.expert_bias.any() and not moe.tokens_per_expert.any() and not moe.dropped_tokens
    x = tokens()
    assert torch.equal(model(x), expected(x))


def test_parameter_counts_hold_every_expert_and_the_active_ones_top_k() -> None:
    cfg = moe_cfg(dense_layers=1, shared_experts=1, experts=8, top_k=3)
    model = Llama(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.dim * 24
    assert param_count(cfg) - active_param_count(cfg) == 2 * (8 - 3) * expert  # two MoE blocks
    assert matmul_param_count(cfg) == active_param_count(cfg) - cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, 16) < flops_per_token(dataclasses.replace(cfg, moe=dataclasses.replace(
        cfg.moe, top_k=8)), 16)


def test_expert_weights_decay_and_learn_as_hidden_matrices_and_the_bias_is_not_optimized() -> None:
    model = Llama(moe_cfg())
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1), hidden_lr_scale=0.5)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    moe = model.moe_layers()["0"]
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        assert group_of[id(w)] is optimizer.param_groups[0] and group_of[id(w)]["weight_decay"] == 0.1
    assert optimizer.lr_scales[0] == 0.5
    router = next(i for i, g in enumerate(optimizer.param_groups) if g is group_of[id(moe.router.gate.weight)])
    assert optimizer.lr_scales[router] == 1.0 and optimizer.param_groups[router]["weight_decay"] == 0.1
    assert all(p is not moe.expert_bias for g in optimizer.param_groups for p in g["params"])


def test_a_tiny_mixture_of_experts_model_learns() -> None:
    cfg = moe_cfg(shared_experts=1, aux_loss_coeff=0.01, z_loss_coeff=0.001, dense_layers=1)
    model = Llama(cfg)
    init_weights(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens(batch=4, seq=16)
    losses = []
    for _ in range(8):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for moe in model.moe_layers().values():
            moe.update_bias(moe.tokens_per_expert, rate=0.001)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(m.expert_bias.abs().sum() > 0 for m in model.moe_layers().values())


# ---------------------------------------------------------------- the config

def test_the_moe_section_loads_and_comes_back_from_a_checkpoints_model_record() -> None:
    cfg = load_config(None, ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.score=sigmoid"])
    assert cfg.model.moe == MoEConfig(experts=8, top_k=2, score="sigmoid")
    assert ModelConfig(**dataclasses.asdict(cfg.model)) == cfg.model  # a manifest's JSON model record
    assert load_config(None).model.moe.experts == 0


@pytest.mark.parametrize("overrides,message", [
    (["model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k = 5 exceeds model.moe.experts = 4"),
    (["model.moe.experts=4", "model.n_layers=2", "model.moe.dense_layers=2"], "leaves no mixture-of-experts"),
    (["model.moe.score=relu"], "expected one of softmax, sigmoid"),
    (["model.moe.capacity_factor=-1"], "model.moe.capacity_factor = -1.0 is out of range"),
    (["model.moe.top_k=0"], "model.moe.top_k = 0 is out of range"),
    (["model.moe.expert=4"], "did you mean 'experts'"),
    (["model.moe.experts=4", "model.moe.aux_loss_coeff=0.01", "parallel.cp=2"],
     "model.moe.aux_loss_coeff = 0.01 with parallel.cp = 2: the sequence-wise balance loss needs"),
])
def test_invalid_moe_settings_are_refused_with_what_is_valid(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)
