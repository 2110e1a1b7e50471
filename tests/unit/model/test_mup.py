"""μP (model.parametrization = "mup"): the same model as the standard one at its base width, and away from it
the init, learning-rate, output and attention scales of Tensor Programs V (for Adam)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.checkpoint.export import check_hf_expressible
from keel.config import ModelConfig, OptimConfig, load_config
from keel.errors import CheckpointError, ConfigError
from keel.model.init import INIT_STD
from keel.model.llama import width_ratio
from keel.train.optim import build_optimizer
from keel.train.step import set_lr
from tests.unit.model.test_model import build, tokens

BASE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)
MUP = dataclasses.replace(BASE, parametrization="mup", base_dim=32)


def test_at_its_base_width_mup_is_the_standard_model() -> None:
    sp, mup = build(BASE), build(MUP)
    for (name, a), (_, b) in zip(sp.named_parameters(), mup.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    torch.testing.assert_close(mup(tokens()), sp(tokens()), rtol=1e-6, atol=1e-6)
    optimizer = build_optimizer(mup, OptimConfig(lr=1e-3), width_ratio(MUP))
    set_lr([optimizer], 1e-3)
    assert {group["lr"] for group in optimizer.param_groups} == {1e-3}


@pytest.mark.parametrize("factor", [4, 16])
def test_wider_models_scale_hidden_init_and_learning_rate_and_the_output(factor: int) -> None:
    cfg = dataclasses.replace(MUP, dim=32 * factor)  # the same heads, each wider
    model = build(cfg)
    params = dict(model.named_parameters())
    # A hidden matrix's std goes as 1/sqrt(width); the embedding's and the output's stay.
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(INIT_STD / factor**0.5, rel=0.05)
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(INIT_STD, rel=0.05)
    assert params["output.weight"].std().item() == pytest.approx(INIT_STD, rel=0.05)
    assert model.output_multiplier == 1 / factor
    # The head size grows from 8 to 8 × factor: q·k is scaled by 1/head size, sp's 1/sqrt(8) at the base.
    assert model.layers["0"].attention.scale == pytest.approx(8**0.5 / (8 * factor))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=1e-4, independent_weight_decay=True),
                                width_ratio(cfg))
    set_lr([optimizer], 1e-2)
    hidden, other, vectors = optimizer.param_groups

    def holds(group: dict, name: str) -> bool:
        return any(p is params[name] for p in group["params"])

    assert holds(hidden, "layers.1.feed_forward.w2.weight") and hidden["lr"] == 1e-2 / factor
    assert holds(other, "output.weight") and other["lr"] == 1e-2
    assert holds(vectors, "norm.weight") and vectors["lr"] == 1e-2 and vectors["weight_decay"] == 0
    # Independent weight decay shrinks every matrix by weight_decay × lr / peak, whatever its group's peak.
    assert hidden["lr"] * hidden["weight_decay"] == pytest.approx(other["lr"] * other["weight_decay"])


def test_the_output_multiplier_scales_the_logits() -> None:
    model = build(dataclasses.replace(MUP, dim=64))
    scaled = model(tokens())
    model.output_multiplier = 1.0
    torch.testing.assert_close(scaled, model(tokens()) / 2)


@pytest.mark.parametrize(("overrides", "expect"), [
    (["model.base_dim=64"], "model.parametrization = 'mup'"),
    (["model.parametrization=mup", "model.tie_embeddings=true"], "model.tie_embeddings = false"),
])
def test_inconsistent_mup_settings_are_refused_in_one_line(overrides: list[str], expect: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert len(str(e.value).splitlines()) == 1 and expect in str(e.value)


def test_a_mup_model_away_from_its_base_width_is_not_exported() -> None:
    check_hf_expressible(MUP)  # at the base width it is a Llama
    with pytest.raises(CheckpointError, match="only a μP model at its base width"):
        check_hf_expressible(dataclasses.replace(MUP, dim=64))
