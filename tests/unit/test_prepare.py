"""`keel data prepare`: sources → documents → shards + manifest, checked against inputs built here."""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from keel.data.prepare import prepare, stdlib_files, unigram_entropy
from keel.data.shards import MANIFEST
from keel.data.tokenizer import ByteTokenizer
from keel.errors import DataError

BOS, EOS = ByteTokenizer.bos, ByteTokenizer.eos
VAL_FRACTION = 0.3
DUPLICATE = "the same document, twice: once as a .txt file, once as a .jsonl line\n"


def expected_in_val(doc: bytes, val_fraction: float = VAL_FRACTION) -> bool:
    """The documented rule, restated independently: the first 8 bytes of sha256(doc), little-endian,
    modulo 10^6, below val_fraction × 10^6."""
    return int.from_bytes(hashlib.sha256(doc).digest()[:8], "little") % 1_000_000 < val_fraction * 1_000_000


def make_sources(root: Path) -> tuple[Path, list[bytes]]:
    """A directory of every supported kind (and one ignored kind), nested; returns it and its documents."""
    root.mkdir(parents=True)
    docs: list[bytes] = []

    def text(rel: str, body: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
        docs.append(body.encode())

    text("a.txt", "plain text, naïve UTF-8 ✓\n")
    text("b.py", "def f(x):\n    return x + 1\n")
    text("c.md", "# Title\n\nSome *markdown*.\n")
    text("nested/deeper/d.txt", "a file two directories down\n")
    text("nested/dup.txt", DUPLICATE)
    lines = [f"jsonl document number {i}: " + "xyz" * i for i in range(30)] + [DUPLICATE]
    body = "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(lines[:15]))
    body += "\n\n"  # a blank line is skipped, not a document
    body += "\n".join(json.dumps({"text": t}) for t in lines[15:]) + "\n"
    (root / "nested" / "e.jsonl").write_text(body, encoding="utf-8")
    docs += [t.encode() for t in lines]
    (root / "nested" / "ignored.bin").write_bytes(b"\x00\x01 not a supported suffix")
    return root, docs


def split_documents(tokens: np.ndarray) -> list[bytes]:
    """Cut BOS … EOS runs back into documents; every token must belong to one."""
    tokens = np.asarray(tokens)
    starts, ends = np.nonzero(tokens == BOS)[0], np.nonzero(tokens == EOS)[0]
    assert len(starts) == len(ends) and (len(starts) == 0 or (starts[0] == 0 and ends[-1] == len(tokens) - 1))
    assert np.array_equal(starts[1:], ends[:-1] + 1), "tokens outside a BOS … EOS document"
    return [bytes(tokens[s + 1:e].astype(np.uint8)) for s, e in zip(starts, ends, strict=True)]


def split_tokens(out: Path, manifest: dict, split: str) -> np.ndarray:
    parts = [np.fromfile(out / f["name"], dtype=manifest["dtype"]) for f in manifest["files"] if f["split"] == split]
    return np.concatenate(parts)


def no_leftovers(parent: Path) -> bool:
    """No half-built `<out>.tmp` or replaced `<out>.old` beside the output (a `.lock` file may stay)."""
    return not [p for p in parent.iterdir() if p.suffix in (".tmp", ".old")]


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under `directory`: content hash and mtime, to prove nothing was touched."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, list[bytes]]:
    return make_sources(tmp_path / "src")


def test_counts_shards_and_checksums_match_inputs(sources, tmp_path):
    src, docs = sources
    out = tmp_path / "corpus"
    manifest = prepare([str(src)], out, val_fraction=VAL_FRACTION)

    val = [d for d in docs if expected_in_val(d)]
    train = [d for d in docs if not expected_in_val(d)]
    assert val and train, "fixture must populate both splits"
    assert manifest["documents"] == {"train": len(train), "val": len(val)}
    # byte tokenizer: BOS + bytes + EOS per document
    assert manifest["tokens"] == {"train": sum(len(d) + 2 for d in train), "val": sum(len(d) + 2 for d in val)}
    assert manifest["source_files"] == 6  # ignored.bin is not a source
    assert manifest["source_bytes"] == sum(len(d) for d in docs)
    assert manifest["dtype"] == "uint16"

    # the directory holds exactly the listed shards and the manifest, which is the returned one
    assert sorted(p.name for p in out.iterdir()) == sorted([f["name"] for f in manifest["files"]] + [MANIFEST])
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert no_leftovers(tmp_path)
    for entry in manifest["files"]:
        data = (out / entry["name"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["tokens"] * 2 == len(data)

    # the shards hold the documents themselves, each in its split
    assert sorted(split_documents(split_tokens(out, manifest, "train"))) == sorted(train)
    assert sorted(split_documents(split_tokens(out, manifest, "val"))) == sorted(val)
    counts = np.bincount(split_tokens(out, manifest, "train"))
    assert manifest["stats"]["unigram_entropy_nats"] == pytest.approx(unigram_entropy(counts))


def test_fingerprint_stable_across_output_dirs(sources, tmp_path):
    src, _ = sources
    a = prepare([str(src)], tmp_path / "one", val_fraction=VAL_FRACTION)
    b = prepare([str(src)], tmp_path / "two", val_fraction=VAL_FRACTION)
    assert a["fingerprint"] == b["fingerprint"] and a["source_fingerprint"] == b["source_fingerprint"]
    assert len(a["fingerprint"]) == 64
    # ...and it depends on the content: one changed byte changes it
    (src / "a.txt").write_text("plain text, naïve UTF-8 !\n", encoding="utf-8")
    c = prepare([str(src)], tmp_path / "three", val_fraction=VAL_FRACTION)
    assert c["fingerprint"] != a["fingerprint"] and c["source_fingerprint"] != a["source_fingerprint"]


def test_split_follows_document_hash_not_file_order(sources, tmp_path):
    src, docs = sources
    files = [str(p) for p in sorted(src.rglob("*")) if p.suffix in (".txt", ".py", ".md", ".jsonl")]
    fwd = prepare(files, tmp_path / "fwd", val_fraction=VAL_FRACTION)
    rev = prepare(files[::-1], tmp_path / "rev", val_fraction=VAL_FRACTION)
    for split in ("train", "val"):
        a = split_documents(split_tokens(tmp_path / "fwd", fwd, split))
        b = split_documents(split_tokens(tmp_path / "rev", rev, split))
        assert sorted(a) == sorted(b)
        assert all(expected_in_val(d) == (split == "val") for d in a)
    # the same document, from two different files, lands twice in one split and never in the other
    in_val = split_documents(split_tokens(tmp_path / "fwd", fwd, "val")).count(DUPLICATE.encode())
    in_train = split_documents(split_tokens(tmp_path / "fwd", fwd, "train")).count(DUPLICATE.encode())
    assert sorted([in_val, in_train]) == [0, 2]


def test_rerun_same_sources_keeps_corpus(sources, tmp_path):
    src, _ = sources
    out = tmp_path / "corpus"
    first = prepare([str(src)], out, val_fraction=VAL_FRACTION)
    before = snapshot(out)
    again = prepare([str(src)], out, val_fraction=VAL_FRACTION)
    assert again == first
    assert snapshot(out) == before  # same content and same mtimes: nothing rewritten


def test_other_sources_need_force(sources, tmp_path):
    src, _ = sources
    out = tmp_path / "corpus"
    first = prepare([str(src)], out, val_fraction=VAL_FRACTION)
    before = snapshot(out)
    other, other_docs = make_sources(tmp_path / "other")
    (other / "extra.txt").write_text("one more document\n")
    other_docs.append(b"one more document\n")

    with pytest.raises(DataError, match="force"):
        prepare([str(other)], out, val_fraction=VAL_FRACTION)
    # a different val_fraction is different settings too
    with pytest.raises(DataError, match="force"):
        prepare([str(src)], out, val_fraction=0.5)
    assert snapshot(out) == before
    assert no_leftovers(tmp_path)

    replaced = prepare([str(other)], out, val_fraction=VAL_FRACTION, force=True)
    assert replaced["source_fingerprint"] != first["source_fingerprint"]
    assert replaced["documents"]["train"] + replaced["documents"]["val"] == len(other_docs)
    decoded = [d for s in ("train", "val") for d in split_documents(split_tokens(out, replaced, s))]
    assert sorted(decoded) == sorted(other_docs)
    assert json.loads((out / MANIFEST).read_text()) == replaced
    assert no_leftovers(tmp_path)


def test_non_corpus_nonempty_out_refused(sources, tmp_path):
    src, _ = sources
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(DataError, match="not a prepared corpus"):
        prepare([str(src)], out, val_fraction=VAL_FRACTION)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_missing_source_is_one_line_error(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="does not exist") as e:
        prepare([str(missing)], tmp_path / "out")
    assert str(missing) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


@pytest.mark.parametrize("bad", ['{"txt": "no text field"}', '{"text": 7}', "not json at all", '["text"]'])
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad):
    path = tmp_path / "docs.jsonl"
    # line 1 good, line 2 blank (still counted), line 3 bad
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + bad + "\n")
    with pytest.raises(DataError) as e:
        prepare([str(path)], tmp_path / "out", val_fraction=0.5)
    assert f"{path}:3:" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="unsupported"):
        prepare([str(path)], tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_directory_without_text_files(tmp_path):
    empty = tmp_path / "data"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "image.png").write_bytes(b"\x89PNG")
    (empty / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="hold no"):
        prepare([str(empty)], tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_one_split_empty_is_refused(tmp_path):
    # val_fraction 0 sends every document to train: the corpus would have no validation split
    path = tmp_path / "a.txt"
    path.write_text("only document\n")
    with pytest.raises(DataError, match="both splits"):
        prepare([str(path)], tmp_path / "out", val_fraction=0.0)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


@pytest.mark.parametrize(("counts", "expected"), [
    ([5, 5, 5, 5], math.log(4)),
    ([0, 3, 0, 3, 3, 3, 0], math.log(4)),  # zero counts contribute nothing
    ([0, 9, 0], 0.0),
    ([1, 3], -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))),
])
def test_unigram_entropy(counts, expected):
    assert unigram_entropy(np.array(counts)) == pytest.approx(expected, abs=1e-12)


def test_stdlib_files_are_stdlib_python():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert files and files == sorted(files)
    assert all(p.suffix == ".py" and p.is_file() for p in files)
    assert all(p.is_relative_to(root) for p in files)
    assert not any({"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts) for p in files)
    assert root / "json" / "__init__.py" in files
