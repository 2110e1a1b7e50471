"""Checkpoints beyond the local disk and beyond keel: an S3-compatible object store (a real server on
loopback), and Hugging Face safetensors out of a run and back into a new one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keel.checkpoint.inspect import load_full_state
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, run_keel

pytestmark = pytest.mark.dist


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def train_cmd(corpus: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={steps}",
            f"data.dir={corpus}", "checkpoint.interval=10", *extra]


@pytest.fixture(scope="module")
def local_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps on 2 processes, a checkpoint every 10 on the local disk, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("formats") / "local"
    result = run_keel(train_cmd(small_corpus, run_dir, 30), cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr
    return run_dir


def test_save_verify_and_resume_on_an_s3_object_store(s3: dict, local_run: Path, small_corpus: Path,
                                                      tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    url = "s3://keel/runs/remote"

    # Rank 1 is SIGKILLed once step 20 is committed to the store; the same command then resumes from it.
    kill = 'callbacks=[{path = "keel.drill.faults:SigkillAfterCheckpoint", args = {step = 20, rank = 1}}]'
    first = run_keel(train_cmd(small_corpus, remote, 30, f"checkpoint.dir={url}", kill), cwd=tmp_path, env=s3)
    assert first.returncode != 0
    assert not (remote / "checkpoints").exists(), "checkpoints go to the object store only"
    verified = run_keel(["ckpt", "verify", str(remote)], cwd=tmp_path, env=s3)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.splitlines() == [f"{url}/step-000010: verified", f"{url}/step-000020: verified"]
    listed = run_keel(["ckpt", "ls", url], cwd=tmp_path, env=s3)
    assert "(latest)" in [line for line in listed.stdout.splitlines() if line.startswith("step-000020")][0]

    resumed = run_keel(train_cmd(small_corpus, remote, 30, f"checkpoint.dir={url}"), cwd=tmp_path, env=s3)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["detail"]["checkpoint"] for e in read_jsonl(remote / "events.jsonl") if e["kind"] == "resume"] == [
        f"{url}/step-000020"]
    assert losses(remote) == losses(local_run), "saved to and resumed from S3, bitwise the same run"


def test_hf_export_starts_a_new_run_from_the_same_weights(local_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    source, target, hf = local_run, tmp_path / "target", tmp_path / "hf"
    exported = run_keel(["ckpt", "export", str(source), "--format", "hf", "--out", str(hf)], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "(step 30)" in exported.stdout, "the run's newest checkpoint"
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                    "tokenizer.json", "tokenizer_config.json"]
    manifest = json.loads((source / "checkpoints" / "step-000030" / "manifest.json").read_text())
    assert manifest["tokenizer"] == {"name": "byte", "vocab_size": 259, "bos": 256, "eos": 257, "pad": 258,
                                     "corpus": str(small_corpus.resolve())}, "where export finds a tokenizer file"

    # A learning rate far below fp32 resolution: one step leaves every weight bitwise where it started.
    started = run_keel(train_cmd(small_corpus, target, 1, f"model.init_from=hf:{hf}", "optim.lr=1e-30",
                                 "optim.warmup_steps=1"), cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    assert f"initialised the weights from hf:{hf}" in started.stdout
    before = load_full_state(source / "checkpoints" / "step-000030")
    after = load_full_state(target / "checkpoints" / "step-000001")
    model_keys = [k for k in before if k.startswith("model.")]
    assert model_keys and all(torch.equal(before[k], after[k]) for k in model_keys)

    again = run_keel(["ckpt", "export", str(source), "--out", str(hf)], cwd=tmp_path)
    assert again.returncode == 2 and "not an empty directory" in again.stderr, again.stderr
    wrong = run_keel(train_cmd(small_corpus, tmp_path / "wrong", 1, f"model.init_from=hf:{hf}", "model.dim=32"),
                     cwd=tmp_path)
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
