"""AdamW and the learning-rate schedule. The schedule is a pure function of the step, so its only
state is the step itself."""

from __future__ import annotations

import math

import torch
from torch import nn

from keel.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms' gains)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of the update made at `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        # 0 at the first step after warmup, 1 at the last step of the run (total_steps - 1).
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps))
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to the floor over the last `decay_fraction` of the run.
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    return cfg.lr + (floor - cfg.lr) * min(1.0, (step - decay_start + 1) / decay_steps)
