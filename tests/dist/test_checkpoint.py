"""Checkpoints under real faults: a rank SIGKILLed mid-write, a full disk, a flipped byte, two jobs on
one run directory; retention, interval policies and resharding. Every run is a real `keel train`."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.checkpoint.manifest import verify
from keel.checkpoint.storage import Storage
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, kill_tagged, run_keel, spawn_keel, tagged, tmpfs

pytestmark = pytest.mark.dist

STEPS = 40


def train_cmd(corpus: Path, run_dir: Path, nproc: int, *extra: str) -> list[str]:
    return ["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={STEPS}",
            f"data.dir={corpus}", "checkpoint.interval=10", "checkpoint.keep_last=10", *extra]


def fault(name: str, **args: object) -> str:
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in args.items())
    return f'callbacks=[{{path = "keel.drill.faults:{name}", args = {{{inline}}}}}]'


def events(run_dir: Path, kind: str, action: str | None = None) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl")
            if e["kind"] == kind and (action is None or e["action"] == action)]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def flip_byte(path: Path, offset: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[min(offset, len(data) - 1)] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> Path:
    """train_cmd(corpus, run_dir, 2): 40 steps on 2 processes, a checkpoint every 10, uninterrupted
    (tests/conftest.py)."""
    return reference_run


def test_checkpoints_carry_a_manifest_that_verifies(reference: Path) -> None:
    storage = Storage(reference / "checkpoints")
    for step in (10, 20, 30, 40):
        manifest = json.loads((ckpt(reference, step) / "manifest.json").read_text())
        assert manifest["step"] == step and manifest["world_size"] == 2
        assert manifest["tokens_seen"] == step * 8 * 64
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng-rank-00000.pt", "rng-rank-00001.pt",
                "train_state.json"} <= set(manifest["files"])
        assert sorted(p.name for p in ckpt(reference, step).iterdir()) == sorted([*manifest["files"], "manifest.json"])
        assert verify(storage, f"step-{step:06d}") == []
    assert os.readlink(reference / "checkpoints" / "latest") == "step-000040"
    committed = events(reference, "checkpoint", "committed")
    assert [e["step"] for e in committed] == [10, 20, 30, 40]
    assert all(e["detail"]["blocking_s"] < e["detail"]["write_s"] for e in committed[:-1])


def test_sigkill_during_background_write_resumes_from_the_previous_checkpoint(
        reference: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    cmd = train_cmd(small_corpus, run_dir, 2, fault("SigkillDuringCheckpointWrite", step=20, rank=1))
    first = run_keel(cmd, cwd=tmp_path)
    assert first.returncode != 0
    assert (run_dir / "checkpoints" / "step-000020.tmp").is_dir(), "the kill lands in the middle of the write"
    assert not ckpt(run_dir, 20).exists()
    assert verify(Storage(run_dir / "checkpoints"), "step-000010") == []
    checked = run_keel(["ckpt", "verify", str(run_dir)], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines() == [
        f"{ckpt(run_dir, 10)}: verified",
        f"{run_dir / 'checkpoints' / 'step-000020.tmp'}: unfinished save, not a checkpoint (ignored on resume)"]

    second = run_keel(cmd[:-1], cwd=tmp_path)  # the same job without the fault
    assert second.returncode == 0, second.stderr
    assert [e["step"] for e in events(run_dir, "resume")] == [10]
    assert [e["detail"]["path"] for e in events(run_dir, "checkpoint", "cleaned")] == [
        str(run_dir / "checkpoints" / "step-000020.tmp")]
    assert not (run_dir / "checkpoints" / "step-000020.tmp").exists()
    assert state_sha256(ckpt(run_dir, STEPS)) == state_sha256(ckpt(reference, STEPS))


def test_flipped_byte_in_the_latest_checkpoint_falls_back_to_the_previous(
        reference: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "flipped"
    shutil.copytree(reference, run_dir)
    flip_byte(ckpt(run_dir, 40) / "__1_0.distcp")
    checked = run_keel(["ckpt", "verify", str(run_dir)], cwd=tmp_path)
    assert checked.returncode == 2 and "1 of 4 checkpoints" in checked.stderr
    assert f"{ckpt(run_dir, 40)}: FAILED: __1_0.distcp does not match its checksum" in checked.stdout
    listed = run_keel(["ckpt", "ls", "--verify", str(run_dir)], cwd=tmp_path)
    assert "CORRUPT" in [line for line in listed.stdout.splitlines() if line.startswith("step-000040")][0]
    result = run_keel(train_cmd(small_corpus, run_dir, 2), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "skipping checkpoint" in result.stdout and "__1_0.distcp does not match its checksum" in result.stdout
    skipped = events(run_dir, "checkpoint", "skipped")
    assert [e["step"] for e in skipped] == [40] and "checksum" in skipped[0]["detail"]["reason"]
    assert [e["step"] for e in events(run_dir, "resume")] == [30]
    # Steps 31-40 were redone and the corrupt step-40 replaced by an exact one.
    assert state_sha256(ckpt(run_dir, STEPS)) == state_sha256(ckpt(reference, STEPS))
    assert verify(Storage(run_dir / "checkpoints"), "step-000040") == []


def test_no_valid_checkpoint_refuses_to_start_fresh(reference: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "all-corrupt"
    shutil.copytree(reference, run_dir)
    for step in (10, 20, 30, 40):
        flip_byte(ckpt(run_dir, step) / "__0_0.distcp")
    (ckpt(run_dir, 30) / "manifest.json").unlink()
    root = run_dir / "checkpoints"
    before = {p.relative_to(root): p.read_bytes() for p in root.glob("step-*/*")}
    result = run_keel(train_cmd(small_corpus, run_dir, 2), cwd=tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("keel")]
    assert error.startswith(f"keel: error: no checkpoint in {root} can be resumed, nothing was changed: ")
    assert "step-000030: no manifest.json" in error and "step-000040: __0_0.distcp does not match" in error
    assert {p.relative_to(root): p.read_bytes() for p in root.glob("step-*/*")} == before
    assert losses(run_dir) == losses(reference), "nothing was trained"

    fresh = run_keel(train_cmd(small_corpus, run_dir, 2, "--resume", "never"), cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert state_sha256(ckpt(run_dir, STEPS)) == state_sha256(ckpt(reference, STEPS))
    aside = {"step-000030": "step-000030.corrupt-no-manifest", **{f"step-{s:06d}": f"step-{s:06d}.corrupt-checksum"
                                                                  for s in (10, 20, 40)}}
    assert {Path(aside[p.parts[0]], *p.parts[1:]): data for p, data in before.items()} == {
        p.relative_to(root): p.read_bytes() for p in root.glob("step-*.corrupt-*/*")}, "set aside, byte for byte"


@pytest.fixture
def small_volume(tmp_path: Path):
    """A real 8 MiB filesystem (tmpfs) to fill up; needs the right to mount (root, as in CI)."""
    with tmpfs(tmp_path / "volume", "8m") as mount:
        yield mount


def test_disk_full_during_a_save_loses_nothing_and_the_next_save_succeeds(
        reference: Path, small_corpus: Path, tmp_path: Path, small_volume: Path) -> None:
    run_dir = tmp_path / "full"
    ckpt_dir = small_volume / "checkpoints"
    result = run_keel(train_cmd(small_corpus, run_dir, 2, f"checkpoint.dir={ckpt_dir}",
                                fault("FillDiskBeforeCheckpoint", path=str(small_volume), step=20)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    failed = events(run_dir, "checkpoint", "failed")
    assert [e["step"] for e in failed] == [20]
    assert "No space left on device" in failed[0]["detail"]["error"]
    assert [e["step"] for e in events(run_dir, "alert", "checkpoint_failed")] == [20]
    assert "the next save retries" in result.stdout
    storage = Storage(ckpt_dir)
    assert sorted(p.name for p in ckpt_dir.glob("step-*")) == ["step-000010", "step-000030", "step-000040"]
    assert all(verify(storage, f"step-{s:06d}") == [] for s in (10, 30, 40))
    assert state_sha256(ckpt_dir / "step-000040") == state_sha256(ckpt(reference, STEPS))
    assert state_sha256(ckpt_dir / "step-000010") == state_sha256(ckpt(reference, 10))


def test_a_second_job_on_the_same_run_directory_is_refused(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "shared"
    first, tag = spawn_keel([*train_cmd(small_corpus, run_dir, 2)[:-2], "train.steps=100000"], tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(events(run_dir, "start")) < 2 or not losses(run_dir):
            assert time.monotonic() < deadline and first.poll() is None, "the first job did not start"
            time.sleep(0.2)
        config = (run_dir / "config.toml").read_text()
        n_events = len(read_jsonl(run_dir / "events.jsonl"))
        second = run_keel(train_cmd(small_corpus, run_dir, 2), cwd=tmp_path)
        assert second.returncode == 2
        assert "is in use by another keel job" in second.stderr and len(second.stderr.strip().splitlines()) == 1
        assert f"pid {first.pid}" in second.stderr
        assert (run_dir / "config.toml").read_text() == config
        assert not [e for e in read_jsonl(run_dir / "events.jsonl")[n_events:] if e["kind"] == "start"]
        assert first.poll() is None, "the first job goes on"
    finally:
        kill_tagged(tag)
        first.wait()
    assert not tagged(tag)


def test_retention_keeps_the_last_the_permanent_and_those_being_read(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "retention"
    storage = Storage(run_dir / "checkpoints")
    with storage.reading("step-000010"):  # a reader (an evaluation job, an export) holds step 10 open
        result = run_keel(["train", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={small_corpus}",
                           "train.steps=60", "checkpoint.interval=10", "checkpoint.keep_last=2",
                           "checkpoint.keep_every=20"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-000010", "step-000020", "step-000040", "step-000050", "step-000060"]
    pruned = [n for e in events(run_dir, "checkpoint", "committed") for n in e["detail"]["pruned"]]
    assert sorted(pruned) == ["step-000030"]
    ls = run_keel(["ckpt", "ls", str(run_dir)], cwd=tmp_path)
    assert ls.returncode == 0, ls.stderr
    rows = {line.split()[0]: line for line in ls.stdout.splitlines()[1:]}
    assert "(latest)" in rows["step-000060"] and "(permanent)" in rows["step-000040"]
    assert "(permanent)" not in rows["step-000050"] and "complete" in rows["step-000050"]


def test_time_and_auto_interval_policies_save_without_changing_the_math(
        reference: Path, small_corpus: Path, tmp_path: Path) -> None:
    for policy in (["checkpoint.policy=seconds", "checkpoint.every_seconds=0.3"],
                   ["checkpoint.policy=auto", "checkpoint.mtbf_hours=0.0002"]):
        run_dir = tmp_path / policy[0].split("=")[1]
        result = run_keel(train_cmd(small_corpus, run_dir, 2, *policy, "checkpoint.interval=5"), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        saved = [e["step"] for e in events(run_dir, "checkpoint", "committed")]
        assert len(saved) >= 3 and saved[-1] == STEPS, saved
        assert state_sha256(ckpt(run_dir, STEPS)) == state_sha256(ckpt(reference, STEPS))
    decisions = events(run_dir, "checkpoint", "interval")
    assert decisions and saved[0] == 5, "auto takes its first save at `interval` steps to measure the cost"
    detail = decisions[0]["detail"]
    assert detail["mtbf_source"] == "checkpoint.mtbf_hours" and math.isclose(detail["mtbf_s"], 0.7, rel_tol=0.01)
    assert 0 < detail["delta_s"] < detail["interval_s"] < detail["mtbf_s"]


def test_resume_in_another_layout_of_the_same_world_size(reference: Path, small_corpus: Path,
                                                          tmp_path: Path) -> None:
    """Saved by FSDP over 2 ranks, resumed with tensor parallel over 2: model, optimizer, data cursor
    and step carry over; RNG streams are re-derived from (seed, step, rank)."""
    run_dir = tmp_path / "tp"
    result = run_keel(train_cmd(small_corpus, run_dir, 2, "parallel.tp=2", "--resume", str(ckpt(reference, 20))),
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    reference_losses, resumed = losses(reference), losses(run_dir)
    assert sorted(resumed) == list(range(21, STEPS + 1))
    for step, loss in resumed.items():
        assert math.isclose(loss, reference_losses[step], rel_tol=1e-4), (step, loss, reference_losses[step])
    state = json.loads((ckpt(run_dir, STEPS) / "train_state.json").read_text())
    assert state["loader"] == json.loads((ckpt(reference, STEPS) / "train_state.json").read_text())["loader"]
