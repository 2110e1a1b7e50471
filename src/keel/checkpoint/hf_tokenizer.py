"""The tokenizer half of a Hugging Face export: keel's tokenizer as files that `transformers.AutoTokenizer`
loads (a `PreTrainedTokenizerFast`) and that give keel's ids on every text.

keel frames each document as BOS, the text's ids, EOS, and never matches special tokens in text. The export
says the same to transformers: its post-processor adds BOS and EOS (`add_special_tokens=True`, the default,
is keel's document; `False` is the text's ids alone) and `split_special_tokens` keeps text that spells a
special token ("<|eos|>") ordinary text. The byte tokenizer becomes a byte-level BPE without merges whose
vocabulary gives each byte its own value as id, with BOS, EOS and PAD at 256, 257 and 258.

Which tokenizer a checkpoint was trained with is in its manifest: the byte tokenizer by name; a BPE or given
tokenizer.json by the sha256 of the file and the corpus directory it lies in, or any copy passed explicitly.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from keel.data.tokenizer import (
    SPECIALS,
    TOKENIZER_FILE,
    ByteTokenizer,
    FileTokenizer,
    Tokenizer,
    _hf_module,
    byte_level_alphabet,
)
from keel.errors import CheckpointError

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)


# ---------------------------------------------------------------- which tokenizer

def checkpoint_tokenizer(described: dict[str, Any] | None, checkpoint: str, given: Path | None = None) -> Tokenizer:
    """keel's tokenizer of `checkpoint`, whose manifest describes it as `described`: the byte tokenizer, or
    the tokenizer.json in `given` (the file or a corpus directory) or else in the corpus the run trained on,
    which must be the very file the checkpoint records (same sha256)."""
    if not described or "name" not in described:
        raise CheckpointError(f"checkpoint {checkpoint} records no tokenizer; export a checkpoint written by "
                              f"`keel train`")
    if described["name"] == "byte":
        if given is not None:
            raise CheckpointError(f"checkpoint {checkpoint} was trained with the byte tokenizer, which needs no "
                                  f"file; leave out --tokenizer {given}")
        return ByteTokenizer()
    name, sha256 = str(described["name"]), described.get("sha256")
    if given is None and not described.get("corpus"):
        raise CheckpointError(f"checkpoint {checkpoint} records its {name} tokenizer's sha256 but not its corpus; "
                              f"pass --tokenizer PATH (the prepared corpus directory or its {TOKENIZER_FILE})")
    path = Path(given if given is not None else described["corpus"])
    if path.is_dir():
        path = path / TOKENIZER_FILE
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}, the {name} tokenizer of checkpoint {checkpoint} "
                              f"({e.strerror or e}); pass --tokenizer PATH of the {TOKENIZER_FILE} it was trained "
                              f"with") from None
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise CheckpointError(f"{path} is not the {name} tokenizer checkpoint {checkpoint} was trained with "
                              f"(sha256 {found[:12]}…, the checkpoint records {str(sha256)[:12]}…); pass "
                              f"--tokenizer PATH of the {TOKENIZER_FILE} it was trained with")
    return FileTokenizer(name, data, str(path))


# ---------------------------------------------------------------- writing


def _byte_level(hf: Any) -> Any:
    """keel's byte tokenizer as a Hugging Face tokenizer: every byte its own token, id = byte value."""
    model = hf.Tokenizer(hf.models.BPE(vocab=byte_level_alphabet(), merges=[]))
    model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = hf.decoders.ByteLevel()
    # Added after the 256 bytes, they take ids 256, 257, 258: ByteTokenizer's BOS, EOS, PAD.
    model.add_special_tokens([hf.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return model


def write_hf_tokenizer(tok: Tokenizer, directory: Path, max_length: int) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json of `tok` into `directory`.
    Returns the names written."""
    hf = _hf_module()  # an error naming keel-pretrain[bpe] without it
    directory = Path(directory)
    if isinstance(tok, ByteTokenizer):
        model = _byte_level(hf)
    else:
        tok.save(directory)  # the exact file keel encodes with; only its post-processor changes below
        model = hf.Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    bos, eos, pad = (model.id_to_token(i) for i in (tok.bos, tok.eos, tok.pad))
    model.post_processor = hf.processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {bos}:1 $B:1 {eos}:1",
        special_tokens=sorted({(bos, tok.bos), (eos, tok.eos)}, key=lambda t: t[1]))
    (directory / TOKENIZER_FILE).write_text(model.to_str(pretty=True))
    specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        # transformers 5 rebuilds the post-processor from these two; earlier versions keep the file's.
        "add_bos_token": True,
        "add_eos_token": True,
        "split_special_tokens": True,  # keel never reads a special token out of text
        "clean_up_tokenization_spaces": False,  # decode gives the text back as it was
        "model_max_length": max_length,
    }
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (directory / SPECIAL_TOKENS_MAP).write_text(json.dumps(specials, indent=2) + "\n")
    return list(TOKENIZER_FILES)
