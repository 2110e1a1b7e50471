"""StepSync: the step's one host synchronisation. One all-reduce of a few numbers, read once on the host.

The loss, the gradient norm and the non-finite flags are always in it; components add their own named
contributions (whether the background save has finished, the seconds since it, whether a pause was
asked...) when they are built. Every value is summed over all ranks, so every rank holds the same
report and takes the same branch.
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
    values: dict[str, float] = field(default_factory=dict)  # the components' contributions, summed over ranks
    data_s: float = 0.0  # this step's wait for data
    step_s: float = 0.0  # this step's forward and backward, until the report
    update_norm: float | None = None  # ‖θ_new − θ_old‖ of this step's update: measured on logged steps only

    @property
    def finite(self) -> bool:
        return not self.nonfinite_ranks


class StepSync:
    """`loss_divisor`: how many times the world counts each loss (the ranks of a tensor-parallel group hold
    the same one)."""

    def __init__(self, loss_divisor: int) -> None:
        self.loss_divisor = loss_divisor
        self.contributions: dict[str, Callable[[], float]] = {}
        self.on_device: dict[str, Callable[[torch.device], torch.Tensor]] = {}  # values computed where the loss is
        self._staging: torch.Tensor | None = None  # pinned host memory the contributions go to a GPU from

    def contribute(self, name: str, value: Callable[[], float]) -> None:
        """`value()` is this rank's part of `name`, read just before each step's reduction."""
        if name in self.contributions or name in self.on_device:
            raise ValueError(f"step sync value {name!r} is contributed twice")
        self.contributions[name] = value

    def contribute_on_device(self, name: str, value: Callable[[torch.device], torch.Tensor]) -> None:
        """`value(device)` is this rank's part of `name`, a 0-d tensor computed on the step's device just before
        each step's reduction: it reaches the host with the step's one synchronisation, not one of its own."""
        if name in self.contributions or name in self.on_device:
            raise ValueError(f"step sync value {name!r} is contributed twice")
        self.on_device[name] = value

    def reduce(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, nonfinite_here: Callable[[], bool],
               data_s: float = 0.0, step_s: float = 0.0) -> StepReport:
        """`loss` is this rank's mean loss (0 on pipeline ranks without the last stage). `nonfinite_here`
        tells whether this rank's own loss or gradient shards hold NaN/Inf; it is asked only when the
        reduced values are not finite, to name the ranks."""
        names = list(self.contributions)
        world = dist.get_world_size()
        loss = loss.detach().float().reshape(1)
        grad_norm = grad_norm.detach().float().reshape(1)
        device = [value(loss.device).float().reshape(1) for value in self.on_device.values()]
        local = torch.cat([loss, grad_norm / world, self._on_device(names, loss.device), *device])
        names += list(self.on_device)
        shared = local.clone()
        dist.all_reduce(shared)
        both = torch.cat([local, shared]).tolist()  # the one host synchronisation of the step
        mine, total = both[:len(local)], both[len(local):]
        nonfinite: list[int] = []
        if not (math.isfinite(total[0]) and math.isfinite(total[1])):
            # Rare: find out which ranks. Every rank sees the same sums, so every rank reaches this collective.
            flags: list = [None] * world
            dist.all_gather_object(flags, nonfinite_here())
            nonfinite = [r for r, f in enumerate(flags) if f] or list(range(world))
        return StepReport(step=step, loss=total[0] / self.loss_divisor, grad_norm=total[1], local_loss=mine[0],
                          nonfinite_ranks=nonfinite, values=dict(zip(names, total[2:], strict=True)),
                          data_s=data_s, step_s=step_s)

    def _on_device(self, names: list[str], device: torch.device) -> torch.Tensor:
        """The contributions' values on `device`. A GPU gets them from pinned memory without waiting: a
        plain copy from the host would wait for the step's queued work, a second synchronisation."""
        values = torch.tensor([float(self.contributions[name]()) for name in names], dtype=torch.float32)
        if device.type != "cuda":
            return values.to(device)
        if self._staging is None or len(self._staging) != len(values):
            self._staging = torch.empty(len(values), dtype=torch.float32, pin_memory=True)
        self._staging.copy_(values)  # the previous step's copy was read by its synchronisation: free to reuse
        return self._staging.to(device, non_blocking=True)
