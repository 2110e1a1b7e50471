"""The model's sizes, without torch (the planner imports them): the feed-forward width, the fused cross
entropy's slice, parameter counts (all, and those a token uses with experts) and training FLOPs per token
(PaLM, Chowdhery et al. 2022, appendix B)."""

from __future__ import annotations

from keel.config import ModelConfig, ffn_hidden_dim, head_size

FUSED_CHUNK = 2**24  # elements of a slice of logits the fused cross entropy computes in fp32 at once (64 MiB)


def _params(cfg: ModelConfig, routed: int) -> int:
    """The parameters of the model when each mixture-of-experts block counts `routed` of its routed experts."""
    attention = cfg.dim * head_size(cfg) * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    dense = 3 * cfg.dim * ffn_hidden_dim(cfg)
    moe = cfg.moe
    moe_layers = max(0, cfg.n_layers - moe.dense_layers) if moe.experts else 0
    expert = 3 * cfg.dim * (moe.expert_dim or ffn_hidden_dim(cfg))
    mixture = cfg.dim * moe.experts + (routed + moe.shared_experts) * expert  # router, routed and shared experts
    blocks = cfg.n_layers * (attention + 2 * cfg.dim) + (cfg.n_layers - moe_layers) * dense + moe_layers * mixture
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    return blocks + embeddings + cfg.dim


def param_count(cfg: ModelConfig) -> int:
    """All trainable parameters, every expert's (what memory holds); a tied output projection is counted once."""
    return _params(cfg, cfg.moe.experts)


def active_param_count(cfg: ModelConfig) -> int:
    """The parameters one token goes through: a mixture-of-experts block's router, shared experts and top_k of
    its routed experts. The same as param_count for a dense model."""
    return _params(cfg, cfg.moe.top_k)


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters a token takes part in a matrix multiply with: the active ones but the input embedding lookup
    (which is the output projection itself when the two are tied)."""
    return active_param_count(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls of the N active parameters (forward 2N, backward 4N) plus
    12·L·H·Q·T for the attention scores and values, with L layers, H heads of size Q and sequence length T."""
    return 6 * matmul_param_count(cfg) + 12 * cfg.n_layers * cfg.n_heads * head_size(cfg) * seq_len
