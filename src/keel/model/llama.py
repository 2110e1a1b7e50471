"""Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention through SDPA."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from keel.config import ModelConfig
from keel.model.attention import sdpa_context
from keel.model.context import ContextParallel
from keel.model.flops import ffn_hidden_dim, head_size
from keel.model.moe import ExpertDispatch, MoE, SwiGLU, is_moe_layer
from keel.model.parallelizable import ParallelPlan

# The attention and SwiGLU projections, the routed experts' 3-D weights among them (a router's output size is the
# number of experts, not a width: it is not one).
HIDDEN_MATRICES = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight",
                   "experts.w1", "experts.w2", "experts.w3")


def width_ratio(cfg: ModelConfig) -> float:
    """μP's base_dim / dim, by which hidden matrices' learning rate and the output logits scale (1 under the
    standard parametrization, and at the base width)."""
    return (cfg.base_dim or cfg.dim) / cfg.dim if cfg.parametrization == "mup" else 1.0


def llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's stretch of RoPE to a longer context: a frequency whose wavelength exceeds
    original / low_freq_factor positions is divided by `rope_factor`, one whose wavelength is below
    original / high_freq_factor is kept, and those between move linearly in original / wavelength from
    the one to the other."""
    original, low, high = cfg.rope_original_max_seq_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    kept = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - kept) * inv_freq / cfg.rope_factor + kept * inv_freq


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None,
                scaled_as: ModelConfig | None = None) -> torch.Tensor:
    """cos/sin of the rotary angles, shape (max_seq_len, head_dim // 2, 2), fp32; `scaled_as`: the model
    whose `rope_scaling` stretches the frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaled_as is not None and scaled_as.rope_scaling == "llama3":
        inv_freq = llama3_frequencies(inv_freq, scaled_as)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of features of x (batch, seq, heads, head_dim) by the angles of each position: `rope` is the
    table of positions 0, 1, ... (rope_tables), or each token's own angles (batch, seq, head_dim // 2, 2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    if rope.dim() == 4:
        cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    else:
        cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = head_size(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # μP scales q·k by 1/head size (sqrt(base head size) / head size: sp's 1/sqrt(head size) at the base width);
        # a head size given as such does not grow with the width.
        base_head = cfg.head_dim or (cfg.base_dim or cfg.dim) / cfg.n_heads
        self.scale = base_head**0.5 / self.head_dim if cfg.parametrization == "mup" else None
        # One gain per feature of a head, shared by all heads (as Qwen3 and OLMo 2 do per head).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.context: ContextParallel | None = None  # the sequence split over ranks (Llama.split_context)
        self.backend = cfg.sdpa_backend  # which SDPA kernel runs (keel.model.attention)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: which keys each query may attend to (batch, 1, seq, seq) — under context parallelism each
        position's document id (batch, seq) instead —, None for causal attention."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.context is not None:
            out = self.context.attention(q, k, v, query_docs=None if mask is None else self.context.split(mask),
                                         key_docs=mask, scale=self.scale)
        else:
            with sdpa_context(self.backend):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                     enable_gqa=self.n_kv_heads != self.n_heads, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(SwiGLU):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.dim, ffn_hidden_dim(cfg))


class Block(nn.Module):
    """Attention and a feed-forward, each a residual branch after an RMSNorm. Block `layer` of a model with
    experts (model.moe) from moe.dense_layers on has a mixture of experts (`moe`) in place of the dense
    feed-forward (`feed_forward`); the other one is None."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = None if is_moe_layer(cfg, layer) else FeedForward(cfg)
        self.moe = MoE(cfg) if is_moe_layer(cfg, layer) else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, mask)
        h = self.ffn_norm(x)
        if self.moe is not None:
            return x + self.moe(h)
        assert self.feed_forward is not None
        return x + self.feed_forward(h)


class Llama(nn.Module):
    """Decoder-only transformer. Blocks live in a ModuleDict keyed by layer index, so that parameter
    names stay stable when a layout keeps only some of the layers. A pipeline stage keeps a range of
    blocks; only the first keeps the embedding and only the last the final norm and output, so a
    stage maps tokens or hidden states to hidden states or logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The embedding, norm and output are None in a pipeline stage that does not hold them (stage_module).
        embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_embeddings: nn.Embedding | None = embeddings
        self.embedding_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.embedding_norm == "rmsnorm" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.output: nn.Linear | None = output
        if cfg.tie_embeddings:
            output.weight = embeddings.weight
        self.register_buffer("rope", self._rope(None), persistent=False)
        self.output_multiplier = width_ratio(cfg)  # μP's readout multiplier
        # data.document_mask: the token that starts a document (the corpus's BOS); None attends causally across
        # the packed documents of a sequence.
        self.document_start: int | None = None
        self.document_positions = False  # data.document_positions: RoPE positions restart at each document
        self.context: ContextParallel | None = None  # this rank's share of each sequence (split_context)

    def moe_layers(self) -> dict[str, MoE]:
        """The mixture-of-experts of each block that has one, by the block's key in `layers`."""
        return {key: module for key, block in self.layers.items() for module in block.modules()
                if isinstance(module, MoE)}

    def _rope(self, device: torch.device | None) -> torch.Tensor:
        return rope_tables(head_size(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta, device,
                           scaled_as=self.cfg)

    def reset_buffers(self) -> None:
        """After materialising a meta-device model: recompute non-persistent buffers and tie the output
        projection to the embedding again (`to_empty` gives each module a new parameter)."""
        self.rope = self._rope(next(self.parameters()).device)
        for moe in self.moe_layers().values():
            moe.reset_counts()
        embeddings, output = self.tok_embeddings, self.output  # both are there when tied: never pipelined
        if (self.cfg.tie_embeddings and embeddings is not None and output is not None
                and output.weight is not embeddings.weight):
            output.weight = embeddings.weight

    def blocks(self) -> nn.ModuleDict:
        return self.layers

    def parallel_plan(self) -> ParallelPlan:
        """Megatron-style TP with sequence parallel: projections column-/row-wise over heads and the SwiGLU
        hidden size; norms and residuals sharded over the sequence between them; the output projection
        sharded over the vocabulary, its logits left as a DTensor for the parallel loss. A mixture of experts
        takes the whole sequences of its tensor-parallel group (gathered) and computes them alike on every rank of
        it, its parameters replicated: its output leaves sharded over the sequence, and the gradient that comes
        back is gathered, so every rank's parameters get the same whole gradient (expert parallelism, not tensor
        parallelism, splits the experts)."""
        top: dict[str, ParallelStyle] = {}
        if self.tok_embeddings is not None:
            top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if self.norm is not None:
            top["norm"] = SequenceParallel()
        if self.output is not None:
            top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        if self.embedding_norm is not None:  # between the embedding and the first block: sharded over the sequence
            top["embedding_norm"] = SequenceParallel(use_local_output=True)
        # QK-norm sees this rank's heads (dimension 2 of batch, sequence, head, feature); its gains are replicated.
        qk_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
        per_head = {"attention.q_norm": qk_norm, "attention.k_norm": qk_norm} if self.cfg.qk_norm else {}
        dense: dict[str, ParallelStyle] = {
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        experts: dict[str, ParallelStyle] = {
            "moe": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_input=True, output_layouts=(Replicate(),),
                                            desired_output_layouts=(Shard(1),), use_local_output=True)}
        return ParallelPlan(top, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            **per_head,
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }, {key: experts if block.moe is not None else dense for key, block in self.layers.items()})

    def embedded(self, x: torch.Tensor) -> torch.Tensor:
        """The token embeddings as the first block sees them (`model.embedding_norm`)."""
        if self.embedding_norm is not None:
            return self.embedding_norm(x)
        return x * self.cfg.dim**0.5 if self.cfg.embedding_norm == "scale" else x

    def mask_documents(self, start: int, positions: bool) -> None:
        """Attend within documents from now on: `start` is the token each document begins with."""
        self.document_start, self.document_positions = start, positions

    def split_context(self, context: ContextParallel | None) -> None:
        """Context parallelism: from now on this rank computes its share of every sequence (`context.positions`),
        its attention exchanging keys and values with the other ranks of the group; None: whole sequences again
        (what the downstream evaluation scores)."""
        self.context = context
        for module in self.modules():
            if isinstance(module, Attention):
                module.context = context

    def split_experts(self, dispatch: ExpertDispatch) -> list[nn.Module]:
        """Expert parallelism: each mixture-of-experts layer sends its tokens' rows through `dispatch` to the ranks
        that hold their experts. Returns the modules that hold the routed experts' weights (experts first) for the
        caller to split over the expert-parallel ranks."""
        experts: list[nn.Module] = []
        for moe in self.moe_layers().values():
            moe.dispatcher = dispatch
            moe.experts.grad_scale = 1.0 / dispatch.size
            experts.append(moe.experts)
        return experts

    def documents(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each token's document (a sequence's tokens before its first document start are one more document), and
        with `document_positions` its position within its document (None: its place in the sequence)."""
        assert self.document_start is not None
        starts = tokens == self.document_start
        index = torch.arange(tokens.shape[1], device=tokens.device)
        if not self.document_positions:
            return starts.cumsum(-1), None
        first = torch.where(starts, index, 0).cummax(-1).values  # where each token's document starts
        return starts.cumsum(-1), index - first

    def attention_inputs(self, tokens: torch.Tensor | None, seq: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The RoPE angles of the positions this rank computes and what its attention masks with (Attention's
        `mask`): causal attention, or within documents, over a sequence of `seq` tokens."""
        document, positions = None, None
        if self.document_start is not None:
            assert tokens is not None, "a pipeline stage with a document mask needs the previous stage's tokens"
            document, positions = self.documents(tokens)
        if self.context is not None:  # this rank's positions: their angles; each position's document as the mask
            mine = self.context.positions(seq, self.rope.device)
            return self.rope[mine if positions is None else positions[:, mine]], document
        rope = self.rope if positions is None else self.rope[positions]
        if document is None:
            return rope, None
        index = torch.arange(seq, device=document.device)
        causal = index[None, :] <= index[:, None]
        return rope, ((document[:, :, None] == document[:, None, :]) & causal)[:, None]

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> Any:
        """Tokens to logits; a pipeline stage maps tokens or hidden states to hidden states or logits. With a
        document mask, a stage before the last also passes the tokens on (`tokens`), for the next stage's mask.
        Under context parallelism the first stage takes the whole sequences' tokens and computes this rank's
        share of them from there on."""
        seq = x.shape[1] * (1 if self.context is None or self.tok_embeddings is not None else self.context.size)
        if self.tok_embeddings is not None:
            tokens, x = x, self.tok_embeddings(x if self.context is None else self.context.split(x))
            x = self.embedded(x)
        rope, mask = self.attention_inputs(tokens, seq)
        for block in self.layers.values():
            x = block(x, rope, mask)
        if self.output is None or self.norm is None:
            return x if self.document_start is None else (x, tokens)
        logits = self.output(self.norm(x))
        return logits * self.output_multiplier if self.output_multiplier != 1.0 else logits
