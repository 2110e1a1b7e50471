"""Float8 training of the blocks' linear layers (torchao, emulated on a CPU): which layers convert, that the
parameters keep their names (checkpoints move between fp8 and bf16 runs), and that the emulated float8 model
computes what the bf16 one does within float8's precision."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from keel.model.float8 import convert_to_float8
from keel.model.init import init_weights
from keel.model.llama import Llama
from tests.unit.model.test_model import TINY, tokens
from tests.unit.model.test_moe import moe_cfg

pytest.importorskip("torchao")

WIDE = dataclasses.replace(TINY, dim=64, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=1.0)


def test_the_blocks_linear_layers_convert_but_not_the_output_a_router_or_misaligned_ones() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = Llama(moe_cfg(expert_dim=24))  # dim 32: attention and the shared experts align, 24-wide ones do not
    kept = convert_to_float8(model, "rowwise", emulate=True, fsdp=False)
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert converted == set(kept) and converted
    assert "output" not in converted and not any("router" in name for name in converted)
    assert all(name.split(".")[-1] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for name in converted)
    for name in converted:
        module = model.get_submodule(name)
        assert module.in_features % 16 == 0 and module.out_features % 16 == 0


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_float8_model_keeps_its_parameter_names_and_computes_as_bf16_within_float8s_precision(
        recipe: str) -> None:
    plain, fp8 = Llama(WIDE), Llama(WIDE)
    for model in (plain, fp8):
        init_weights(model, 0)
    before = {name: p.detach().clone() for name, p in fp8.named_parameters()}
    convert_to_float8(fp8, recipe, emulate=True, fsdp=False)
    assert fp8.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(before[name], p) for name, p in fp8.named_parameters())  # high-precision weights kept
    x = tokens(2, 16)
    losses = []
    for model in (plain, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert losses[1] != losses[0]  # float8 really ran
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in fp8.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        cosine = F.cosine_similarity(p.grad.flatten(), grads[name].flatten(), dim=0)
        assert cosine > 0.97, (name, cosine)

