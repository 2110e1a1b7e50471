"""Inputs that are not local files: Hugging Face datasets the test builds (a save_to_disk directory, a
directory of Parquet files and one JSON Lines file that load_dataset reads) and Parquet objects on a real
S3 server on loopback. Each gives the same token shards as the same documents in a local JSONL file, is
fetched once, and refetched when its content changes; bad ones are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keel.config import DataConfig, SourceConfig
from keel.data.prepare import prepare
from keel.data.remote import parse_hf
from keel.errors import DataError
from tests.conftest import keel_env
from tests.unit.data.test_prepare import contents, prose

_RNG = np.random.default_rng(11)
DOCS = [prose(_RNG, 60) for _ in range(40)]


def config(*paths: str) -> DataConfig:
    return DataConfig(sources={"main": SourceConfig(paths=list(paths))}, val_fraction=0.2)


def shards(out: Path) -> dict[str, str]:
    return {name: digest for name, digest in contents(out).items() if name.endswith(".bin")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """The documents as a local JSON Lines file, prepared: its shards and manifest."""
    root = tmp_path_factory.mktemp("reference")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare(config(str(root / "docs.jsonl")), root / "corpus")
    return shards(root / "corpus"), manifest


def same_corpus(out: Path, manifest: dict, reference: tuple[dict, dict]) -> None:
    expected, expected_manifest = reference
    assert expected and shards(out) == expected
    assert (manifest["documents"], manifest["tokens"], manifest["fingerprint"]) == \
        (expected_manifest["documents"], expected_manifest["tokens"], expected_manifest["fingerprint"])


def test_hf_specs_name_a_dataset_its_config_and_split() -> None:
    assert parse_hf("hf:allenai/c4:en@validation") == ("allenai/c4", "en", "validation")
    assert parse_hf("hf:/data/my set@test") == ("/data/my set", None, "test")
    assert parse_hf("hf:wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", "train")
    with pytest.raises(DataError, match="expected hf:NAME"):
        parse_hf("hf:")


def test_local_hf_datasets_give_the_same_shards_as_local_jsonl(tmp_path: Path, reference) -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS})
    datasets.DatasetDict({"train": table, "validation": table.select(range(20))}).save_to_disk(tmp_path / "saved")
    (tmp_path / "files").mkdir()  # a directory of data files: two Parquet shards of the train split
    table.select(range(25)).to_parquet(tmp_path / "files" / "train-00000-of-00002.parquet")
    table.select(range(25, len(DOCS))).to_parquet(tmp_path / "files" / "train-00001-of-00002.parquet")
    table.to_json(tmp_path / "one.jsonl")
    for name, spec in [("saved", f"hf:{tmp_path / 'saved'}@train"), ("files", f"hf:{tmp_path / 'files'}"),
                       ("one", f"hf:{tmp_path / 'one.jsonl'}")]:
        out = tmp_path / "out" / name
        same_corpus(out, prepare(config(spec), out), reference)
    validation = prepare(config(f"hf:{tmp_path / 'saved'}@validation"), tmp_path / "val")
    assert validation["documents"] == {"train": 16, "val": 4}
    # Fetched once: a second preparation finds the corpus and the fetched dataset as they are.
    fetched = contents(tmp_path / "out" / ".saved.sources")
    prepare(config(f"hf:{tmp_path / 'saved'}@train"), tmp_path / "out" / "saved")
    assert contents(tmp_path / "out" / ".saved.sources") == fetched and len(fetched) == 1


@pytest.mark.parametrize("spec, message", [
    ("hf:{root}/missing", r"cannot be loaded \(.*"),
    ("hf:{root}/saved@test", r"no split 'test' \(splits: train\)"),
    ("hf:{root}/notext", r"no column 'text' \(columns: body\); set data.text_field"),
    ("hf:{root}/bad.xml", r"a data file must end in .parquet, .jsonl"),
])
def test_bad_hf_datasets_are_one_line_errors(tmp_path: Path, spec: str, message: str) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:3]})}).save_to_disk(tmp_path / "saved")
    datasets.Dataset.from_dict({"body": DOCS[:3]}).save_to_disk(tmp_path / "notext")
    (tmp_path / "bad.xml").write_text("<docs/>")
    with pytest.raises(DataError, match=message) as caught:
        prepare(config(spec.format(root=tmp_path)), tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


def test_an_s3_parquet_source_gives_the_same_shards_and_is_refetched_only_when_it_changes(
        s3: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import boto3

    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    for i, part in enumerate((DOCS[:25], DOCS[25:])):
        pq.write_table(pa.table({"text": part}), tmp_path / f"part-{i}.parquet")
        client.upload_file(str(tmp_path / f"part-{i}.parquet"), "keel", f"docs/part-{i}.parquet")
    client.put_object(Bucket="keel", Key="docs/README", Body=b"not an input")
    out = tmp_path / "corpus"
    same_corpus(out, prepare(config("s3://keel/docs/*.parquet"), out), reference)
    fetched = contents(tmp_path / ".corpus.sources")
    assert len(fetched) == 2
    same_corpus(out, prepare(config("s3://keel/docs/"), out, force=True), reference)  # the prefix: the same two
    assert contents(tmp_path / ".corpus.sources") == fetched, "an unchanged object is not fetched again"
    pq.write_table(pa.table({"text": DOCS[25:30]}), tmp_path / "short.parquet")
    client.upload_file(str(tmp_path / "short.parquet"), "keel", "docs/part-1.parquet")  # a new version
    assert prepare(config("s3://keel/docs/"), out, force=True)["documents"] == {"train": 24, "val": 6}
    with pytest.raises(DataError, match=r"source 'main': path 's3://keel/nothing/\*.parquet' holds no files"):
        prepare(config("s3://keel/nothing/*.parquet"), tmp_path / "none")


def test_keel_data_prepare_refuses_a_missing_split_in_one_line_with_exit_2(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:3]})}).save_to_disk(tmp_path / "saved")
    done = subprocess.run([sys.executable, "-m", "keel", "data", "prepare", "--source", f"hf:{tmp_path}/saved@dev",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=keel_env(),
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"keel: error: source 'main': path 'hf:{tmp_path}/saved@dev': no split "
                                                f"'dev' (splits: train)"]
    assert not (tmp_path / "out").exists()
