"""Checks across fields: what no single field's bounds can say (the layout against the world size is
keel.parallel.degrees'; a registered option brings its own, which run here too)."""

from __future__ import annotations

import math

from keel.config.schema import Config, DataConfig, ModelConfig, SourceConfig, TrainConfig
from keel.config.sections import registered_checks
from keel.errors import ConfigError


def check_consistency(cfg: Config) -> None:
    """What a loaded config must hold across its fields, checked in this order so the first problem is named."""
    _check_model(cfg.model, cfg.train)
    _check_registered(cfg)
    _check_moe(cfg.model)
    if cfg.train.global_batch % cfg.train.micro_batch:
        raise ConfigError(f"train.global_batch = {cfg.train.global_batch} must divide by train.micro_batch = "
                          f"{cfg.train.micro_batch}")
    _check_peak_flops(cfg.monitor.peak_flops)
    _check_mixture(cfg.data)
    for i, (start, *end) in enumerate(cfg.data.skip_batches):
        if len(end) != 1 or not 0 <= start < end[0]:
            raise ConfigError(f"data.skip_batches[{i}] = {[start, *end]}: expected [start, end] with 0 <= start < end")
    if cfg.guard.spike.warmup > cfg.guard.spike.window:
        raise ConfigError(f"guard.spike.warmup = {cfg.guard.spike.warmup} exceeds guard.spike.window = "
                          f"{cfg.guard.spike.window}: the window must hold the warm-up steps")
    _check_fault_tolerance(cfg)
    if cfg.data.document_positions and not cfg.data.document_mask:
        raise ConfigError("data.document_positions = true restarts positions per document, which needs "
                          "data.document_mask = true; set both or neither")
    if cfg.guard.spike.attn_logit_threshold and not cfg.monitor.signals_interval:
        raise ConfigError(f"guard.spike.attn_logit_threshold = {cfg.guard.spike.attn_logit_threshold:g} reads the "
                          f"instability signals; set monitor.signals_interval (e.g. 10) or the threshold to 0")
    _check_fast_path(cfg)
    if cfg.monitor.alerts.moe_collapse_share >= 1:
        raise ConfigError(f"monitor.alerts.moe_collapse_share = {cfg.monitor.alerts.moe_collapse_share:g}: at 1 "
                          f"or more, experts of any layer not perfectly balanced count as collapsed; expected a "
                          f"fraction of the fair share below 1 (e.g. 0.1)")
    if cfg.monitor.signals_interval and cfg.parallel.compile:
        raise ConfigError(f"monitor.signals_interval = {cfg.monitor.signals_interval} needs eager blocks (its hooks "
                          f"read inside them); set parallel.compile = false or monitor.signals_interval = 0")
    if cfg.eval.downstream_tasks and cfg.parallel.pp > 1:
        raise ConfigError(f"eval.downstream_tasks runs lm-eval on the whole model, which parallel.pp = "
                          f"{cfg.parallel.pp} splits into stages; evaluate its checkpoints with `keel eval` instead")
    for i, cb in enumerate(cfg.callbacks):
        if ":" not in cb.path:
            raise ConfigError(f"callbacks[{i}].path = {cb.path!r}: expected 'package.module:Class'")


def _check_registered(cfg: Config) -> None:
    """The checks that registered options bring (parallel.cp's, parallel.ep's, ...)."""
    for check in registered_checks():
        check(cfg)


def _check_fast_path(cfg: Config) -> None:
    """The options that trade memory or speed on a GPU: each only where it means something."""
    p = cfg.parallel
    if p.compile_mode != "default" and not p.compile:
        raise ConfigError(f"parallel.compile_mode = {p.compile_mode!r} is torch.compile's mode, but "
                          f"parallel.compile = false; set parallel.compile = true or parallel.compile_mode = 'default'")
    t = cfg.train
    if t.param_dtype == "bf16" and t.precision not in ("bf16", "fp8"):
        raise ConfigError(f"train.param_dtype = 'bf16' computes on bf16 weights, but train.precision = "
                          f"{t.precision!r}; set train.precision = 'bf16' (or 'fp8') or train.param_dtype = 'fp32'")
    if t.param_dtype == "bf16" and cfg.fault_tolerance.replica_groups > 1:
        raise ConfigError("train.param_dtype = 'bf16' is for one process, not replica groups; set "
                          "train.param_dtype = 'fp32' or fault_tolerance.replica_groups = 1")
    if p.ac_selective != "layer" and p.activation_checkpoint != "selective":
        raise ConfigError(f"parallel.ac_selective = {p.ac_selective!r} chooses what selective checkpointing keeps, "
                          f"but parallel.activation_checkpoint = {p.activation_checkpoint!r}; set "
                          f"activation_checkpoint = 'selective' or ac_selective = 'layer'")


def _check_fault_tolerance(cfg: Config) -> None:
    ft = cfg.fault_tolerance
    if ft.replica_groups == 1:
        return
    if ft.min_replicas > ft.replica_groups:
        raise ConfigError(f"fault_tolerance.min_replicas = {ft.min_replicas} exceeds fault_tolerance.replica_groups "
                          f"= {ft.replica_groups}: no quorum could ever form")
    if ft.lighthouse and not (ft.lighthouse.startswith("http://") and ft.lighthouse.rpartition(":")[2].isdigit()):
        raise ConfigError(f"fault_tolerance.lighthouse = {ft.lighthouse!r}: expected http://HOST:PORT")


def _check_model(m: ModelConfig, t: TrainConfig) -> None:
    if m.init_from and not m.init_from.startswith("hf:"):
        raise ConfigError(f"model.init_from = {m.init_from!r}: expected hf:PATH, a Hugging Face Llama, "
                          "Qwen3 or Qwen3-MoE directory")
    if m.head_dim and m.head_dim % 2:
        raise ConfigError(f"model.head_dim = {m.head_dim} must be even for RoPE")
    if not m.head_dim and m.dim % m.n_heads:
        raise ConfigError(f"model.dim = {m.dim} must divide by model.n_heads = {m.n_heads} (or set model.head_dim)")
    if not m.head_dim and (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for RoPE")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor = {m.rope_high_freq_factor:g} must exceed "
                          f"model.rope_low_freq_factor = {m.rope_low_freq_factor:g} (Llama 3.1 uses 4 and 1)")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads = {m.n_heads} must divide by model.n_kv_heads = {m.n_kv_heads}")
    if m.base_dim and m.parametrization != "mup":
        raise ConfigError(f"model.base_dim = {m.base_dim} is a μP setting but model.parametrization = "
                          f"{m.parametrization!r}; set model.parametrization = 'mup' or model.base_dim = 0")
    if m.parametrization == "mup" and m.tie_embeddings:
        raise ConfigError("model.parametrization = 'mup' scales the output and the embedding differently; set "
                          "model.tie_embeddings = false")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")


def _check_moe(m: ModelConfig) -> None:
    moe = m.moe
    if not moe.experts:
        return
    if moe.top_k > moe.experts:
        raise ConfigError(f"model.moe.top_k = {moe.top_k} exceeds model.moe.experts = {moe.experts}: a token "
                          f"chooses at most every expert; set top_k between 1 and {moe.experts}")
    if moe.dense_layers >= m.n_layers:
        raise ConfigError(f"model.moe.dense_layers = {moe.dense_layers} leaves no mixture-of-experts block among "
                          f"model.n_layers = {m.n_layers}; set dense_layers below {m.n_layers} or model.moe.experts "
                          f"= 0")


def _check_peak_flops(peak: str) -> None:
    if peak in ("auto", "measure"):
        return
    try:
        valid = float(peak) > 0 and math.isfinite(float(peak))
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError(f"monitor.peak_flops = {peak!r}: expected auto, measure, or a positive number of FLOP/s "
                          f"such as 989e12")


def _check_source(name: str, source: SourceConfig) -> None:
    if not name.isidentifier():
        raise ConfigError(f"data.sources.{name}: a source name is letters, digits and underscores, such as web")
    if not source.paths:
        raise ConfigError(f"data.sources.{name}.paths is empty: give files, directories, globs or 'stdlib'")
    if 0 < source.max_chars < source.min_chars:
        raise ConfigError(f"data.sources.{name}: min_chars = {source.min_chars} exceeds max_chars = "
                          f"{source.max_chars}; give min_chars <= max_chars (or max_chars = 0, unbounded)")


def _check_mixture(data: DataConfig) -> None:
    for name, source in data.sources.items():
        _check_source(name, source)
    phases = [("data.sources", {n: s.weight for n, s in data.sources.items()})]
    phases += [(f"data.schedule[{i}]", p.weights) for i, p in enumerate(data.schedule)]
    for where, weights in phases:
        for name, weight in weights.items():
            if name not in data.sources:
                raise ConfigError(f"{where}: unknown source {name!r}; the sources are {', '.join(data.sources)}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
                raise ConfigError(f"{where}: weight {name} = {weight!r}: expected a number >= 0")
        if not any(w > 0 for w in weights.values()):
            raise ConfigError(f"{where}: every weight is 0; give at least one source a positive weight")
    d = data.dedup
    if (d.bands == 0) != (d.rows == 0) or d.bands * d.rows > d.num_perm:
        raise ConfigError(f"data.dedup.bands = {d.bands}, rows = {d.rows}: set both (bands × rows <= num_perm = "
                          f"{d.num_perm}) or neither (0: chosen from the threshold)")
    steps = [p.step for p in data.schedule]
    if steps != sorted(set(steps)):
        raise ConfigError(f"data.schedule steps {steps} must increase strictly")
    if data.tokenizer != "byte" and not data.tokenizer.startswith("bpe:") and not data.tokenizer.endswith(".json"):
        raise ConfigError(f"data.tokenizer = {data.tokenizer!r}: expected byte, bpe:VOCAB (e.g. bpe:8192) or the path "
                          f"of a tokenizer.json")


def head_size(m: ModelConfig) -> int:
    """The size of each attention head: `model.head_dim` when given, else dim / n_heads."""
    return m.head_dim or m.dim // m.n_heads


def ffn_hidden_dim(m: ModelConfig) -> int:
    """The SwiGLU hidden size: `model.ffn_dim` when given, else Llama's rule: 2/3 of 4·dim, scaled by the
    multiplier, rounded up to `multiple_of`."""
    if m.ffn_dim:
        return m.ffn_dim
    hidden = int(m.ffn_dim_multiplier * int(2 * 4 * m.dim / 3))
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


def check_vocab_size(cfg: Config, corpus_vocab: int) -> None:
    """The embedding must have a row for every token id the corpus holds."""
    if cfg.model.vocab_size < corpus_vocab:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the corpus tokenizer's "
                          f"vocabulary ({corpus_vocab}); set model.vocab_size >= {corpus_vocab}")
