"""The instability signals: each reading equals the quantity computed the long way, and a step that is not
sampled carries no hook."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from keel.config import ModelConfig, OptimConfig
from keel.core.callbacks import Step
from keel.core.state import TrainState
from keel.model.init import init_weights
from keel.model.llama import Llama, apply_rope
from keel.train.optim import build_optimizer
from keel.train.signals import InstabilitySignals, largest_attention_logit

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=320)


def naive_largest_logit(model: Llama, layer: int, x: torch.Tensor) -> float:
    """Every causal score of every head, written out (keys shared by GQA groups)."""
    attention = model.layers[str(layer)].attention
    b, s, _ = x.shape
    q = attention.wq(x).view(b, s, -1, attention.head_dim)
    k = attention.wk(x).view(b, s, -1, attention.head_dim)
    if attention.q_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = apply_rope(q, model.rope), apply_rope(k, model.rope)
    best = -math.inf
    for h in range(q.shape[2]):
        kv = h // (q.shape[2] // k.shape[2])
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(attention.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        best = max(best, scores[:, causal].max().item())
    return best


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_largest_attention_logit_is_that_of_every_causal_pair_over_chunks(qk_norm: bool) -> None:
    model = Llama(dataclasses.replace(TINY, qk_norm=qk_norm))
    init_weights(model, 0)
    with torch.no_grad():
        model.layers["1"].attention.wq.weight.mul_(40)  # logits far from 0, a future key would win if unmasked
    x = torch.randn(2, 300, TINY.dim)  # more queries than one chunk of scores
    got = largest_attention_logit(model.layers["1"].attention, x, model.rope).item()
    assert got == pytest.approx(naive_largest_logit(model, 1, x), rel=1e-5)


def one_step(model: Llama, optimizer: torch.optim.Optimizer, signals: InstabilitySignals, number: int,
             tokens: torch.Tensor) -> tuple[Step, list[torch.Tensor]]:
    step = Step(number=number, state=TrainState(step=number - 1), last=False)
    signals.on_step_start(step)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    signals.on_backward(step, False)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    step.updated = True
    signals.on_step_end(step)
    return step, before


def test_each_reading_is_the_quantity_itself_and_unsampled_steps_have_no_hooks(group: None, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Llama(TINY)
    init_weights(model, 0)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    signals = InstabilitySignals(2, [model], [optimizer], TINY.n_layers, pp=1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17))
    one_step(model, optimizer, signals, 1, tokens)
    assert signals.last == {}  # step 1 is not sampled
    logit: dict[str, float] = {}  # the long way, with the weights of the forward
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):  # noqa: ANN202 (a hook)
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            outputs[name] = output.detach()
            if name != "logits":
                with torch.no_grad():
                    logit[name] = naive_largest_logit(model, int(name), model.layers[name].attention_norm(args[0]))
        return hook

    for i, block in model.layers.items():
        block.register_forward_hook(keep(i))
    model.register_forward_hook(keep("logits"))
    _, before = one_step(model, optimizer, signals, 2, tokens)
    last = signals.last
    ours = [m for m in model.modules() if len(m._forward_hooks) > (m in (*model.layers.values(), model))]
    assert not ours, "the sampled step's hooks are gone"
    params = dict(zip([n for n, _ in model.named_parameters()], before, strict=True))
    with torch.no_grad():
        for i in ("0", "1"):
            assert last[f"signals/attn_logit_max/layer_{i}"] == pytest.approx(logit[i], rel=1e-5)
            assert last[f"signals/act_rms/layer_{i}"] == pytest.approx(outputs[i].square().mean().sqrt().item(),
                                                                       rel=1e-5)
            change = torch.cat([(p - params[n]).flatten() for n, p in model.named_parameters()
                                if n.startswith(f"layers.{i}.")])
            assert last[f"signals/update_rms/layer_{i}"] == pytest.approx(change.square().mean().sqrt().item(),
                                                                          rel=1e-4)
        log_z = torch.logsumexp(outputs["logits"], dim=-1)
    assert last["signals/attn_logit_max"] == max(last[f"signals/attn_logit_max/layer_{i}"] for i in "01")
    assert last["signals/log_z_mean"] == pytest.approx(log_z.mean().item(), rel=1e-5)
    assert last["signals/log_z_max"] == pytest.approx(log_z.max().item(), rel=1e-5)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_float8_run_reads_the_share_its_casts_flush_to_zero_and_the_largest_amax(group: None,
                                                                                   recipe: str) -> None:
    pytest.importorskip("torchao")
    from keel.model.float8 import convert_to_float8, is_float8

    model = Llama(dataclasses.replace(TINY, dim=64))
    init_weights(model, 0)
    convert_to_float8(model, recipe, emulate=True, fsdp=False)
    with torch.no_grad():  # one feature 10^5 times the others: the rest of every row is below float8's reach
        model.tok_embeddings.weight[:, 0] = 1e3
    inputs: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):  # noqa: ANN202 (a hook)
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            inputs.setdefault(name, []).append(args[0].detach().float().flatten(0, -2))
        return hook

    for name, module in model.named_modules():
        if is_float8(module):
            module.register_forward_hook(keep(name))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    signals = InstabilitySignals(1, [model], [optimizer], TINY.n_layers, pp=1, float8_rowwise=recipe == "rowwise")
    one_step(model, optimizer, signals, 1, torch.randint(0, TINY.vocab_size, (2, 17)))
    last = signals.last
    for layer in ("0", "1"):  # the long way: every float8 input scaled, cast and compared
        flushed = total = 0
        for name, xs in inputs.items():
            if name.startswith(f"layers.{layer}."):
                for x in xs:
                    amax = x.abs().amax(-1, keepdim=True) if recipe == "rowwise" else x.abs().amax()
                    scale = 2.0 ** torch.floor(torch.log2(448.0 / amax))
                    flushed += int((((x * scale).to(torch.float8_e4m3fn) == 0) & (x != 0)).sum())
                    total += x.numel()
        assert last[f"signals/float8_underflow/layer_{layer}"] == pytest.approx(flushed / total)
    assert last["signals/float8_underflow/layer_0"] > 0.05  # the first layer's projections see the planted rows
    assert last["signals/float8_amax_max"] == max(x.abs().max().item() for xs in inputs.values() for x in xs)
    plain = InstabilitySignals(1, [Llama(TINY)], [optimizer], TINY.n_layers, pp=1)
    assert not any("float8" in key for key in plain._reduce())  # a run without float8 layers has none
