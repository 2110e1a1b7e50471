"""Every private torch API keel calls, in one place, each with why keel needs it. A torch upgrade is checked
here first (tests/unit/core/test_torch_private.py exercises each one on the installed torch); every other
module imports these names, never a private torch one. (The worker server preloads torch._inductor.config by
name without calling anything in it, marked there.)"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Activation checkpointing of a whole module (a block), as torchtitan applies it: torch.utils.checkpoint's public
# API wraps a function, and its module wrapper lives only under this private path.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor

__all__ = ["abort_process_group", "checkpoint_wrapper", "copy_all_", "default_store", "float8_matmul",
           "fsspec_checkpoint_io",
           "in_backward", "norms", "pin_by_registering", "process_groups", "sdp_choice",
           "set_group_timeout", "set_local_tensor", "shard_box"]


def norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor in one fused call (torch._foreach_norm, which clip_grad_norm_ itself uses)."""
    return list(torch._foreach_norm(list(tensors))) if tensors else []


def copy_all_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
              non_blocking: bool = False) -> None:
    """Copy every source into its destination in one call (torch._foreach_copy_): the interpreter lock is
    released once for the whole state instead of once per tensor, which a checkpoint's staging relies on."""
    torch._foreach_copy_(list(destinations), list(sources), non_blocking=non_blocking)


def float8_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(a · scale_a) @ (b · scale_b) of float8 operands in `out_dtype` (torch._scaled_mm, the kernel torchao's
    float8 linear layers run): `keel plan --calibrate-sweep` times it. `b` is column-major."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def in_backward() -> bool:
    """Whether the current code runs inside an autograd backward pass (activation checkpointing recomputing a
    block's forward): torch._C._current_graph_task_id is -1 outside one, and no public API tells."""
    return bool(torch._C._current_graph_task_id() != -1)


def default_store() -> Any:
    """The default process group's TCP store, which the watchdog reads its peers' heartbeats through."""
    return dist.distributed_c10d._get_default_store()


def process_groups() -> list[Any]:
    """Every process group of this process (the default one and those made from it)."""
    return list(dist.distributed_c10d._world.pg_map)


def set_group_timeout(seconds: float, group: Any) -> None:
    """Change a live group's collective timeout: the watchdog tightens it once it has learned the step time
    (init_process_group's timeout is fixed at creation)."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def abort_process_group() -> None:
    """Abort the default group's pending collectives, so that a hung rank's exit is not held up by them."""
    dist.distributed_c10d._abort_process_group()


def shard_box(dtensor: DTensor) -> tuple[list[int], list[int]]:
    """Where this rank's local shard of `dtensor` lies in the global tensor: its offsets and sizes per dimension.
    DTensor's chunk protocol, which DCP's planner asks every tensor for, is the one way to tell."""
    (chunk,) = dtensor.__create_chunk_list__()
    return list(chunk.offsets), list(chunk.sizes)


def set_local_tensor(dtensor: DTensor, local: torch.Tensor) -> None:
    """Point a DTensor at another local shard of the same shape: a checkpoint's pinned host buffer keeps the
    DTensor's spec without DTensor.from_local moving the buffer to the mesh's device."""
    dtensor._local_tensor = local


def flatten_mesh(mesh: Any, name: str) -> Any:
    """One dimension made of a multi-dimensional mesh's (FSDP shards parameters over data and context parallel
    ranks together); DeviceMesh's flattening is private."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A one-dimensional mesh regrouped into several dimensions of the same ranks (expert parallelism splits the
    parameter-sharding ranks into expert groups and the ranks left over); DeviceMesh's unflattening is private."""
    return mesh._unflatten(0, sizes, names)


def sdp_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               gqa: bool) -> int:
    """The SDPA kernel (an SDPBackend value) torch picks for these inputs under the kernels enabled now: what a
    run names at start for model.sdpa_backend = auto. CUDA has public checks per kernel, but not torch's order
    of preference among them, and a CPU none at all."""
    return int(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=None, enable_gqa=gqa))


def flash_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                        scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel with its log-sum-exp per query (batch, heads, queries), which the public SDPA does
    not return; grouped-query heads and an additive mask of the inputs' dtype. A row that the mask rules out
    entirely comes back as 0 with a log-sum-exp of 0."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                         scale=scale)
    return out, lse


def flash_attention_cpu_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                                 scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's backward from a given output and log-sum-exp (those of the whole row, when the keys
    are one block of several): the gradients of q, k and v."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return dq, dk, dv


def fsspec_checkpoint_io() -> tuple[type, type]:
    """DCP's reader and writer for fsspec URLs (s3://...), which torch keeps under a private module; imported
    when a remote checkpoint directory is used."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecReader, FsspecWriter


def pin_by_registering(threads: int) -> None:
    """Make pinned host memory malloc'd pages that `threads` threads touch, then cudaHostRegister locks,
    instead of cudaHostAlloc, which maps every page of a multi-GB buffer on one thread under a driver lock
    (PyTorch's pinned_use_cuda_host_register allocator option). Runtime allocator settings go through a
    private call (public from the environment only, which is read once); the call replaces every setting, so
    the environment's are passed along, and a pinned option of the user's own is left to win. torch takes a
    power of two threads: `threads` is rounded down to one."""
    given = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    if "pinned_" in given:
        return
    ours = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{1 << (max(1, threads).bit_length() - 1)}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    with contextlib.suppress(RuntimeError):  # a setting of the user's that cannot change once CUDA runs
        setter(f"{given},{ours}" if given else ours)  # leaves pinning as it was
