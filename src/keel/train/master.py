"""bf16 parameters with fp32 master weights (train.param_dtype = "bf16").

Between steps every parameter holds its fp32 master weights, so that the optimizer, its fp32 moments, the
checkpoints (the same names and dtypes as a run with fp32 parameters: either resumes the other), the guards'
snapshots and fingerprints, the metrics and the export see exactly what they see without this option. For the
forward and backward passes (`computing`) each parameter's storage is swapped for a bf16 copy of its master: the
blocks compute on bf16 weights, and the gradients are computed and accumulated over the micro-batches in bf16,
half the bytes of fp32 ones. After the backward the masters come back and each gradient is widened to fp32 for
the clip and the update, which is computed on the master; the next forward's copy carries it to the bf16 weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class Bf16Params:
    """The parameters of the model parts of one rank (each once: a tied weight is one parameter)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.params = list({id(p): p for part in parts for p in part.parameters()}.values())

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Inside: every parameter and its gradient in bf16, the fp32 master kept aside; after: the masters back,
        the gradients widened to fp32."""
        masters = [p.data for p in self.params]
        for p in self.params:
            _swap(p, p.data.to(torch.bfloat16))
        try:
            yield
        finally:
            for p, master in zip(self.params, masters, strict=True):
                _swap(p, master)


def _swap(p: nn.Parameter, data: torch.Tensor) -> None:
    """Give `p` another storage of the same shape, in its dtype, with its gradient (if any) cast to it."""
    grad, p.grad = p.grad, None
    p.data = data
    if grad is not None:
        p.grad = grad.to(data.dtype)

