"""The model's sizes, without torch (the planner imports them): the feed-forward width, the fused cross
entropy's slice, parameter counts and training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B)."""

from __future__ import annotations

from keel.config import ModelConfig, ffn_hidden_dim, head_size

FUSED_CHUNK = 2**24  # elements of a slice of logits the fused cross entropy computes in fp32 at once (64 MiB)


def param_count(cfg: ModelConfig) -> int:
    """All trainable parameters; a tied output projection is counted once."""
    attention = cfg.dim * head_size(cfg) * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    feed_forward = 3 * cfg.dim * ffn_hidden_dim(cfg)
    block = attention + feed_forward + 2 * cfg.dim
    embeddings = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * block + embeddings + cfg.dim


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply: everything but the input embedding lookup
    (which is the output projection itself when the two are tied)."""
    return param_count(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward 2N, backward 4N) plus 12·L·H·Q·T for
    the attention scores and values, with L layers, H heads of size Q and sequence length T."""
    return 6 * matmul_param_count(cfg) + 12 * cfg.n_layers * cfg.n_heads * head_size(cfg) * seq_len
