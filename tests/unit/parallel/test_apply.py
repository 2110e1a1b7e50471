"""What keel.parallel.apply does to a one-process model: per-block compile in the configured mode, activation
checkpointing, and the tensor-parallel styles of float8 layers."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from keel.config import ModelConfig, ParallelConfig
from keel.model.float8 import convert_to_float8
from keel.model.flops import ffn_hidden_dim
from keel.model.init import canonical_name, init_weights
from keel.model.llama import Llama
from keel.parallel.apply import apply_activation_checkpointing, compile_blocks, float8_style

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)
WIDE = dataclasses.replace(TINY, dim=64, ffn_dim_multiplier=1.0)  # every block's linear layer takes float8


def build(cfg: ModelConfig = TINY) -> Llama:
    model = Llama(cfg)
    init_weights(model, 0)
    return model


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def grads(model: Llama, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def compiler_settings(model: Llama) -> list[dict]:
    """The Inductor settings each block was compiled with (torch.compile's `mode` sets them)."""
    return [block._compiled_call_impl.get_compiler_config() for block in model.blocks().values()]


@pytest.mark.parametrize(("mode", "autotune", "cudagraphs"), [
    ("default", False, False), ("reduce-overhead", False, True), ("max-autotune", True, True),
    ("max-autotune-no-cudagraphs", True, False)])
def test_each_compile_mode_reaches_torch_compile_of_every_block(mode: str, autotune: bool, cudagraphs: bool) -> None:
    model = build()
    compile_blocks(model, ParallelConfig(compile=True, compile_mode=mode).compile_mode)
    for settings in compiler_settings(model):
        assert settings["max_autotune"] is autotune and settings["triton.cudagraphs"] is cudagraphs


def test_blocks_compiled_with_max_autotune_train_to_the_eager_gradients_on_a_cpu() -> None:
    eager, compiled = build(), build()
    compile_blocks(compiled, "max-autotune-no-cudagraphs")
    x = tokens()
    expected, got = grads(eager, x), grads(compiled, x)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- activation checkpointing
DEEP = dataclasses.replace(TINY, dim=64, n_layers=4, max_seq_len=64)


class LiveTensors(TorchDispatchMode):
    """Every tensor the operations under it produce; `bytes()`: the storage still held of those alive now."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def bytes(self) -> int:
        storages = {}
        for ref in self.made:
            if (t := ref()) is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def checkpointed(ac: str, selective: str = "layer") -> Llama:
    model = build(DEEP)
    apply_activation_checkpointing(model, ParallelConfig(activation_checkpoint=ac, ac_selective=selective))
    return model


def held_for_backward(model: Llama, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the activations the blocks hold between their forward and backward (fp32), and the loss."""
    with LiveTensors() as live:
        rope, _ = model.attention_inputs(x, x.shape[1])
        h = model.tok_embeddings(x)
        for block in model.blocks().values():
            h = block(h, rope)
        loss = h.square().mean()
    return live.bytes(), loss


def test_op_level_checkpointing_holds_attention_and_every_other_matmul_of_each_block() -> None:
    x = tokens(2, 64)
    held = {(ac, sel): held_for_backward(checkpointed(ac, sel), x)[0]
            for ac, sel in [("none", "layer"), ("full", "layer"), ("selective", "layer"), ("selective", "op")]}
    # In the order a block runs them the matmuls are wq, wk, wv, wo, w1, w3, w2: it keeps wq, wv, w1 and w2, and
    # the attention's output and log-sum-exp; besides, every block's input, the last block's output and the loss.
    batch, seq, dim, heads, hidden = 2, 64, DEEP.dim, DEEP.n_heads, ffn_hidden_dim(DEEP)
    kv = DEEP.n_kv_heads * dim // heads
    kept = 4 * batch * seq * (dim + kv + hidden + dim + dim + heads)
    assert held["selective", "op"] == DEEP.n_layers * (kept + 4 * batch * seq * dim) + 4 * batch * seq * dim + 4
    assert held["full", "layer"] < held["selective", "op"] < held["selective", "layer"] < held["none", "layer"]


@pytest.mark.parametrize(("ac", "selective"), [("full", "layer"), ("selective", "layer"), ("selective", "op")])
def test_checkpointed_blocks_give_the_gradients_of_the_plain_model_bitwise(ac: str, selective: str) -> None:
    x = tokens(2, 64)
    plain, wrapped = build(DEEP), checkpointed(ac, selective)
    expected = grads(plain, x)
    got = {canonical_name(name): g for name, g in grads(wrapped, x).items()}
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_op_level_checkpointing_wraps_every_block_whatever_ac_every() -> None:
    model = build(DEEP)
    apply_activation_checkpointing(model, ParallelConfig(activation_checkpoint="selective", ac_selective="op",
                                                         ac_every=3))
    assert all(isinstance(block, CheckpointWrapper) for block in model.blocks().values())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tensorwise_float8_layers_take_the_float8_styles_with_the_declared_layouts(recipe: str) -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    model = Llama(WIDE)
    convert_to_float8(model, recipe, emulate=True, fsdp=False)
    plan, block = model.parallel_plan(), model.layers["0"]
    styles = {name: float8_style(block, name, style) for name, style in plan.block.items()}
    wq, wo = styles["attention.wq"], styles["attention.wo"]
    if recipe == "rowwise":  # scaled per row of the gathered input: the plain styles
        assert styles == plan.block
        return
    assert type(wq) is Float8ColwiseParallel and type(wo) is Float8RowwiseParallel
    assert wo.output_layouts == (Shard(1),) and wo.use_local_output == plan.block["attention.wo"].use_local_output
    assert styles["attention_norm"] is plan.block["attention_norm"]  # not a linear layer
    plain = Llama(WIDE)  # no float8 layers: nothing changes
    assert all(float8_style(plain.layers["0"], name, style) is style for name, style in plan.block.items()
               if isinstance(style, ColwiseParallel | RowwiseParallel))
