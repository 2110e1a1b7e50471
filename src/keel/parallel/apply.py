"""Parallelise the model for its layout: tensor + sequence parallel, activation checkpointing,
per-block compile, then FSDP2 (HSDP across replicas). A one-process run wraps nothing."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from keel.config import ParallelConfig
from keel.core.torch_private import checkpoint_wrapper
from keel.model.llama import Llama
from keel.parallel.layout import Layout


def parallelize(model: Llama, layout: Layout, cfg: ParallelConfig, param_dtype: torch.dtype) -> None:
    if layout.tensor_parallel:
        apply_tensor_parallel(model, layout.tp)
    apply_activation_checkpointing(model, cfg)
    if cfg.compile:
        for block in model.layers.values():
            block.compile()  # in place: parameter names stay the same
    if layout.shards_parameters:
        reduce_dtype = torch.bfloat16 if cfg.reduce_dtype == "bf16" else torch.float32
        apply_fsdp(model, layout.fsdp, param_dtype, reduce_dtype)


def apply_tensor_parallel(model: Llama, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallel: projections column-/row-wise over heads and the
    SwiGLU hidden size; norms and residuals sharded over the sequence between them; the output
    projection sharded over the vocabulary, its logits left as a DTensor for the parallel loss."""
    top: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    if model.embedding_norm is not None:  # between the embedding and the first block: sharded over the sequence
        top["embedding_norm"] = SequenceParallel(use_local_output=True)
    parallelize_module(model, tp_mesh, top)
    # QK-norm sees this rank's heads (dimension 2 of batch, sequence, head, feature); its gains are replicated.
    qk_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
    per_head = {"attention.q_norm": qk_norm, "attention.k_norm": qk_norm} if model.cfg.qk_norm else {}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            **per_head,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_activation_checkpointing(model: Llama, cfg: ParallelConfig) -> None:
    """Recompute the activations of every block (`full`) or of one block in `ac_every` (`selective`).
    The wrapper's prefix is left out of state-dict and init names, so checkpoints move between settings."""
    if cfg.activation_checkpoint == "none":
        return
    every = 1 if cfg.activation_checkpoint == "full" else cfg.ac_every
    for i, (name, block) in enumerate(model.layers.items()):
        if i % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: Llama, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """Shard parameters, gradients and optimizer state over `mesh` (a 2-D mesh gives HSDP); gather
    parameters in `param_dtype`, reduce gradients in `reduce_dtype`."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
