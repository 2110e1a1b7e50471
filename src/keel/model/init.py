"""Layout-independent initialisation: each parameter's values depend only on the seed and its name.

The full tensor is drawn from a generator seeded by (seed, name) and each process keeps its own
shard of it, so one process and N processes start from bitwise-identical weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from keel.config import ModelConfig
from keel.model.llama import HIDDEN_MATRICES, Llama, width_ratio

INIT_STD = 0.02
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name without the prefixes that wrappers (checkpointing, compile) insert."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{canonical_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int, device: torch.device) -> torch.Tensor:
    """The full initial value of one parameter."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    # Output projections of each residual branch (the experts' w2 among them) are scaled down with depth (GPT-2 /
    # Llama practice). A router's gate is drawn as the other matrices are, INIT_STD, not scaled under μP.
    residual_out = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
    std = INIT_STD / math.sqrt(2 * cfg.n_layers) if residual_out else INIT_STD
    if name.endswith(HIDDEN_MATRICES):
        std *= math.sqrt(width_ratio(cfg))  # μP: a hidden matrix's std goes as 1/sqrt(fan-in)
    gen = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    full = torch.empty(shape, device=device)
    return full.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Fill every parameter (plain or DTensor shard) from its name-seeded full value; the experts' balancing
    biases start at 0."""
    model.reset_buffers()
    for moe in model.moe_layers().values():
        moe.expert_bias.zero_()
    for name, param in model.named_parameters():
        name = canonical_name(name)
        device = param.device if not isinstance(param, DTensor) else param.to_local().device
        full = init_value(name, param.shape, model.cfg, seed, device)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full.to(param.dtype))
