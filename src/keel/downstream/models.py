"""What `keel eval` evaluates: a keel checkpoint (the newest that verifies under a run directory, or one
`checkpoints/step-NNNNNN`), through keel's own model and tokenizer, or a Hugging Face export, through
lm-eval's Hugging Face model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from keel.checkpoint.export import CONFIG, INDEX, SINGLE, load_checkpoint_model
from keel.checkpoint.hf_tokenizer import checkpoint_tokenizer
from keel.checkpoint.inspect import latest_verified
from keel.checkpoint.manifest import read_manifest
from keel.config import ModelConfig
from keel.downstream.scoring import Scorer
from keel.errors import ConfigError


def is_hf_export(path: Path) -> bool:
    return (path / CONFIG).is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def keel_model(target: str, device: torch.device, batch_size: int, tokenizer: Path | None = None
               ) -> tuple[Scorer, dict[str, Any]]:
    """The checkpoint's model as keel scores text with it, and what was loaded (checkpoint, step)."""
    storage, name = latest_verified(target)
    manifest = read_manifest(storage, name)
    assert manifest is not None  # a checkpoint that verifies has its manifest
    cfg = ModelConfig(**manifest["model"])
    tok = checkpoint_tokenizer(manifest.get("tokenizer"), storage.path(name), tokenizer)
    with storage.reading(name):
        model = load_checkpoint_model(storage.path(name), cfg, device)
    return Scorer(model, tok, cfg.max_seq_len, device, batch_size), {"checkpoint": storage.path(name),
                                                                       "step": manifest["step"]}


def hf_model(path: Path, device: torch.device, batch_size: int) -> tuple[Any, dict[str, Any]]:
    """lm-eval's Hugging Face model of an export, reading requests as keel's adapter does: without special tokens
    around the text (keel's exported tokenizer frames a text as a whole document, BOS and EOS)."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:
        raise ConfigError(f"evaluating a Hugging Face export needs {e.name or 'lm-eval'}: pip install "
                          f"'keel-pretrain[eval]'") from None
    lm = HFLM(pretrained=str(path), device=str(device), batch_size=batch_size, dtype="float32",
              add_bos_token=False)
    return lm, {"export": str(path)}


def keel_lm(scorer: Scorer) -> Any:
    """The scorer as lm-eval's model (lm-eval imported only here: keel's own tasks are scored without it)."""
    from keel.downstream.adapter import KeelLM

    return KeelLM(scorer)
