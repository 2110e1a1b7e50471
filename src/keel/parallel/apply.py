"""Parallelise the model for its layout: the registered degrees (context parallel, expert parallel, ...: each
through its hook of the model), tensor + sequence parallel, activation checkpointing, per-block compile, then
FSDP2 (HSDP across replicas). A one-process run wraps nothing. Any model that declares its blocks, tensor-parallel
plan and experts (`keel.model.parallelizable`) is parallelised alike."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from keel.config import ParallelConfig
from keel.core.torch_private import checkpoint_wrapper
from keel.model.float8 import is_float8, tensorwise
from keel.model.parallelizable import Parallelizable
from keel.parallel.layout import Layout
from keel.parallel.selective import op_contexts


def parallelize(model: Parallelizable, layout: Layout, cfg: ParallelConfig, param_dtype: torch.dtype) -> None:
    apart = apply_degrees(model, layout, cfg)
    if layout.tensor_parallel:
        apply_tensor_parallel(model, layout.tp)
    apply_activation_checkpointing(model, cfg)
    if cfg.compile:
        compile_blocks(model, cfg.compile_mode)
    if layout.shards_parameters:
        reduce_dtype = torch.bfloat16 if cfg.reduce_dtype == "bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # A pipeline runs many micro-batches through a stage between its gradient syncs: its parameters stay
        # gathered from the first forward to the sync, not gathered again for each micro-batch's forward and
        # backward (the schedule reshards them after the last backward).
        reshard = not layout.pipelined
        for module, mesh in apart:  # split over a degree's ranks already: FSDP shards them over the ranks left over
            fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        apply_fsdp(model, layout.fsdp, policy, reshard)


def apply_degrees(model: Parallelizable, layout: Layout, cfg: ParallelConfig) -> list[tuple[nn.Module, DeviceMesh]]:
    """What each degree above 1 asks of the model (`DegreeSpec.apply`), the mesh's first; returns the modules they
    split, each with the mesh FSDP shards it over."""
    d = layout.degrees
    return [(module, mesh) for spec in d.specs if spec.apply is not None and d.of(spec.name) > 1
            for module, mesh in spec.apply(model, layout, cfg)]


def module_of(model: Parallelizable) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"only an nn.Module can be parallelised, not a {type(model).__name__}")
    return model


def apply_tensor_parallel(model: Parallelizable, tp_mesh: DeviceMesh) -> None:
    """The model's own plan (`parallel_plan`): its top-level modules, then every block."""
    plan = model.parallel_plan()
    parallelize_module(module_of(model), tp_mesh, plan.top)
    for key, block in model.blocks().items():
        styles = {**plan.block, **plan.by_block.get(key, {})}
        if tp_mesh.device_type == "cuda":  # gloo moves no float8 tensors
            styles = {name: float8_style(block, name, style) for name, style in styles.items()}
        parallelize_module(block, tp_mesh, styles)


def float8_style(block: nn.Module, name: str, style: ParallelStyle) -> ParallelStyle:
    """`style`, or torchao's float8 counterpart for a float8 linear layer with tensorwise scales: it casts the
    layer's input to float8 before the all-gather, half the bytes of bf16, with one scale computed over the shards,
    which is the whole tensor's as without it. Rowwise float8 layers take the plain styles: their scales, per row,
    are computed on the gathered input."""
    module = block.get_submodule(name)
    if not isinstance(style, ColwiseParallel | RowwiseParallel) or not is_float8(module) or not tensorwise(module):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    float8 = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
    return float8(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                  use_local_output=style.use_local_output)


def apply_activation_checkpointing(model: Parallelizable, cfg: ParallelConfig) -> None:
    """Recompute the activations of every block (`full`), of one block in `ac_every` (`selective`), or of every
    block all but its attention and every other matmul (`selective` with ac_selective = op: keel.parallel.selective).
    The wrapper's prefix is left out of state-dict and init names, so checkpoints move between settings."""
    if cfg.activation_checkpoint == "none":
        return
    by_op = cfg.activation_checkpoint == "selective" and cfg.ac_selective == "op"
    every = cfg.ac_every if cfg.activation_checkpoint == "selective" and not by_op else 1
    options: dict[str, Any] = {"context_fn": op_contexts} if by_op else {}
    blocks = model.blocks()
    for i, (name, block) in enumerate(blocks.items()):
        if i % every == 0:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False, **options)


def compile_blocks(model: Parallelizable, mode: str) -> None:
    """torch.compile each block in `mode` (parallel.compile_mode), in place: parameter names stay the same."""
    for block in model.blocks().values():
        block.compile(mode=mode)


def apply_fsdp(model: Parallelizable, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
               reshard_after_forward: bool) -> None:
    """Shard parameters, gradients and optimizer state over `mesh` (a 2-D mesh gives HSDP); gather
    parameters and reduce gradients in the policy's dtypes; `reshard_after_forward`: free each unit's gathered
    parameters after its forward, and gather them again for its backward."""
    for block in model.blocks().values():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module_of(model), mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
