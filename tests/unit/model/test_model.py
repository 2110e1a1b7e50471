"""The Llama model, its name-seeded initialisation and the parameter/FLOP counts derived from its config."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from keel.config import ModelConfig, load_config
from keel.model.flops import flops_per_token, matmul_param_count, param_count
from keel.model.init import INIT_STD, canonical_name, init_weights, name_seed
from keel.model.llama import Llama, ffn_hidden_dim, llama3_frequencies, rope_tables
from tests.conftest import REPO

# Small enough to build and run in milliseconds; GQA (4 query heads share 2 KV heads) and a SwiGLU
# width that needs rounding (int(8/3·32) = 85 → 96) so the counts are not trivially right.
TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)


def build(cfg: ModelConfig = TINY, seed: int = 0) -> Llama:
    model = Llama(cfg)
    init_weights(model, seed)
    return model


def tokens(batch: int = 2, seq: int = 12, vocab: int = TINY.vocab_size, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# ---------------------------------------------------------------- forward

def test_forward_shape_and_dtype() -> None:
    model = build()
    x = tokens(batch=3, seq=TINY.max_seq_len)
    logits = model(x)
    assert logits.shape == (3, TINY.max_seq_len, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_attention_is_causal() -> None:
    model = build()
    x = tokens(batch=1, seq=12)
    changed = x.clone()
    changed[0, 7] = (x[0, 7] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=0, atol=1e-6)
    # ...while the changed position and everything after it do see the change.
    assert (after[0, 7:] - before[0, 7:]).abs().amax(dim=-1).min() > 1e-4


def _expand_kv(model: Llama, cfg: ModelConfig) -> Llama:
    """The same network as multi-head attention: each KV head copied to the query heads of its group."""
    mha_cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    mha = Llama(mha_cfg)
    head_dim, rep = cfg.dim // cfg.n_heads, cfg.n_heads // cfg.n_kv_heads
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            value = value.view(cfg.n_kv_heads, head_dim, cfg.dim).repeat_interleave(rep, dim=0).reshape(-1, cfg.dim)
        state[name] = value
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_grouped_query_attention_matches_expanded_multi_head(n_kv_heads: int) -> None:
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    model = build(cfg)
    attention = model.layers["0"].attention
    head_dim = cfg.dim // cfg.n_heads
    assert attention.wk.weight.shape == (n_kv_heads * head_dim, cfg.dim)
    assert attention.wq.weight.shape == (cfg.n_heads * head_dim, cfg.dim)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), _expand_kv(model, cfg)(x), rtol=1e-5, atol=1e-5)


def test_tie_embeddings_shares_the_tensor() -> None:
    tied = build(dataclasses.replace(TINY, tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert "output.weight" not in dict(tied.named_parameters())
    with torch.no_grad():
        tied.tok_embeddings.weight[0, 0] = 123.0
    assert tied.output.weight[0, 0] == 123.0
    untied = build()
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


# ---------------------------------------------------------------- counts

COUNT_CONFIGS = [
    TINY,
    dataclasses.replace(TINY, tie_embeddings=True),
    dataclasses.replace(TINY, n_kv_heads=4, ffn_dim_multiplier=1.3, multiple_of=8, n_layers=3),
    dataclasses.replace(TINY, n_kv_heads=1, tie_embeddings=True, dim=48, n_heads=6),
    dataclasses.replace(TINY, head_dim=12, ffn_dim=40, n_layers=1),  # heads wider than dim / n_heads, as Qwen3's
]


def count_id(c: ModelConfig) -> str:
    return f"kv{c.n_kv_heads}-tied{c.tie_embeddings}-L{c.n_layers}-h{c.head_dim}"


def _unique_numel(model: torch.nn.Module) -> int:
    # model.parameters() yields a shared (tied) tensor once; dedupe by identity to be explicit.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("cfg", COUNT_CONFIGS, ids=count_id)
def test_param_count_matches_the_model(cfg: ModelConfig) -> None:
    assert param_count(cfg) == _unique_numel(Llama(cfg))


@pytest.mark.parametrize("cfg", COUNT_CONFIGS, ids=count_id)
def test_flops_per_token(cfg: ModelConfig) -> None:
    model = Llama(cfg)
    # Everything but the input embedding lookup; when tied, that tensor is the output projection and counts.
    lookup = 0 if cfg.tie_embeddings else model.tok_embeddings.weight.numel()
    matmul = _unique_numel(model) - lookup
    assert matmul_param_count(cfg) == matmul
    head_dim = model.layers["0"].attention.head_dim
    for seq_len in (1, 16, 4096):
        expected = 6 * matmul + 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len
        assert flops_per_token(cfg, seq_len) == expected


@pytest.mark.parametrize(("name", "hidden"), [("llama3_8b", 14336), ("llama3_70b", 28672), ("llama3_405b", 53248),
                                              ("gpu_1b", 8192)])
def test_ffn_hidden_dim_of_llama3(name: str, hidden: int) -> None:
    # The FFN dimensions of "The Llama 3 Herd of Models", Table 3, and of Llama 3.2 1B's model card.
    assert ffn_hidden_dim(load_config(REPO / "configs" / f"{name}.toml").model) == hidden


def test_ffn_hidden_dim_rounds_up_to_multiple_of() -> None:
    assert ffn_hidden_dim(ModelConfig(dim=32, multiple_of=16)) == 96  # int(85.33) = 85 → 96
    assert ffn_hidden_dim(ModelConfig(dim=48, multiple_of=1)) == 128  # exactly 8/3·48
    assert ffn_hidden_dim(ModelConfig(dim=48, multiple_of=64)) == 128


def test_ffn_dim_and_head_dim_are_taken_as_given() -> None:
    cfg = dataclasses.replace(TINY, ffn_dim=50, head_dim=12)
    model = build(cfg)
    assert ffn_hidden_dim(cfg) == 50 and model.layers["0"].feed_forward.w1.weight.shape == (50, 32)
    assert model.layers["0"].attention.wq.weight.shape == (4 * 12, 32) and model.rope.shape == (16, 6, 2)
    assert model(tokens()).shape == (2, 12, TINY.vocab_size)


def test_llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones() -> None:
    """Llama 3.1's published setting (factor 8, low 1, high 4, original 8192) at head size 128, theta 500000."""
    cfg = ModelConfig(rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_seq_len=8192)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    scaled = llama3_frequencies(inv_freq, cfg)
    wavelength = 2 * math.pi / inv_freq
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()  # every band holds frequencies
    assert torch.equal(scaled[short], inv_freq[short])
    torch.testing.assert_close(scaled[long], inv_freq[long] / 8, rtol=1e-6, atol=0)
    ramp = ~short & ~long
    assert ((scaled[ramp] < inv_freq[ramp]) & (scaled[ramp] > inv_freq[ramp] / 8)).all()
    assert (scaled[1:] <= scaled[:-1]).all(), "the frequencies stay in order"
    tables = rope_tables(128, 16, 500000.0, scaled_as=cfg)
    torch.testing.assert_close(tables[3, :, 1], torch.sin(3 * scaled))
    assert torch.equal(rope_tables(128, 16, 500000.0, scaled_as=ModelConfig()), rope_tables(128, 16, 500000.0))


def test_llama3_8b_param_count() -> None:
    # Published size: 8.03B parameters.
    assert round(param_count(load_config(REPO / "configs" / "llama3_8b.toml").model) / 1e9, 2) == 8.03


def test_gpu_1b_param_count() -> None:
    # Llama 3.2 1B's published size, 1.24B parameters (tied embeddings).
    assert round(param_count(load_config(REPO / "configs" / "gpu_1b.toml").model) / 1e9, 2) == 1.24


# ---------------------------------------------------------------- initialisation

def test_meta_init_equals_cpu_init_bitwise() -> None:
    # The trainer builds on the meta device and materialises; that must not change a single bit.
    with torch.device("meta"):
        meta = Llama(TINY)
    meta.to_empty(device="cpu")
    init_weights(meta, seed=3)
    cpu = build(seed=3)
    assert_same_params(meta, cpu)
    assert meta.rope.device.type == "cpu" and torch.equal(meta.rope, cpu.rope)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(meta(x), cpu(x))


def test_meta_init_keeps_embeddings_tied() -> None:
    cfg = dataclasses.replace(TINY, tie_embeddings=True)
    with torch.device("meta"):
        meta = Llama(cfg)
    meta.to_empty(device="cpu")
    init_weights(meta, seed=3)
    assert meta.output.weight is meta.tok_embeddings.weight
    assert_same_params(meta, build(cfg, seed=3))


def test_init_depends_on_the_seed_only() -> None:
    torch.manual_seed(1)  # the global RNG must play no part
    a = build(seed=5)
    torch.manual_seed(2)
    b = build(seed=5)
    assert_same_params(a, b)
    c = build(seed=6)
    for (name, pa), pc in zip(a.named_parameters(), c.parameters(), strict=True):
        if name.endswith("norm.weight"):
            assert torch.equal(pa, pc)
        else:
            assert not torch.equal(pa, pc), name


def test_different_parameters_get_different_values() -> None:
    # Same shape, different names → independent draws (a shared stream would make them equal).
    layer = build().layers["0"]
    assert not torch.equal(layer.attention.wk.weight, layer.attention.wv.weight)
    assert not torch.equal(layer.feed_forward.w1.weight, layer.feed_forward.w3.weight)
    assert not torch.equal(build().layers["0"].attention.wq.weight, build().layers["1"].attention.wq.weight)


def test_init_value_does_not_depend_on_depth() -> None:
    shallow = dict(build(dataclasses.replace(TINY, n_layers=2), seed=0).named_parameters())
    deep = dict(build(dataclasses.replace(TINY, n_layers=4), seed=0).named_parameters())
    assert "tok_embeddings.weight" in shallow
    for name, value in shallow.items():
        if name.endswith(("wo.weight", "w2.weight")):
            # Residual output projections: the same draw, scaled by 1/sqrt(2·n_layers).
            torch.testing.assert_close(deep[name], value * math.sqrt(4 / 8), rtol=1e-6, atol=0)
        else:
            assert torch.equal(deep[name], value), name


def test_init_statistics() -> None:
    cfg = dataclasses.replace(TINY, dim=64, n_heads=4, vocab_size=512)
    model = build(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        std = INIT_STD / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
        assert abs(p.mean().item()) < 3 * std / math.sqrt(p.numel()) + 1e-9, name
        assert abs(p.std().item() / std - 1) < 0.1, name
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 2 * cfg.n_layers + 1


@pytest.mark.parametrize(("wrapped", "plain"), [
    ("layers.0._checkpoint_wrapped_module.attention.wq.weight", "layers.0.attention.wq.weight"),
    ("_orig_mod.layers.1.feed_forward.w2.weight", "layers.1.feed_forward.w2.weight"),
    ("_fsdp_wrapped_module.tok_embeddings.weight", "tok_embeddings.weight"),
    ("_orig_mod.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.ffn_norm.weight",
     "layers.0.ffn_norm.weight"),
    ("norm.weight", "norm.weight"),
])
def test_canonical_name_strips_wrapper_prefixes(wrapped: str, plain: str) -> None:
    assert canonical_name(wrapped) == plain
    assert name_seed(0, wrapped) == name_seed(0, plain)


def test_name_seed_depends_on_seed_and_name() -> None:
    seeds = {name_seed(s, n) for s in (0, 1) for n in ("a.weight", "b.weight")}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_wrapped_blocks_initialise_like_plain_ones() -> None:
    plain = build(seed=2)
    wrapped = Llama(TINY)
    wrapped.layers["0"] = checkpoint_wrapper(wrapped.layers["0"])
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    init_weights(wrapped, seed=2)
    values = {canonical_name(n): p for n, p in wrapped.named_parameters()}
    for name, p in plain.named_parameters():
        assert torch.equal(values[name], p), name
