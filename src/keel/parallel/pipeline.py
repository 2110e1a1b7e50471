"""Pipeline parallelism: the decoder split by layer into stages, each stage parallelised like a whole
model on the other mesh dimensions (TP, FSDP), run by a `torch.distributed.pipelining` schedule."""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from keel.config import Config
from keel.core.dtensor import plain
from keel.model.llama import Llama
from keel.model.loss import Objective
from keel.model.split import stage_range
from keel.parallel.layout import Layout

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zb": ScheduleInterleavedZeroBubble}


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Round-robin ("loop") assignment: rank r holds stages r, r + pp, r + 2·pp, …"""
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_module(model: Llama, stage: int, n_stages: int) -> Llama:
    """A copy of the (meta-device) model that keeps only the blocks of `stage`; names are unchanged."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in stage_range(model.cfg.n_layers, n_stages, stage)}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
        part.embedding_norm = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


class Pipeline:
    """This rank's stages and the schedule that runs them. `forward_backward` and `evaluate` mirror
    the functions of `keel.train.step` for a pipelined model."""

    def __init__(self, cfg: Config, layout: Layout, parts: list[Llama], stages: list[int],
                 optimizers: list[torch.optim.Optimizer], objective: Objective) -> None:
        n_stages = layout.degrees.pp * cfg.parallel.pp_stages_per_rank
        device = next(parts[0].parameters()).device
        group = layout.pp.get_group()
        self.parts, self.optimizers, self.objective = parts, optimizers, objective
        self.cross_entropies: list[torch.Tensor] = []  # of the micro-batches the last stage ran, in order
        self.pp_group = group
        self.has_first, self.has_last = 0 in stages, n_stages - 1 in stages
        pipeline_stages = [PipelineStage(part, stage, n_stages, device, group=group)
                           for part, stage in zip(parts, stages, strict=True)]
        self.cls = SCHEDULES[cfg.parallel.pp_schedule]
        self.stages = pipeline_stages[0] if cfg.parallel.pp_stages_per_rank == 1 else pipeline_stages
        n_micro = layout.degrees.pp_microbatches
        # Every pipeline micro-batch holds this many sequences. A step with more or fewer sequences on this
        # rank (replica groups: the survivors of a lost group take its share) runs more or fewer of them.
        self.chunk = cfg.train.global_batch // layout.dp // n_micro
        self.schedules = {n_micro: self.cls(self.stages, n_microbatches=n_micro, loss_fn=self._loss)}
        self.schedule = self.schedules[n_micro]

    def _run(self, run, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The mean loss of this rank's batch on the last stage, 0 elsewhere."""
        device = next(self.parts[0].parameters()).device
        inputs = torch.cat([x for x, _ in micro_batches]).to(device)
        targets = torch.cat([y for _, y in micro_batches]).to(device)
        self.cross_entropies = []
        losses: list[torch.Tensor] = []
        with self.objective.sharded():
            if self.has_first:
                run(inputs, target=targets, losses=losses)
            else:
                run(target=targets, losses=losses)
        if not self.has_last:
            return torch.zeros((), device=device)
        # The micro-batches' own: the first step's shape inference also calls the loss function, first.
        return torch.stack([plain(loss) for loss in self.cross_entropies[-len(losses):]]).mean()

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the objective it differentiates; the cross entropy is what is reported."""
        differentiated, cross_entropy = self.objective(logits, self.objective.local(targets))
        self.cross_entropies.append(cross_entropy.detach())
        return differentiated

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run the schedule's forward and backward; gradients accumulate in this rank's stages."""
        n = sum(len(x) for x, _ in micro_batches) // self.chunk
        if n not in self.schedules:
            self.schedules[n] = self.cls(self.stages, n_microbatches=n, loss_fn=self._loss)
        # The step's outputs (the logits of every micro-batch) are not wanted: unsaved, each is freed once
        # its backward has run instead of at the end of the step.
        return self._run(partial(self.schedules[n].step, return_outputs=False), micro_batches)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed token loss and token count, counted on the ranks that hold the last stage."""
        loss = self._run(self.schedule.eval, batches).double()
        tokens = float(sum(self.objective.local(y).numel() for _, y in batches)) if self.has_last else 0.0
        return loss * tokens, torch.tensor(tokens, dtype=torch.float64, device=loss.device)
