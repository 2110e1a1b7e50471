"""AdamW and the learning-rate schedule. The schedule is a pure function of the step, so its only
state is the step itself."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from keel.config import OptimConfig
from keel.core.dtensor import local
from keel.model.init import canonical_name
from keel.model.llama import HIDDEN_MATRICES


class ScaledAdamW(torch.optim.AdamW):
    """AdamW whose parameter groups take the schedule's learning rate times their own multiplier
    (`lr_scales`, one per group; μP's hidden matrices: base_dim / dim). The multipliers are not in the
    optimizer's state dict: they follow from the config."""

    def __init__(self, groups: list[dict], lr_scales: list[float] | None = None, **kwargs: Any) -> None:
        super().__init__(groups, **kwargs)
        # Without multipliers every group takes the schedule's rate (how a checkpoint probes the state it keeps).
        self.lr_scales = lr_scales or [1.0] * len(self.param_groups)
        # A group steps in one fused kernel: fewer kernels than the foreach path's dozen a step, and for
        # DTensors fewer operators to shard, each of which a fresh process (a replacement rank's first step)
        # shards once, slowly. DTensor's fused kernel takes DTensors only: tensor parallelism leaves a mixture of
        # experts' parameters plain where no FSDP wraps them, and a group that mixes the two steps tensor by
        # tensor.
        self.fusable = [len({isinstance(p, DTensor) for p in group["params"]}) == 1 for group in self.param_groups]
        self._impose(self.param_groups)

    def _impose(self, groups: list[dict]) -> None:
        for group, fusable in zip(groups, self.fusable, strict=True):
            group["fused"], group["foreach"] = fusable, False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A state dict brings back the saved groups' settings: this optimizer's kernels stay, and with them where
        # the step counts live (on the parameters' device for the fused kernel).
        groups = [dict(group) for group in state_dict["param_groups"]]
        self._impose(groups)
        super().load_state_dict({**state_dict, "param_groups": groups})


def build_optimizer(model: nn.Module, cfg: OptimConfig, hidden_lr_scale: float = 1.0) -> ScaledAdamW:
    """AdamW with weight decay on matrices only (not on norms' gains); the hidden matrices (attention and
    SwiGLU projections, the experts' 3-D weights among them) learn at `hidden_lr_scale` times the rate of the
    rest. A router's gate learns and decays as the embedding and output do; buffers such as the experts'
    balancing bias are not parameters and never reach the optimizer. AdamW shrinks a parameter by
    lr·weight_decay per step; independent weight decay divides the coefficient by the group's peak learning
    rate, so that the shrink is weight_decay·lr/peak whatever the peak."""
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    hidden = [p for n, p in named if n.endswith(HIDDEN_MATRICES)]
    other = [p for n, p in named if p.ndim >= 2 and not n.endswith(HIDDEN_MATRICES)]
    vectors = [p for _, p in named if p.ndim < 2]
    groups, scales = [], []
    for params, scale, decays in [(hidden, hidden_lr_scale, True), (other, 1.0, True), (vectors, 1.0, False)]:
        if not params:  # a pipeline stage without embedding or output
            continue
        weight_decay = (cfg.weight_decay / (cfg.lr * scale) if cfg.independent_weight_decay else cfg.weight_decay
                        ) if decays else 0.0
        groups.append({"params": params, "weight_decay": weight_decay})
        scales.append(scale)
    return ScaledAdamW(groups, scales, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


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


def copies_held(p: torch.Tensor, pp: int) -> int:
    """How many ranks hold each element of `p`, so that a sum over all ranks counts every element once:
    the sizes of the mesh dimensions it is replicated over, times the ranks outside its mesh that are
    not other pipeline stages (`pp` of them hold different parameters). A plain tensor is every rank's of its
    stage (the parameters of a mixture of experts under tensor parallelism without FSDP)."""
    if not isinstance(p, DTensor):
        return max(1, dist.get_world_size() // pp) if dist.is_initialized() else 1
    mesh = p.device_mesh
    replicated = math.prod(mesh.size(i) for i, placement in enumerate(p.placements) if placement.is_replicate())
    return replicated * max(1, dist.get_world_size() // (mesh.size() * pp))


def update_norm_sq(optimizers: list[torch.optim.Optimizer], pp: int = 1) -> torch.Tensor:
    """This rank's share of the squared L2 norm of the update AdamW just applied, ‖θ_new − θ_old‖²,
    recovered from θ_new and the moments one tensor at a time (AdamW: θ_new = θ_old·(1 − lr·wd) −
    lr·m̂/(√v̂ + ε)), so no copy of the parameters is kept. Summed over all ranks it is the global one."""
    total = torch.zeros((), dtype=torch.float64, device=_device(optimizers))
    for p, update in applied_updates(optimizers):
        total += update.square().sum() / copies_held(p, pp)
    return total


@torch.no_grad()
def applied_updates(optimizers: list[torch.optim.Optimizer]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter with this rank's share of the change AdamW just applied to it (fp64), recovered
    from the parameter and its moments."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not state:
                    continue
                step = float(state["step"])
                m, v = local(state["exp_avg"]).double(), local(state["exp_avg_sq"]).double()
                adam = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
                new = local(p).double()
                yield p, new - (new + lr * adam) / (1 - lr * wd)


def _device(optimizers: list[torch.optim.Optimizer]) -> torch.device:
    return next(local(p).device for o in optimizers for g in o.param_groups for p in g["params"])
