"""`keel data prepare`: sources → documents → shards + manifest, checked against inputs built here."""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import keel.data.prepare as prepare_module
from keel.config import CleanConfig, DataConfig, DecontamConfig, DedupConfig, SourceConfig
from keel.data.prepare import prepare, stdlib_files, unigram_entropy
from keel.data.shards import MANIFEST
from keel.data.tokenizer import ByteTokenizer
from keel.errors import DataError

BOS, EOS = ByteTokenizer.bos, ByteTokenizer.eos
VAL_FRACTION = 0.3
DUPLICATE = "the same document, twice: once as a .txt file, once as a .jsonl line\n"


def passthrough(paths: list, val_fraction: float = VAL_FRACTION, **kw) -> DataConfig:
    """Cleaning, dedup and decontamination off: every document reaches the shards as it was read."""
    return DataConfig(sources={"main": SourceConfig(paths=[str(p) for p in paths])}, val_fraction=val_fraction,
                      clean=CleanConfig(enabled=False), dedup=DedupConfig(exact=False, near=False),
                      decontam=DecontamConfig(enabled=False), **kw)


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


def split_tokens(out: Path, manifest: dict, split: str, source: str | None = None) -> np.ndarray:
    parts = [np.fromfile(out / f["name"], dtype=manifest["dtype"]) for f in manifest["files"]
             if f["split"] == split and source in (None, f["source"])]
    return np.concatenate(parts)


def no_leftovers(parent: Path) -> bool:
    """No half-built `<out>.tmp`, replaced `<out>.old` or unfinished work directory beside the output."""
    return not [p for p in parent.iterdir() if ".tmp" in p.name or ".old" in p.name or ".work-" in p.name]


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every file under `directory`: content hash and mtime, to prove nothing was touched."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def contents(directory: Path) -> dict[str, str]:
    return {k: v[0] for k, v in snapshot(directory).items()}


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, list[bytes]]:
    return make_sources(tmp_path / "src")


def test_counts_shards_and_checksums_match_inputs(sources, tmp_path):
    src, docs = sources
    out = tmp_path / "corpus"
    manifest = prepare(passthrough([src]), out)

    val = [d for d in docs if expected_in_val(d)]
    train = [d for d in docs if not expected_in_val(d)]
    assert val and train, "fixture must populate both splits"
    assert manifest["documents"] == {"train": len(train), "val": len(val)}
    # byte tokenizer: BOS + bytes + EOS per document
    assert manifest["tokens"] == {"train": sum(len(d) + 2 for d in train), "val": sum(len(d) + 2 for d in val)}
    assert manifest["text_bytes"] == {"train": sum(len(d) for d in train), "val": sum(len(d) for d in val)}
    assert manifest["source_files"] == 6  # ignored.bin is not a source
    assert manifest["source_bytes"] == sum(len(d) for d in docs)
    assert manifest["dtype"] == "uint16"

    # the directory holds exactly the listed shards, the manifest (the returned one) and the statistics
    listed = [f["name"] for f in manifest["files"]]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted([*listed, MANIFEST, "stats.json"])
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
    a = prepare(passthrough([src]), tmp_path / "one")
    b = prepare(passthrough([src]), tmp_path / "two")
    assert a["fingerprint"] == b["fingerprint"] and a["prepare_fingerprint"] == b["prepare_fingerprint"]
    assert len(a["fingerprint"]) == 64
    # ...and it depends on the content: one changed byte changes it
    (src / "a.txt").write_text("plain text, naïve UTF-8 !\n", encoding="utf-8")
    c = prepare(passthrough([src]), tmp_path / "three")
    assert c["fingerprint"] != a["fingerprint"] and c["prepare_fingerprint"] != a["prepare_fingerprint"]


def test_split_follows_document_hash_not_file_order(sources, tmp_path):
    src, docs = sources
    files = [p for p in sorted(src.rglob("*")) if p.suffix in (".txt", ".py", ".md", ".jsonl")]
    fwd = prepare(passthrough(files), tmp_path / "fwd")
    rev = prepare(passthrough(files[::-1]), tmp_path / "rev")
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
    first = prepare(passthrough([src]), out)
    before = snapshot(out)
    again = prepare(passthrough([src]), out, force=True)  # force never rebuilds an identical corpus
    assert again == first
    assert snapshot(out) == before  # same content and same mtimes: nothing rewritten


def test_other_sources_need_force_and_a_failed_prepare_overwrites_nothing(sources, tmp_path):
    src, _ = sources
    out = tmp_path / "corpus"
    first = prepare(passthrough([src]), out)
    before = snapshot(out)
    other, other_docs = make_sources(tmp_path / "other")
    (other / "extra.txt").write_text("one more document\n")
    other_docs.append(b"one more document\n")

    with pytest.raises(DataError, match="force"):
        prepare(passthrough([other]), out)
    # a different val_fraction is different settings too
    with pytest.raises(DataError, match="force"):
        prepare(passthrough([src], val_fraction=0.5), out)
    # a forced prepare that fails (no validation document at all) leaves the old corpus as it was
    with pytest.raises(DataError, match="both splits"):
        prepare(passthrough([other], val_fraction=1e-9), out, force=True)
    assert snapshot(out) == before

    replaced = prepare(passthrough([other]), out, force=True)
    assert replaced["prepare_fingerprint"] != first["prepare_fingerprint"]
    assert replaced["documents"]["train"] + replaced["documents"]["val"] == len(other_docs)
    decoded = [d for s in ("train", "val") for d in split_documents(split_tokens(out, replaced, s))]
    assert sorted(decoded) == sorted(other_docs)
    assert json.loads((out / MANIFEST).read_text()) == replaced
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name or ".old" in p.name]


def test_non_corpus_nonempty_out_refused(sources, tmp_path):
    src, _ = sources
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(DataError, match="not a prepared corpus"):
        prepare(passthrough([src]), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("make", ["missing", "empty_file", "unsupported", "no_text_files"])
def test_bad_source_is_a_one_line_error_naming_it(tmp_path, make):
    bad = tmp_path / "bad"
    if make == "empty_file":
        bad = tmp_path / "empty.txt"
        bad.write_text("")
    elif make == "unsupported":
        bad = tmp_path / "table.csv"
        bad.write_text("a,b\n1,2\n")
    elif make == "no_text_files":
        (bad / "sub").mkdir(parents=True)
        (bad / "sub" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError) as e:
        prepare(passthrough([bad]), tmp_path / "out")
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


@pytest.mark.parametrize("bad", ['{"txt": "no text field"}', '{"text": 7}', "not json at all", '["text"]'])
def test_malformed_jsonl_line_is_counted_by_file_and_line_and_the_prepare_goes_on(tmp_path, bad):
    path = tmp_path / "docs.jsonl"
    good = [f"good document number {i} with enough words to pass every filter" for i in range(20)]
    # lines 1-10 good, line 11 blank, line 12 bad, lines 13-22 good
    lines = [json.dumps({"text": t}) for t in good[:10]] + ["", bad] + [json.dumps({"text": t}) for t in good[10:]]
    path.write_text("\n".join(lines) + "\n")
    manifest = prepare(passthrough([path], val_fraction=0.3), tmp_path / "out")
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["malformed"] == 1 and stats["malformed_lines"][0].startswith(f"{path}:12:")
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 20


def test_one_split_empty_is_refused(tmp_path):
    # a tiny val_fraction sends every document to train: the corpus would have no validation split
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for i, path in enumerate(paths):
        path.write_text(f"document number {i}\n")
    with pytest.raises(DataError, match="both splits"):
        prepare(passthrough(paths, val_fraction=1e-9), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert not [p for p in tmp_path.iterdir() if ".work" in p.name], "work that no run can use is removed"


def test_a_single_text_file_is_refused_before_anything_is_written(tmp_path):
    # a text file is one document: it cannot fill a training and a validation split
    path = tmp_path / "a.txt"
    path.write_text("only document\n")
    with pytest.raises(DataError, match="the sources hold one document, the text file"):
        prepare(passthrough([path]), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def prose(rng: np.random.Generator, words: int) -> str:
    """Random words of 3–8 letters: text that every cleaning filter keeps and that no two calls share."""
    return " ".join("".join(rng.choice(LETTERS, rng.integers(3, 9))) for _ in range(words)) + "."


def test_exact_and_near_duplicates_are_removed_across_sources_and_counted(tmp_path):
    rng = np.random.default_rng(0)
    originals = [prose(rng, 300) for _ in range(30)]
    near = []
    for doc in originals[:5]:  # 3 words of 300 changed: Jaccard of word 5-grams about 0.9
        words = doc.split(" ")
        for i in (50, 150, 250):
            words[i] = "changed"
        near.append(" ".join(words))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in originals))
    # source b: 4 exact copies (one with other case and spacing) and the 5 near copies
    copies = originals[10:13] + ["  " + originals[13].upper().replace(" ", "\n ") + " "]
    (tmp_path / "b" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in copies + near))
    data = DataConfig(sources={"a": SourceConfig(paths=[str(tmp_path / "a")]),
                               "b": SourceConfig(paths=[str(tmp_path / "b")])}, val_fraction=0.1)
    manifest = prepare(data, tmp_path / "out")
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["documents_in"] == 39
    assert (stats["exact_duplicates"], stats["near_duplicates"]) == (4, 5)
    assert stats["documents_out"] == 30 == manifest["documents"]["train"] + manifest["documents"]["val"]
    assert stats["sources"]["b"]["train_documents"] + stats["sources"]["b"]["val_documents"] == 0
    assert stats["lsh"]["bands"] * stats["lsh"]["rows"] <= 128 and "J" in stats["lsh"]["formula"]
    removed = [json.loads(line) for line in (tmp_path / "out" / "removed" / "near_duplicate.jsonl").open()]
    assert len(removed) == 5 and all(r["kept"].startswith(str(tmp_path / "a")) for r in removed)


def test_training_documents_sharing_a_13_gram_with_an_eval_file_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "TASK_BYTES", 1)  # a task per file, in two worker processes
    rng = np.random.default_rng(1)
    benchmark = prose(rng, 40).split(" ")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": " ".join(benchmark)}) + "\n")
    docs = [prose(rng, 100) for _ in range(40)]
    thirteen, twelve = " " + " ".join(benchmark[10:23]), " " + " ".join(benchmark[10:22])
    # two documents that land in the training split (validation documents are protected, never removed)
    a = next(i for i, d in enumerate(docs) if not expected_in_val((d + thirteen).encode(), 0.1))
    b = next(i for i, d in enumerate(docs) if i != a and not expected_in_val((d + twelve).encode(), 0.1))
    docs[a] += thirteen  # 13 words of the benchmark: contaminated
    docs[b] += twelve  # 12 words: not
    (tmp_path / "train").mkdir()
    for i in range(0, len(docs), 10):
        lines = "".join(json.dumps({"text": t}) + "\n" for t in docs[i:i + 10])
        (tmp_path / "train" / f"{i:02d}.jsonl").write_text(lines)
    data = DataConfig(sources={"main": SourceConfig(paths=[str(tmp_path / "train")])}, val_fraction=0.1, workers=2,
                      decontam=DecontamConfig(eval_files=[str(tmp_path / "eval.jsonl")]))
    out = tmp_path / "out"
    prepare(data, out)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["decontaminated"] == 1 and stats["contamination"]["eval_files"] == 1
    kept = split_documents(split_tokens(out, json.loads((out / MANIFEST).read_text()), "train"))
    assert docs[a].encode() not in kept and docs[b].encode() in kept
    sample = json.loads((out / "removed" / "decontaminated.jsonl").read_text().splitlines()[0])
    assert sample == {"origin": f"{tmp_path / 'train' / f'{a // 10 * 10:02d}.jsonl'}#{a % 10}", "text": docs[a][:2000]}


def test_named_sources_get_their_own_shards(tmp_path):
    rng = np.random.default_rng(2)
    for name in ("web", "code"):
        (tmp_path / name).mkdir()
        for i in range(8):
            (tmp_path / name / f"{i}.txt").write_text(f"{name} " + prose(rng, 60))
    data = DataConfig(sources={n: SourceConfig(paths=[str(tmp_path / n)]) for n in ("web", "code")},
                      val_fraction=0.2)
    manifest = prepare(data, tmp_path / "out")
    assert list(manifest["sources"]) == ["web", "code"]
    for name in ("web", "code"):
        docs = split_documents(split_tokens(tmp_path / "out", manifest, "train", name))
        assert docs and all(d.startswith(f"{name} ".encode()) for d in docs)


def test_a_source_bounded_by_length_keeps_only_its_documents_and_counts_the_rest(tmp_path):
    """Two sources over the same files split them by length (a context-extension mixture's short and long
    documents): each document lands in exactly one, and what a source leaves out is counted."""
    src = tmp_path / "src"
    src.mkdir()
    lengths = [40, 90, 150, 400, 999, 1000, 1001, 3000]
    for i, n in enumerate(lengths):
        (src / f"{i}.txt").write_text((f"document {i} " * 400)[:n])
    bounded = {"short": SourceConfig(paths=[str(src)], max_chars=1000),
               "long": SourceConfig(paths=[str(src)], min_chars=1001)}
    data = passthrough([src])
    data.sources = bounded
    out = tmp_path / "out"
    manifest = prepare(data, out)
    found = {name: [len(d) for split in ("train", "val") if any(
        f["source"] == name and f["split"] == split for f in manifest["files"])
        for d in split_documents(split_tokens(out, manifest, split, name))] for name in bounded}
    assert sorted(found["short"]) == [n for n in lengths if n <= 1000]
    assert sorted(found["long"]) == [n for n in lengths if n > 1000]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["outside_source_length"] == len(lengths)  # each file, left to the other source
    assert stats["documents_in"] == len(lengths) and stats["source_bytes"] == sum(lengths)
    unbounded = prepare(passthrough([src]), tmp_path / "plain")
    assert unbounded["prepare_fingerprint"] != manifest["prepare_fingerprint"]


def test_output_is_byte_identical_with_one_or_two_workers(tmp_path):
    rng = np.random.default_rng(3)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.jsonl").write_text("".join(json.dumps({"text": prose(rng, 80)}) + "\n" for _ in range(20)))
    one = prepare(DataConfig(sources={"main": SourceConfig(paths=[str(src)])}, workers=1), tmp_path / "one")
    two = prepare(DataConfig(sources={"main": SourceConfig(paths=[str(src)])}, workers=2), tmp_path / "two")
    assert one == two
    assert contents(tmp_path / "one") == contents(tmp_path / "two")
    assert no_leftovers(tmp_path)


def test_bpe_tokenizer_is_trained_stored_and_fingerprinted(tmp_path):
    rng = np.random.default_rng(4)
    src = tmp_path / "docs.jsonl"
    vocabulary = prose(rng, 100).split(" ")  # documents of 100 recurring words: what BPE learns to pack
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(vocabulary, 60))}) + "\n" for _ in range(60)))
    out = tmp_path / "out"
    data = DataConfig(sources={"main": SourceConfig(paths=[str(src)])}, tokenizer="bpe:400", val_fraction=0.1)
    manifest = prepare(data, out)
    described = manifest["tokenizer"]
    assert described["vocab_size"] == 400 and described["sha256"] == hashlib.sha256(
        (out / "tokenizer.json").read_bytes()).hexdigest()
    from keel.data.tokenizer import open_tokenizer

    tokenizer = open_tokenizer(out, described)
    tokens = split_tokens(out, manifest, "train")
    starts = np.nonzero(tokens == described["bos"])[0]
    assert len(starts) == manifest["documents"]["train"]
    first = tokenizer.decode(tokens[starts[0]:starts[1]])
    assert first in src.read_text() and len(first) > 100
    assert manifest["tokens"]["train"] < 0.6 * manifest["text_bytes"]["train"]  # BPE packs several bytes a token


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


def test_a_zstd_compressed_jsonl_file_gives_the_same_shards_as_plain_jsonl(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    rng = np.random.default_rng(4)
    lines = "".join(json.dumps({"text": prose(rng, 80)}) + "\n" for _ in range(60)).encode()
    (tmp_path / "plain").mkdir()
    (tmp_path / "zst").mkdir()
    (tmp_path / "plain" / "docs.jsonl").write_bytes(lines)
    (tmp_path / "zst" / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    plain = prepare(DataConfig(sources={"main": SourceConfig(paths=[str(tmp_path / "plain")])}, val_fraction=0.2),
                    tmp_path / "p")
    zst = prepare(DataConfig(sources={"main": SourceConfig(paths=[str(tmp_path / "zst")])}, val_fraction=0.2),
                  tmp_path / "z")
    shards = {name: data for name, data in contents(tmp_path / "p").items() if name.endswith(".bin")}
    assert shards and shards == {n: d for n, d in contents(tmp_path / "z").items() if n.endswith(".bin")}
    assert (plain["documents"], plain["tokens"], plain["fingerprint"]) == (zst["documents"], zst["tokens"],
                                                                          zst["fingerprint"])  # the same corpus
