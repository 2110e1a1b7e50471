"""Dedup primitives: exact keys, shingle hashes, MinHash signatures, LSH parameters and near-duplicate clusters.

Pinned hash values guard determinism across machines and numpy versions (work files of different processes and
runs are compared with each other); the quality test plants near-duplicate pairs of known Jaccard similarity
and compares keel's clustering with datasketch's MinHashLSH on the same data.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from keel.data import dedup
from keel.data.dedup import (
    MinHasher,
    UnionFind,
    exact_key,
    lsh_formula,
    lsh_params,
    near_duplicate_roots,
    ngram_hashes,
    scan_hashes,
    shingles,
    shingles_batch,
)
from keel.errors import DataError

REPO = Path(__file__).resolve().parents[3]


def load_bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("bench_dedup", REPO / "bench" / "dedup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = load_bench()


def random_text(rng: np.random.Generator, words: int) -> list[str]:
    vocab = [f"w{k}" for k in range(5000)]
    return [vocab[i] for i in rng.integers(0, len(vocab), size=words)]


def exact_jaccard(a: str, b: str) -> float:
    sa, sb = set(shingles(a, "word", 5).tolist()), set(shingles(b, "word", 5).tolist())
    return len(sa & sb) / len(sa | sb)


def test_exact_key_folds_case_and_whitespace_only() -> None:
    key = exact_key("Hello  World")
    assert len(key) == 16
    assert key.hex() == "e9a804b2e527fd3601d2ffc0bb023cd6"  # blake2b-128 of "hello world"
    assert exact_key("  hello\tWORLD\n") == key
    assert exact_key("hello world!") != key
    assert exact_key("helloworld") != key


def test_hashes_are_pinned_across_machines_and_processes() -> None:
    assert [hex(int(v)) for v in shingles("the quick brown fox jumps over", "word", 5)] == [
        "0xbc7bb0f44f76b3d2", "0xaed75cd9af3f0631"]
    assert [hex(int(v)) for v in shingles("abcd", "char", 3)] == ["0x99617a7b0c99164f", "0xbe25b150f880f75a"]
    text = "the quick brown fox jumps over the lazy dog"
    expected = [135369701, 998116216, 679575259, 370424039]
    assert MinHasher(128, 1, "word", 5).signatures([text])[0, :4].tolist() == expected
    # Another interpreter with another hash seed must agree (Python's hash() is salted per process).
    code = ("from keel.data.dedup import MinHasher; "
            f"print(MinHasher(128, 1, 'word', 5).signatures([{text!r}])[0, :4].tolist())")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


def test_shingle_counts() -> None:
    words = " ".join(f"w{k}" for k in range(10))
    assert len(shingles(words, "word", 5)) == 6
    assert len(shingles("a b c", "word", 5)) == 1  # shorter than n: one shingle of the whole text
    assert len(shingles("", "word", 5)) == 0
    assert len(shingles("  \n\t ", "word", 5)) == 0
    assert len(shingles("abcdef", "char", 3)) == 4
    assert len(shingles("ab", "char", 3)) == 1
    assert len(shingles("é" * 3, "char", 2)) == 5  # UTF-8 bytes, not code points
    assert len(shingles("a  b", "char", 3)) == 1  # whitespace runs collapse to one space before shingling
    assert shingles("x", "word", 1).dtype == np.uint64
    assert len(ngram_hashes("a b c d", 5)) == 0
    assert len(ngram_hashes("a b c d e f", 5)) == 2


def test_shingles_depend_on_the_gram_only() -> None:
    # Case and layout are normalised away; the same gram hashes the same at any position, in any text.
    assert np.array_equal(shingles("A  b C\nd e", "word", 5), shingles("a b c d e", "word", 5))
    first, second = shingles("q a b c d e", "word", 5), shingles("a b c d e z", "word", 5)
    assert first[1] == second[0] and first[0] != second[1]
    assert np.array_equal(ngram_hashes("x a b c", 3)[1:], ngram_hashes("a b c", 3))
    words = random_text(np.random.default_rng(0), 3000)
    distinct = {tuple(words[i:i + 5]) for i in range(len(words) - 4)}
    assert len(np.unique(shingles(" ".join(words), "word", 5))) == len(distinct)  # no collisions
    chars = shingles("abcabc", "char", 3)
    assert chars[0] == chars[3] and len(np.unique(chars)) == 3
    # Grams that differ by one word or one byte do not collide.
    assert shingles("a b c d e", "word", 5)[0] != shingles("a b c d f", "word", 5)[0]
    assert shingles("ab", "word", 1)[0] != shingles("a b", "word", 2)[0]


def test_scan_hashes_match_each_hash_of_each_text(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    texts = [" ".join(random_text(rng, int(k))) for k in rng.integers(0, 40, size=30)]
    texts += ["", "  ", "\t Lead AND\n\ntrail  ", "x\x1cY\x0bz", "Straße  X", "\u00a0lead", "ünï cödé"]
    monkeypatch.setattr(dedup, "_GROUP_BYTES", 100)  # many groups: texts must not leak across group bounds
    hasher = MinHasher(32, 5, "word", 3)
    got = scan_hashes(texts, hasher, 4)
    assert np.array_equal(got.signatures, np.stack([hasher.signatures([t])[0] for t in texts]))
    assert got.keys == [exact_key(t) for t in texts]
    assert got.gram_counts.tolist() == [len(ngram_hashes(t, 4)) for t in texts]
    assert np.array_equal(got.grams, np.concatenate([ngram_hashes(t, 4) for t in texts]))
    none = scan_hashes(texts, None, 0, keys=False)
    assert none.signatures.shape == (len(texts), 0) and not none.keys and not len(none.grams)


def test_batches_match_single_texts(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    texts = [" ".join(random_text(rng, int(k))) for k in rng.integers(0, 40, size=30)] + ["", "x y", "ünï cödé"]
    monkeypatch.setattr(dedup, "_GROUP_BYTES", 100)  # many groups: texts must not leak across group bounds
    for kind in ("word", "char"):
        hashes, counts = shingles_batch(texts, kind, 4)
        assert counts.tolist() == [len(shingles(t, kind, 4)) for t in texts]
        assert np.array_equal(hashes, np.concatenate([shingles(t, kind, 4) for t in texts]))
    # Whitespace of any kind and amount is one space, as str.split() sees it, whatever the neighbours are.
    messy = ["\t lead and\n\ntrail  ", "", "  ", "x\x1cy\u00a0z\u3000w", "Ünï \r\n cödé\x0b", "a\tb c  d e"]
    for kind in ("word", "char"):
        got = shingles_batch(messy, kind, 3)
        want = shingles_batch([" ".join(t.split()) for t in messy], kind, 3)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert got[1].tolist() == [len(shingles(t, kind, 3)) for t in messy]
    assert len(shingles("x\x1cy\u00a0z\u3000w", "word", 1)) == 4
    hasher = MinHasher(64, 3, "word", 4)
    batch = hasher.signatures(texts)
    assert batch.shape == (len(texts), 64) and batch.dtype == np.uint32
    assert np.array_equal(batch, np.concatenate([hasher.signatures([t]) for t in texts]))
    assert (batch[texts.index("")] == 0xFFFFFFFF).all()
    assert np.array_equal(batch, hasher.signatures(texts))  # deterministic across calls


def test_signature_agreement_estimates_jaccard() -> None:
    rng = np.random.default_rng(2)
    base = random_text(rng, 400)
    hasher = MinHasher(256, 7, "word", 5)
    for edits in (0, 5, 15, 40, 100, 250):
        copy = list(base)
        for pos in rng.choice(len(base), size=edits, replace=False):
            copy[pos] = f"new{pos}"
        a, b = " ".join(base), " ".join(copy)
        sig = hasher.signatures([a, b])
        estimate = float((sig[0] == sig[1]).mean())
        assert abs(estimate - exact_jaccard(a, b)) <= 0.1, (edits, estimate, exact_jaccard(a, b))
    # Permutations depend on the seed; the first k are shared by any num_perm.
    text = " ".join(base)
    assert not np.array_equal(MinHasher(64, 1).signatures([text]), MinHasher(64, 2).signatures([text]))
    assert np.array_equal(MinHasher(128, 1).signatures([text])[:, :64], MinHasher(64, 1).signatures([text]))


def test_lsh_params_match_datasketch_and_make_sense() -> None:
    from datasketch import MinHashLSH

    assert lsh_params(0.8, 128) == (9, 13)
    for threshold in (0.5, 0.7, 0.8, 0.9):
        for num_perm in (64, 128, 256):
            lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
            bands, rows = lsh_params(threshold, num_perm)
            assert (bands, rows) == (lsh.b, lsh.r)
            assert bands * rows <= num_perm
    # A stricter threshold needs more rows per band: the 50% point moves up with it.
    half = [(1 - 0.5 ** (1 / b)) ** (1 / r) for b, r in (lsh_params(t, 128) for t in (0.5, 0.7, 0.9))]
    assert half == sorted(half) and abs(half[1] - 0.7) < 0.06
    line = lsh_formula(9, 13)
    assert "b=9" in line and "r=13" in line and "50% at J = 0.82" in line and "\n" not in line
    with pytest.raises(DataError, match="threshold"):
        lsh_params(1.5, 128)


def test_near_duplicates_merge_and_unrelated_stay_apart(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    base = random_text(rng, 300)
    near = list(base)
    near[150] = "changed"  # J ≈ 0.97
    texts = [" ".join(random_text(rng, 300)), " ".join(near), " ".join(random_text(rng, 300)), " ".join(base),
             " ".join(base).upper()]
    signatures = MinHasher(128, 1, "word", 5).signatures(texts)
    bands, rows = lsh_params(0.8, 128)
    roots = near_duplicate_roots(signatures, bands, rows, 0.8)
    assert roots.tolist() == [0, 1, 2, 1, 1]  # the cluster's smallest index is its root
    assert roots.dtype == np.int64
    # Documents outside the alive mask take part in nothing.
    alive = np.array([True, False, True, True, True])
    assert near_duplicate_roots(signatures, bands, rows, 0.8, alive).tolist() == [0, 1, 2, 3, 3]
    # A memory-mapped signature file gives the same answer.
    mapped = np.memmap(tmp_path / "sig.bin", dtype=np.uint32, mode="w+", shape=signatures.shape)
    mapped[:] = signatures
    mapped.flush()
    reopened = np.memmap(tmp_path / "sig.bin", dtype=np.uint32, mode="r", shape=signatures.shape)
    assert near_duplicate_roots(reopened, bands, rows, 0.8).tolist() == [0, 1, 2, 1, 1]


def test_band_collisions_are_verified_and_outliers_do_not_break_chains() -> None:
    rng = np.random.default_rng(4)
    bands, rows, width = 4, 4, 32
    group = rng.integers(0, 1 << 32, size=width, dtype=np.uint32)
    sig = rng.integers(0, 1 << 32, size=(7, width), dtype=np.uint32)
    # Everyone shares band 0. Docs 1, 4 and 5 are a group agreeing on 24 of 32 entries with each other (each
    # has its own values in columns 20-21 and one of its own in each of bands 1-3, so only band 0 brings them
    # together); docs 0, 2, 3 and 6 are outliers agreeing with the rest on band 0 alone. The bucket's first
    # member is an outlier, and two outliers sit between the group's first and second members.
    sig[:, :rows] = group[:rows]
    for g, doc in enumerate((1, 4, 5)):
        sig[doc] = group
        sig[doc, 20:22] = rng.integers(0, 1 << 32, size=2, dtype=np.uint32)
        for band in range(1, bands):
            sig[doc, band * rows + g] ^= 1
    assert near_duplicate_roots(sig, bands, rows, 0.7).tolist() == [0, 1, 2, 3, 1, 1, 6]
    assert near_duplicate_roots(sig, bands, rows, 0.8).tolist() == list(range(7))  # 24/32 < 0.8


def test_union_find_keeps_the_smallest_root() -> None:
    sets = UnionFind(8)
    sets.union(np.array([7, 6, 5, 2]), np.array([6, 5, 3, 1]))
    assert sets.find(np.arange(8)).tolist() == [0, 1, 1, 3, 4, 3, 3, 3]
    sets.union(np.array([3]), np.array([2]))
    assert sets.find(np.arange(8)).tolist() == [0, 1, 1, 1, 4, 1, 1, 1]


def test_bad_arguments_raise_data_errors() -> None:
    with pytest.raises(DataError, match="word, char"):
        shingles("a", "sentence", 3)
    with pytest.raises(DataError, match="at least 1"):
        MinHasher(128, 1, "word", 0)
    with pytest.raises(DataError, match="bands × rows <= num_perm"):
        near_duplicate_roots(np.zeros((3, 16), dtype=np.uint32), 5, 4, 0.8)
    with pytest.raises(DataError, match=r"\(0, 1\]"):
        near_duplicate_roots(np.zeros((3, 16), dtype=np.uint32), 4, 4, 0.0)
    with pytest.raises(DataError, match="alive"):
        near_duplicate_roots(np.zeros((3, 16), dtype=np.uint32), 4, 4, 0.8, np.ones(2, dtype=bool))


def test_quality_on_planted_pairs_matches_datasketch() -> None:
    texts, pairs = BENCH.make_corpus(4000, seed=5, pair_share=0.75)
    high = [p for p in pairs if p[2] >= 0.9]
    low = [p for p in pairs if p[2] <= 0.5]
    assert len(high) >= 500 and len(low) >= 500
    for i, j, sim in pairs[:40]:  # the recorded similarity is the exact word-5-gram Jaccard keel sees
        assert abs(exact_jaccard(texts[i], texts[j]) - sim) < 1e-12
    params = lsh_params(0.8, 128)
    keel_roots, _ = BENCH.keel_roots(texts, 128, 0.8, params)
    sketch_roots, _ = BENCH.datasketch_roots(texts, 128, 0.8, params)
    keel, sketch = BENCH.quality(keel_roots, pairs), BENCH.quality(sketch_roots, pairs)
    assert keel["recall_j_ge_0.9"] >= 0.95
    assert keel["precision_j_le_0.5"] >= 0.99
    assert keel["unplanted_merged"] == 0
    assert abs(keel["recall_j_ge_0.9"] - sketch["recall_j_ge_0.9"]) <= 0.02
    assert abs(keel["precision_j_le_0.5"] - sketch["precision_j_le_0.5"]) <= 0.02
