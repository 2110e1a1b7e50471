"""The stability levers of the model and its objective: QK-norm, the embedding's scale or norm, and the
z-loss, each checked by what it is for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from keel.config import load_config
from keel.errors import ConfigError
from keel.model.llama import Llama
from keel.model.loss import Objective, log_normaliser
from tests.unit.model.test_model import TINY, build, tokens


@torch.no_grad()
def scaled_logits(model: Llama, suffixes: tuple[str, ...], factor: float) -> torch.Tensor:
    for name, p in model.named_parameters():
        if name.endswith(suffixes):
            p.mul_(factor)
    return model(tokens())


@pytest.mark.parametrize(("qk_norm", "invariant"), [(True, True), (False, False)])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(qk_norm: bool, invariant: bool) -> None:
    """What QK-norm is for: attention logits that cannot grow with the query and key weights."""
    cfg = dataclasses.replace(TINY, qk_norm=qk_norm)
    model = build(cfg)
    before = model(tokens()).detach()
    after = scaled_logits(model, ("wq.weight", "wk.weight"), 30.0)
    assert torch.allclose(before, after, atol=1e-4) is invariant


def test_qk_norm_gains_are_one_per_feature_of_a_head_and_start_at_one() -> None:
    model = build(dataclasses.replace(TINY, qk_norm=True))
    gains = {n: p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(gains) == 2 * TINY.n_layers
    assert all(p.shape == (TINY.dim // TINY.n_heads,) and torch.equal(p, torch.ones_like(p)) for p in gains.values())


def test_a_normalised_embedding_is_blind_to_the_scale_of_the_table() -> None:
    model = build(dataclasses.replace(TINY, embedding_norm="rmsnorm"))
    before = model(tokens()).detach()
    assert torch.allclose(before, scaled_logits(model, ("tok_embeddings.weight",), 50.0), atol=1e-4)
    assert model.embedding_norm is not None and model.embedding_norm.weight.shape == (TINY.dim,)


def test_a_scaled_embedding_is_the_table_times_the_root_of_the_width() -> None:
    scaled = build(dataclasses.replace(TINY, embedding_norm="scale"))
    plain = build(TINY)
    with torch.no_grad():
        assert plain.tok_embeddings is not None
        plain.tok_embeddings.weight.mul_(TINY.dim**0.5)
    torch.testing.assert_close(scaled(tokens()), plain(tokens()), rtol=0, atol=1e-5)


def test_an_unknown_embedding_norm_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.embedding_norm=layernorm"])
    assert "model.embedding_norm" in str(e.value) and "rmsnorm" in str(e.value)


def test_log_normaliser_is_logsumexp_even_where_exp_overflows() -> None:
    logits = torch.randn(5, 61) * 3 + torch.tensor([0.0, 500.0, -500.0, 90.0, 0.0])[:, None]
    torch.testing.assert_close(log_normaliser(logits), torch.logsumexp(logits, dim=-1))


def test_without_a_z_loss_the_objective_is_the_cross_entropy_itself() -> None:
    logits, targets = torch.randn(2, 6, 61), torch.randint(0, 61, (2, 6))
    differentiated, cross_entropy = Objective()(logits, targets)
    assert differentiated is cross_entropy
    torch.testing.assert_close(cross_entropy, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_the_z_loss_adds_its_coefficient_times_the_mean_square_log_normaliser() -> None:
    logits, targets = (torch.randn(2, 6, 61) + 4).requires_grad_(), torch.randint(0, 61, (2, 6))
    differentiated, cross_entropy = Objective(z_loss=1e-2)(logits, targets)
    log_z = torch.logsumexp(logits.detach().flatten(0, 1), dim=-1)
    torch.testing.assert_close(differentiated - cross_entropy, 1e-2 * log_z.square().mean())
    # It pulls log Z towards 0: a step down its gradient lowers every row's log Z here (all positive).
    (differentiated - cross_entropy).backward()
    assert logits.grad is not None
    moved = torch.logsumexp((logits - 10 * logits.grad).detach().flatten(0, 1), dim=-1)
    assert (moved < log_z).all()
