"""A Hugging Face Llama, Qwen3 or Qwen3-MoE model's config.json as keel's `model.*` fields: what
`model.init_from` fills the model config with, and what keel's model cannot represent, refused with one
line. The fields of `model.moe` are named "moe.FIELD" here, beside the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.config.checks import ffn_hidden_dim
from keel.config.schema import ModelConfig, MoEConfig
from keel.errors import CheckpointError, ConfigError
from keel.paths import check_input

CONFIG = "config.json"
# model_type -> (architecture, whether it has QK-norm)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", False), "qwen3": ("Qwen3ForCausalLM", True),
                 "qwen3_moe": ("Qwen3MoeForCausalLM", True)}
# A Qwen3-MoE block in keel's terms besides its sizes: experts scored by softmax and chosen by score alone (no
# selection bias, so none that moves), no shared experts, the routed output unscaled, no token dropped.
QWEN3_MOE = {"moe.score": "softmax", "moe.shared_experts": 0, "moe.score_scale": 1.0, "moe.capacity_factor": 0.0,
             "moe.bias_update_rate": 0.0}
# keel's model field -> where a Hugging Face config holds it (for messages)
SOURCES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
           "ffn_dim": "intermediate_size",
           "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings",
           "tie_embeddings": "tie_word_embeddings", "qk_norm": "model_type (qwen3: QK-norm)",
           "rope_scaling": "rope_parameters.rope_type", "rope_factor": "rope_parameters.factor",
           "rope_low_freq_factor": "rope_parameters.low_freq_factor",
           "rope_high_freq_factor": "rope_parameters.high_freq_factor",
           "rope_original_max_seq_len": "rope_parameters.original_max_position_embeddings",
           "moe.experts": "num_experts", "moe.top_k": "num_experts_per_tok", "moe.expert_dim": "moe_intermediate_size",
           "moe.dense_layers": "mlp_only_layers (the leading dense layers)", "moe.normalize_top_k": "norm_topk_prob",
           **{key: f"Qwen3-MoE's {key.removeprefix('moe.')}" for key in QWEN3_MOE}}
# Fields a run may set otherwise than the model: the RoPE tables' length changes no weight and no output.
FREE = {"max_seq_len"}
_LLAMA3 = {"rope_factor": ("factor", float), "rope_low_freq_factor": ("low_freq_factor", float),
           "rope_high_freq_factor": ("high_freq_factor", float),
           "rope_original_max_seq_len": ("original_max_position_embeddings", int)}


def _field(hf: dict[str, Any], key: str, kind: type, where: str = "") -> Any:
    if key not in hf:
        raise CheckpointError(f"Hugging Face config has no {where + key!r}; a Llama config.json needs it")
    value = hf[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise CheckpointError(f"Hugging Face config {where}{key} = {value!r} is not a {kind.__name__}")
    return value


def _rope_spec(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where the RoPE parameters are (transformers 5 writes `rope_parameters`, earlier versions
    `rope_scaling` beside a top-level `rope_theta`) and the one that scales, if either does."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        spec = hf.get(key) or {}
        if not isinstance(spec, dict):
            raise CheckpointError(f"Hugging Face config {key} = {spec!r} is not a mapping")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise CheckpointError(f"Hugging Face config {key}.rope_type = {kind!r} is not supported; keel "
                                  f"implements unscaled RoPE ('default') and Llama 3's scaling ('llama3')")
        found.append((key, kind, spec))
    scaled = [(key, spec) for key, kind, spec in found if kind == "llama3"]
    return scaled[0] if scaled else ("rope_parameters", found[0][2])


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and the Llama 3 scaling of either config form."""
    key, spec = _rope_spec(hf)
    params = hf.get("rope_parameters") or {}
    theta = spec.get("rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise CheckpointError(f"Hugging Face config rope_theta = {theta!r} is not a positive number")
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": "none"}
    if spec.get("rope_type", spec.get("type")) == "llama3":
        fields["rope_scaling"] = "llama3"
        for ours, (theirs, kind) in _LLAMA3.items():
            value = _field(spec, theirs, kind, f"{key}.")
            if value <= 0:
                raise CheckpointError(f"Hugging Face config {key}.{theirs} = {value!r} is not positive")
            fields[ours] = value
        if fields["rope_high_freq_factor"] <= fields["rope_low_freq_factor"]:
            raise CheckpointError(f"Hugging Face config {key}.high_freq_factor = {fields['rope_high_freq_factor']} "
                                  f"does not exceed low_freq_factor = {fields['rope_low_freq_factor']}")
    return fields


def _check_architecture(hf: dict[str, Any]) -> None:
    if hf.get("model_type") not in ARCHITECTURES:
        raise CheckpointError(f"Hugging Face config model_type = {hf.get('model_type')!r} is not supported; "
                              f"keel reads {' and '.join(map(repr, ARCHITECTURES))}")
    if hf.get("use_sliding_window", False):
        raise CheckpointError("Hugging Face config use_sliding_window = true is not supported; keel's attention "
                              "is causal over the whole sequence")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"Hugging Face config hidden_act = {act!r} is not supported; keel's SwiGLU uses 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise CheckpointError(f"Hugging Face config {key} = {hf[key]!r} is not supported; keel's projections "
                                  f"have no bias ({key} must be false)")


def _heads(hf: dict[str, Any]) -> tuple[int, int, int, int]:
    """hidden_size, attention heads, key/value heads and the head size (0: hidden_size / heads), as keel's
    attention can take them."""
    dim = _field(hf, "hidden_size", int)
    n_heads = _field(hf, "num_attention_heads", int)
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if dim < 1 or n_heads < 1 or not isinstance(n_kv_heads, int) or n_kv_heads < 1:
        raise CheckpointError(f"Hugging Face config has hidden_size = {dim}, num_attention_heads = {n_heads}, "
                              f"num_key_value_heads = {n_kv_heads!r}; all must be positive integers")
    if n_heads % n_kv_heads:
        raise CheckpointError(f"Hugging Face config num_attention_heads = {n_heads} does not divide by "
                              f"num_key_value_heads = {n_kv_heads}; keel's grouped-query attention needs it to")
    head_dim = hf.get("head_dim") or (dim // n_heads if dim % n_heads == 0 else 0)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 or head_dim % 2:
        raise CheckpointError(f"Hugging Face config head_dim = {head_dim!r} (hidden_size = {dim}, "
                              f"num_attention_heads = {n_heads}) is not supported; RoPE needs an even head size")
    return dim, n_heads, n_kv_heads, 0 if head_dim * n_heads == dim else head_dim


def _positive(hf: dict[str, Any], key: str) -> int:
    value: int = _field(hf, key, int)
    if value < 1:
        raise CheckpointError(f"Hugging Face config {key} = {value} is not a positive integer")
    return value


def _sparse_layers(hf: dict[str, Any], n_layers: int) -> list[int]:
    """The layers of a Qwen3-MoE config that are mixture-of-experts blocks, by transformers' rule: those
    not in mlp_only_layers whose number (from 1) divides by decoder_sparse_step."""
    step = _positive(hf, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise CheckpointError(f"Hugging Face config mlp_only_layers = {dense!r} is not a list of layer numbers")
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def _moe_fields(hf: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """model.moe's fields of a Qwen3-MoE config; only `moe.experts = 0` for a dense model. keel's blocks
    hold experts from `dense_layers` on, so the sparse layers must be the last ones."""
    if hf["model_type"] != "qwen3_moe":
        return {"moe.experts": 0}
    experts = _field(hf, "num_experts" if "num_experts" in hf else "num_local_experts", int)
    sparse = _sparse_layers(hf, n_layers) if experts > 0 else []
    if not sparse:
        return {"moe.experts": 0}  # every block is dense
    if sparse != list(range(sparse[0], n_layers)):
        raise CheckpointError(f"Hugging Face config decoder_sparse_step = {hf.get('decoder_sparse_step', 1)} and "
                              f"mlp_only_layers = {hf.get('mlp_only_layers')} make layers {sparse} of {n_layers} "
                              f"mixture-of-experts blocks; keel's are the last ones (decoder_sparse_step = 1, "
                              f"mlp_only_layers the leading layers 0, 1, ...)")
    top_k = _positive(hf, "num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(f"Hugging Face config num_experts_per_tok = {top_k} exceeds num_experts = {experts}")
    return {"moe.experts": experts, "moe.top_k": top_k, "moe.expert_dim": _positive(hf, "moe_intermediate_size"),
            "moe.dense_layers": sparse[0], **QWEN3_MOE,
            "moe.normalize_top_k": _field(hf, "norm_topk_prob", bool) if "norm_topk_prob" in hf else False}


def hf_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """keel's model fields (name -> value, model.moe's as "moe.FIELD") of a Hugging Face Llama, Qwen3 or
    Qwen3-MoE config; refuses what keel's model cannot represent. `intermediate_size` is taken as given, as
    `ffn_dim` (a Qwen3-MoE's dense layers' size)."""
    _check_architecture(hf)
    dim, n_heads, n_kv_heads, head_dim = _heads(hf)
    n_layers = _field(hf, "num_hidden_layers", int)
    return {
        "dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
        "vocab_size": _field(hf, "vocab_size", int), "ffn_dim": _positive(hf, "intermediate_size"),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), **_rope_fields(hf),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qk_norm": ARCHITECTURES[hf["model_type"]][1],
        **_moe_fields(hf, n_layers),
    }


def model_config(fields: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of `hf_model_fields`' fields."""
    moe = {key.removeprefix("moe."): value for key, value in fields.items() if key.startswith("moe.")}
    return ModelConfig(**{key: value for key, value in fields.items() if not key.startswith("moe.")},
                       moe=MoEConfig(**moe))


def field_value(cfg: ModelConfig, key: str) -> Any:
    """The value of a field as `hf_model_fields` names it."""
    return getattr(cfg.moe, key.removeprefix("moe.")) if key.startswith("moe.") else getattr(cfg, key)


def read_hf_model_fields(path: Path) -> dict[str, Any]:
    """keel's model fields of a Hugging Face model directory's config.json."""
    file = Path(path) / CONFIG
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is not a Hugging Face model directory: it has no {CONFIG}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {str(file)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{str(file)!r} is not a JSON object")
    return hf_model_fields(hf)


# ---------------------------------------------------------------- model.init_from

def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _same(given: Any, taken: Any) -> bool:
    return given == taken and isinstance(given, bool) == isinstance(taken, bool)


def _rule_size(model: dict[str, Any], dim: int) -> int | None:
    """The SwiGLU size the given ffn_dim_multiplier and multiple_of make at `dim`; None while they are not
    valid values (loading names them)."""
    defaults = ModelConfig()
    multiplier = model.get("ffn_dim_multiplier", defaults.ffn_dim_multiplier)
    multiple = model.get("multiple_of", defaults.multiple_of)
    if (isinstance(multiplier, bool) or not isinstance(multiplier, int | float) or multiplier <= 0
            or isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        return None
    return ffn_hidden_dim(ModelConfig(dim=dim, ffn_dim_multiplier=float(multiplier), multiple_of=multiple))


def given_fields(path: list[str], value: Any) -> set[str]:
    """The model fields that setting model.PATH to `value` gives (path [] for the [model] table itself),
    model.moe's as "moe.FIELD"."""
    for key in reversed(path):
        value = {key: value}
    if not isinstance(value, dict):
        return set()
    moe = value.get("moe")
    return {key for key in value if key != "moe" or not isinstance(moe, dict)} | (
        {f"moe.{key}" for key in moe} if isinstance(moe, dict) else set())


def _given(model: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The values of the model fields `names` (as `given_fields` names them) that the raw tree `model` holds."""
    moe = model["moe"] if isinstance(model.get("moe"), dict) else {}
    values = {}
    for name in names:
        table, key = (moe, name.removeprefix("moe.")) if name.startswith("moe.") else (model, name)
        if key in table:
            values[name] = table[key]
    return values


def _set(model: dict[str, Any], key: str, value: Any) -> None:
    if not key.startswith("moe."):
        model[key] = value
    elif isinstance(moe := model.setdefault("moe", {}), dict):  # otherwise loading names what model.moe is
        moe[key.removeprefix("moe.")] = value


def _disagreements(model: dict[str, Any], given: dict[str, Any], taken: dict[str, Any]) -> list[str]:
    """Each field `given` in the config (name -> value) whose value differs from the one the Hugging Face
    config sets."""
    diffs = [f"model.{key} = {given[key]!r} but {SOURCES[key]} = {value!r}" for key, value in taken.items()
             if key in given and key not in FREE | {"head_dim", "moe.expert_dim"} and not _same(given[key], value)]
    head = taken["head_dim"] or taken["dim"] // taken["n_heads"]
    if "head_dim" in given and not _same(given["head_dim"] or head, head):
        diffs.append(f"model.head_dim = {given['head_dim']!r} but head_dim = {head}")
    size = taken.get("moe.expert_dim")
    if "moe.expert_dim" in given and size and not _same(given["moe.expert_dim"] or taken["ffn_dim"], size):
        diffs.append(f"model.moe.expert_dim = {given['moe.expert_dim']!r} but moe_intermediate_size = {size}")
    rule = {"ffn_dim_multiplier", "multiple_of"} & set(given)
    if rule and "ffn_dim" not in given and _rule_size(model, taken["dim"]) not in (None, taken["ffn_dim"]):
        diffs.append(f"{' and '.join(f'model.{k} = {model[k]!r}' for k in sorted(rule))} make a SwiGLU size of "
                     f"{_rule_size(model, taken['dim'])} but intermediate_size = {taken['ffn_dim']}")
    return diffs


def fill_from_hf(data: dict[str, Any], in_file: set[str], on_command_line: set[str]) -> None:
    """With `model.init_from = "hf:PATH"`, set every model field the Hugging Face config determines (in the
    raw config tree `data`, before it is built). A field given in the config must agree with it: one given
    on the command line always, one in the config file when the file itself names `init_from` (a
    command-line `init_from` replaces the file's model); `in_file` and `on_command_line` name them as
    `given_fields` does. `max_seq_len` may differ, and so may the fields of
    model.moe that only training reads (the balance losses' coefficients)."""
    model = data.get("model")
    source = model.get("init_from") if isinstance(model, dict) else None
    if not isinstance(source, str) or not source.startswith("hf:") or "\0" in source or not _utf8(source):
        return  # no import, or a value loading refuses with its own message
    assert isinstance(model, dict)
    path = check_input(source.removeprefix("hf:"), "model.init_from", "dir",
                       "pass hf:DIR, a Hugging Face Llama, Qwen3 or Qwen3-MoE model directory", ConfigError)
    taken = read_hf_model_fields(path)
    given = _given(model, on_command_line if "init_from" in on_command_line else in_file | on_command_line)
    if diffs := _disagreements(model, given, taken):
        raise ConfigError(f"model.init_from = {source!r} sets the model from {str(path / CONFIG)!r}, which the "
                          f"config contradicts: {'; '.join(diffs)}; drop these model.* settings (the model's "
                          f"config.json fills them) or start from another model")
    for key, value in taken.items():
        if key not in FREE or key not in given:
            _set(model, key, value)
    for key in ("ffn_dim_multiplier", "multiple_of"):  # unused beside ffn_dim: not left to mislead
        if key not in given:
            model.pop(key, None)
