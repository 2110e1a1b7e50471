"""Float8 training of the blocks' linear layers (`train.precision = "fp8"`), through torchao: each kept
`nn.Linear` becomes a `Float8Linear` that casts its input, weight and output gradient to float8 with dynamic scales
(one per row, or one per tensor) for its three matrix multiplications, and keeps its weight a high-precision
parameter under the same name, so that checkpoints move between fp8 and bf16 runs unchanged. On a CPU torchao
emulates the float8 GEMMs: the numerics of a GPU run, not its speed."""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

# float8 GEMMs take dimensions that are multiples of 16.
ALIGN = 16


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
