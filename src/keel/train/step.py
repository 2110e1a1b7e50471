"""One optimizer step: micro-batches → forward/backward → global-norm clip → update."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel_loss


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the vocabulary-parallel loss) as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float,
                       pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (across shards, ranks and pipeline stages); clip to
    `max_norm` unless it is 0."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # sharded gradients: the local norm is a partial sum
    if pp_group is not None:  # each stage holds its own parameters: add the squares over stages
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


def apply_update(optimizers: list[torch.optim.Optimizer], params: list[nn.Parameter], grad_clip: float,
                 pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip, update, clear the gradients; returns the gradient norm before clipping."""
    grad_norm = grad_norm_and_clip(params, grad_clip, pp_group)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float, grad_clip: float,
               autocast_dtype: torch.dtype | None = None, loss_parallel: bool = False,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns this rank's mean loss over its micro-batches and the global gradient norm, as tensors
    (no host synchronisation here). With `loss_parallel` the logits stay sharded over the vocabulary
    (tensor parallel) and the loss and its backward are computed on the shards."""
    set_lr([optimizer], lr)
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with amp:
            logits = model(inputs)
        with vocab_parallel_loss() if loss_parallel else nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / len(micro_batches)
            loss.backward()
        loss_sum += plain(loss.detach())
    return loss_sum, apply_update([optimizer], list(model.parameters()), grad_clip)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             autocast_dtype: torch.dtype | None = None, loss_parallel: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and token count of this rank's validation batches."""
    device = next(model.parameters()).device
    amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        with amp:
            logits = model(inputs)
        with vocab_parallel_loss() if loss_parallel else nullcontext():
            total += plain(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")).double()
        count += targets.numel()
    model.train(was_training)
    return total, count
