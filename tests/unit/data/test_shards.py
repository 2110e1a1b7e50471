"""open_corpus: a prepared corpus opens as read-only memmaps; any damage is refused, never repaired."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keel.config import CleanConfig, DataConfig, DecontamConfig, DedupConfig, SourceConfig
from keel.data import shards
from keel.data.prepare import prepare
from keel.data.shards import MANIFEST, VERIFIED_ENV, open_corpus
from keel.data.tokenizer import ByteTokenizer
from keel.errors import DataError
from tests.conftest import keel_env

BOS, EOS = ByteTokenizer.bos, ByteTokenizer.eos


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def split_documents(tokens: np.ndarray) -> list[bytes]:
    starts, ends = np.nonzero(tokens == BOS)[0], np.nonzero(tokens == EOS)[0]
    assert len(starts) == len(ends) and starts[0] == 0 and ends[-1] == len(tokens) - 1
    assert np.array_equal(starts[1:], ends[:-1] + 1)
    return [bytes(tokens[s + 1:e].astype(np.uint8)) for s, e in zip(starts, ends, strict=True)]


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[bytes]]:
    """A corpus of 40 documents given as an ordered file list, with tiny shards so that each split
    spans several files: the order of documents in the shards is then the order of the sources."""
    src = tmp_path / "src"
    src.mkdir()
    docs, files = [], []
    for i in range(40):
        path = src / f"doc{i:02d}.txt"
        body = f"document {i}: " + "é" * (i % 7) + "abc" * i + "\n"
        path.write_text(body, encoding="utf-8")
        docs.append(body.encode())
        files.append(str(path))
    out = tmp_path / "corpus"
    # cleaning and dedup off: the shards hold exactly these documents, in this order
    prepare(DataConfig(sources={"main": SourceConfig(paths=files)}, val_fraction=0.25, shard_tokens=200,
                       clean=CleanConfig(enabled=False), dedup=DedupConfig(exact=False, near=False),
                       decontam=DecontamConfig(enabled=False)), out)
    return out, docs


def first_shard(out: Path) -> Path:
    return out / json.loads((out / MANIFEST).read_text())["files"][0]["name"]


def test_open_decodes_back_to_documents(corpus):
    out, docs = corpus
    c = open_corpus(out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert c.manifest == manifest and c.fingerprint == manifest["fingerprint"] and c.vocab_size == 259
    assert len(c.splits["train"]) > 1 and len(c.splits["val"]) >= 1  # several shards, in manifest order
    for split in ("train", "val"):
        for shard in c.splits[split]:
            assert isinstance(shard, np.memmap) and shard.dtype == np.uint16 and not shard.flags.writeable
    train = split_documents(np.concatenate(c.splits["train"]))
    val = split_documents(np.concatenate(c.splits["val"]))
    assert sorted(train + val) == sorted(docs)
    # within a split, documents keep source order
    assert train == [d for d in docs if d in train] and val == [d for d in docs if d in val]
    assert len(train) == manifest["documents"]["train"] and len(val) == manifest["documents"]["val"]
    assert sum(len(s) for s in c.splits["train"]) == manifest["tokens"]["train"]


def test_truncated_shard(corpus):
    out, _ = corpus
    shard = first_shard(out)
    os.truncate(shard, shard.stat().st_size - 2)  # one token short
    before = snapshot(out)
    for verify in (True, False):  # the size check does not depend on checksums
        with pytest.raises(DataError, match="truncated") as e:
            open_corpus(out, verify_checksums=verify)
        assert shard.name in str(e.value) and "\n" not in str(e.value)
    assert snapshot(out) == before


def test_flipped_byte_fails_sha256(corpus):
    out, _ = corpus
    shard = first_shard(out)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit different
    shard.write_bytes(bytes(data))
    before = snapshot(out)
    with pytest.raises(DataError, match="sha256") as e:
        open_corpus(out)
    assert shard.name in str(e.value)
    assert snapshot(out) == before
    # without verification the size check passes and the altered bytes are what is read
    c = open_corpus(out, verify_checksums=False)
    assert bytes(c.splits["train"][0].tobytes()) == bytes(data)
    assert snapshot(out) == before


def counted_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shards hashed from now on, in a job that has verified nothing yet."""
    monkeypatch.setenv(VERIFIED_ENV, "")
    hashed: list[str] = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    return hashed


def test_a_job_hashes_its_corpus_once_and_again_when_a_shard_changes(corpus, monkeypatch):
    out, _ = corpus
    hashed = counted_hashes(monkeypatch)
    open_corpus(out)
    names = [f["name"] for f in json.loads((out / MANIFEST).read_text())["files"]]
    assert sorted(hashed) == sorted(names)
    open_corpus(out)  # the same process again (a one-process run opens it twice)
    assert sorted(hashed) == sorted(names)
    # A worker inherits the launcher's environment: it opens the corpus without hashing a shard.
    opens_without_hashing = "import sys, keel.data.shards as s; s.sha256_file = None; s.open_corpus(sys.argv[1])"
    worker = subprocess.run([sys.executable, "-c", opens_without_hashing, str(out)], env=keel_env(),
                            capture_output=True, text=True)
    assert worker.returncode == 0, worker.stderr
    unverified = subprocess.run([sys.executable, "-c", opens_without_hashing, str(out)],
                                env={**keel_env(), VERIFIED_ENV: ""}, capture_output=True, text=True)
    assert unverified.returncode != 0 and "TypeError" in unverified.stderr  # without the key it hashes
    # A shard replaced under the job (same size, other bytes) no longer matches the key: hashed, refused.
    shard = first_shard(out)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256") as e:
        open_corpus(out)
    assert shard.name in str(e.value) and "\n" not in str(e.value)
    assert hashed.count(shard.name) == 2


def test_missing_shard(corpus):
    out, _ = corpus
    first_shard(out).unlink()
    before = snapshot(out)
    with pytest.raises(DataError, match="missing"):
        open_corpus(out)
    assert snapshot(out) == before


def test_missing_directory(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        open_corpus(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()


def test_missing_manifest(corpus):
    out, _ = corpus
    (out / MANIFEST).unlink()
    before = snapshot(out)
    with pytest.raises(DataError, match="no manifest.json"):
        open_corpus(out)
    assert snapshot(out) == before


@pytest.mark.parametrize("text", ["{not json", "", "{}", "[]", '{"files": []}'])
def test_invalid_manifest(corpus, text):
    out, _ = corpus
    (out / MANIFEST).write_text(text)
    before = snapshot(out)
    with pytest.raises(DataError, match="not a valid corpus manifest") as e:
        open_corpus(out)
    assert "\n" not in str(e.value)
    assert snapshot(out) == before
