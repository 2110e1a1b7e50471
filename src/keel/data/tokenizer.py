"""Tokenizers for prepared corpora: bytes, byte-level BPE trained on the corpus, or a given tokenizer.json.

Three kinds share one small interface (`Tokenizer`) so that preparing, loading and evaluating a corpus never
needs to know which one it has:

- `ByteTokenizer` needs nothing: the 256 byte values are the ids, then BOS, EOS and PAD.
- `train_bpe` trains a byte-level BPE with Hugging Face `tokenizers` on the kept training documents. Byte-level
  means every string encodes (there is no unknown token) and decodes back exactly, and each vocabulary entry
  stands for a known run of bytes, which makes bits per byte exact.
- `load_tokenizer_file` wraps a user's tokenizer.json, finding its BOS/EOS/PAD among the usual names.

Both file kinds are described by the sha256 of the tokenizer.json bytes saved beside the shards, so that a
corpus, a checkpoint and an evaluation can tell whether they speak the same vocabulary (`open_tokenizer`).

Determinism of training: the Hugging Face BPE trainer sorts its initial alphabet by code point, breaks ties
between equally frequent pairs by the pair's token ids (themselves given out in merge order) and sums pair
counts exactly however many threads share the work; the JSON lists the vocabulary by id and the merges by rank.
Word counts are sums, so the same texts in any order give a byte-identical tokenizer.json, in any process and
with any number of threads (RAYON_NUM_THREADS=1 and the default were compared); nothing needs pinning.

Special tokens are recognised only as ids, never in text: a document containing the characters "<|eos|>"
encodes them as ordinary text, so no document can end itself early and every text round-trips.
`tokenizers` is imported only when a BPE or file tokenizer is asked for, so keel works without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from keel.errors import DataError
from keel.paths import check_input

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
MIN_BPE_VOCAB, MAX_BPE_VOCAB = 300, 1_000_000
# Hugging Face's trainer sums pair counts in 32-bit integers, which wrap past 2**31 (huggingface/tokenizers
# issue 2058) into a silently wrong vocabulary. A pair occurs at most once per byte of text, so training on
# fewer bytes than that can never overflow; a vocabulary gains little from more text anyway.
TRAIN_BYTES_LIMIT = 2_000_000_000
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")  # what train_bpe adds, ids 0, 1, 2

# Names by which tokenizer.json files in the wild call their document delimiters, most specific first.
BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>")
EOS_NAMES = ("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
# data.tokenizer, parsed: the byte tokenizer, BPE of a vocabulary size, or a tokenizer.json.
TokenizerSpec = tuple[Literal["byte"], None] | tuple[Literal["bpe"], int] | tuple[Literal["file"], Path]
_SPEC_FORMS = f"byte, bpe:VOCAB ({MIN_BPE_VOCAB} to {MAX_BPE_VOCAB}) or the path of a tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos: int
    eos: int
    pad: int

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each text as BOS, its ids, EOS (uint32)."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`, special tokens left out."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the manifest records: name, vocab_size, bos, eos, pad (and file, sha256 for file tokenizers)."""
        ...

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for special tokens), int64, length vocab_size."""
        ...

    def save(self, directory: Path) -> None:
        """Write what `open_tokenizer` needs beside the shards."""
        ...


class ByteTokenizer:
    """Ids 0-255 are the bytes of the UTF-8 text; 256, 257, 258 are BOS, EOS, PAD."""

    name = "byte"
    bos, eos, pad = 256, 257, 258
    vocab_size = 259

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        out = []
        for text in texts:
            data = text.encode("utf-8", errors="replace")  # only a lone surrogate is replaced, as "?"
            ids = np.empty(len(data) + 2, dtype=np.uint32)
            ids[0], ids[-1] = self.bos, self.eos
            ids[1:-1] = np.frombuffer(data, dtype=np.uint8)
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos": self.bos, "eos": self.eos, "pad": self.pad}

    def token_bytes(self) -> np.ndarray:
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        counts[:256] = 1
        return counts

    def save(self, directory: Path) -> None:
        """Nothing to write: the byte tokenizer is fully described by its name."""


class FileTokenizer:
    """A Hugging Face tokenizer.json, kept as the exact bytes it was built from (they are its fingerprint)."""

    def __init__(self, name: str, data: bytes, source: str) -> None:
        self.name = name
        self._data = data
        self.sha256 = hashlib.sha256(data).hexdigest()
        hf = _hf_module()
        try:
            config = json.loads(data)
            self._hf = hf.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{source} is not a Hugging Face tokenizer.json ({first_line})") from e
        # Special tokens only ever come from ids: text that spells one is encoded as text.
        self._hf.encode_special_tokens = True
        vocab = self._hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        eos = _find_token(self._hf, vocab, EOS_NAMES)
        if eos is None:
            raise DataError(f"{source} has no end-of-document token; expected one of {', '.join(EOS_NAMES)}")
        self.eos = eos
        # A single delimiter (GPT-2's <|endoftext|>) serves as BOS and PAD too.
        bos, pad = _find_token(self._hf, vocab, BOS_NAMES), _find_token(self._hf, vocab, PAD_NAMES)
        self.bos = eos if bos is None else bos
        self.pad = eos if pad is None else pad
        self.byte_level = _uses_byte_level(config)
        # Exact only when text reaches the byte-level model unchanged: no normaliser, no added prefix space.
        self.token_bytes_exact = self.byte_level and config.get("normalizer") is None and not _adds_prefix(config)
        self._config = config
        self._token_bytes: np.ndarray | None = None

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)  # fast: skips character offsets
        try:
            encodings = encode(texts, add_special_tokens=False)
        except (TypeError, UnicodeEncodeError):  # a lone surrogate cannot cross into Rust: replace it, as bytes do
            texts = [t.encode("utf-8", errors="replace").decode("utf-8") for t in texts]
            encodings = encode(texts, add_special_tokens=False)
        out = []
        for enc in encodings:
            body = enc.ids
            ids = np.empty(len(body) + 2, dtype=np.uint32)
            ids[0], ids[-1] = self.bos, self.eos
            ids[1:-1] = body
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        keep = (ids != self.bos) & (ids != self.eos) & (ids != self.pad)
        return self._hf.decode(ids[keep].tolist(), skip_special_tokens=True)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "bos": self.bos, "eos": self.eos, "pad": self.pad,
                "file": TOKENIZER_FILE, "sha256": self.sha256}

    def token_bytes(self) -> np.ndarray:
        if self._token_bytes is None:
            self._token_bytes = _count_token_bytes(self)
            self._token_bytes.setflags(write=False)
        return self._token_bytes

    def save(self, directory: Path) -> None:
        path = Path(directory) / TOKENIZER_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self._data)
        tmp.replace(path)


def _hf_module() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise DataError("BPE and tokenizer.json tokenizers need Hugging Face tokenizers: "
                        "pip install 'keel-pretrain[bpe]'") from e
    return tokenizers


def _find_token(hf: HFTokenizer, vocab: dict[str, int], names: tuple[str, ...]) -> int | None:
    added = {tok.content: i for i, tok in hf.get_added_tokens_decoder().items()}
    for name in names:
        if name in added:
            return added[name]
    for name in names:
        if name in vocab:
            return vocab[name]
    return None


def _components(node: Any) -> Iterator[dict]:
    """Every typed component of a pre-tokenizer or decoder, looking inside Sequences."""
    if isinstance(node, dict):
        if "type" in node:
            yield node
        for value in node.values():
            yield from _components(value)
    elif isinstance(node, list):
        for value in node:
            yield from _components(value)


def _uses_byte_level(config: dict) -> bool:
    return any(c["type"] == "ByteLevel" for c in _components(config.get("pre_tokenizer"))) and \
        any(c["type"] == "ByteLevel" for c in _components(config.get("decoder")))


def _adds_prefix(config: dict) -> bool:
    return any(c.get("add_prefix_space") for c in _components(config.get("pre_tokenizer")))


def byte_level_alphabet() -> dict[str, int]:
    """The printable character that byte-level BPE writes for each byte value: printable Latin-1 bytes stand
    for themselves, the rest (controls, space, soft hyphen) are moved to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    moved = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + moved)
            moved += 1
    return {c: b for b, c in chars.items()}


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _count_token_bytes(tok: FileTokenizer) -> np.ndarray:
    """Text bytes per id, once per vocabulary entry (not per encoded token). Byte-level entries are runs of
    alphabet characters, one byte each; other models get a best effort: SentencePiece's "▁" is a space,
    "<0xNN>" byte fallbacks are one byte, a WordPiece continuation prefix is no text."""
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    added = tok._hf.get_added_tokens_decoder()
    alphabet = byte_level_alphabet()
    model = tok._config.get("model") or {}
    prefix = model.get("continuing_subword_prefix") or ""
    for text, i in tok._hf.get_vocab(with_added_tokens=True).items():
        if i in (tok.bos, tok.eos, tok.pad):
            continue
        if i in added:  # added tokens match raw text
            counts[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
        elif tok.byte_level:
            counts[i] = sum(1 if c in alphabet else len(c.encode("utf-8")) for c in text)
        elif _BYTE_FALLBACK.fullmatch(text):
            counts[i] = 1
        else:
            if prefix and text.startswith(prefix):
                text = text[len(prefix):]
            counts[i] = len(text.replace("\u2581", " ").encode("utf-8"))
    return counts


def train_bpe(texts: Iterable[str], vocab_size: int, max_bytes: int = TRAIN_BYTES_LIMIT) -> FileTokenizer:
    """A byte-level BPE of `vocab_size` ids (fewer if the texts run out of pairs to merge), trained on the first
    `max_bytes` of `texts`, which are streamed: memory holds the word counts, not the corpus."""
    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise DataError(f"BPE vocabulary {vocab_size} is out of range; use {MIN_BPE_VOCAB} to {MAX_BPE_VOCAB}")
    if not 0 < max_bytes <= TRAIN_BYTES_LIMIT:
        raise DataError(f"BPE training bytes {max_bytes} are out of range; use 1 to {TRAIN_BYTES_LIMIT}")
    hf = _hf_module()
    pre = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model = hf.Tokenizer(hf.models.BPE())
    model.pre_tokenizer = pre
    model.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(_training_texts(texts, max_bytes), trainer)
    return FileTokenizer("bpe", model.to_str().encode("utf-8"), "the trained BPE")


def _training_texts(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """The texts up to `max_bytes` of UTF-8, the last one cut to fit; lone surrogates replaced as in encoding."""
    left = max_bytes
    for text in texts:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            data = text.encode("utf-8", errors="replace")
            text = data.decode("utf-8")
        if len(data) >= left:
            yield data[:left].decode("utf-8", errors="ignore")
            return
        left -= len(data)
        yield text


def load_tokenizer_file(path: Path, name: str = "file") -> FileTokenizer:
    """A user's tokenizer.json; its BOS/EOS/PAD are found by name (BOS and PAD fall back to EOS)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read tokenizer file {path}: {e.strerror or e}") from e
    return FileTokenizer(name, data, str(path))


def parse_tokenizer_spec(spec: str) -> TokenizerSpec:
    """("byte", None), ("bpe", vocab) or ("file", path) for data.tokenizer."""
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        vocab = spec[4:]
        if not vocab.isdigit() or not MIN_BPE_VOCAB <= int(vocab) <= MAX_BPE_VOCAB:
            raise DataError(f"tokenizer {spec!r}: the BPE vocabulary must be a whole number from {MIN_BPE_VOCAB} "
                            f"to {MAX_BPE_VOCAB}, e.g. bpe:8192")
        return "bpe", int(vocab)
    if spec.endswith(".json"):
        path = check_input(os.path.expanduser(spec), "tokenizer file", "file", "give the path of a tokenizer.json",
                           DataError)
        return "file", path
    raise DataError(f"tokenizer {spec!r} is not valid; use {_SPEC_FORMS}")


def open_tokenizer(corpus_dir: Path, described: dict[str, Any]) -> Tokenizer:
    """The tokenizer a prepared corpus was built with, from its manifest's "tokenizer" entry."""
    if described.get("name") == "byte":
        return ByteTokenizer()
    path = Path(corpus_dir) / TOKENIZER_FILE
    if "sha256" not in described:
        raise DataError(f"the manifest of {corpus_dir} describes tokenizer {described.get('name')!r} without a "
                        "sha256; prepare the corpus again")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path} is missing or unreadable ({e.strerror or e}); prepare the corpus again") from e
    if hashlib.sha256(data).hexdigest() != described["sha256"]:
        raise DataError(f"{path} was altered since the corpus was prepared (sha256 differs from the manifest); "
                        "prepare the corpus again")
    tok = FileTokenizer(str(described["name"]), data, str(path))
    for key in ("bos", "eos", "pad", "vocab_size"):
        if key in described and described[key] != getattr(tok, key):
            raise DataError(f"{path} gives {key} = {getattr(tok, key)} but the manifest says {described[key]}; "
                            "prepare the corpus again")
    return tok


def bits_per_byte(loss_nats: float, tokens: int, text_bytes: int) -> float:
    """Mean loss in nats per token turned into bits per byte of text, comparable across tokenizers."""
    if text_bytes <= 0:
        raise ValueError("bits per byte needs a positive number of text bytes")
    return loss_nats * tokens / (text_bytes * math.log(2))
