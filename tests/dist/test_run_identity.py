"""A resume continues the run it resumes and no other: identity fields changed are refused before any
worker starts (one line, exit 2, nothing written), other settings change and are recorded, and an identity
change accepted on purpose is recorded in the events and in every later manifest."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keel.config import CleanConfig, DataConfig, DecontamConfig, DedupConfig, SourceConfig
from keel.data.prepare import prepare
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, keel_env, run_keel

pytestmark = pytest.mark.dist


def tree_digest(root: Path) -> dict[str, str]:
    """Every checkpoint file's digest; `.locks/` holds the readers' lock files, which a start that begins
    checking its checkpoint creates before it refuses."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".locks" not in p.relative_to(root).parts}


@pytest.fixture
def finished_copy(reference_run: Path, tmp_path: Path) -> Path:
    """The 40-step reference run, to be resumed past its end with train.steps=44."""
    run_dir = tmp_path / "A"
    shutil.copytree(reference_run, run_dir, symlinks=True)
    return run_dir


def resume_cmd(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={corpus}",
            "checkpoint.interval=10", "checkpoint.keep_last=10", "train.steps=44", *extra]


@pytest.mark.parametrize("change, field, old, new", [
    ("model.n_layers=1", "model.n_layers", "2", "1"),
    ("train.seq_len=32", "train.seq_len", "64", "32"),
    ("train.global_batch=16", "train.global_batch", "8", "16"),
    ("train.seed=1", "train.seed", "0", "1"),
])
def test_identity_change_is_refused_before_any_worker_starts(finished_copy: Path, small_corpus: Path,
                                                             change: str, field: str, old: str, new: str) -> None:
    before = tree_digest(finished_copy)
    result = run_keel(resume_cmd(finished_copy, small_corpus, change), cwd=finished_copy.parent, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{field} {old} → {new}" in lines[0] and "--accept-change" in lines[0] and "--run-dir" in lines[0]
    assert "step-000040" in lines[0]
    assert tree_digest(finished_copy) == before, "a refused resume must write nothing"


def test_other_settings_change_and_an_accepted_identity_change_is_recorded(finished_copy: Path,
                                                                           small_corpus: Path) -> None:
    allowed = ["optim.lr=0.001", "checkpoint.interval=2", "monitor.interval=2", "train.micro_batch=2"]
    result = run_keel(resume_cmd(finished_copy, small_corpus, *allowed, "model.max_seq_len=128",
                                 "--accept-change", "model.max_seq_len"), cwd=finished_copy.parent)
    assert result.returncode == 0, result.stderr
    changed = [e for e in read_jsonl(finished_copy / "events.jsonl") if e["kind"] == "config"
               and e["action"] == "changed"]
    assert len(changed) == 1 and changed[0]["step"] == 40
    changes = changed[0]["detail"]["changes"]
    assert changes["optim.lr"] == [0.003, 0.001] and changes["train.steps"] == [40, 44]
    assert changes["train.micro_batch"] == [4, 2] and changes["model.max_seq_len"] == [64, 128]
    assert changed[0]["detail"]["identity_accepted"] == ["model.max_seq_len"]
    for step in (42, 44):  # every later manifest keeps the run's history of accepted changes
        manifest = json.loads((finished_copy / "checkpoints" / f"step-{step:06d}" / "manifest.json").read_text())
        assert manifest["identity_changes"] == [{"step": 40, "key": "model.max_seq_len", "old": 64, "new": 128}]
        assert manifest["identity"]["model.max_seq_len"] == 128 and manifest["config"]["optim"]["lr"] == 0.001


@pytest.mark.timeout(200)
def test_plain_torchrun_workers_refuse_an_identity_change(finished_copy: Path, small_corpus: Path) -> None:
    """Without keel's launcher, the workers compare before loading: every rank refuses alike."""
    before = tree_digest(finished_copy / "checkpoints")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "keel",
           "train", *resume_cmd(finished_copy, small_corpus, "model.n_layers=1")[3:]]  # without --nproc 2
    result = subprocess.run(cmd, cwd=finished_copy.parent, env=keel_env(), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode != 0
    refusals = [line for line in result.stderr.splitlines() if "would change what defines the run" in line]
    # Every rank refuses; torchrun stops the others once the first has exited, so one or both say it.
    assert refusals and all("model.n_layers 2 → 1" in line for line in refusals), result.stderr
    assert "/keel/" not in result.stderr, "no traceback from keel (torchrun prints its own for a failed worker)"
    assert tree_digest(finished_copy / "checkpoints") == before



def test_guards_judge_an_accepted_change_by_the_steps_after_it_and_never_roll_back_behind_it(
        finished_copy: Path, small_corpus: Path, tmp_path: Path) -> None:
    """A change of what the run computes accepted at step 40 (another corpus, of four characters the first one
    hardly holds, in random order): the loss after it is no spike against the losses before it, and a real spike later (a
    poisoned batch) rolls back no further than the change, though guard.rollback_steps reaches back to step 21."""
    rng = random.Random(0)
    (tmp_path / "noise").mkdir()
    for i in range(40):
        (tmp_path / "noise" / f"{i}.txt").write_text("".join(rng.choices("~^|`", k=4000)))
    noise = tmp_path / "noise_corpus"
    prepare(DataConfig(sources={"main": SourceConfig(paths=[str(tmp_path / "noise")])}, val_fraction=0.1,
                       clean=CleanConfig(enabled=False), dedup=DedupConfig(exact=False, near=False),
                       decontam=DecontamConfig(enabled=False)), noise)
    spike = ["guard.spike.warmup=4", "guard.spike.window=20", "guard.rollback_steps=60", "guard.snapshot_interval=0"]
    result = run_keel([*resume_cmd(finished_copy, small_corpus, "train.steps=90", *spike,
                                   'drill.inject=["poison_batch:batch=80"]'), f"data.dir={noise}",
                       "data.allow_corpus_change=true"], cwd=finished_copy.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(finished_copy / "metrics.jsonl") if "train/loss" in r}
    assert losses[41] > 1.3 * losses[40], "the change raises the loss: what the guards must not take for a spike"
    guard = [e for e in read_jsonl(finished_copy / "events.jsonl") if e["kind"] == "guard"]
    rollbacks = [e for e in guard if e["action"] == "rolled_back"]
    assert [(e["step"], e["detail"]["to_step"]) for e in rollbacks] == [(80, 40)], (guard, losses)
