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


def bf16_loss_backward(model: Llama) -> float:
    """One forward under bf16 autocast and its backward, on the same tokens each call; the loss."""
    x = tokens(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return loss.item()


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
    losses = [bf16_loss_backward(model) for model in (plain, fp8)]
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert losses[1] != losses[0]  # float8 really ran
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in fp8.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        cosine = F.cosine_similarity(p.grad.flatten(), grads[name].flatten(), dim=0)
        assert cosine > 0.97, (name, cosine)



def test_a_float8_cast_keeps_e4m3_values_and_rounds_the_others_within_its_precision() -> None:
    from keel.model.float8 import fake_float8, power_of_2_scale

    exact = torch.tensor([[1.0, -0.5, 448.0, 0.0], [3.0, 0.25, -2.0, 1.5]])
    assert torch.equal(fake_float8(exact, -1), exact)  # a row's amax lands on 448 by a power-of-2 scale: exact
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    q = fake_float8(x, -1)
    assert not torch.equal(q, x)
    # Scaled, a row's amax lands within [224, 448]; e4m3's normal numbers start at 2^-6 and carry 3 mantissa bits
    # (within half an ulp, 2^-4 of the value); below, subnormals are spaced 2^-9 apart.
    scale = power_of_2_scale(x.abs().amax(-1, keepdim=True))
    normal = x.abs() * scale >= 2**-6
    assert ((q - x).abs() <= x.abs() * 2**-4)[normal].all()
    assert ((q - x).abs() * scale <= 2**-10)[~normal].all()
    assert fake_float8(torch.zeros(0, 4), 0).shape == (0, 4)  # an expert that got no token


def test_the_emulated_float8_grouped_gemm_takes_every_product_through_float8_per_group() -> None:
    from keel.model.float8 import EmulatedFloat8GroupedMM, fake_float8

    torch.manual_seed(0)
    sizes = [3, 0, 5]  # the middle expert got no token
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(3, 16, 32, requires_grad=True)
    out = EmulatedFloat8GroupedMM.apply(x, w, sizes)
    grad = torch.randn_like(out)
    out.backward(grad)
    xq, wq = fake_float8(x.detach(), -1), fake_float8(w.detach(), -1)
    assert torch.equal(out, torch.cat([xq[:3] @ wq[0].T, xq[3:] @ wq[2].T]))
    gq, wt = fake_float8(grad, -1), fake_float8(w.detach(), -2)
    assert torch.equal(x.grad, torch.cat([gq[:3] @ wt[0], gq[3:] @ wt[2]]))
    assert torch.equal(w.grad[1], torch.zeros(16, 32))
    assert torch.equal(w.grad[2], fake_float8(grad[3:], 0).T @ fake_float8(x.detach()[3:], 0))
    # ...and all of it within float8's precision of the exact products.
    exact = torch.cat([x.detach()[:3] @ w.detach()[0].T, x.detach()[3:] @ w.detach()[2].T])
    assert F.cosine_similarity(out.detach().flatten(), exact.flatten(), dim=0) > 0.99


def test_aligned_routed_experts_train_in_float8_and_misaligned_ones_in_bf16() -> None:
    from keel.model.float8 import float8_expert_swiglu
    from keel.model.moe import Experts, expert_swiglu

    cfg = moe_cfg(expert_dim=32, dense_layers=0)
    plain, fp8 = Llama(cfg), Llama(cfg)
    for model in (plain, fp8):
        init_weights(model, 0)
    kept = convert_to_float8(fp8, "tensorwise", emulate=True, fsdp=False)  # the experts' scaling is rowwise anyway
    experts = {name for name, module in fp8.named_modules() if isinstance(module, Experts)}
    assert experts and experts <= set(kept)
    assert all(fp8.get_submodule(name).swiglu is float8_expert_swiglu for name in experts)
    losses = [bf16_loss_backward(model) for model in (plain, fp8)]
    assert losses[1] == pytest.approx(losses[0], rel=2e-2) and losses[1] != losses[0]
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in fp8.named_parameters():
        if ".experts." in name:
            assert F.cosine_similarity(p.grad.flatten(), grads[name].flatten(), dim=0) > 0.97, name
    misaligned = Llama(moe_cfg(expert_dim=24))
    convert_to_float8(misaligned, "rowwise", emulate=True, fsdp=False)
    assert all(m.swiglu is expert_swiglu for m in misaligned.modules() if isinstance(m, Experts))
