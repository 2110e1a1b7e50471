"""Float8 training of the blocks' linear layers (`train.precision = "fp8"`), through torchao: each kept
`nn.Linear` becomes a `Float8Linear` that casts its input, weight and output gradient to float8 with dynamic scales
(one per row, or one per tensor) for its three matrix multiplications, and keeps its weight a high-precision
parameter under the same name, so that checkpoints move between fp8 and bf16 runs unchanged. On a CPU torchao
emulates the float8 GEMMs: the numerics of a GPU run, not its speed."""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch
from torch import nn

# float8 GEMMs take dimensions that are multiples of 16.
ALIGN = 16
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # what dynamic scaling maps each row's (or tensor's) amax to


def keeps_float8(module: nn.Module, name: str) -> bool:
    """The linear layers that train in float8: every one in the blocks whose dimensions float8 GEMMs take, but not
    the output projection (the logits' precision matters most) nor a router's gate (it scores in fp32)."""
    if not isinstance(module, nn.Linear) or name == "output" or name.endswith("router.gate"):
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def convert_to_float8(model: nn.Module, recipe: str, emulate: bool, fsdp: bool) -> list[str]:
    """Swap the kept linear layers for torchao's float8 ones, in place (on the meta device too, before the model is
    parallelised); returns their names. Tensorwise scaling under FSDP all-gathers the weights in float8."""
    if emulate:  # torchao says at import that its CUDA kernels do not load: true, and not needed to emulate
        logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")
    kept = [name for name, module in model.named_modules() if keeps_float8(module, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=keeps_float8)
    return kept


def is_float8(module: nn.Module) -> bool:
    """Whether `module` is one of torchao's float8 linear layers (torchao is imported only by a float8 run)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


@torch.no_grad()
def float8_reading(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What casting `x` to float8 e4m3 with dynamic scaling does to it, as torchao scales (amax to the format's
    largest value, the scale rounded down to a power of 2; per row or per tensor): its amax (not finite: an
    overflow), how many of its non-zero elements flush to zero (underflow), and its number of elements."""
    x = x.detach().float().flatten(0, -2)
    amax = x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax()
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(1e-12))))
    flushed = ((x * scale).to(torch.float8_e4m3fn) == 0) & (x != 0)
    return amax.max(), flushed.sum(), x.numel()
