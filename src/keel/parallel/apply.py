"""Parallelise the model over the data-parallel mesh with FSDP2: one `fully_shard` per block, then the root."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from keel.model.llama import Llama


def apply_fsdp(model: Llama, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    """Shard parameters, gradients and optimizer state over `mesh`. Gradients are reduced in fp32.
    A one-process mesh wraps nothing: there is nothing to shard."""
    if mesh.size() == 1:
        return
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
