"""Instability signals, on one step in `monitor.signals_interval`: per layer, the largest attention logit and
the RMS of the block's output and of the update the optimizer applied to the block; and the mean and largest
log-normaliser (log Z) of the output logits. Wortsman et al. (ICLR 2024) show attention-logit growth and
output-logit divergence preceding the instabilities of large runs, and reproduce them in small ones. A float8 run
(`train.precision = "fp8"`) adds, per layer, the share of its float8 layers' inputs that the cast flushes to zero,
and the largest input amax (not finite: an overflow).

The forward hooks exist only during a sampled step's forward and backward, read every micro-batch, and ignore
activation checkpointing's recomputation (a forward inside the backward); the readings are reduced over every
rank with two all-reduces on that step, so that every layout reads the same global batch, and appear in the
next metrics record. Other steps pay nothing.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from keel.core.callbacks import Callback, Step
from keel.core.dtensor import local, plain
from keel.core.torch_private import in_backward
from keel.model.float8 import float8_reading, is_float8
from keel.model.llama import Attention, Block, apply_rope
from keel.model.loss import log_normaliser
from keel.train.optim import applied_updates, copies_held

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_QUERY_CHUNK = 256  # queries per block of attention scores: memory stays at chunk × sequence per head


def _layer(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing recomputing a block."""
    return in_backward()


@torch.no_grad()
def largest_attention_logit(attention: Attention, x: torch.Tensor, rope: torch.Tensor,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """The largest attention logit (q·k times the attention's scale, 1/√d by default) over this rank's heads
    and every (query, key) pair of `x` that attends: causal, or as `mask` (batch, 1, seq, seq) says. Under context
    parallelism `x` holds this rank's positions and `mask` each position's document (batch, seq): the keys of the
    whole sequence are gathered from the group (a collective) and each query sees those its true position may."""
    batch, seq = x.shape[0], x.shape[1]
    q = attention.wq(x).view(batch, seq, -1, attention.head_dim)
    k = attention.wk(x).view(batch, seq, -1, attention.head_dim)
    if attention.q_norm is not None and attention.k_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = apply_rope(q, rope).float(), apply_rope(k, rope).float()
    context = attention.context
    if context is not None:
        k = context.gather(k.transpose(1, 2)).transpose(1, 2)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    keys = torch.arange(k.shape[1], device=x.device)
    queries = keys if context is None else context.positions(k.shape[1], x.device)
    largest = torch.tensor(-math.inf, device=x.device)
    scale = attention.scale or 1 / math.sqrt(attention.head_dim)
    for start in range(0, seq, _QUERY_CHUNK):
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, start:start + _QUERY_CHUNK], k) * scale
        rows = slice(start, start + scores.shape[2])
        scores = scores.masked_fill(_hidden(queries[rows], keys, mask, rows, context is not None), -math.inf)
        largest = torch.maximum(largest, scores.max())
    return largest


def _hidden(queries: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, rows: slice,
            split: bool) -> torch.Tensor:
    """Which keys each of the query rows `rows` (at sequence positions `queries`) may not see, broadcastable to
    (batch, heads, queries, keys); `split`: `mask` is each position's document, not the (query, key) mask."""
    if mask is not None and not split:
        return ~mask[:, :, rows]
    later = keys[None, :] > queries[:, None]
    if mask is None:
        return later
    return (later[None] | (mask[:, queries, None] != mask[:, None, :]))[:, None]


class InstabilitySignals(Callback):
    """`last`: the latest readings, as metrics (`signals/...`; per layer `signals/<name>/layer_<i>`)."""
    priority = 160

    def __init__(self, interval: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 n_layers: int, pp: int, float8_rowwise: bool = True) -> None:
        self.interval, self.parts, self.optimizers, self.n_layers, self.pp = interval, parts, optimizers, n_layers, pp
        self.rowwise = float8_rowwise  # how the float8 casts scale: per row, or per tensor
        self.last: dict[str, float] = {}
        self.last_step = 0
        self._handles: list[Any] = []
        self._attn: dict[int, torch.Tensor] = {}
        self._act: dict[int, tuple[torch.Tensor, int]] = {}
        self._log_z: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._float8: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # amax, flushed, elements

    def on_step_start(self, step: Step) -> None:
        self._remove()  # a step abandoned by a rollback left them
        self.last_step = 0  # this step's readings are not in yet (a step without an update computes none)
        if not self.interval or step.number % self.interval:
            return
        self._attn, self._act, self._log_z, self._float8 = {}, {}, None, {}
        for part in self.parts:
            for name, module in part.named_modules():
                layer = _layer(name)
                if is_float8(module) and layer is not None:
                    self._handles.append(module.register_forward_hook(self._on_float8(layer)))
                elif isinstance(module, Attention) and layer is not None:
                    self._handles.append(module.register_forward_hook(self._on_attention(layer)))
                elif isinstance(module, Block) and layer is not None:
                    self._handles.append(module.register_forward_hook(self._on_block(layer)))
            if isinstance(getattr(part, "output", None), nn.Linear):  # the last stage: its output is the logits
                self._handles.append(part.register_forward_hook(self._on_logits))

    def on_backward(self, step: Step, replaying: bool) -> None:
        self._remove()  # every micro-batch is through; a replay's recomputation is not read again

    def on_step_end(self, step: Step) -> None:
        if not self.interval or step.number % self.interval or not step.updated:
            return
        self.last, self.last_step = self._reduce(), step.number

    def of_step(self, number: int) -> dict[str, float]:
        """The readings of step `number` when it computed them (the same on every rank), else nothing."""
        return self.last if self.last_step == number else {}

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ the hooks (every micro-batch)

    def _on_attention(self, layer: int):  # noqa: ANN202 (a hook)
        def hook(module: Attention, args: tuple, output: Any) -> None:
            if not _recomputing():
                value = largest_attention_logit(module, *args[:3])
                self._attn[layer] = torch.maximum(self._attn[layer], value) if layer in self._attn else value
        return hook

    def _on_block(self, layer: int):  # noqa: ANN202 (a hook)
        def hook(module: Block, args: tuple, output: torch.Tensor) -> None:
            if not _recomputing():
                out = local(output)
                square, count = self._act.get(layer, (torch.zeros((), device=out.device), 0))
                self._act[layer] = (square + out.detach().float().square().sum(), count + out.numel())
        return hook

    def _on_float8(self, layer: int):  # noqa: ANN202 (a hook)
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not _recomputing():
                amax, flushed, count = float8_reading(local(args[0]), self.rowwise)
                if layer in self._float8:
                    top, total, elements = self._float8[layer]
                    amax, flushed, count = torch.maximum(top, amax), total + flushed, elements + count
                self._float8[layer] = (amax, flushed, count)
        return hook

    def _on_logits(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if _recomputing():
            return
        with torch.no_grad():
            log_z = plain(log_normaliser(output.detach().flatten(0, -2).float()))
        if self._log_z is None:
            self._log_z = (log_z.sum(), log_z.max(), log_z.numel())
        else:
            total, top, count = self._log_z
            self._log_z = (total + log_z.sum(), torch.maximum(top, log_z.max()), count + log_z.numel())

    # ------------------------------------------------------------------ reduction over every rank

    def _reduce(self) -> dict[str, float]:
        n, device = self.n_layers, next(p for part in self.parts for p in part.parameters()).device
        # Per layer: the attention logit, then log Z and the float8 inputs' amax.
        largest = torch.full((n + 2,), -math.inf, device=device)
        # Per layer: activations' squares and count, updates' squares and count; log Z's sum and count; per layer:
        # float8's flushed elements and count.
        sums = torch.zeros(6 * n + 2, dtype=torch.float64, device=device)
        for layer, value in self._attn.items():
            largest[layer] = value
        for layer, (amax, flushed, count) in self._float8.items():
            largest[n + 1] = torch.maximum(largest[n + 1], amax)
            sums[4 * n + 2 + layer], sums[5 * n + 2 + layer] = flushed, count
        for layer, (square, count) in self._act.items():
            sums[layer], sums[n + layer] = square, count
        held = {id(p): _layer(name) for part in self.parts for name, p in part.named_parameters()}
        for p, update in applied_updates(self.optimizers):
            if (block := held.get(id(p))) is not None:
                copies = copies_held(p, self.pp)
                sums[2 * n + block] += update.square().sum() / copies
                sums[3 * n + block] += update.numel() / copies
        if self._log_z is not None:
            sums[4 * n], largest[n], sums[4 * n + 1] = self._log_z[0], self._log_z[1], self._log_z[2]
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        top, total = largest.tolist(), sums.tolist()
        record = {"signals/attn_logit_max": max(top[:n]), "signals/log_z_max": top[n],
                  "signals/log_z_mean": total[4 * n] / max(1.0, total[4 * n + 1])}
        shares = {i: total[4 * n + 2 + i] / total[5 * n + 2 + i] for i in range(n) if total[5 * n + 2 + i]}
        if shares:  # a float8 run's (summed over every rank: the same record everywhere)
            record["signals/float8_amax_max"] = top[n + 1]
            record |= {f"signals/float8_underflow/layer_{i}": share for i, share in shares.items()}
            record["signals/float8_underflow_max"] = max(shares.values())
        for i in range(n):
            record[f"signals/attn_logit_max/layer_{i}"] = top[i]
            record[f"signals/act_rms/layer_{i}"] = math.sqrt(total[i] / max(1.0, total[n + i]))
            record[f"signals/update_rms/layer_{i}"] = math.sqrt(total[2 * n + i] / max(1.0, total[3 * n + i]))
        return record
