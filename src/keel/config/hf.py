"""A Hugging Face Llama or Qwen3 model's config.json as keel's `model.*` fields: what `model.init_from`
fills the model config with, and what keel's model cannot represent, refused with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from keel.config.checks import ffn_hidden_dim
from keel.config.schema import ModelConfig
from keel.errors import CheckpointError, ConfigError
from keel.paths import check_input

CONFIG = "config.json"
# model_type -> (architecture, whether it has QK-norm)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", False), "qwen3": ("Qwen3ForCausalLM", True)}
# keel's model field -> where a Hugging Face config holds it (for messages)
SOURCES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
           "ffn_dim": "intermediate_size",
           "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings",
           "tie_embeddings": "tie_word_embeddings", "qk_norm": "model_type (qwen3: QK-norm)",
           "rope_scaling": "rope_parameters.rope_type", "rope_factor": "rope_parameters.factor",
           "rope_low_freq_factor": "rope_parameters.low_freq_factor",
           "rope_high_freq_factor": "rope_parameters.high_freq_factor",
           "rope_original_max_seq_len": "rope_parameters.original_max_position_embeddings"}
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


def hf_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """keel's model fields (name -> value) of a Hugging Face Llama or Qwen3 config; refuses what keel's
    model cannot represent. `intermediate_size` is taken as given, as `ffn_dim`."""
    _check_architecture(hf)
    dim, n_heads, n_kv_heads, head_dim = _heads(hf)
    hidden = _field(hf, "intermediate_size", int)
    if hidden < 1:
        raise CheckpointError(f"Hugging Face config intermediate_size = {hidden} is not a positive integer")
    return {
        "dim": dim, "n_layers": _field(hf, "num_hidden_layers", int), "n_heads": n_heads, "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": _field(hf, "vocab_size", int), "ffn_dim": hidden,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), **_rope_fields(hf),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qk_norm": ARCHITECTURES[hf["model_type"]][1],
    }


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


def _disagreements(model: dict[str, Any], given: set[str], taken: dict[str, Any]) -> list[str]:
    """Each field `given` in the config whose value differs from the one the Hugging Face config sets."""
    diffs = [f"model.{key} = {model[key]!r} but {SOURCES[key]} = {value!r}" for key, value in taken.items()
             if key in given and key not in FREE | {"head_dim"} and not _same(model[key], value)]
    head = taken["head_dim"] or taken["dim"] // taken["n_heads"]
    if "head_dim" in given and not _same(model["head_dim"] or head, head):
        diffs.append(f"model.head_dim = {model['head_dim']!r} but head_dim = {head}")
    rule = {"ffn_dim_multiplier", "multiple_of"} & given
    if rule and "ffn_dim" not in given and _rule_size(model, taken["dim"]) not in (None, taken["ffn_dim"]):
        diffs.append(f"{' and '.join(f'model.{k} = {model[k]!r}' for k in sorted(rule))} make a SwiGLU size of "
                     f"{_rule_size(model, taken['dim'])} but intermediate_size = {taken['ffn_dim']}")
    return diffs


def fill_from_hf(data: dict[str, Any], in_file: set[str], on_command_line: set[str]) -> None:
    """With `model.init_from = "hf:PATH"`, set every model field the Hugging Face config determines (in the
    raw config tree `data`, before it is built). A field given in the config must agree with it: one given
    on the command line always, one in the config file when the file itself names `init_from` (a
    command-line `init_from` replaces the file's model). `max_seq_len` may differ."""
    model = data.get("model")
    source = model.get("init_from") if isinstance(model, dict) else None
    if not isinstance(source, str) or not source.startswith("hf:") or "\0" in source or not _utf8(source):
        return  # no import, or a value loading refuses with its own message
    assert isinstance(model, dict)
    path = check_input(source.removeprefix("hf:"), "model.init_from", "dir",
                       "pass hf:DIR, a Hugging Face Llama or Qwen3 model directory", ConfigError)
    taken = read_hf_model_fields(path)
    given = (on_command_line if "init_from" in on_command_line else in_file | on_command_line) & set(model)
    if diffs := _disagreements(model, given, taken):
        raise ConfigError(f"model.init_from = {source!r} sets the model from {str(path / CONFIG)!r}, which the "
                          f"config contradicts: {'; '.join(diffs)}; drop these model.* settings (the model's "
                          f"config.json fills them) or start from another model")
    for key, value in taken.items():
        if key not in FREE or key not in given:
            model[key] = value
    for key in ("ffn_dim_multiplier", "multiple_of"):  # unused beside ffn_dim: not left to mislead
        if key not in given:
            model.pop(key, None)
