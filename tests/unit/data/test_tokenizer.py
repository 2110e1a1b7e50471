"""Tokenizers: exact round trips, byte accounting for bits per byte, deterministic BPE training, fingerprints."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import keel
from keel.data.tokenizer import (
    ByteTokenizer,
    Tokenizer,
    bits_per_byte,
    byte_level_alphabet,
    load_tokenizer_file,
    open_tokenizer,
    parse_tokenizer_spec,
    train_bpe,
)
from keel.errors import DataError

tokenizers = pytest.importorskip("tokenizers")

STDLIB_FILES = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
TRAIN_FILES = STDLIB_FILES[:40]  # about 300 KB
HELD_OUT_FILES = STDLIB_FILES[150:165]
ODD_TEXTS = ["", " ", "\x00\x01\x1b[0m\x7f", "naïve café — 日本語 ≠ ∑", "emoji 😀👩‍👩‍👧 flags 🇫🇷 \U0010ffff",
             "crlf\r\nand\ttabs\u00a0nbsp \u200b zero-width", "<|bos|><|eos|><|pad|> written as text", "   lead",
             "trail   ", "\ufeffbom"]
SRC = Path(keel.__file__).resolve().parents[1]


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8") for f in files]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe(read(TRAIN_FILES), 1024)


def assert_round_trip(tok: Tokenizer, texts: list[str]) -> None:
    sizes = tok.token_bytes()
    for text, ids in zip(texts, tok.encode_documents(texts), strict=True):
        assert ids.dtype == np.uint32
        assert ids[0] == tok.bos and ids[-1] == tok.eos
        assert not np.isin(ids[1:-1], [tok.bos, tok.eos, tok.pad]).any()
        assert tok.decode(ids) == text
        assert int(sizes[ids].sum()) == len(text.encode("utf-8"))


def test_byte_tokenizer_ids_and_round_trip(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    assert (tok.bos, tok.eos, tok.pad, tok.vocab_size, tok.name) == (256, 257, 258, 259, "byte")
    [ids] = tok.encode_documents(["hé"])
    assert ids.tolist() == [256, 104, 0xC3, 0xA9, 257]
    assert_round_trip(tok, ODD_TEXTS + read(HELD_OUT_FILES[:3]))
    assert tok.token_bytes().tolist() == [1] * 256 + [0, 0, 0]
    tok.save(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert isinstance(tok, Tokenizer)


def test_bpe_round_trips_real_and_odd_text(bpe: Tokenizer) -> None:
    assert bpe.vocab_size == 1024 and (bpe.bos, bpe.eos, bpe.pad) == (0, 1, 2)
    assert_round_trip(bpe, read(HELD_OUT_FILES) + ODD_TEXTS)
    # The special tokens' spelling in text stays text, and ids decode only to text.
    [ids] = bpe.encode_documents(["<|eos|>"])
    assert len(ids) > 3
    assert bpe.decode([bpe.bos, bpe.pad, *ids.tolist(), bpe.eos]) == "<|eos|>"


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_bpe_round_trips_any_text(bpe: Tokenizer, text: str) -> None:
    assert_round_trip(bpe, [text])
    assert_round_trip(ByteTokenizer(), [text])


def test_lone_surrogates_are_replaced_not_fatal(bpe: Tokenizer) -> None:
    for tok in (ByteTokenizer(), bpe):
        [ids] = tok.encode_documents(["a\ud800b"])
        assert tok.decode(ids) == "a?b"


def test_bpe_compresses_held_out_text(bpe: Tokenizer) -> None:
    texts = read(HELD_OUT_FILES)
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    byte_tokens = sum(len(ids) for ids in ByteTokenizer().encode_documents(texts))
    bpe_tokens = sum(len(ids) for ids in bpe.encode_documents(texts))
    assert byte_tokens > text_bytes
    assert bpe_tokens < 0.5 * text_bytes


def test_byte_level_alphabet_matches_hugging_face() -> None:
    ours = byte_level_alphabet()
    assert sorted(ours.values()) == list(range(256))
    assert set(ours) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert ours["A"] == ord("A") and ours["\u0120"] == ord(" ")  # GPT-2's well-known "Ġ" for a space


def test_training_is_deterministic_across_runs_and_processes(bpe: Tokenizer, tmp_path: Path) -> None:
    again = train_bpe(iter(read(TRAIN_FILES)[::-1]), 1024)  # order does not matter: training counts words
    assert again.describe() == bpe.describe()
    bpe.save(tmp_path)
    script = ("import sys; from pathlib import Path; from keel.data.tokenizer import train_bpe; "
              "texts = (Path(p).read_text(encoding='utf-8') for p in sys.argv[2:]); "
              "train_bpe(texts, 1024).save(Path(sys.argv[1]))")
    other = tmp_path / "other"
    other.mkdir()
    env = dict(os.environ, PYTHONPATH=str(SRC), RAYON_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", script, str(other), *map(str, TRAIN_FILES)], env=env, check=True,
                   timeout=60)
    assert (other / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    # Different data gives a different fingerprint.
    assert train_bpe(read(TRAIN_FILES[1:]), 1024).describe()["sha256"] != bpe.describe()["sha256"]


def test_training_stops_at_max_bytes() -> None:
    texts = read(TRAIN_FILES[:8])
    head = sum(len(t.encode("utf-8")) for t in texts[:5])
    capped = train_bpe(iter(texts), 512, max_bytes=head + 1000)
    assert capped.sha256 == train_bpe([*texts[:5], texts[5].encode()[:1000].decode(errors="ignore")], 512).sha256
    assert capped.sha256 != train_bpe(texts, 512).sha256
    with pytest.raises(DataError, match="training bytes"):
        train_bpe(texts, 512, max_bytes=0)


def test_saved_bpe_reopens_and_detects_alteration(bpe: Tokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path)
    described = bpe.describe()
    data = (tmp_path / "tokenizer.json").read_bytes()
    assert described["file"] == "tokenizer.json" and described["sha256"] == hashlib.sha256(data).hexdigest()
    reopened = open_tokenizer(tmp_path, described)
    assert reopened.describe() == described
    texts = read(HELD_OUT_FILES[:2])
    assert all(np.array_equal(a, b) for a, b in zip(reopened.encode_documents(texts), bpe.encode_documents(texts),
                                                    strict=True))
    assert isinstance(open_tokenizer(tmp_path, ByteTokenizer().describe()), ByteTokenizer)

    (tmp_path / "tokenizer.json").write_bytes(data + b"\n")  # still valid JSON, different bytes
    with pytest.raises(DataError, match="altered.*prepare the corpus again"):
        open_tokenizer(tmp_path, described)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(DataError, match="prepare the corpus again"):
        open_tokenizer(tmp_path, described)


def gpt2_like(path: Path) -> Path:
    """A byte-level tokenizer.json whose only delimiter is <|endoftext|>, as GPT-2's."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(read(TRAIN_FILES[:5]), trainer)
    hf.save(str(path))
    return path


def test_given_tokenizer_file(tmp_path: Path) -> None:
    path = gpt2_like(tmp_path / "gpt2.json")
    tok = load_tokenizer_file(path)
    eot = tok._hf.token_to_id("<|endoftext|>")
    assert (tok.bos, tok.eos, tok.pad) == (eot, eot, eot)
    assert tok.token_bytes_exact and tok.vocab_size == 400
    assert_round_trip(tok, ODD_TEXTS + read(HELD_OUT_FILES[:2]))
    described = tok.describe()
    assert described["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    tok.save(corpus)
    assert (corpus / "tokenizer.json").read_bytes() == path.read_bytes()
    assert open_tokenizer(corpus, described).describe() == described

    # A changed file has a different fingerprint (here it also gains a PAD).
    hf = tokenizers.Tokenizer.from_file(str(path))
    hf.add_special_tokens(["<pad>"])
    hf.save(str(path))
    changed = load_tokenizer_file(path).describe()
    assert changed["sha256"] != described["sha256"] and changed["pad"] == 400 and changed["vocab_size"] == 401
    path.write_bytes(path.read_bytes() + b" ")
    assert load_tokenizer_file(path).describe()["sha256"] != changed["sha256"]


def test_given_tokenizer_with_bos_template_and_sentencepiece_style(tmp_path: Path) -> None:
    """A Llama-2-like file: <s>/</s>, a post-processor that would add <s>, and Metaspace instead of bytes."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    hf.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                             show_progress=False)
    hf.train_from_iterator(read(TRAIN_FILES[:5]), trainer)
    hf.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(tmp_path / "sp.json"))
    tok = load_tokenizer_file(tmp_path / "sp.json")
    assert (tok.bos, tok.eos, tok.pad) == (1, 2, 2)
    assert not tok.token_bytes_exact
    [ids] = tok.encode_documents(["def f(x):\n    return x"])
    assert ids[0] == 1 and ids[1] != 1 and ids[-1] == 2  # BOS once: the template is not applied
    assert tok.decode(ids).split() == ["def", "f(x):", "return", "x"]
    assert tok.token_bytes()[ids].sum() > 0


def test_given_tokenizer_errors(tmp_path: Path) -> None:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    hf.save(str(tmp_path / "no_eos.json"))
    with pytest.raises(DataError, match=r"no_eos\.json has no end-of-document token; expected one of .*</s>"):
        load_tokenizer_file(tmp_path / "no_eos.json")
    (tmp_path / "bad.json").write_text('{"version": "1.0"}')
    with pytest.raises(DataError, match=r"bad\.json is not a Hugging Face tokenizer\.json"):
        load_tokenizer_file(tmp_path / "bad.json")
    with pytest.raises(DataError, match="cannot read tokenizer file"):
        load_tokenizer_file(tmp_path / "missing.json")


def test_parse_tokenizer_spec(tmp_path: Path) -> None:
    assert parse_tokenizer_spec("byte") == ("byte", None)
    assert parse_tokenizer_spec("bpe:8192") == ("bpe", 8192)
    assert parse_tokenizer_spec("bpe:300") == ("bpe", 300)
    path = gpt2_like(tmp_path / "tok.json")
    assert parse_tokenizer_spec(str(path)) == ("file", path)
    for bad in ("bpe:299", "bpe:1000001", "bpe:", "bpe:8k", "bpe:-5"):
        with pytest.raises(DataError, match="whole number from 300 to 1000000"):
            parse_tokenizer_spec(bad)
    with pytest.raises(DataError, match=r"nowhere/tok\.json' does not exist"):
        parse_tokenizer_spec(str(tmp_path / "nowhere" / "tok.json"))
    for bad in ("bpe", "gpt2", "", "Byte"):
        with pytest.raises(DataError, match=r"use byte, bpe:VOCAB .* or the path of a tokenizer\.json"):
            parse_tokenizer_spec(bad)
    with pytest.raises(DataError, match="out of range"):
        train_bpe(["x"], 100)


def test_missing_tokenizers_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what an environment without the package looks like
    with pytest.raises(DataError, match=r"pip install 'keel-pretrain\[bpe\]'"):
        train_bpe(["some text"], 512)
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(DataError, match=r"keel-pretrain\[bpe\]"):
        load_tokenizer_file(tmp_path / "t.json")
    assert ByteTokenizer().encode_documents(["ok"])[0].tolist() == [256, 111, 107, 257]


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2), 100, 100) == pytest.approx(1.0)
    # Same total loss spread over fewer, longer tokens: the same bits per byte.
    assert bits_per_byte(2.0, 250, 1000) == pytest.approx(bits_per_byte(0.5, 1000, 1000))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 10, 0)
