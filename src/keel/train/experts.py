"""Mixture-of-experts routing across the run: the experts' loads summed over every rank's tokens, the
auxiliary-loss-free balancing that moves each layer's selection bias after an applied update, and the loads
as metrics.

Each rank counts the tokens its own forwards send to each expert (keel.model.moe). The counts of one layer live on
the pipeline stage that holds it, so every stage fills its layers' rows of one (layers, experts) table and one
all-reduce over all ranks sums them: the ranks of the batch split and of the sequence split hold different tokens,
and the ranks of a tensor-parallel group the same ones (each computes its group's whole sequences), counted once.
With replica groups, each rank's counts are first summed with the same rank's of every live group, with the
gradients (`Step.tallies`), so that every group moves its biases alike. The update follows only an applied step,
from the counts of that step alone: a skipped or undone step's are dropped, and a replay's recomputation does not
count again. The biases are also kept in the host train state, so that a rollback
to an in-memory snapshot takes them back with the weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from keel.config import Config
from keel.core.callbacks import Step
from keel.model.init import canonical_name
from keel.model.moe import MoE, bias_step
from keel.train.components import Builtin


def expert_layers(parts: list[nn.Module]) -> dict[int, MoE]:
    """The mixture-of-experts module of each block this rank holds, by layer index."""
    found: dict[int, MoE] = {}
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found[int(canonical_name(name).split(".")[1])] = module
    return dict(sorted(found.items()))


def expert_balance(cfg: Config, parts: list[nn.Module], device: torch.device) -> list[ExpertBalance]:
    """The component of a mixture-of-experts model, on every rank (each takes part in the sum); none for a dense
    one."""
    return [ExpertBalance(parts, cfg, device)] if cfg.model.moe.experts else []


class ExpertBalance(Builtin):
    # After the replica groups' sum of the loads, which a replay's restore must keep; after the update (Metering's
    # clock first), before a checkpoint stages the biases.
    priority = 145
    state_name = "experts"  # its part of the host train state

    def __init__(self, parts: list[nn.Module], cfg: Config, device: torch.device) -> None:
        moe = cfg.model.moe
        self.layers, self.rate, self.log_every = expert_layers(parts), moe.bias_update_rate, cfg.monitor.interval
        self.expert_rows = list(range(moe.dense_layers, cfg.model.n_layers))
        self.tp = cfg.parallel.tp
        # Every layer's biases on every rank (a pipeline stage holds some layers): the host train state holds them
        # all, as the summed loads that move them are known everywhere. They stay on the device between steps.
        self.biases = torch.zeros(cfg.model.n_layers, moe.experts, dtype=torch.float32, device=device)
        self.counted: list[torch.Tensor] = []  # the counts of the step's own forwards, for a replay to restore

    def on_step_start(self, step: Step) -> None:
        for moe in self.layers.values():  # what a step that ended early counted is not carried into this one
            moe.reset_counts()
        step.tallies.extend(moe.tokens_per_expert for moe in self.layers.values())  # summed across replica groups

    def on_backward(self, step: Step, replaying: bool) -> None:
        if not replaying:
            self.counted = [moe.tokens_per_expert.clone() for moe in self.layers.values()]
            return
        for moe, counts in zip(self.layers.values(), self.counted, strict=True):
            moe.tokens_per_expert.copy_(counts)

    def on_step_end(self, step: Step) -> None:
        if not step.updated:
            return
        table = torch.zeros(self.biases.shape, dtype=torch.int64, device=self.biases.device)
        for layer, moe in self.layers.items():
            table[layer] = moe.tokens_per_expert
            moe.reset_counts()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        loads = table[self.expert_rows].double() / self.tp  # exact: each count is tp equal parts
        if self.rate:
            self.biases[self.expert_rows] += bias_step(loads, self.rate)
            self._place()
        if step.number % self.log_every == 0 or step.last:  # the steps whose metrics are logged: read them there
            imbalance = (loads.max(-1).values / loads.mean(-1).clamp_min(1e-12)).tolist()
            step.metrics.update({f"moe/imbalance/layer_{i}": v for i, v in zip(self.expert_rows, imbalance,
                                                                                strict=True)})
            step.metrics["moe/imbalance_max"] = max(imbalance)

    def _place(self) -> None:
        with torch.no_grad():
            for layer, moe in self.layers.items():
                moe.expert_bias.copy_(self.biases[layer])

    def state_dict(self) -> dict[str, Any]:
        return {"biases": self.biases.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "biases" in state:
            self.biases = torch.tensor(state["biases"], dtype=torch.float32, device=self.biases.device)
            self._place()
