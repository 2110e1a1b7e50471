"""Op-level selective activation checkpointing (parallel.ac_selective = "op"): a checkpointed block keeps the
outputs of its costly operations and recomputes the cheap ones in the backward pass.

Kept: attention (whichever SDPA kernel ran), and every other matrix multiplication, counted in the order the
block runs them (the 1st, 3rd, ...); also a float8 matmul's output and its amax reduction, and a reduce-scatter, so
that the backward repeats no collective of tensor parallelism. Recomputed: the 2nd, 4th, ... matmuls and everything
elementwise (norms, RoPE, SwiGLU's activation), which costs little beside the matmuls kept. Keeping every other
matmul halves what the matmuls would hold, where keeping all of them would save little over no checkpointing.
The backward's recomputation counts the matmuls again from the first, so it keeps and recomputes the same ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten
MATMUL = aten.mm.default


def _kept_ops() -> set[Any]:
    """The operations whose outputs a block keeps, besides every other matmul: those the installed torch has."""
    kept = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_mm.default, aten.max.default}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        kept.add(functional.reduce_scatter_tensor.default)
    return kept


KEPT = _kept_ops()


def op_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy for one checkpointed forward (and its recomputation): its own matmul counts."""
    matmuls = {False: 0, True: 0}  # by whether the block is being recomputed

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == MATMUL:
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1
        else:
            keep = op in KEPT
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_contexts() -> tuple[Any, Any]:
    """torch.utils.checkpoint's `context_fn`: the forward's and the recomputation's contexts under `op_policy`."""
    return create_selective_checkpoint_contexts(op_policy())
