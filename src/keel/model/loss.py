"""The training objective: the next token's cross entropy, plus the z-loss when asked."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def log_normaliser(logits: torch.Tensor) -> torch.Tensor:
    """log Z of each row of (tokens, vocabulary) logits, Z the softmax's normaliser; the logits may be a
    DTensor sharded over the vocabulary (the reductions then span the shards)."""
    peak = logits.detach().amax(dim=-1, keepdim=True)
    return (logits - peak).exp().sum(dim=-1).log() + peak.squeeze(-1)


def objective(logits: torch.Tensor, targets: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the backward differentiates, and the cross entropy, each a mean over the tokens. With a z-loss
    coefficient (PaLM) the first adds z_loss * mean((log Z)^2), which pulls log Z towards 0 and keeps the
    output logits from drifting; without one both are the same tensor."""
    flat = logits.flatten(0, 1).float()
    cross_entropy = F.cross_entropy(flat, targets.flatten())
    if not z_loss:
        return cross_entropy, cross_entropy
    return cross_entropy + z_loss * log_normaliser(flat).square().mean(), cross_entropy
