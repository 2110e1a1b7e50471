"""Hugging Face Llama interchange: export a keel checkpoint's weights as a `LlamaForCausalLM` directory
(config.json + safetensors, and the run's tokenizer: `keel.checkpoint.hf_tokenizer`) and load such a
directory into a keel model. A model with QK-norm goes as a `Qwen3ForCausalLM`: Llama's architecture with
an RMSNorm on each head's queries and keys before RoPE, as keel's; a mixture of experts as a
`Qwen3MoeForCausalLM`, Qwen3 whose blocks after `mlp_only_layers` route each token to softmax-scored
experts, each stored as its own SwiGLU. Embedding scaling or normalisation has no counterpart in any, and
is refused, as is a mixture of experts Qwen3-MoE does not express (`keel.config.hf.QWEN3_MOE`). Which model
fields a Hugging Face config.json sets (Llama 3's RoPE scaling among them) is `keel.config.hf`'s;
`hf_config` writes them back.

keel's RoPE rotates adjacent feature pairs (2i, 2i+1) of each head, Meta's original layout; Hugging Face
rotates the two halves (i, i + head_dim/2). The attention is the same once the rows of wq and wk (and the
gains of the QK-norm) are permuted within each head, so export permutes them and import undoes it; every
other weight maps 1:1, but the routed experts' 3-D weights, one 2-D tensor per expert.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from keel.checkpoint.hf_tokenizer import write_hf_tokenizer
from keel.checkpoint.storage import fsync_path, locate
from keel.config import ModelConfig, head_size
from keel.config.hf import (
    ARCHITECTURES,
    CONFIG,
    FREE,
    QWEN3_MOE,
    SOURCES,
    field_value,
    hf_model_fields,
    model_config,
    read_hf_model_fields,
)
from keel.data.tokenizer import Tokenizer
from keel.errors import CheckpointError
from keel.model.flops import ffn_hidden_dim
from keel.model.init import canonical_name
from keel.model.llama import Llama, width_ratio
from keel.model.moe import expert_dim
from keel.paths import check_writable_dir

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight", "attention.q_norm.weight": "self_attn.q_norm.weight",
          "attention.k_norm.weight": "self_attn.k_norm.weight", "moe.router.gate.weight": "mlp.gate.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# A routed experts' weight (experts, rows, columns) is one (rows, columns) tensor per expert in Qwen3-MoE.
_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
_EXPERT_HF = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_name(name: str) -> str:
    """The Hugging Face name of a keel parameter (canonical name, no wrapper prefixes)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK:
        raise CheckpointError(f"keel parameter {name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def hf_names(name: str, experts: int) -> list[str]:
    """The Hugging Face names of the tensors a keel parameter is stored as: one, or one per expert."""
    m = _EXPERTS.fullmatch(name)
    if m is None:
        return [hf_name(name)]
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_HF[m.group(2)]}.weight" for e in range(experts)]


def _to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of one head ordered (pair, 2) -> (2, pair): interleaved RoPE layout to rotate-half layout."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `_to_halves`."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, -1).transpose(1, 2).reshape(w.shape)


def _rope_heads(name: str, cfg: ModelConfig) -> int | None:
    """Heads whose rows a keel tensor interleaves for RoPE, or None when it needs no permutation."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one head's gains, shared by all heads
    return None


def _hf_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A keel tensor as the Hugging Face tensors it is stored as (by name)."""
    heads = _rope_heads(name, cfg)
    tensor = _to_halves(tensor, heads) if heads else tensor
    pieces = tensor.unbind(0) if _EXPERTS.fullmatch(name) else (tensor,)
    return dict(zip(hf_names(name, cfg.moe.experts), pieces, strict=True))


def _check_qwen3_moe(cfg: ModelConfig) -> None:
    """Refuse a mixture of experts that Qwen3-MoE cannot represent. The selection bias is checked where it is,
    in a checkpoint: a rate that has not moved it yet changes nothing."""
    if not cfg.qk_norm:
        raise CheckpointError("model.qk_norm = false in a mixture-of-experts model: its Hugging Face counterpart, "
                              "Qwen3-MoE, normalises each head's queries and keys; only a mixture of experts with "
                              "model.qk_norm = true is exchanged")
    for key, value in QWEN3_MOE.items():
        if key != "moe.bias_update_rate" and field_value(cfg, key) != value:
            raise CheckpointError(f"model.{key} = {field_value(cfg, key)!r} has no Qwen3-MoE counterpart (whose "
                                  f"{key.removeprefix('moe.')} is {value!r}); only a mixture of experts with "
                                  f"model.{key} = {value!r} is exchanged")


def check_hf_expressible(cfg: ModelConfig) -> None:
    """Refuse a model that neither Hugging Face Llama, Qwen3 nor Qwen3-MoE can represent."""
    if width_ratio(cfg) != 1.0:
        raise CheckpointError(f"model.parametrization = 'mup' at model.dim = {cfg.dim} != model.base_dim = "
                              f"{cfg.base_dim} scales the output logits and the attention, which Hugging Face "
                              f"Llama and Qwen3 do not; only a μP model at its base width is exchanged")
    if cfg.embedding_norm != "none":
        raise CheckpointError(f"model.embedding_norm = {cfg.embedding_norm!r} has no Hugging Face Llama or Qwen3 "
                              f"counterpart; only a model with model.embedding_norm = 'none' is exchanged")
    if cfg.moe.experts:
        _check_qwen3_moe(cfg)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- configs

def _rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE's entries of config.json: transformers < 5 reads a top-level `rope_theta` and `rope_scaling`,
    transformers 5 `rope_parameters`."""
    scaling = {} if cfg.rope_scaling == "none" else {
        "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling or None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling}}


def _moe_config(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3-MoE's entries of config.json. The balance loss's coefficient only trains: transformers applies it
    (with output_router_logits) to a loss of its own, over the batch and every layer."""
    moe = cfg.moe
    return {"num_experts": moe.experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": expert_dim(cfg),
            "norm_topk_prob": moe.normalize_top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.dense_layers)), "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": False, "use_sliding_window": False, "sliding_window": None}


def _qwen3_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
            "layer_types": ["full_attention"] * cfg.n_layers}


def hf_config(cfg: ModelConfig, dtype: torch.dtype, special_tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """config.json of a `LlamaForCausalLM` (or Qwen3, Qwen3-MoE) equal to a keel model. `special_tokens`
    ({"bos": …, "eos": …, "pad": …}) fills the token ids; without it they are null, since Hugging Face's
    defaults (1, 2) would name ordinary tokens of keel's byte tokenizer."""
    check_hf_expressible(cfg)
    tokens = special_tokens or {}
    model_type = "qwen3_moe" if cfg.moe.experts else "qwen3" if cfg.qk_norm else "llama"
    extra = {"llama": {}, "qwen3": _qwen3_config(cfg), "qwen3_moe": _moe_config(cfg)}[model_type]
    return {
        "architectures": [ARCHITECTURES[model_type][0]],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": head_size(cfg),
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        **_rope_config(cfg),
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tokens.get("bos"),
        "eos_token_id": tokens.get("eos"),
        "pad_token_id": tokens.get("pad"),
        "use_cache": True,
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
        **extra,
    }


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The keel ModelConfig of a Hugging Face Llama (or Qwen3, Qwen3-MoE) config; refuses what keel's model
    cannot represent."""
    return model_config(hf_model_fields(hf))


def read_hf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama directory's config.json."""
    return model_config(read_hf_model_fields(path))


def check_hf_matches(path: Path, cfg: ModelConfig) -> None:
    """Refuse a Hugging Face model whose architecture differs from the run's model config."""
    check_hf_expressible(cfg)
    taken = read_hf_model_fields(path)
    diffs = [f"model.{key} = {field_value(cfg, key)} but {SOURCES[key]} = {value}" for key, value in taken.items()
             if key not in FREE | {"ffn_dim", "head_dim", "moe.expert_dim"} and field_value(cfg, key) != value]
    if head_size(cfg) != head_size(model_config(taken)):
        diffs.append(f"the head size (model.head_dim, or model.dim / model.n_heads) is {head_size(cfg)} but "
                     f"head_dim = {head_size(model_config(taken))}")
    if ffn_hidden_dim(cfg) != taken["ffn_dim"]:
        diffs.append(f"the SwiGLU size (model.ffn_dim, or model.ffn_dim_multiplier and model.multiple_of) is "
                     f"{ffn_hidden_dim(cfg)} but intermediate_size = {taken['ffn_dim']}")
    if "moe.expert_dim" in taken and expert_dim(cfg) != taken["moe.expert_dim"]:
        diffs.append(f"the experts' size (model.moe.expert_dim, or the dense one) is {expert_dim(cfg)} but "
                     f"moe_intermediate_size = {taken['moe.expert_dim']}")
    if diffs:
        raise CheckpointError(f"the model config does not match the Hugging Face model {str(path)!r}: "
                              f"{'; '.join(diffs)}; set the model.* fields to match")
    _check_hf_weights(path, cfg)


def _check_hf_weights(path: Path, cfg: ModelConfig) -> None:
    """Every tensor the model needs is listed, and every weight file exists and is whole: opening one parses
    its header and checks that the file covers every tensor's bytes."""
    where = _hf_files(path)
    with torch.device("meta"):
        needed = [source for name, _ in Llama(cfg).named_parameters()
                  for source in hf_names(canonical_name(name), cfg.moe.experts)]
    if missing := [name for name in needed if name not in where]:
        raise CheckpointError(f"{str(path)!r} has no tensor {missing[0]!r} ({len(missing)} of the model's "
                              f"{len(needed)} missing); pass a complete Hugging Face Llama directory")
    for file in sorted(set(where.values())):
        with _open(file):
            pass


# ---------------------------------------------------------------- export

def _reader(checkpoint: Path | str) -> dcp.StorageReader:
    storage, name = locate(checkpoint)  # a directory or an object-store URL, as checkpoint.dir allows
    return storage.reader(name)


def _read_metadata(checkpoint: Path | str) -> Metadata:
    try:
        return _reader(checkpoint).read_metadata()
    except (OSError, ValueError, EOFError, RuntimeError) as e:
        raise CheckpointError(f"{str(checkpoint)!r} is not a readable keel checkpoint (no torch.distributed."
                              f"checkpoint .metadata: {type(e).__name__}); pass a checkpoints/step-NNNNNN "
                              f"directory") from None


def _shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive groups of tensor indices of at most max_bytes each; a larger tensor gets its own."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if groups and total + size <= max_bytes:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


def check_export_target(out: Path) -> None:
    """`out` must be missing or an empty directory, and creatable: checked before anything is read or written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{str(out)!r} already exists and is not an empty directory; export into a new "
                              f"directory (nothing is overwritten)")
    check_writable_dir(out, "--out")


def export_hf(checkpoint: Path | str, cfg: ModelConfig, out: Path, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 5 * 2**30, tokenizer: Tokenizer | None = None) -> list[Path]:
    """Write the model weights of a keel checkpoint as a Hugging Face Llama directory `out`, with
    `tokenizer` as its Hugging Face tokenizer (and its BOS, EOS and PAD ids in config.json). Reads only
    the model tensors, one output shard at a time, so memory stays near one shard. The directory is built
    beside `out` and renamed into place: it appears complete or not at all. Returns the files written."""
    out = Path(out)
    check_hf_expressible(cfg)
    check_export_target(out)
    metadata = _read_metadata(checkpoint)
    with torch.device("meta"):
        model = Llama(cfg)
    # named_parameters lists a tied output projection once, as tok_embeddings.weight.
    shapes = {name: p.shape for name, p in model.named_parameters()}
    names = list(shapes)
    stored = _stored_dtypes(checkpoint, metadata, shapes)
    _check_selection_bias(checkpoint, metadata, model)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shapes[name]) * itemsize for name in names]
    groups = _shards(sizes, max_shard_bytes)
    files = [SINGLE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                 for i in range(len(groups))]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        # The tokenizer first: what it lacks (the tokenizers package) shows before the weights are read.
        tokenizer_files = [] if tokenizer is None else write_hf_tokenizer(tokenizer, tmp, cfg.max_seq_len)
        weight_map: dict[str, str] = {}
        for group, file in zip(groups, files, strict=True):
            part = {names[i]: torch.empty(shapes[names[i]], dtype=stored[names[i]]) for i in group}
            _load_model_tensors(checkpoint, part)
            tensors = {}
            for name, tensor in part.items():
                for source, piece in _hf_tensors(name, tensor, cfg).items():
                    tensors[source] = piece.to(dtype).contiguous()
                    weight_map[source] = file
            save_file(tensors, tmp / file, metadata={"format": "pt"})
            del part, tensors
        written = list(files)
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            written.append(INDEX)
        written += tokenizer_files
        special_tokens = None if tokenizer is None else {"bos": tokenizer.bos, "eos": tokenizer.eos,
                                                         "pad": tokenizer.pad}
        (tmp / CONFIG).write_text(json.dumps(hf_config(cfg, dtype, special_tokens), indent=2) + "\n")
        written.append(CONFIG)
        _move_into_place(tmp, out, written)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / file for file in written]


def _stored_dtypes(checkpoint: Path | str, metadata: Metadata, shapes: dict[str, torch.Size]) -> dict[str, torch.dtype]:
    """The dtype each model tensor is stored in; refuses a checkpoint that lacks one or holds another shape."""
    stored: dict[str, torch.dtype] = {}
    for name, shape in shapes.items():
        meta = metadata.state_dict_metadata.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{str(checkpoint)!r} has no model tensor {name!r}; export with the model config "
                                  f"the checkpoint was trained with")
        if meta.size != shape:
            raise CheckpointError(f"{str(checkpoint)!r} holds {name!r} with shape {list(meta.size)}, the model config "
                                  f"expects {list(shape)}; export with the config it was trained with")
        stored[name] = meta.properties.dtype
    return stored


def _persistent_buffers(model: Llama) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds beside the parameters: the experts' selection biases."""
    saved = model.state_dict().keys()
    return {name: buffer for name, buffer in model.named_buffers() if name in saved}


def _saved_tensors(model: Llama) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of a model, by name: its parameters (a tied one once) and persistent buffers."""
    return {**dict(model.named_parameters()), **_persistent_buffers(model)}


def _check_selection_bias(checkpoint: Path | str, metadata: Metadata, model: Llama) -> None:
    """Qwen3-MoE chooses experts by their scores alone: refuse a checkpoint whose selection biases moved."""
    shapes = {name: b.shape for name, b in _persistent_buffers(model).items() if name.endswith("expert_bias")}
    stored = _stored_dtypes(checkpoint, metadata, shapes)
    biases = {name: torch.empty(shape, dtype=stored[name]) for name, shape in shapes.items()}
    _load_model_tensors(checkpoint, biases)
    for name, bias in biases.items():
        if bias.any():
            raise CheckpointError(f"{str(checkpoint)!r} holds a non-zero expert selection bias {name!r} (max |bias| "
                                  f"{bias.abs().max():.3g}, moved by model.moe.bias_update_rate), which Qwen3-MoE "
                                  f"has no counterpart of; only a model trained with model.moe.bias_update_rate = 0 "
                                  f"is exported")


def _load_model_tensors(checkpoint: Path | str, part: dict[str, torch.Tensor]) -> None:
    """Fill `part` (model tensor name -> tensor) from the checkpoint, in this one process."""
    with warnings.catch_warnings():  # DCP warns that it assumes one process, which is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load({"model": part}, storage_reader=_reader(checkpoint), no_dist=True)
        except CheckpointException as e:
            causes = sorted({f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
                             for err, _ in e.failures.values()})
            raise CheckpointError(f"cannot read the model from {str(checkpoint)!r}: "
                                  f"{'; '.join(causes)}") from None


def load_checkpoint_model(checkpoint: Path | str, cfg: ModelConfig, device: torch.device) -> Llama:
    """The model of a keel checkpoint, whole, in this one process (as it trained: fp32 master weights)."""
    metadata = _read_metadata(checkpoint)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in _saved_tensors(Llama(cfg)).items()}
    stored = _stored_dtypes(checkpoint, metadata, shapes)  # refuses a config that does not fit the checkpoint
    model = Llama(cfg)
    targets = _saved_tensors(model)
    part = {name: torch.empty(shapes[name], dtype=stored[name]) for name in shapes}
    _load_model_tensors(checkpoint, part)
    with torch.no_grad():
        for name, tensor in part.items():
            targets[name].copy_(tensor)
    return model.to(device).eval()


def _move_into_place(tmp: Path, out: Path, written: list[str]) -> None:
    """Make the finished export in `tmp` durable and shared, then rename it to `out` (missing or empty)."""
    for file in written:
        (tmp / file).chmod(0o644)  # safetensors creates its files private
        fsync_path(tmp / file)
    tmp.chmod(0o755)  # mkdtemp makes it private; an export is meant to be shared
    check_export_target(out)  # again: something may have appeared while we wrote
    try:
        os.rename(tmp, out)  # replaces only a missing or empty directory
    except OSError as e:
        raise CheckpointError(f"cannot move the export into {str(out)!r}: {e.strerror}; nothing was "
                              f"overwritten") from None
    fsync_path(out.parent)


# ---------------------------------------------------------------- import

def _hf_files(path: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor of a Hugging Face directory, single-file or sharded."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read {str(index)!r}: {type(e).__name__}; it needs a weight_map") from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE
    if single.is_file():
        with _open(single) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    raise CheckpointError(f"{str(path)!r} holds neither {SINGLE} nor {INDEX}; pass a Hugging Face model directory")


def _open(file: Path) -> Any:
    """A lazy safetensors reader: tensors are read from the file only when asked for."""
    try:
        return safe_open(file, framework="pt")
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {str(file)!r}: {(str(e).strip().splitlines() or [''])[0]}") from None


def _parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    for name, param in model.named_parameters():
        yield canonical_name(name), param


class _HfTensors:
    """The tensors of a Hugging Face directory, read one at a time, each file opened once (in `stack`)."""

    def __init__(self, path: Path, stack: ExitStack) -> None:
        self.path, self.where, self.stack = path, _hf_files(path), stack
        self.opened: dict[Path, Any] = {}

    def read(self, source: str, shape: list[int], name: str) -> torch.Tensor:
        """Tensor `source`, which keel's `name` expects to have `shape`."""
        if source not in self.where:
            raise CheckpointError(f"{str(self.path)!r} has no tensor {source!r} (keel's {name!r})")
        file = self.where[source]
        if file not in self.opened:
            self.opened[file] = self.stack.enter_context(_open(file))
        handle = self.opened[file]
        if source not in handle.keys():  # noqa: SIM118
            raise CheckpointError(f"{str(file)!r} has no tensor {source!r} though the index names it")
        found = list(handle.get_slice(source).get_shape())
        if found != shape:
            raise CheckpointError(f"{str(self.path)!r}: tensor {source!r} has shape {found}, keel's {name!r} "
                                  f"expects {shape}")
        tensor: torch.Tensor = handle.get_tensor(source)
        return tensor


@torch.no_grad()
def load_hf_weights(model: Llama, path: Path) -> None:
    """Fill a keel Llama, or a pipeline stage of one, from a Hugging Face Llama directory: the counterpart
    of `init_weights` for a run that starts from pretrained weights. Parameters may be DTensors; each
    process reads the full tensors it needs (lazily, one at a time) and keeps its own shard. The experts'
    selection biases start at zero, as Qwen3-MoE has none."""
    path = Path(path)
    cfg = model.cfg
    check_hf_matches(path, cfg)
    model.reset_buffers()
    for moe in model.moe_layers().values():
        moe.expert_bias.zero_()
    with ExitStack() as stack:
        tensors = _HfTensors(path, stack)
        for name, param in _parameters(model):
            if _EXPERTS.fullmatch(name):  # one tensor per expert
                full = torch.stack([tensors.read(source, list(param.shape[1:]), f"{name}[{e}]")
                                    for e, source in enumerate(hf_names(name, cfg.moe.experts))])
            else:
                full = tensors.read(hf_name(name), list(param.shape), name)
            heads = _rope_heads(name, cfg)
            full = _to_pairs(full, heads) if heads else full
            local = param.to_local() if isinstance(param, DTensor) else param
            full = full.to(device=local.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
