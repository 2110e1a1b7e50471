"""The per-step report every guard sees: one all-reduce of a few numbers, read once on the host.

It is the step's only host synchronisation. The loss, the gradient norm and the non-finite flags are
reduced over all ranks, so every rank holds the same report and takes the same branch; the caller
adds its own numbers (e.g. checkpoint progress) to the same reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepReport:
    step: int  # the step being made (1-based): its update has not been applied yet
    loss: float  # global mean loss
    grad_norm: float  # global gradient norm before clipping (mean over ranks of each rank's global norm)
    local_loss: float  # this rank's own loss, bitwise (replay and attribution compare it)
    nonfinite_ranks: list[int] = field(default_factory=list)  # ranks whose loss or gradients hold NaN/Inf
    extras: list[float] = field(default_factory=list)  # the caller's values, summed over ranks
    data_s: float = 0.0  # this step's wait for data
    step_s: float = 0.0  # this step's forward and backward, until the report
    update_norm: float | None = None  # ‖θ_new − θ_old‖ of this step's update: measured on logged steps only

    @property
    def finite(self) -> bool:
        return not self.nonfinite_ranks


def reduce_report(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, loss_divisor: int, extras: list[float],
                  nonfinite_here: Callable[[], bool], data_s: float = 0.0, step_s: float = 0.0) -> StepReport:
    """`loss` is this rank's mean loss (0 on pipeline ranks without the last stage), counted
    `loss_divisor` times over the world (the ranks of a tensor-parallel group hold the same one).
    `nonfinite_here` tells whether this rank's own loss or gradient shards hold NaN/Inf; it is asked
    only when the reduced values are not finite, to name the ranks."""
    world = dist.get_world_size()
    loss = loss.detach().float().reshape(1)
    grad_norm = grad_norm.detach().float().reshape(1)
    local = torch.cat([loss, grad_norm / world, torch.tensor(extras, dtype=torch.float32, device=loss.device)])
    shared = local.clone()
    dist.all_reduce(shared)
    mine, total = local.tolist(), shared.tolist()  # the one host synchronisation of the step
    nonfinite: list[int] = []
    if not (math.isfinite(total[0]) and math.isfinite(total[1])):
        # Rare: find out which ranks. Every rank sees the same sums, so every rank reaches this collective.
        flags: list = [None] * world
        dist.all_gather_object(flags, nonfinite_here())
        nonfinite = [r for r, f in enumerate(flags) if f] or list(range(world))
    return StepReport(step=step, loss=total[0] / loss_divisor, grad_norm=total[1], local_loss=mine[0],
                      nonfinite_ranks=nonfinite, extras=total[2:], data_s=data_s, step_s=step_s)
