"""Mixture-of-experts routing across the run: the experts' loads summed over every rank's tokens, the
auxiliary-loss-free balancing that moves each layer's selection bias after an applied update, and what the
router did over each logged interval as metrics (loads, imbalance, router entropy, the biases' spread, dropped
tokens).

Each rank counts the tokens its own forwards send to each expert (keel.model.moe). The counts of one layer live on
the pipeline stage that holds it, so every stage fills its layers' rows of one table (per layer: the tokens per
expert, the dropped slots, the summed router entropy) and one all-reduce over all ranks sums them: the ranks of the
batch split and of the sequence split hold different tokens, and the ranks of a tensor-parallel group the same ones
(each computes its group's whole sequences), counted once. With replica groups, each rank's counts are first
summed with the same rank's of every live group, with the gradients (`Step.tallies`), so that every group
moves its biases alike. The update follows only an applied step, from the counts of that step alone: a skipped or
undone step's are dropped, and a replay's recomputation does not count again. The biases are also kept in the host
train state, so that a rollback to an in-memory snapshot takes them back with the weights. The applied steps'
summed counts also add up on the device until a logged step reads them to the host, once: the metrics cost no host
synchronisation in between.
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


def counters(moe: MoE) -> tuple[torch.Tensor, ...]:
    """What a layer counts in its training forwards: tokens per expert, dropped slots, summed router entropy."""
    return moe.tokens_per_expert, moe.dropped_tokens, moe.router_entropy


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
        self.experts, self.top_k, self.capacity = moe.experts, moe.top_k, moe.capacity_factor > 0
        # Every layer's biases on every rank (a pipeline stage holds some layers): the host train state holds them
        # all, as the summed loads that move them are known everywhere. They stay on the device between steps.
        self.biases = torch.zeros(cfg.model.n_layers, moe.experts, dtype=torch.float32, device=device)
        # The applied steps' counts since the last logged step, summed over the ranks, per layer: the loads, then
        # the dropped slots and the summed router entropy (float64 holds counts exactly up to 2**53).
        self.window = torch.zeros(cfg.model.n_layers, moe.experts + 2, dtype=torch.float64, device=device)
        self.window_steps = 0
        self.counted: list[list[torch.Tensor]] = []  # the counts of the step's own forwards, for a replay to restore

    def on_step_start(self, step: Step) -> None:
        for moe in self.layers.values():  # what a step that ended early counted is not carried into this one
            moe.reset_counts()
        step.tallies.extend(c for moe in self.layers.values() for c in counters(moe))  # summed across replica groups

    def on_backward(self, step: Step, replaying: bool) -> None:
        if not replaying:
            self.counted = [[c.clone() for c in counters(moe)] for moe in self.layers.values()]
            return
        for moe, counted in zip(self.layers.values(), self.counted, strict=True):
            for live, kept in zip(counters(moe), counted, strict=True):
                live.copy_(kept)

    def on_step_end(self, step: Step) -> None:
        if step.updated:
            self._apply()
        if (step.number % self.log_every == 0 or step.last) and self.window_steps:  # the steps whose metrics are
            step.metrics.update(self._metrics())  # logged: the interval's counts are read there, and only there

    def _apply(self) -> None:
        """The step's counts summed over all ranks (one all-reduce) move the biases and join the interval's."""
        table = torch.zeros(self.window.shape, dtype=torch.float64, device=self.window.device)
        for layer, moe in self.layers.items():
            table[layer, :self.experts] = moe.tokens_per_expert
            table[layer, self.experts:] = torch.stack([moe.dropped_tokens.double(), moe.router_entropy])
            moe.reset_counts()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
        table /= self.tp  # exact for the counts, each tp equal parts (the entropy: the mean of tp equal sums)
        if self.rate:
            self.biases[self.expert_rows] += bias_step(table[self.expert_rows, :self.experts], self.rate)
            self._place()
        self.window += table
        self.window_steps += 1

    def _metrics(self) -> dict[str, Any]:
        """Each expert layer's loads over the interval (shares of its choices), their imbalance (max / mean) and
        least share (min / mean), the router's mean entropy per token, the biases' spread and the dropped slots."""
        rows = self.expert_rows
        spread = self.biases[rows].max(-1).values - self.biases[rows].min(-1).values
        values = torch.cat([self.window[rows], spread.double().unsqueeze(-1)], -1).tolist()  # one read to the host
        self.window.zero_()
        self.window_steps = 0
        out: dict[str, Any] = {}
        for layer, row in zip(rows, values, strict=True):
            loads, (dropped, entropy, bias_spread) = row[:self.experts], row[self.experts:]
            total = max(sum(loads), 1.0)  # an applied step routed tokens in every expert layer
            fair = total / self.experts
            out[f"moe/load/layer_{layer}"] = [round(n / total, 6) for n in loads]
            out[f"moe/imbalance/layer_{layer}"] = max(loads) / fair
            out[f"moe/min_load/layer_{layer}"] = min(loads) / fair
            out[f"moe/entropy/layer_{layer}"] = entropy / (total / self.top_k)  # every token makes top_k choices
            out[f"moe/bias_spread/layer_{layer}"] = bias_spread
            if self.capacity:
                out[f"moe/dropped_tokens/layer_{layer}"] = dropped
        out["moe/imbalance_max"] = max(out[f"moe/imbalance/layer_{layer}"] for layer in rows)
        return out

    def _place(self) -> None:
        with torch.no_grad():
            for layer, moe in self.layers.items():
                moe.expert_bias.copy_(self.biases[layer])

    def state_dict(self) -> dict[str, Any]:
        return {"biases": self.biases.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.zero_()  # a rollback's abandoned steps are not the interval's
        self.window_steps = 0
        if "biases" in state:
            self.biases = torch.tensor(state["biases"], dtype=torch.float32, device=self.biases.device)
            self._place()
