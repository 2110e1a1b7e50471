"""The training objective: the next token's cross entropy, plus the z-loss when asked.

Two ways to compute it, the same function of the logits: torch's `F.cross_entropy` on an fp32 copy, and
a fused one (`train.cross_entropy = "fused"`). Torch's keeps, at its backward, the logits, the fp32
log-probabilities, their gradient and the fp32 gradient of the logits: 14 bytes per logit with bf16 logits,
16 with fp32 ones, the largest buffer of a layout with a large vocabulary. The fused one keeps only the
logits and one fp32 log Z per token; its backward computes the gradient (softmax minus the one-hot target,
scaled) a slice of rows at a time in fp32 and writes it over the logits, which nothing reads afterwards:
2 or 4 bytes per logit, and fp32 slices of at most `FUSED_CHUNK` elements. Logits sharded over the
vocabulary by tensor parallelism (a DTensor, `loss_parallel`) are reduced over the shards with two
all-reduces, as Megatron's vocabulary-parallel cross entropy does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from keel.config import TrainConfig
from keel.core.dtensor import plain
from keel.model.flops import FUSED_CHUNK

CROSS_ENTROPY = ("torch", "fused")


def log_normaliser(logits: torch.Tensor) -> torch.Tensor:
    """log Z of each row of (tokens, vocabulary) logits, Z the softmax's normaliser; the logits may be a
    DTensor sharded over the vocabulary (the reductions then span the shards)."""
    peak = logits.detach().amax(dim=-1, keepdim=True)
    return (logits - peak).exp().sum(dim=-1).log() + peak.squeeze(-1)


@dataclass(frozen=True)
class Objective:
    """The loss a step differentiates (`train.z_loss`, `train.cross_entropy`), as the layout computes it
    (keel.parallel.layout): on logits sharded over the vocabulary (`vocab_parallel`: tensor parallel), and over
    this rank's share of each sequence's targets (`local`: context parallel)."""
    z_loss: float = 0.0
    cross_entropy: str = "torch"
    vocab_parallel: bool = False
    split: Callable[[torch.Tensor], torch.Tensor] | None = None  # a batch's targets → this rank's share

    @classmethod
    def of(cls, train: TrainConfig, vocab_parallel: bool = False,
           split: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Objective:
        return cls(train.z_loss, train.cross_entropy, vocab_parallel, split)

    def local(self, targets: torch.Tensor) -> torch.Tensor:
        """The targets of the positions this rank computes logits for."""
        return targets if self.split is None else self.split(targets)

    def sharded(self) -> AbstractContextManager:
        """Where the loss and its backward run: torch's loss-parallel context for vocabulary-sharded logits."""
        return loss_parallel() if self.vocab_parallel else nullcontext()

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the backward differentiates, and the cross entropy, each a mean over the tokens. With a z-loss
        coefficient (PaLM) the first adds z_loss * mean((log Z)^2), which pulls log Z towards 0 and keeps the
        output logits from drifting; without one both are the same tensor."""
        if self.cross_entropy == "fused":
            mean_ce, mean_square_log_z = fused_cross_entropy(logits, targets)
            return (mean_ce + self.z_loss * mean_square_log_z if self.z_loss else mean_ce), mean_ce
        flat = logits.flatten(0, 1).float()
        mean_ce = F.cross_entropy(flat, targets.flatten())
        if not self.z_loss:
            return mean_ce, mean_ce
        return mean_ce + self.z_loss * log_normaliser(flat).square().mean(), mean_ce

    def summed(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The cross entropy summed over the tokens, in fp64 (evaluation)."""
        if self.cross_entropy == "fused":
            return fused_cross_entropy(logits, targets)[0].double() * targets.numel()
        return plain(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")).double()


TORCH_CROSS_ENTROPY = Objective()  # torch's cross entropy, no z-loss


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross entropy, mean (log Z)^2) of (batch, seq, vocabulary) logits, as plain tensors; the
    logits' memory holds their gradient once the backward has run."""
    group, first = None, 0
    if isinstance(logits, DTensor):
        if logits.placements != (Shard(logits.dim() - 1),):
            raise ValueError(f"fused cross entropy: logits placed {logits.placements}, expected sharded over "
                             "the vocabulary")
        mesh = logits.device_mesh
        group = mesh.get_group()
        share = -(-logits.shape[-1] // mesh.size())  # torch.chunk's split: the last shards may be shorter
        first = min(mesh.get_local_rank() * share, logits.shape[-1])
        logits = logits.to_local()
    return _FusedCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), group, first)


def _rows(vocab: int) -> int:
    return max(1, FUSED_CHUNK // max(vocab, 1))


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                first: int) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = logits.shape[1]
        local = targets - first
        here = (local >= 0) & (local < vocab)
        local = local.clamp(0, max(vocab - 1, 0))
        log_z = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.zeros_like(log_z)
        for start in range(0, logits.shape[0], _rows(vocab)):
            rows = slice(start, start + _rows(vocab))
            part = logits[rows].float()
            log_z[rows] = torch.logsumexp(part, dim=-1)
            picked[rows] = part.gather(1, local[rows, None]).squeeze(1)
        picked = torch.where(here, picked, 0.0)
        if group is not None:  # log Z over the shards: log Σ exp(log Z_shard), stable around the largest
            top = log_z.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack(((log_z - top).exp(), picked))
            dist.all_reduce(sums, group=group)
            log_z, picked = sums[0].log() + top, sums[1]
        ctx.save_for_backward(logits, local, here, log_z)
        ctx.set_materialize_grads(False)
        return (log_z - picked).mean(), log_z.square().mean()

    @staticmethod
    def backward(ctx: Any, grad_ce: torch.Tensor | None, grad_z: torch.Tensor | None) -> tuple[Any, ...]:
        logits, local, here, log_z = ctx.saved_tensors
        n = logits.shape[0]
        # d/dlogits: softmax · (g_ce + 2·g_z·log Z) / n, less g_ce / n at the target.
        scale = torch.zeros_like(log_z) if grad_ce is None else grad_ce.expand_as(log_z) / n
        hit = scale * here
        if grad_z is not None:
            scale = scale + grad_z * 2 * log_z / n
        for start in range(0, n, _rows(logits.shape[1])):
            rows = slice(start, start + _rows(logits.shape[1]))
            part = (logits[rows].float() - log_z[rows, None]).exp_().mul_(scale[rows, None])
            part.scatter_add_(1, local[rows, None], -hit[rows, None])
            logits[rows] = part  # over the logits: their memory holds the gradient from here on
        return logits, None, None, None
