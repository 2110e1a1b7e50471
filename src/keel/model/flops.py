"""The model's sizes, without torch (the planner imports them): the feed-forward width, the fused cross
entropy's slice, parameter counts (all, and those a token uses with experts) and training FLOPs per token
(PaLM, Chowdhery et al. 2022, appendix B)."""

from __future__ import annotations

from keel.config import ModelConfig, ffn_hidden_dim, head_size

FUSED_CHUNK = 2**24  # elements of a slice of logits the fused cross entropy computes in fp32 at once (64 MiB)


def block_param_count(cfg: ModelConfig, layer: int, routed: int | None = None) -> int:
    """Block `layer`'s parameters: attention, its two norms' gains and its feed-forward; in a mixture-of-experts
    block the router, the shared experts and `routed` of its routed experts (None: every one)."""
    attention = cfg.dim * head_size(cfg) * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    moe = cfg.moe
    if not (moe.experts and layer >= moe.dense_layers):
        return attention + 2 * cfg.dim + 3 * cfg.dim * ffn_hidden_dim(cfg)
    expert = 3 * cfg.dim * (moe.expert_dim or ffn_hidden_dim(cfg))
    routed = moe.experts if routed is None else routed
    return attention + 2 * cfg.dim + cfg.dim * moe.experts + (routed + moe.shared_experts) * expert


def routed_expert_param_count(cfg: ModelConfig, layer: int) -> int:
    """Every routed expert's parameters in block `layer` (what expert parallelism splits); 0 in a dense block."""
    return block_param_count(cfg, layer) - block_param_count(cfg, layer, 0)


def _params(cfg: ModelConfig, routed: int) -> int:
    """The parameters of the model when each mixture-of-experts block counts `routed` of its routed experts."""
    blocks = sum(block_param_count(cfg, layer, routed) for layer in range(cfg.n_layers))
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


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the attention scores and values: 12·L·H·Q·T."""
    return 12 * cfg.n_layers * cfg.n_heads * head_size(cfg) * seq_len


def linear_widths_per_token(cfg: ModelConfig) -> int:
    """The inputs and outputs a token has at the blocks' linear layers, over every block (each layer's
    in + out features; in a mixture-of-experts block its router, shared and top_k routed experts'): what a
    float8 matmul casts."""
    q, kv = cfg.n_heads * head_size(cfg), cfg.n_kv_heads * head_size(cfg)
    attention = 2 * (cfg.dim + q) + 2 * (cfg.dim + kv)  # wq and wo, wk and wv
    moe, total = cfg.moe, 0
    for layer in range(cfg.n_layers):
        if moe.experts and layer >= moe.dense_layers:
            width = moe.expert_dim or ffn_hidden_dim(cfg)
            total += attention + (cfg.dim + moe.experts) + 3 * (cfg.dim + width) * (moe.top_k + moe.shared_experts)
        else:
            total += attention + 3 * (cfg.dim + ffn_hidden_dim(cfg))
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls of the N active parameters (forward 2N, backward 4N) plus
    12·L·H·Q·T for the attention scores and values, with L layers, H heads of size Q and sequence length T."""
    return 6 * matmul_param_count(cfg) + attention_flops_per_token(cfg, seq_len)
