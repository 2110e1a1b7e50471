"""Bad input to `keel train`: one-line error, exit code 2, and no data or checkpoint file touched."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.conftest import SMALL_RUN, run_keel


def tree_digest(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots if root.exists() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(small_corpus: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "corpus"
    shutil.copytree(small_corpus, copy)
    return copy


def check_bad_input(args: list[str], tmp_path: Path, expect: str, *watched: Path) -> None:
    before = tree_digest(*watched)
    result = run_keel(["train", "--nproc", "2", *args], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel: error:"), result.stderr
    assert expect in lines[0], lines[0]
    assert tree_digest(*watched) == before, "bad input must not modify any file"
    assert not (tmp_path / "run").exists(), "a rejected start must not create the run directory"


def test_unknown_key_suggests_the_right_one(corpus: Path, tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", "train.stpes=5"], tmp_path,
                    "did you mean 'steps'", corpus)


def test_wrong_type_names_field_and_expectation(corpus: Path, tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", "optim.lr=fast"], tmp_path,
                    "optim.lr = 'fast': expected a number", corpus)


def test_out_of_range_value(corpus: Path, tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", "train.steps=0"], tmp_path,
                    "train.steps = 0 is out of range: must be >= 1", corpus)


def test_missing_data_path(tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={tmp_path / 'nowhere'}"], tmp_path,
                    "does not exist")
    assert not (tmp_path / "nowhere").exists()


def test_truncated_shard(corpus: Path, tmp_path: Path) -> None:
    shard = corpus / "main-train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-100])
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN], tmp_path,
                    "truncated", corpus)


def test_altered_shard_fails_its_checksum(corpus: Path, tmp_path: Path) -> None:
    shard = corpus / "main-train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x01
    shard.write_bytes(bytes(data))
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN], tmp_path,
                    "sha256", corpus)


def test_resume_path_that_is_not_a_checkpoint(corpus: Path, tmp_path: Path) -> None:
    not_a_checkpoint = tmp_path / "step-000020"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "model.pt").write_bytes(b"not a checkpoint")
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                     "--resume", str(not_a_checkpoint)], tmp_path, "is not a committed keel checkpoint",
                    corpus, not_a_checkpoint)


def test_batch_that_does_not_split_over_the_processes(corpus: Path, tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                     "train.global_batch=4"], tmp_path, "train.global_batch = 4 must divide by", corpus)
