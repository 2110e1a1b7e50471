"""The tokenizer half of a Hugging Face export: keel's tokenizer as files that `transformers.AutoTokenizer`
loads (a `PreTrainedTokenizerFast`) and that give keel's ids on every text.

keel frames each document as BOS, the text's ids, EOS, and never matches special tokens in text. The export
says the same to transformers: its post-processor adds BOS and EOS (`add_special_tokens=True`, the default,
is keel's document; `False` is the text's ids alone) and `split_special_tokens` keeps text that spells a
special token ("<|eos|>") ordinary text. The byte tokenizer becomes a byte-level BPE without merges whose
vocabulary gives each byte its own value as id, with BOS, EOS and PAD at 256, 257 and 258: plain JSON, written
here without Hugging Face `tokenizers`, so that a run of the runtime-only install exports as it is. A BPE or
given tokenizer.json is read and written through `tokenizers` (the `bpe` extra, which trained or loaded it).

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


def _added_token(content: str, token_id: int) -> dict[str, Any]:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def _byte_level() -> dict[str, Any]:
    """keel's byte tokenizer as a Hugging Face tokenizer.json (without its post-processor): every byte its own
    token, id = byte value, and BOS, EOS, PAD after them (ids 256, 257, 258, as ByteTokenizer's)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added_token(s, 256 + i) for i, s in enumerate(SPECIALS)],
        "normalizer": None, "pre_tokenizer": byte_level,
        "post_processor": None,
        # The decoder's regex and prefix flags play no part in decoding; these are `tokenizers`' defaults.
        "decoder": {**byte_level, "add_prefix_space": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": byte_level_alphabet(), "merges": []},
    }


def _framing(bos: str, bos_id: int, eos: str, eos_id: int) -> dict[str, Any]:
    """The post-processor that frames a text as keel's document, BOS text EOS (a pair as two documents)."""
    def special(token: str, type_id: int) -> dict[str, Any]:
        return {"SpecialToken": {"id": token, "type_id": type_id}}

    def text(name: str, type_id: int) -> dict[str, Any]:
        return {"Sequence": {"id": name, "type_id": type_id}}

    single = [special(bos, 0), text("A", 0), special(eos, 0)]
    pair = [*single, special(bos, 1), text("B", 1), special(eos, 1)]
    tokens = {token: {"id": token, "ids": [token_id], "tokens": [token]}
              for token, token_id in sorted({(bos, bos_id), (eos, eos_id)}, key=lambda t: t[1])}
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": tokens}


def _tokenizer_json(tok: Tokenizer, directory: Path) -> tuple[dict[str, Any], list[str]]:
    """tokenizer.json of `tok` as a dict with keel's framing, and the names of its BOS, EOS and PAD tokens."""
    if isinstance(tok, ByteTokenizer):
        config, names = _byte_level(), list(SPECIALS)
    else:
        hf = _hf_module()  # a BPE or given file: an error naming keel-pretrain[bpe] without it
        tok.save(directory)  # the exact file keel encodes with; only its post-processor changes
        model = hf.Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        config = json.loads(model.to_str())
        names = [model.id_to_token(i) for i in (tok.bos, tok.eos, tok.pad)]
    config["post_processor"] = _framing(names[0], tok.bos, names[1], tok.eos)
    return config, names


def write_hf_tokenizer(tok: Tokenizer, directory: Path, max_length: int) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json of `tok` into `directory`.
    Returns the names written."""
    directory = Path(directory)
    tokenizer, (bos, eos, pad) = _tokenizer_json(tok, directory)
    (directory / TOKENIZER_FILE).write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n",
                                            encoding="utf-8")
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
