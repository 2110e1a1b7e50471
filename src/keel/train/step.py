"""The training step, as the Trainer runs it: micro-batches → forward/backward → global-norm clip → update."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from keel.core.dtensor import local, plain
from keel.core.torch_private import norms as grad_norms
from keel.model.init import canonical_name
from keel.model.loss import TORCH_CROSS_ENTROPY, Objective
from keel.model.moe import scale_auxiliary_losses
from keel.train.master import Bf16Params


def by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters grouped by their device mesh (plain tensors as one group), as their gradients are: DTensor's
    fused operations take tensors of one mesh, and experts split over expert parallelism have their own."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())


def grad_norm(groups: list[list[nn.Parameter]], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (across shards, ranks and pipeline stages) of parameters grouped by mesh
    (`by_mesh`): the norm of each mesh's gradients made whole over its mesh, then of those."""
    grads = [[p.grad for p in group if p.grad is not None] for group in groups]
    parts = [plain(torch.nn.utils.get_total_norm(g, norm_type=2.0, foreach=True)) for g in grads if g]
    if not parts:
        parts = [torch.nn.utils.get_total_norm([], norm_type=2.0)]
    total = parts[0] if len(parts) == 1 else torch.nn.utils.get_total_norm(parts, norm_type=2.0)
    if pp_group is not None:  # each stage holds its own parameters: add the squares over stages
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    return total


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    """The schedule's learning rate, times each group's multiplier where the optimizer has them."""
    for optimizer in optimizers:
        scales = getattr(optimizer, "lr_scales", None) or [1.0] * len(optimizer.param_groups)
        for group, scale in zip(optimizer.param_groups, scales, strict=True):
            group["lr"] = lr * scale


def forward_backward(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                     autocast_dtype: torch.dtype | None = None,
                     objective: Objective = TORCH_CROSS_ENTROPY) -> torch.Tensor:
    """Accumulate the gradients of this rank's micro-batches' objective (`keel.model.loss`, as the layout computes
    it); returns its mean cross entropy as a tensor (no host synchronisation here)."""
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = objective.local(targets.to(device, non_blocking=True))
        with amp:
            logits = model(inputs)
        with objective.sharded():
            differentiated, cross_entropy = objective(logits, targets)
            del logits  # autograd keeps what the loss needs; the rest of the logits is freed before the backward
            (differentiated / len(micro_batches)).backward()
        loss_sum += plain(cross_entropy.detach() / len(micro_batches))
    return loss_sum


class Stepper:
    """One training step of this rank's model parts (a whole model, or pipeline stages), cut where the
    guards look: after the backward, before the update."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], pipeline: Any, *,
                 grad_clip: float, autocast_dtype: torch.dtype | None,
                 objective: Objective = TORCH_CROSS_ENTROPY, bf16_params: Bf16Params | None = None) -> None:
        self.parts, self.optimizers, self.pipeline = parts, optimizers, pipeline
        self.bf16_params = bf16_params  # train.param_dtype = bf16: the passes compute on bf16 parameters
        self.grad_clip, self.autocast_dtype = grad_clip, autocast_dtype
        self.objective = objective
        # Each parameter once, by its name in the model (a pipeline stage's are the whole model's).
        self.names = {p: canonical_name(n) for part in parts for n, p in part.named_parameters()}
        self.params = list(self.names)
        self.groups = by_mesh(self.params)  # fixed once parallelised: the norm and the clip go mesh by mesh
        self.pp_group = pipeline.pp_group if pipeline is not None else None
        self.sequences = 0  # of the last step on this rank: what the auxiliary losses are averaged over
        self.before_step: Callable[[], None] = lambda: None  # with the gradients clipped, before the optimizers step

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        sequences = sum(len(inputs) for inputs, _ in micro_batches)
        if sequences != self.sequences:  # survivors of a lost replica group take more
            self.sequences = sequences
            for part in self.parts:
                scale_auxiliary_losses(part, sequences)
        if self.pipeline is not None:
            return self.pipeline.forward_backward(micro_batches)
        with self.bf16_params.computing() if self.bf16_params is not None else nullcontext():
            return forward_backward(self.parts[0], micro_batches, autocast_dtype=self.autocast_dtype,
                                    objective=self.objective)

    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.groups, self.pp_group)

    def nonfinite_here(self, loss: torch.Tensor) -> bool:
        """Whether this rank's own loss or gradient shards hold a NaN or Inf (a host synchronisation:
        asked only once the step report says some rank does)."""
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        norms = grad_norms(grads)
        return not bool(torch.isfinite(torch.stack([loss.detach().float().reshape(()), *norms])).all())

    def update(self, lr: float, total_norm: torch.Tensor) -> None:
        """Clip with the norm already computed, step, clear the gradients."""
        set_lr(self.optimizers, lr)
        self.clip(total_norm)
        self.before_step()
        for optimizer in self.optimizers:
            optimizer.step()
        self.drop()

    def clip(self, total_norm: torch.Tensor) -> None:
        """Scale the gradients down to a global norm of `optim.grad_clip` (0: no clipping)."""
        if self.grad_clip > 0:
            for group in self.groups:
                torch.nn.utils.clip_grads_with_norm_(group, self.grad_clip, total_norm, foreach=True)

    def drop(self) -> None:
        """Skip the update: the gradients are cleared, parameters and optimizer state stay as they are."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def recompute(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                  after_backward: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Run this step's forward and backward again from scratch (then `after_backward`, as the loop
        does); returns the loss and the gradients it produced, and puts back those of the first computation."""
        first = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            loss = self.forward_backward(micro_batches)
            after_backward()
            again = [p.grad for p in self.params]
        finally:
            for p, g in zip(self.params, first, strict=True):
                p.grad = g
        return loss, again


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             autocast_dtype: torch.dtype | None = None, objective: Objective = TORCH_CROSS_ENTROPY,
             bf16_params: Bf16Params | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and token count of this rank's validation batches (its share of them), on the weights
    training computes with (bf16 ones with `bf16_params`)."""
    with bf16_params.computing() if bf16_params is not None else nullcontext():
        return _evaluate(model, batches, autocast_dtype, objective)


def _evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast_dtype: torch.dtype | None,
              objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), objective.local(targets.to(device))
        with amp:
            logits = model(inputs)
        with objective.sharded():
            total += objective.summed(logits, targets)
        count += targets.numel()
    model.train(was_training)
    return total, count
