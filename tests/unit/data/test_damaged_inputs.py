"""Damaged inputs of `keel data prepare`, made here with zstandard: one that is all a source has is a one-line
error that leaves nothing behind; one among others is skipped whole, named on the console, in the manifest and
by `keel data stats`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import keel.data.prepare as prepare_module
from keel.cli import main
from keel.config import CleanConfig, DataConfig, DecontamConfig, DedupConfig, SourceConfig
from keel.data.prepare import prepare
from keel.data.shards import MANIFEST

zstandard = pytest.importorskip("zstandard")

PASSTHROUGH = ["data.clean.enabled=false", "data.dedup.exact=false", "data.dedup.near=false",
               "data.decontam.enabled=false", "data.val_fraction=0.3"]


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def documents(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(["alpha", "beta", "gamma", "delta", "epsilon"], k=60)) + f" {seed}-{i}"
            for i in range(n)]


def frame(texts: list[str]) -> bytes:
    """One zstd frame with a checksum, as the zstd tool writes it."""
    return zstandard.ZstdCompressor(write_checksum=True).compress(jsonl(texts))


def flipped(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    return bytes(damaged)


def where_it_breaks(data: bytes) -> tuple[int, str]:
    """The byte on which a fresh decompressor, fed one byte at a time, fails, and zstd's reason."""
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    for at in range(len(data)):
        try:
            decompressor.decompress(data[at:at + 1])
        except zstandard.ZstdError as e:
            return at, str(e).removeprefix("zstd decompressor error: ")
    raise AssertionError("the damage decodes")


def damaged_files() -> dict[str, tuple[bytes, str]]:
    """name: (content, the reason the prepare must give for it)."""
    whole = frame(documents(1, 400))
    broken = flipped(whole)
    at, why = where_it_breaks(broken)
    return {"flipped.jsonl.zst": (broken, f"corrupt zstd data: decompression broke at byte {at} of {len(whole)}, in "
                                          f"frame 1 (from byte 0): {why}"),
            "truncated.jsonl.zst": (whole[:len(whole) // 2], f"truncated zstd file: it ends at byte {len(whole) // 2} "
                                                             f"inside frame 1 (from byte 0)"),
            "text.jsonl.zst": (jsonl(documents(2, 5)), "not zstd data: no zstd frame starts at byte 0 (frame 1; it "
                                                       "starts with b'{\"te')")}


def left_behind(parent: Path, inputs: set[str]) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in inputs)


@pytest.mark.parametrize("name", sorted(damaged_files()))
def test_a_damaged_zst_file_alone_is_one_line_exit_2_and_leaves_nothing(tmp_path: Path, name: str,
                                                                        capsys: pytest.CaptureFixture) -> None:
    content, reason = damaged_files()[name]
    path = tmp_path / name
    path.write_bytes(content)
    assert main(["data", "prepare", "--source", str(path), "--out", str(tmp_path / "corpus"), *PASSTHROUGH]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"keel: error: {path}: {reason}; it is the only file of source 'main', so nothing can be prepared: repair "
        f"or replace it"]
    assert left_behind(tmp_path, {name}) == []  # no corpus, lock or work directory


def test_damaged_zst_files_in_a_directory_are_skipped_named_and_shown_by_stats(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "source"
    source.mkdir()
    good, plain = documents(3, 50), documents(4, 30)
    (source / "good.jsonl.zst").write_bytes(frame(good[:20]) + frame(good[20:]))
    (source / "plain.jsonl").write_bytes(jsonl(plain[:10]) + b"not json\n" + jsonl(plain[10:]))
    (source / "latin-1.txt").write_bytes("caf\u00e9 ".encode("latin-1") + " ".join(good[:2]).encode())
    damaged = damaged_files()
    for name, (content, _) in damaged.items():
        (source / name).write_bytes(content)
    out = tmp_path / "corpus"
    assert main(["data", "prepare", "--source", str(source), "--out", str(out), *PASSTHROUGH]) == 0
    printed = capsys.readouterr().out.splitlines()
    skipped = [f"{source / name}: {reason}" for name, (_, reason) in sorted(damaged.items())]
    assert [line for line in printed if line.startswith("skipped")] == [f"skipped       {s}" for s in skipped]
    assert "malformed     1 line or row in 1 file, left out (`keel data stats` names them)" in printed

    manifest = json.loads((out / MANIFEST).read_text())
    assert [f"{s['path']}: {s['reason']}" for s in manifest["skipped_files"]] == skipped
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == len(good) + len(plain) + 1  # no more

    assert main(["data", "stats", str(out)]) == 0
    stats = capsys.readouterr().out.splitlines()
    at = stats.index("skipped files     3 (damaged: none of their documents are in the corpus)")
    assert stats[at + 1:at + 4] == [f"  {s}" for s in skipped]
    assert f"malformed         1 in 1 file ({source / 'plain.jsonl'} 1)" in stats
    assert f"                  {source / 'plain.jsonl'}:11: bad JSON (Expecting value at column 1)" in stats
    assert f"undecodable       1 document kept with U+FFFD for what was not valid Unicode ({source / 'latin-1.txt'}: " \
           f"invalid UTF-8 at byte 3)" in stats


def test_a_directory_of_damaged_files_only_is_one_line_naming_them(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "source"
    source.mkdir()
    damaged = damaged_files()
    for name, (content, _) in damaged.items():
        (source / name).write_bytes(content)
    assert main(["data", "prepare", "--source", str(source), "--out", str(tmp_path / "corpus"), *PASSTHROUGH]) == 2
    shown = "; ".join(f"{source / name}: {reason}" for name, (_, reason) in sorted(damaged.items()))
    assert capsys.readouterr().err.splitlines() == [
        f"keel: error: source 'main': none of its 3 files can be read ({shown}); repair or replace them"]
    assert left_behind(tmp_path, {"source"}) == []


def test_a_damaged_evaluation_file_is_refused_before_anything_is_written(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(documents(5, 40)))
    content, reason = damaged_files()["truncated.jsonl.zst"]
    (tmp_path / "eval.jsonl.zst").write_bytes(content)
    assert main(["data", "prepare", "--source", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "corpus"),
                 "data.decontam.enabled=true", f"data.decontam.eval_files=['{tmp_path / 'eval.jsonl.zst'}']"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"keel: error: {tmp_path / 'eval.jsonl.zst'}: {reason}; repair it or remove it from data.decontam.eval_files"]
    assert left_behind(tmp_path, {"docs.jsonl", "eval.jsonl.zst"}) == []


def test_a_parquet_file_that_cannot_be_opened_is_skipped_and_named(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("pyarrow")
    (tmp_path / "docs.jsonl").write_bytes(jsonl(documents(6, 30)))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 and then no footer at all")
    out = tmp_path / "corpus"
    assert main(["data", "prepare", "--source", str(tmp_path), "--out", str(out), *PASSTHROUGH]) == 0
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped       {tmp_path / 'broken.parquet'}: not a readable "
                                                       f"Parquet file (")
    manifest = json.loads((out / MANIFEST).read_text())
    assert [s["path"] for s in manifest["skipped_files"]] == [str(tmp_path / "broken.parquet")]
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 30


def test_many_skipped_files_are_all_recorded_and_the_console_names_the_first_20(tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "docs.jsonl").write_bytes(jsonl(documents(7, 30)))
    for i in range(23):
        (tmp_path / f"bad-{i:02d}.jsonl.zst").write_bytes(b"not zstd")
    out = tmp_path / "corpus"
    assert main(["data", "prepare", "--source", str(tmp_path), "--out", str(out), *PASSTHROUGH]) == 0
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert skipped[:20] == [f"skipped       {tmp_path / f'bad-{i:02d}.jsonl.zst'}: not zstd data: no zstd frame starts "
                            f"at byte 0 (frame 1; it starts with b'not ')" for i in range(20)]
    assert skipped[20:] == ["skipped       ... 3 more damaged files (`keel data stats` lists all)"]
    assert len(json.loads((out / MANIFEST).read_text())["skipped_files"]) == 23
    assert main(["data", "stats", str(out)]) == 0
    assert "skipped files     23 (damaged: none of their documents are in the corpus)" in capsys.readouterr().out


def test_skipped_files_are_recorded_in_input_order_by_two_workers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepare_module, "TASK_BYTES", 1)  # a task per file, shared by the worker processes
    source = tmp_path / "source"
    source.mkdir()
    damaged = damaged_files()
    for i, (name, (content, _)) in enumerate(sorted(damaged.items())):
        (source / f"{i}-good.jsonl").write_bytes(jsonl(documents(10 + i, 20)))
        (source / f"{i}-{name}").write_bytes(content)
    data = DataConfig(sources={"main": SourceConfig(paths=[str(source)])}, val_fraction=0.3, workers=2,
                      clean=CleanConfig(enabled=False), dedup=DedupConfig(exact=False, near=False),
                      decontam=DecontamConfig(enabled=False))
    manifest = prepare(data, tmp_path / "corpus")
    assert [(s["path"], s["reason"]) for s in manifest["skipped_files"]] == [
        (str(source / f"{i}-{name}"), reason) for i, (name, (_, reason)) in enumerate(sorted(damaged.items()))]
    assert manifest["documents"]["train"] + manifest["documents"]["val"] == 20 * len(damaged)


def test_too_few_documents_names_what_was_left_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "docs.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    assert main(["data", "prepare", "--source", str(path), "--out", str(tmp_path / "corpus"), *PASSTHROUGH]) == 2
    assert capsys.readouterr().err.splitlines()[-1:] == [  # after the progress lines
        "keel: error: sources main give 0 training and 0 validation documents after cleaning and dedup; both splits "
        "need at least one (more documents or another data.val_fraction); 1 malformed line or row was left out, the "
        f"first {path}: unreadable after line 0 (BadGzipFile: Not a gzipped file (b'no'))"]
