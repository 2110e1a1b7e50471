"""DTensor helpers every layer uses."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the vocabulary-parallel loss) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t
