"""Exact resume across a real SIGKILL, resume on another world size, and 1 vs 2 processes.

Every run here is a real `keel train` command: torchrun's elastic agent, gloo, FSDP2 and DCP.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, run_keel

pytestmark = pytest.mark.dist

STEPS = 40
KILL_AT = 20


def train_cmd(corpus: Path, run_dir: Path, nproc: int, *extra: str) -> list[str]:
    return ["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={STEPS}",
            f"data.dir={corpus}", *extra]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def final_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step-{STEPS:06d}"


# Run A, `reference_run` (tests/conftest.py): train_cmd(corpus, run_dir, 2) uninterrupted, saving every 10 steps.


def test_sigkill_after_checkpoint_resumes_bitwise(reference_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "B"
    # The same command for both attempts; rank 1 SIGKILLs itself once the step-20 checkpoint is committed.
    kill = ['callbacks=[{path = "keel.drill.faults:SigkillAfterCheckpoint", args = {step = 20, rank = 1}}]']
    cmd = train_cmd(small_corpus, run_dir, 2, *kill)

    first = run_keel(cmd, cwd=tmp_path)
    assert first.returncode != 0, "the killed run must fail"
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start"]
    assert {e["rank"] for e in starts} == {0, 1}
    assert (run_dir / "checkpoints" / f"step-{KILL_AT:06d}" / "manifest.json").exists()
    assert not final_checkpoint(run_dir).exists(), "the kill must stop the run before it finishes"
    assert max(losses(run_dir)) < STEPS

    second = run_keel(cmd, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    resumes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert [e["step"] for e in resumes] == [KILL_AT]
    assert "resumed" in second.stdout

    assert state_sha256(final_checkpoint(run_dir)) == state_sha256(final_checkpoint(reference_run))
    resumed = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r and r["step"] > KILL_AT]
    # The loss lines written after the resume: steps 21-40, once each, bitwise equal to run A's.
    assert [r["step"] for r in resumed[-(STEPS - KILL_AT):]] == list(range(KILL_AT + 1, STEPS + 1))
    reference = losses(reference_run)
    for record in resumed[-(STEPS - KILL_AT):]:
        assert record["train/loss"] == reference[record["step"]], record["step"]


def test_rerun_of_finished_run_says_so(reference_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "A-copy"
    shutil.copytree(reference_run, run_dir, symlinks=True)
    before = state_sha256(final_checkpoint(run_dir))
    result = run_keel(train_cmd(small_corpus, run_dir, 2), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "already finished at step 40" in result.stdout
    assert losses(run_dir) == losses(reference_run), "nothing may be retrained"
    assert state_sha256(final_checkpoint(run_dir)) == before


def snapshot(run_dir: Path) -> dict[str, tuple]:
    """`run_dir` and every entry in it: its kind, size, mtime and (for a file) content hash (a directory's mtime
    changes with any file made or removed in it, such as a lock file left or not)."""
    return {str(p.relative_to(run_dir)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns,
                                          None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in [run_dir, *sorted(run_dir.rglob("*"))]}


def test_finished_run_refuses_a_changed_learning_rate_and_writes_nothing(reference_run: Path, small_corpus: Path,
                                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "A-copy"
    shutil.copytree(reference_run, run_dir, symlinks=True)
    before = snapshot(run_dir)
    refused = run_keel(train_cmd(small_corpus, run_dir, 2, "optim.lr=1e-2"), cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    lines = (refused.stdout + refused.stderr).splitlines()
    assert len(lines) == 1, lines
    assert "finished at step 40" in lines[0] and "optim.lr 0.003 → 0.01" in lines[0], lines[0]
    assert "--run-dir NEW" in lines[0] and "--accept-change optim.lr" in lines[0], lines[0]
    assert snapshot(run_dir) == before, "a refused rerun must leave the run directory as it was"

    # Accepted on purpose, beside a setting that may change freely (and on one process instead of two): the run
    # stays finished with its results, and the change is recorded.
    accepted = run_keel(train_cmd(small_corpus, run_dir, 1, "optim.lr=1e-2", "monitor.interval=2",
                                  "--accept-change", "optim.lr"), cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr
    assert "already finished at step 40" in accepted.stdout
    changed = [e["detail"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "config"][-1]
    assert changed["changes"]["optim.lr"] == [3e-3, 1e-2] and changed["changes"]["monitor.interval"] == [1, 2]
    assert changed["identity_accepted"] == ["optim.lr"]
    assert losses(run_dir) == losses(reference_run), "nothing may be retrained"


def test_resume_on_one_process_continues_the_same_run(reference_run: Path, small_corpus: Path,
                                                      tmp_path: Path) -> None:
    """Saved at step 20 by 2 processes, resumed by 1: same global batches (gradient accumulation
    keeps the global batch), losses within 1e-5 relative of the uninterrupted 2-process run."""
    run_dir = tmp_path / "D"
    step20 = reference_run / "checkpoints" / f"step-{KILL_AT:06d}"
    result = run_keel(train_cmd(small_corpus, run_dir, 1, "--resume", str(step20)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    reference, resumed = losses(reference_run), losses(run_dir)
    assert sorted(resumed) == list(range(KILL_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert math.isclose(loss, reference[step], rel_tol=1e-5), (step, loss, reference[step])
    state = json.loads((final_checkpoint(run_dir) / "train_state.json").read_text())
    reference_state = json.loads((final_checkpoint(reference_run) / "train_state.json").read_text())
    assert state["loader"] == reference_state["loader"]
    assert state["tokens_seen"] == reference_state["tokens_seen"]


def test_one_and_two_processes_take_the_same_first_step(reference_run: Path, small_corpus: Path,
                                                        tmp_path: Path) -> None:
    run_dir = tmp_path / "E"
    result = run_keel(train_cmd(small_corpus, run_dir, 1, "train.steps=2"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    one, two = losses(run_dir)[1], losses(reference_run)[1]
    assert math.isclose(one, two, rel_tol=1e-6), (one, two)


def test_resume_never_refuses_to_overwrite_checkpoints(reference_run: Path, small_corpus: Path,
                                                       tmp_path: Path) -> None:
    run_dir = tmp_path / "A-copy"
    shutil.copytree(reference_run, run_dir, symlinks=True)
    before = state_sha256(final_checkpoint(run_dir))
    result = run_keel(train_cmd(small_corpus, run_dir, 2, "--resume", "never"), cwd=tmp_path)
    assert result.returncode == 2
    assert "already holds checkpoints" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert state_sha256(final_checkpoint(run_dir)) == before


def test_resume_on_another_corpus_is_refused(reference_run: Path, tmp_path: Path) -> None:
    """The corpus fingerprint is part of the run's identity, compared before any worker starts."""
    from keel.data.prepare import prepare
    from tests.conftest import SMALL_SOURCES, small_data

    other = tmp_path / "other-corpus"
    prepare(small_data(SMALL_SOURCES[1:2], val_fraction=0.3), other)
    run_dir = tmp_path / "F"
    step20 = reference_run / "checkpoints" / f"step-{KILL_AT:06d}"
    result = run_keel(train_cmd(other, run_dir, 2, "--resume", str(step20)), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "data.corpus" in result.stderr and "data.allow_corpus_change=true" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (run_dir / "checkpoints").exists()


def test_elastic_agent_restarts_the_killed_worker_group_and_the_run_finishes_exactly(
        reference_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    """With --max-restarts the agent itself restarts the workers after the SIGKILL; they resume from
    the latest checkpoint (not from the --resume given to the first attempt) and finish bitwise equal."""
    run_dir = tmp_path / "G"
    kill = ['callbacks=[{path = "keel.drill.faults:SigkillAfterCheckpoint", args = {step = 20, rank = 1}}]']
    result = run_keel(train_cmd(small_corpus, run_dir, 2, *kill, "--max-restarts", "1", "--resume", "never"),
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start"]
    assert len(starts) == 4, "two ranks, started twice"
    assert [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"] == [KILL_AT]
    assert state_sha256(final_checkpoint(run_dir)) == state_sha256(final_checkpoint(reference_run))


def test_checkpoint_of_another_model_shape_is_refused(reference_run: Path, small_corpus: Path,
                                                      tmp_path: Path) -> None:
    step20 = reference_run / "checkpoints" / f"step-{KILL_AT:06d}"
    before = state_sha256(step20)
    run_dir = tmp_path / "H"
    result = run_keel(train_cmd(small_corpus, run_dir, 2, "--resume", str(step20), "model.dim=32"), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines() == [
        f"keel: error: resuming {step20} would change what defines the run: model.dim 64 → 32; start a new run "
        f"with --run-dir, or accept the change on purpose with --accept-change model.dim (recorded in events.jsonl "
        f"and the manifest)"]
    assert state_sha256(step20) == before
    assert not (run_dir / "checkpoints").exists()
