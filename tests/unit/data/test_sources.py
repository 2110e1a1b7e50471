"""Input sources: which files each source resolves to, how documents stream out of them, and the errors."""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from keel.data import sources
from keel.data.sources import InputFile, damage, read_documents, resolve_inputs
from keel.errors import DataError


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def docs_of(f: InputFile, field: str = "text") -> tuple[list[str], list[str]]:
    malformed: list[str] = []
    return list(read_documents(f, field, malformed)), malformed


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write(tmp_path / "corpus/b.md", "# B\n")
    write(tmp_path / "corpus/a.txt", "a\n")
    write(tmp_path / "corpus/sub/c.py", "x = 1\n")
    write(tmp_path / "corpus/sub/d.jsonl", '{"text": "d"}\n')
    write(tmp_path / "corpus/sub/e.rst", "E\n=\n")  # unsupported: skipped inside a directory
    write(tmp_path / "corpus/notes.csv", "a,b\n")
    write(tmp_path / "corpus/.git/config.txt", "hidden\n")  # hidden directories are skipped
    write(tmp_path / "corpus/sub/__init__.py", "")  # an empty file inside a directory: an empty document
    return tmp_path


def test_directory_is_walked_recursively_in_sorted_order(tree: Path) -> None:
    inputs = resolve_inputs({"main": [str(tree / "corpus")]})
    assert [f.path.relative_to(tree / "corpus").as_posix() for f in inputs] == [
        "a.txt", "b.md", "sub/__init__.py", "sub/c.py", "sub/d.jsonl"]
    assert [f.kind for f in inputs] == ["text", "text", "text", "text", "jsonl"]
    assert [f.is_code for f in inputs] == [False, False, True, True, False]
    assert inputs[0].size == 2 and {f.source for f in inputs} == {"main"}


def test_sources_keep_their_order_and_globs_expand(tree: Path) -> None:
    inputs = resolve_inputs({"code": [str(tree / "corpus/**/*.py")],
                             "prose": [str(tree / "corpus/*.md"), str(tree / "corpus/a.txt")]})
    assert [(f.source, f.path.name) for f in inputs] == [("code", "__init__.py"), ("code", "c.py"), ("prose", "b.md"),
                                                         ("prose", "a.txt")]
    # A file reached twice within one source is read once.
    twice = resolve_inputs({"main": [str(tree / "corpus/a.txt"), str(tree / "corpus/[ab].*")]})
    assert [f.path.name for f in twice] == ["a.txt", "b.md"]


def test_stdlib_source() -> None:
    inputs = resolve_inputs({"std": ["stdlib"]})
    assert len(inputs) > 500 and all(f.is_code for f in inputs)
    assert any(f.path.name == "os.py" for f in inputs)


@pytest.mark.parametrize("entry, message", [
    ("missing.txt", "does not exist"),
    ("nothing/*.jsonl", "matches no files"),
    ("corpus/notes.csv", "unsupported type; supported files end in .txt, .md, .py, .jsonl, .jsonl.gz, "
                         ".jsonl.zst or .parquet"),
    ("empty.txt", "is empty"),
])
def test_bad_paths_are_one_line_errors_naming_source_and_path(tree: Path, entry: str, message: str) -> None:
    write(tree / "empty.txt", "")
    with pytest.raises(DataError, match=message) as e:
        resolve_inputs({"web": [str(tree / "corpus/a.txt"), str(tree / entry)]})
    assert "'web'" in str(e.value) and str(tree / entry) in str(e.value) and "\n" not in str(e.value)


def test_source_without_supported_files(tree: Path) -> None:
    write(tree / "tables/x.csv", "1,2\n")
    with pytest.raises(DataError, match=r"source 'web' \(paths \[.*tables'\]\) holds no non-empty \.txt, .* or "
                                        r"\.parquet files"):
        resolve_inputs({"main": [str(tree / "corpus")], "web": [str(tree / "tables")]})


def test_file_in_two_sources(tree: Path) -> None:
    with pytest.raises(DataError, match="is in source 'a' and in source 'b'"):
        resolve_inputs({"a": [str(tree / "corpus")], "b": [str(tree / "corpus/sub/c.py")]})
    with pytest.raises(DataError, match="is in source 'std' and in source 'mine'"):
        resolve_inputs({"std": ["stdlib"], "mine": [os.__file__]})
    two = {"short": [str(tree / "corpus")], "long": [str(tree / "corpus")]}
    with pytest.raises(DataError, match="is in source 'short' and in source 'long'.*disjoint"):
        resolve_inputs(two, lengths={"short": (0, 1000), "long": (1000, 0)})  # 1,000 characters: both
    split = resolve_inputs(two, lengths={"short": (0, 999), "long": (1000, 0)})
    assert [f.path for f in split if f.source == "short"] == [f.path for f in split if f.source == "long"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file whatever its permissions")
def test_unreadable_file(tree: Path) -> None:
    locked = tree / "corpus/a.txt"
    locked.chmod(0)
    try:
        with pytest.raises(DataError, match=f"file '{locked}' is not readable"):
            resolve_inputs({"main": [str(tree / "corpus")]})
    finally:
        locked.chmod(0o644)


def test_text_file_is_one_document_with_bad_bytes_replaced_and_counted(tmp_path: Path) -> None:
    f = resolve_inputs({"m": [str(write(tmp_path / "a.txt", b"caf\xc3\xa9 \xff\xfe end\n"))]})[0]
    assert docs_of(f) == (["caf\u00e9 \ufffd\ufffd end\n"], [])
    repaired: list[str] = []
    assert list(read_documents(f, "text", [], repaired)) == ["caf\u00e9 \ufffd\ufffd end\n"]
    assert repaired == [f"{f.path}: invalid UTF-8 at byte 6"]
    good = resolve_inputs({"m": [str(write(tmp_path / "b.txt", "caf\u00e9 \ufffd end\n"))]})[0]
    assert list(read_documents(good, "text", [], repaired)) == ["caf\u00e9 \ufffd end\n"] and len(repaired) == 1


def test_jsonl_malformed_lines_are_reported_and_reading_goes_on(tmp_path: Path) -> None:
    lines = [b'{"text": "first"}', b"", b"{not json", b"[1, 2]", b'{"body": "x"}', b'{"text": 7}',
             b'{"text": "caf\xff"}', b'{"text": "lone \\ud800 surrogate", "id": 3}', b"   ", b'{"text": "last"}']
    path = write(tmp_path / "d.jsonl", b"\n".join(lines) + b"\n")
    repaired: list[str] = []
    malformed: list[str] = []
    docs = list(read_documents(resolve_inputs({"m": [str(path)]})[0], "text", malformed, repaired))
    assert docs == ["first", "lone \ufffd surrogate", "last"]
    assert repaired == [f"{path}:8: lone surrogate escapes"]
    assert malformed == [f"{path}:3: bad JSON (Expecting property name enclosed in double quotes at column 2)",
                         f"{path}:4: expected a JSON object, got list",
                         f"{path}:5: no 'text' field",
                         f"{path}:6: field 'text' is int, not a string",
                         f"{path}:7: invalid UTF-8 at byte 13"]
    assert docs_of(resolve_inputs({"m": [str(path)]})[0], field="body")[0] == ["x"]


def test_jsonl_gz_is_read_and_a_truncated_stream_reported(tmp_path: Path) -> None:
    rng = random.Random(0)
    texts = ["".join(rng.choices("abcdefghij klmnop", k=200)) for _ in range(2000)]
    payload = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    whole = write(tmp_path / "whole.jsonl.gz", payload)
    f = resolve_inputs({"m": [str(whole)]})[0]
    assert f.kind == "jsonl" and docs_of(f) == (texts, [])

    cut = write(tmp_path / "cut.jsonl.gz", payload[: len(payload) // 2])
    docs, malformed = docs_of(resolve_inputs({"m": [str(cut)]})[0])
    assert 0 < len(docs) < len(texts) and docs == texts[: len(docs)]
    assert len(malformed) == 1 and malformed[0].startswith(f"{cut}: unreadable after line ")
    assert "EOFError" in malformed[0]


def zst_texts_and_frames(zstandard: Any) -> tuple[list[str], list[bytes]]:
    """Documents and the two frames holding them (the first ending mid-line), checksummed as the zstd tool writes
    them by default."""
    rng = random.Random(0)
    texts = ["".join(rng.choices("abcdefghij klmnop", k=200)) for _ in range(2000)]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    return texts, [compress(raw[:100_001]), compress(raw[100_001:])]


def breaks_at(zstandard: Any, frame: bytes, at: int) -> bool:
    """Whether a fresh decompressor takes the frame's first `at` bytes and fails on the next one, independently of
    how the reader feeds it."""
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    decompressor.decompress(frame[:at])
    with pytest.raises(zstandard.ZstdError):
        decompressor.decompress(frame[at:at + 1])
    return True


@pytest.fixture(params=[1 << 20, 4096], ids=["one read", "many reads"])
def zstd_chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The compressed bytes read at a time: the whole test file at once, or frames spanning many reads and reads
    spanning two frames."""
    monkeypatch.setattr(sources, "ZSTD_CHUNK", request.param)
    return request.param


def test_jsonl_zst_is_read_across_frames(tmp_path: Path, zstd_chunk: int) -> None:
    zstandard = pytest.importorskip("zstandard")
    texts, frames = zst_texts_and_frames(zstandard)
    f = resolve_inputs({"m": [str(write(tmp_path / "whole.jsonl.zst", b"".join(frames)))]})[0]
    assert f.kind == "jsonl" and docs_of(f) == (texts, []) and damage(f) is None


def test_a_truncated_zst_file_is_named_with_the_byte_and_frame_where_it_ends(tmp_path: Path, zstd_chunk: int) -> None:
    zstandard = pytest.importorskip("zstandard")
    texts, frames = zst_texts_and_frames(zstandard)
    payload = b"".join(frames)
    end = len(payload) * 3 // 4  # inside the second frame
    cut = resolve_inputs({"m": [str(write(tmp_path / "cut.jsonl.zst", payload[:end]))]})[0]
    reason = f"truncated zstd file: it ends at byte {end} inside frame 2 (from byte {len(frames[0])})"
    assert damage(cut) == reason
    docs, malformed = docs_of(cut)  # read on its own, every whole line before the cut, and no more
    assert 0 < len(docs) < len(texts) and docs == texts[: len(docs)]
    assert malformed == [f"{cut.path}: unreadable after line {len(docs)} ({reason})"]


@pytest.mark.parametrize("frame", [0, 1])
@pytest.mark.parametrize("where", ["block header", "middle"])
def test_a_flipped_byte_in_a_zst_frame_is_named_with_the_byte_where_decompression_broke(tmp_path: Path, frame: int,
                                                                                        where: str,
                                                                                        zstd_chunk: int) -> None:
    zstandard = pytest.importorskip("zstandard")
    _, frames = zst_texts_and_frames(zstandard)
    damaged = bytearray(frames[frame])
    header = zstandard.frame_header_size(frames[frame])
    damaged[header + 2 if where == "block header" else len(damaged) // 2] ^= 0xFF  # a block's size; or its data
    frames[frame] = bytes(damaged)
    f = resolve_inputs({"m": [str(write(tmp_path / "flip.jsonl.zst", b"".join(frames)))]})[0]
    reason = damage(f)
    assert reason is not None
    start = sum(map(len, frames[:frame]))
    at = int(reason.split(" at byte ")[1].split(" ")[0])
    assert reason == (f"corrupt zstd data: decompression broke at byte {at} of {f.size}, in frame {frame + 1} "
                      f"(from byte {start}): {reason.split('): ')[1]}")
    assert start <= at < start + len(frames[frame]) and breaks_at(zstandard, frames[frame], at - start)


def test_a_file_that_is_not_zst_or_has_trailing_garbage_is_named(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    texts, frames = zst_texts_and_frames(zstandard)
    not_zstd = resolve_inputs({"m": [str(write(tmp_path / "text.jsonl.zst", '{"text": "plain"}\n' * 20))]})[0]
    assert damage(not_zstd) == "not zstd data: no zstd frame starts at byte 0 (frame 1; it starts with b'{\"te')"
    assert docs_of(not_zstd)[0] == []
    payload = b"".join(frames)
    tail = resolve_inputs({"m": [str(write(tmp_path / "tail.jsonl.zst", payload + b"garbage"))]})[0]
    assert damage(tail) == f"not zstd data: no zstd frame starts at byte {len(payload)} (frame 3; it starts with " \
                           f"b'garb')"
    assert docs_of(tail)[0] == texts


def test_parquet_is_streamed_with_nulls_reported(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [None if i % 1000 == 7 else f"document {i}" for i in range(2500)]  # spans several record batches
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": list(range(2500)), "content": texts}), path, row_group_size=700)
    f = resolve_inputs({"m": [str(path)]})[0]
    assert f.kind == "parquet"
    docs, malformed = docs_of(f, field="content")
    assert docs == [t for t in texts if t is not None]
    assert malformed == [f"{path}:row 7: null", f"{path}:row 1007: null", f"{path}:row 2007: null"]
    with pytest.raises(DataError, match=f"{path}: no column 'text' \\(columns: id, content\\)"):
        docs_of(f)
    with pytest.raises(DataError, match="column 'id' holds int64, expected strings"):
        docs_of(f, field="id")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "p.parquet", b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"pip install 'keel-pretrain\[parquet\]'"):
        docs_of(resolve_inputs({"m": [str(path)]})[0])


def test_corrupt_parquet_is_reported_not_raised(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = write(tmp_path / "p.parquet", b"this is not parquet at all")
    docs, malformed = docs_of(resolve_inputs({"m": [str(path)]})[0])
    assert docs == [] and len(malformed) == 1 and malformed[0].startswith(f"{path}: not a readable Parquet file")
