"""Float8 training of the blocks' linear layers (`train.precision = "fp8"`), through torchao: each kept
`nn.Linear` becomes a `Float8Linear` that casts its input, weight and output gradient to float8 with dynamic scales
(one per row, or one per tensor) for its three matrix multiplications, and keeps its weight a high-precision
parameter under the same name, so that checkpoints move between fp8 and bf16 runs unchanged; a mixture of
experts' routed experts run their grouped GEMMs in float8 (rowwise). On a CPU the float8 GEMMs are emulated: the
numerics of a GPU run, not its speed."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from keel.model.moe import Experts, grouped_swiglu

# float8 GEMMs take dimensions that are multiples of 16.
ALIGN = 16
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # what dynamic scaling maps each row's (or tensor's) amax to


def power_of_2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale dynamic scaling gives values of this amax: e4m3's largest value over it, rounded down to a power
    of 2 (as torchao rounds it), so that scaling is exact and the largest value lands within the format."""
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(1e-12))))


def keeps_float8(module: nn.Module, name: str) -> bool:
    """The linear layers that train in float8: every one in the blocks whose dimensions float8 GEMMs take, but not
    the output projection (the logits' precision matters most) nor a router's gate (it scores in fp32)."""
    if not isinstance(module, nn.Linear) or name == "output" or name.endswith("router.gate"):
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def convert_to_float8(model: nn.Module, recipe: str, emulate: bool, fsdp: bool) -> list[str]:
    """Swap the kept linear layers for torchao's float8 ones and give the routed experts float8 grouped GEMMs (rowwise
    whatever the recipe: the only scaling torchao's grouped GEMM has), in place (on the meta device too, before the
    model is parallelised); returns their names. Tensorwise scaling under FSDP all-gathers the linear layers'
    weights in float8."""
    if emulate:  # torchao says at import that its CUDA kernels do not load: true, and not needed to emulate
        logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise")
    kept = [name for name, module in model.named_modules() if keeps_float8(module, name)]
    convert_to_float8_training(model, config=config, module_filter_fn=keeps_float8)
    for name, module in model.named_modules():
        if isinstance(module, Experts) and experts_take_float8(module):
            module.swiglu = float8_expert_swiglu
            kept.append(name)
    return kept


# ---------------------------------------------------------------- routed experts: float8 grouped GEMMs

def experts_take_float8(experts: Experts) -> bool:
    """Whether the experts' both dimensions are multiples of 16, as float8 grouped GEMMs need."""
    hidden, dim = experts.w1.shape[1:]
    return hidden % ALIGN == 0 and dim % ALIGN == 0


def fake_float8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` (float32) as it comes back from a cast to float8 e4m3 with a power-of-2 scale per slice along `dim`:
    rowwise scaling takes the slices along the dimension a product contracts. An empty slice stays empty."""
    x = x.float()
    if x.shape[dim] == 0:
        return x
    scale = power_of_2_scale(x.abs().amax(dim, keepdim=True))
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale


class EmulatedFloat8GroupedMM(torch.autograd.Function):
    """Each group's rows of `x` (rows, K), sorted by group (`sizes` rows each), times the transpose of its weight of
    `w` (groups, N, K), with every operand of the three products in float8, scaled per slice along the dimension
    the product contracts, as torchao's rowwise float8 grouped GEMM scales them: forward x by rows and w by its
    output rows; the input's gradient, the output gradient by rows and w by its input columns; the weight's
    gradient, both per group along its tokens. The products of the float8 values are summed in float32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.sizes = sizes
        xq, wq = fake_float8(x, -1), fake_float8(w, -1)
        return torch.cat([rows @ wq[g].T for g, rows in enumerate(xq.split(sizes))])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w = ctx.saved_tensors
        gq, wq = fake_float8(grad, -1), fake_float8(w, -2)
        dx = torch.cat([rows @ wq[g] for g, rows in enumerate(gq.split(ctx.sizes))])
        dw = torch.stack([fake_float8(g, 0).T @ fake_float8(rows, 0)
                          for g, rows in zip(grad.split(ctx.sizes), x.split(ctx.sizes), strict=True)])
        return dx.to(x.dtype), dw.to(w.dtype), None


def float8_expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         w3: torch.Tensor) -> torch.Tensor:
    """keel.model.moe.expert_swiglu with its three grouped GEMMs in float8 (rowwise): on CUDA torchao's scaled
    grouped GEMM in bf16, on a CPU its emulation (EmulatedFloat8GroupedMM), in the autocast dtype as a float8
    linear layer's output is."""
    if x.is_cuda:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as mm

        bf16 = torch.bfloat16
        out = grouped_swiglu(x.to(bf16), counts, w1.to(bf16), w2.to(bf16), w3.to(bf16), mm=lambda a, b, offs: mm(
            a, b, offs, out_dtype=bf16, pad_token_groups_for_grouped_mm=False))
        return out.to(x.dtype)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    sizes = counts.tolist()
    with torch.autocast("cpu", enabled=False):
        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return EmulatedFloat8GroupedMM.apply(a, w, sizes)

        return mm(F.silu(mm(x, w1)) * mm(x, w3), w2).to(dtype)


def is_float8(module: nn.Module) -> bool:
    """Whether `module` is one of torchao's float8 linear layers (torchao is imported only by a float8 run)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def tensorwise(module: nn.Module) -> bool:
    """Whether a float8 linear layer scales its input by one amax for the whole tensor."""
    from torchao.float8.config import ScalingGranularity

    config: Any = module.config
    return bool(config.cast_config_input.scaling_granularity == ScalingGranularity.TENSORWISE)


@torch.no_grad()
def float8_reading(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What casting `x` to float8 e4m3 with dynamic scaling does to it, as torchao scales (amax to the format's
    largest value, the scale rounded down to a power of 2; per row or per tensor): its amax (not finite: an
    overflow), how many of its non-zero elements flush to zero (underflow), and its number of elements."""
    x = x.detach().float().flatten(0, -2)
    amax = x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax()
    scale = power_of_2_scale(amax)
    flushed = ((x * scale).to(torch.float8_e4m3fn) == 0) & (x != 0)
    return amax.max(), flushed.sum(), x.numel()
