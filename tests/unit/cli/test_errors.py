"""Bad input to `keel train` and `keel ckpt export`: one-line error, exit code 2, no file touched and no run
directory made."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from keel.checkpoint.export import CONFIG, INDEX, SINGLE, hf_config, hf_name
from keel.cli import main
from keel.config import ModelConfig
from keel.model.llama import Llama
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


# ---------------------------------------------------------------- found by the launcher, before any worker

SMALL_MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


@pytest.fixture
def hf_model(tmp_path: Path) -> Path:
    """A Hugging Face Llama directory of SMALL_RUN's model."""
    out = tmp_path / "hf"
    out.mkdir()
    model = Llama(SMALL_MODEL)
    save_file({hf_name(name): p.detach() for name, p in model.named_parameters()}, out / SINGLE)
    (out / CONFIG).write_text(json.dumps(hf_config(SMALL_MODEL, torch.float32)))
    return out


def test_seed_beyond_64_bits(corpus: Path, tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                     "train.seed=99999999999999999999"], tmp_path, "train.seed = 99999999999999999999 is out of "
                    "range: must be >= 0 and <= 18446744073709551615", corpus)


def test_checkpoint_dir_on_proc(corpus: Path, tmp_path: Path) -> None:
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                     "checkpoint.dir=/proc/keel"], tmp_path, "'/proc/keel' is on the kernel's proc file system", corpus)


def test_config_file_that_is_not_utf8(corpus: Path, tmp_path: Path) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    check_bad_input(["--run-dir", str(tmp_path / "run"), "--config", str(config), f"data.dir={corpus}", *SMALL_RUN],
                    tmp_path, "is not UTF-8 text (byte 11", corpus, config)


def test_truncated_hf_weights(corpus: Path, tmp_path: Path, hf_model: Path) -> None:
    weights = hf_model / SINGLE
    weights.write_bytes(weights.read_bytes()[:-1000])
    check_bad_input(["--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                     f"model.init_from=hf:{hf_model}"], tmp_path, "file not fully covered", corpus, hf_model)


# The same contract in-process, where a subprocess adds nothing but its start-up time.

def check_bad_input_in_process(argv: list[str], tmp_path: Path, expect: str, capsys: pytest.CaptureFixture,
                               *watched: Path) -> None:
    before = tree_digest(*watched)
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel: error:") and expect in lines[0], lines
    assert tree_digest(*watched) == before, "bad input must not modify any file"
    assert not (tmp_path / "run").exists(), "a rejected start must not create the run directory"


@pytest.mark.parametrize(("flags", "expect"), [
    (["--max-restarts", "-1"], "--max-restarts -1: expected 0 or more restarts"),
    (["--nproc", "0"], "--nproc 0: expected a positive number of processes"),
    (["--resume", "{afile}"], "--resume '{afile}' is a file"),
    (["--run-dir", "{afile}"], "--run-dir '{afile}' is a file, not a directory"),
    (["--run-dir", "{afile}/run"], "--run-dir '{afile}/run' cannot be created: '{afile}' is a file"),
])
def test_bad_flag(flags: list[str], expect: str, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    flags = [f.format(afile=afile) for f in flags]
    run_dir = [] if "--run-dir" in flags else ["--run-dir", str(tmp_path / "run")]
    check_bad_input_in_process(["train", *run_dir, *flags, f"data.dir={corpus}", *SMALL_RUN], tmp_path,
                               expect.format(afile=afile), capsys, corpus, afile)


@pytest.mark.parametrize(("override", "expect"), [
    ("model.vocab_size=100", "model.vocab_size = 100 is smaller than the corpus tokenizer's vocabulary (259)"),
    ('callbacks=[{path = "no_such_module:Logger"}]',
     "callbacks[0].path = 'no_such_module:Logger' cannot be imported: ModuleNotFoundError"),
    ('callbacks=[{path = "keel.core.callbacks:Callback", args = {every = 2}}]',
     "callbacks[0].args = {'every': 2} do not fit keel.core.callbacks:Callback"),
])
def test_bad_override_found_by_the_launcher(override: str, expect: str, corpus: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    check_bad_input_in_process(["train", "--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                                override], tmp_path, expect, capsys, corpus)


def test_missing_hf_weight_file(corpus: Path, tmp_path: Path, hf_model: Path, capsys: pytest.CaptureFixture) -> None:
    (hf_model / SINGLE).unlink()
    check_bad_input_in_process(["train", "--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                                f"model.init_from=hf:{hf_model}"], tmp_path, "holds neither model.safetensors",
                               capsys, corpus, hf_model)


def test_sharded_hf_weights_missing_a_shard(corpus: Path, tmp_path: Path, hf_model: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    tensors = load_file(hf_model / SINGLE)
    names = sorted(tensors)
    half = {"weight_map": {name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(names)}}
    save_file({n: tensors[n] for n, f in half["weight_map"].items() if f.startswith("model-00001")},
              hf_model / "model-00001-of-00002.safetensors")  # the second shard is never written
    (hf_model / SINGLE).unlink()
    (hf_model / INDEX).write_text(json.dumps(half))
    check_bad_input_in_process(["train", "--run-dir", str(tmp_path / "run"), f"data.dir={corpus}", *SMALL_RUN,
                                f"model.init_from=hf:{hf_model}"], tmp_path,
                               "model-00002-of-00002.safetensors': No such file", capsys, corpus, hf_model)


def test_export_out_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    (tmp_path / "ckpts").mkdir()
    check_bad_input_in_process(["ckpt", "export", str(tmp_path / "ckpts"), "--out", str(afile / "sub")], tmp_path,
                               f"--out '{afile}/sub' cannot be created: '{afile}' is a file", capsys, afile)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ckpts"]
