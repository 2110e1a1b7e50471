"""What keel.parallel.apply does to a one-process model: per-block compile in the configured mode, and
activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from keel.config import ModelConfig, ParallelConfig
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.parallel.apply import compile_blocks

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)


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
