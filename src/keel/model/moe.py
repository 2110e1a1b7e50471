"""Mixture-of-experts feed-forward (DeepSeek-V3 / Qwen3-MoE style): a router sends each token to `top_k` of
`experts` SwiGLU experts and sums their outputs weighted by its scores, beside shared experts that every token
goes through.

The chosen (token, expert) slots are sorted by expert and every projection runs once over all experts
(`expert_swiglu`: a grouped GEMM on CUDA), the function expert parallelism calls on the tokens a rank receives.
Balance is kept by a per-expert bias that only selection sees, moved between steps (`MoE.update_bias`), and
optionally by DeepSeek-V3's sequence-wise balance loss and ST-MoE's router z-loss, which reach the router through
the backward pass (`AuxLoss`) so that the model still returns only its logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from keel.config import ModelConfig, ffn_hidden_dim
from keel.core.dtensor import local
from keel.core.torch_private import in_backward

# Rows of each group of a grouped GEMM on CUDA are padded to a multiple of this, so that every group starts
# 16-byte aligned for bf16 and fp8 kernels (the weight gradient's GEMM is grouped along the tokens).
GROUP_ALIGN = 16


class SwiGLU(nn.Module):
    """w2(silu(w1 x) · w3 x): the dense feed-forward, and the shared experts side by side as one."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def expert_dim(cfg: ModelConfig) -> int:
    """The SwiGLU hidden size of each expert: `model.moe.expert_dim`, else the dense feed-forward's."""
    return cfg.moe.expert_dim or ffn_hidden_dim(cfg)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe.experts > 0 and layer >= cfg.moe.dense_layers


# ---------------------------------------------------------------- the experts' compute

def looped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """expert_swiglu as one matmul per expert over its rows."""
    groups = x.split(counts.tolist())
    outs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]) for e, rows in enumerate(groups)]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   align: int = GROUP_ALIGN, mm: GroupedMM | None = None) -> torch.Tensor:
    """expert_swiglu as one grouped GEMM per projection (`mm`: torch.nn.functional.grouped_mm) in x's dtype. Each
    expert's rows are copied into a zero-padded buffer at a multiple of `align`; the buffer is sized for any
    counts (rows + experts · align), so nothing waits for the counts to reach the host, and its last group takes
    the slack rows, zeros, so that every row has a defined output."""
    n, experts = x.shape[0], counts.shape[0]
    counts = counts.long()
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    expert_of = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
    place = (ends - padded)[expert_of] + torch.arange(n, device=x.device) - (counts.cumsum(0) - counts)[expert_of]
    rows = n + experts * align
    offs = torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)
    buffer = x.new_zeros(rows, x.shape[1]).index_copy(0, place, x)
    mm = mm or (lambda a, b, offs: F.grouped_mm(a, b, offs=offs))
    hidden = F.silu(mm(buffer, w1.mT, offs)) * mm(buffer, w3.mT, offs)
    return mm(hidden, w2.mT, offs).index_select(0, place)


def expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU on its own rows of `x` (rows, dim), sorted by expert: the first counts[0] rows are
    expert 0's, the next counts[1] expert 1's, ... (counts sums to the rows). w1 and w3 are (experts, hidden,
    dim), w2 (experts, dim, hidden). On CUDA a grouped GEMM in bf16, the dtype its kernels take, when the
    sizes keep its operands' rows 16-byte aligned; otherwise a loop over the experts in x's dtype."""
    if x.is_cuda and x.shape[-1] % 8 == 0 and w1.shape[1] % 8 == 0:
        bf16 = torch.bfloat16
        return grouped_swiglu(x.to(bf16), counts, w1.to(bf16), w2.to(bf16), w3.to(bf16)).to(x.dtype)
    return looped_swiglu(x, counts, w1, w2, w3)


class ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is scaled by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


ExpertSwiGLU = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Experts(nn.Module):
    """The routed experts' weights as 3-D parameters, experts first: expert parallelism shards dimension 0, and
    this rank computes with its own experts' rows (`local`). Under expert parallelism a rank's experts take tokens
    from every rank of its group, so their gradient holds `grad_scale`⁻¹ = ep ranks' shares where data
    parallelism averages one rank's: it is scaled back as it leaves the weights. `swiglu` computes them
    (expert_swiglu; keel.model.float8 puts its float8 one in its place)."""

    swiglu: ExpertSwiGLU

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)  # keel.model.init replaces it by the name-seeded value
        self.grad_scale = 1.0
        self.swiglu = expert_swiglu

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local(w) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        return self.swiglu(x, counts, w1, w2, w3)


class ExpertDispatch(Protocol):
    """How the tokens reach experts held by other ranks (expert parallelism, `keel.parallel.experts`): `size`
    ranks, each holding experts / size of them."""

    size: int

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send each of this rank's rows (sorted by expert; counts[e] of them for expert e, over all experts) to
        the rank that holds its expert. Returns the rows received, sorted by this rank's experts, how many each
        of them has, and what `combine` needs to send the results back."""
        ...

    def combine(self, out: torch.Tensor, exchange: Any) -> torch.Tensor:
        """The experts' outputs of the received rows back on the ranks that sent them, in the order sent."""
        ...


class PermuteRows(torch.autograd.Function):
    """x[order], whose gradient is the gradient gathered back by the inverse permutation: no scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = PermuteRows.apply(x, order, inverse)
    return out


def sort_by(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stable order that sorts `keys` and its inverse permutation (for `permute_rows`)."""
    order = keys.argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return order, inverse


# ---------------------------------------------------------------- routing

class Routing(NamedTuple):
    logits: torch.Tensor  # (tokens, experts) fp32
    scores: torch.Tensor  # (tokens, experts): softmax or sigmoid of the logits
    weights: torch.Tensor  # (tokens, top_k): what each chosen expert's output is weighted by
    chosen: torch.Tensor  # (tokens, top_k): the experts chosen


class Router(nn.Module):
    """Scores every expert for every token in fp32 and chooses the top_k by score plus `bias`; the chosen
    experts' weights are their scores without the bias."""

    def __init__(self, dim: int, experts: int, top_k: int, score: str, normalize_top_k: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.top_k, self.score = top_k, score
        self.normalize = normalize_top_k or score == "sigmoid"

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(logits, scores, weights, chosen)


class AuxLoss(torch.autograd.Function):
    """The identity on a layer's output whose backward also gives `aux`, an auxiliary loss computed from the
    router's logits, the gradient `scale`: the training objective gains scale × aux without the model returning
    it (Megatron-Core's trick)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_like = scale, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def balance_loss(routing: Routing, sequences: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over the sequences: per sequence of T tokens,
    Σ_i f_i · P_i with f_i = experts / (top_k · T) × the times expert i was chosen and P_i the mean over the
    tokens of its score normalised over the experts. 1 when perfectly balanced."""
    experts = routing.scores.shape[-1]
    chosen = routing.chosen.view(sequences, -1)
    picks = torch.zeros(sequences, experts, device=chosen.device).scatter_add_(
        1, chosen, torch.ones_like(chosen, dtype=torch.float32))
    f = picks * experts / chosen.shape[1]  # chosen.shape[1] = top_k · T
    scores = routing.scores / routing.scores.sum(-1, keepdim=True)
    p = scores.view(sequences, -1, experts).mean(1)
    return (f * p).sum()


def z_loss(routing: Routing, sequences: int) -> torch.Tensor:
    """ST-MoE's router z-loss, the mean over each sequence's tokens of logsumexp(logits)², summed over the
    sequences."""
    return routing.logits.logsumexp(-1).square().view(sequences, -1).mean(1).sum()


def bias_step(loads: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3): how each expert's selection bias moves after a step whose
    choices per expert were `loads` (last dimension: the experts), up by `rate` below the mean load, down above."""
    loads = loads.double()  # exact counts beyond float32's 2**24
    return (rate * torch.sign(loads.mean(-1, keepdim=True) - loads)).float()


def score_entropy(scores: torch.Tensor) -> torch.Tensor:
    """The entropy (nats) of each token's scores normalised over the experts, summed over the tokens: how
    sharply the router picks (ln(experts) when it cannot tell the experts apart)."""
    p = scores.detach() / scores.detach().sum(-1, keepdim=True)
    return -torch.special.xlogy(p, p).sum()


def scale_auxiliary_losses(model: nn.Module, sequences: int) -> None:
    """Before a training step of `sequences` sequences on this rank: each mixture-of-experts layer's auxiliary
    losses (sums over a forward's sequences) enter the gradient divided by them, as per-sequence means over the
    step, the way the training loss averages its tokens (data parallelism then averages over the ranks)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_scale = 1.0 / sequences


# ---------------------------------------------------------------- the layer

class MoE(nn.Module):
    """Router, routed experts and shared experts in place of a block's feed-forward. Its state besides the
    parameters: `expert_bias`, the balancing bias (saved with the model); `tokens_per_expert`, the (token,
    expert) choices made by training forwards since the last `update_bias`; `dropped_tokens`, the choices that
    a full expert dropped (capacity_factor > 0) since the last `reset_counts`; `router_entropy`, the entropy of
    the router's normalised scores summed over the tokens of training forwards since then (`score_entropy`);
    `aux_losses`, the last training forward's balance and z-losses per sequence (detached). `aux_scale`
    multiplies the auxiliary losses' gradient (`scale_auxiliary_losses`)."""

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped_tokens: torch.Tensor
    router_entropy: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.experts_n, self.top_k = moe.experts, moe.top_k
        self.capacity_factor, self.score_scale = moe.capacity_factor, moe.score_scale
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.router = Router(cfg.dim, moe.experts, moe.top_k, moe.score, moe.normalize_top_k)
        self.experts = Experts(moe.experts, cfg.dim, expert_dim(cfg))
        self.shared = SwiGLU(cfg.dim, moe.shared_experts * expert_dim(cfg)) if moe.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(moe.experts))
        self.register_buffer("tokens_per_expert", torch.zeros(moe.experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("router_entropy", torch.zeros((), dtype=torch.float64), persistent=False)
        self.aux_scale = 1.0
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.dispatcher: ExpertDispatch | None = None  # set under expert parallelism

    def capacity(self, tokens: int) -> int:
        """The most (token, expert) slots one expert takes from a forward of `tokens` tokens."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts_n)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of each expert chosen fewer times than the
        mean of `counts` by `rate`, lower the others' (counts: the choices per expert, summed over the data-parallel
        ranks by the caller), and start counting again."""
        self.expert_bias += bias_step(counts.to(self.expert_bias.device), rate)
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def reset_counts(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped_tokens.zero_()
        self.router_entropy.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat, self.expert_bias)
        training = self.training and torch.is_grad_enabled()
        counting = training and not in_backward()  # activation checkpointing's recompute runs inside backward
        out = self.routed(flat, routing, counting) * self.score_scale
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.to(x.dtype).view_as(x)
        if training:
            out = self.with_aux_losses(out, routing, x.shape[0], counting)
        return out

    def routed(self, flat: torch.Tensor, routing: Routing, counting: bool) -> torch.Tensor:
        """The routed experts' outputs summed with their weights (fp32), each token's slots gathered back in
        token order (no scatter: the same sums in any run)."""
        n, k = routing.chosen.shape
        ids = routing.chosen.flatten()  # slot s is token s // k's choice s % k
        counts = torch.bincount(ids, minlength=self.experts_n)
        if counting:
            self.tokens_per_expert += counts
            self.router_entropy += score_entropy(routing.scores)
        if self.capacity_factor:
            ids, counts = self.drop_over_capacity(ids, counts, n, counting)
        order, inverse = sort_by(ids)
        slots = flat.unsqueeze(1).expand(n, k, flat.shape[1]).reshape(n * k, flat.shape[1])
        sorted_x = permute_rows(slots, order, inverse)
        if self.capacity_factor:  # the dropped slots sort last: they give zeros
            kept = int(counts.sum())
            out = self.run_experts(sorted_x[:kept], counts)
            out = torch.cat([out, out.new_zeros(n * k - kept, out.shape[1])])
        else:
            out = self.run_experts(sorted_x, counts)
        out = permute_rows(out, inverse, order).view(n, k, -1)
        return (out.float() * routing.weights.unsqueeze(-1)).sum(1)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs of rows sorted by expert: here, or on the ranks that hold them."""
        if self.dispatcher is None:
            return self.experts(x, counts)
        rows, local_counts, exchange = self.dispatcher.dispatch(x, counts)
        return self.dispatcher.combine(self.experts(rows, local_counts), exchange)

    def drop_over_capacity(self, ids: torch.Tensor, counts: torch.Tensor, tokens: int,
                           counting: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert keeps its first `capacity` slots in token order; the others get the id `experts`, which
        sorts after every expert's. The ids and the kept slots per expert."""
        capacity = self.capacity(tokens)
        order = ids.argsort(stable=True)
        first = counts.cumsum(0) - counts
        rank_sorted = torch.arange(ids.shape[0], device=ids.device) - first[ids[order]]
        rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
        dropped = rank >= capacity
        if counting:
            self.dropped_tokens += dropped.sum()
        return ids.masked_fill(dropped, self.experts_n), counts.clamp(max=capacity)

    def with_aux_losses(self, out: torch.Tensor, routing: Routing, sequences: int, counting: bool) -> torch.Tensor:
        balance, z = balance_loss(routing, sequences), z_loss(routing, sequences)
        if counting:
            self.aux_losses = {"balance": balance.detach() / sequences, "z": z.detach() / sequences}
        if not (self.aux_loss_coeff or self.z_loss_coeff):
            return out
        aux = self.aux_loss_coeff * balance + self.z_loss_coeff * z
        result: torch.Tensor = AuxLoss.apply(out, aux, self.aux_scale)
        return result
