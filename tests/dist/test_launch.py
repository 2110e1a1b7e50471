"""`torchrun -m keel train` works as well as `keel train --nproc`: keel runs as a worker of an
external elastic agent, and the workers prepare the built-in corpus once between them. The job's life:
its workers die with their launcher, a second job stays out while any worker of the first lives, and a
stop signal while the job starts is a pause."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from keel.data.shards import open_corpus
from keel.errors import EXIT_STORAGE
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, TAG, free_port, keel_env, kill_tagged, run_keel, spawn_keel, tagged, tmpfs

pytestmark = pytest.mark.dist


@pytest.mark.timeout(240)
def test_external_torchrun_prepares_the_corpus_once_and_trains(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "keel", "train", *SMALL_RUN, "train.steps=3"]
    result = subprocess.run(cmd, cwd=tmp_path, env=keel_env(), capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr
    corpus = open_corpus(tmp_path / "data" / "stdlib")  # built by the workers, checksums verified
    assert corpus.manifest["sources"]["main"]["paths"] == ["stdlib"]
    assert not list((tmp_path / "data").glob(".stdlib.tmp-*")), "no half-written corpus is left"
    run_dir = tmp_path / "runs" / "tiny"
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1]
    assert all(e["detail"]["world_size"] == 2 for e in starts)
    assert (run_dir / "checkpoints" / "step-000003" / "manifest.json").exists()
    assert result.stdout.count("preparing the built-in corpus") <= 1


# ---------------------------------------------------------------- the job's life: start, kill, pause

def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the job ended with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def events_of(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in read_jsonl(path) if e["kind"] == kind] if path.exists() else []


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def sigkill_once_saved_and_see_all_gone(proc: subprocess.Popen, tag: str, run_dir: Path, job: int) -> list[int]:
    """SIGKILL the launcher (keel's or torchrun's) of a running 2-process job once its first checkpoint is
    committed; its workers must follow it within seconds. Returns the processes of the job left 10 s
    after the kill (none, unless a worker outlived its launcher). `job`: how many processes the job runs."""
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step-000005" / "manifest.json").exists(), 180,
                 "the first checkpoint", proc)
        assert len(tagged(tag)) == job, "the launcher, its workers (and keel's worker server, its resource tracker)"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return tagged(tag)
    finally:
        kill_tagged(tag)


@pytest.mark.timeout(240)
def test_workers_die_with_their_sigkilled_launcher_and_the_rerun_resumes(small_corpus: Path,
                                                                         tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = ["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={small_corpus}",
           "train.steps=30", "checkpoint.interval=5"]
    proc, tag = spawn_keel(cmd, tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert sigkill_once_saved_and_see_all_gone(proc, tag, run_dir, 5) == [], "the workers die with their launcher"
    rerun = run_keel(cmd, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert [e["step"] for e in events_of(run_dir, "resume")][-1] >= 5


@pytest.mark.timeout(240)
def test_workers_of_a_plain_torchrun_die_with_it(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "keel",
           "train", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={small_corpus}", "train.steps=30",
           "checkpoint.interval=5"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**keel_env(), TAG: tag}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    assert sigkill_once_saved_and_see_all_gone(proc, tag, run_dir, 3) == [], "the workers die with their torchrun"


def test_a_second_job_is_refused_while_a_worker_of_the_first_lives(small_corpus: Path, tmp_path: Path) -> None:
    """A worker left by an earlier job (here a process holding the workers' share of the run directory, as
    every worker does for its whole life) keeps a new job out, which names it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hold = ("import sys, time; from pathlib import Path; from keel.rundir.lock import hold_as_worker; "
            "hold_as_worker(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")
    orphan = subprocess.Popen([sys.executable, "-c", hold, str(run_dir)], env=keel_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert orphan.stdout is not None and orphan.stdout.readline().strip() == "held"
        result = run_keel(["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN,
                           f"data.dir={small_corpus}", "train.steps=3"], cwd=tmp_path, timeout=120)
    finally:
        orphan.kill()
        orphan.wait()
    assert result.returncode == 2
    assert result.stderr.strip() == (f"keel: error: run directory {str(run_dir)!r} is still in use by workers of an "
                                     f"earlier keel job (pids {orphan.pid}); wait for them to end or stop them, or "
                                     f"pass another --run-dir")
    assert not (run_dir / "events.jsonl").exists(), "nothing started"


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` now (the kernel's caught-signals mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


def _launcher_validating(run_dir: Path, tag: str) -> bool:
    return True


def _workers_started(run_dir: Path, tag: str) -> bool:
    return len(tagged(tag)) >= 5  # the launcher, its worker server and its resource tracker, two workers


def _workers_loading(run_dir: Path, tag: str) -> bool:
    return len(events_of(run_dir, "start")) >= 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("moment, sig", [
    (_launcher_validating, signal.SIGTERM),
    (_workers_started, signal.SIGUSR1),
    (_workers_loading, signal.SIGTERM),
])
def test_a_stop_signal_while_the_job_starts_is_a_pause(reference_run: Path, small_corpus: Path, tmp_path: Path,
                                                       moment, sig: signal.Signals) -> None:
    """SIGTERM or SIGUSR1 to the launcher before any step: exit 75, every checkpoint file as it was."""
    run_dir = tmp_path / "A"
    shutil.copytree(reference_run, run_dir, symlinks=True)
    before = tree_digest(run_dir / "checkpoints")
    cmd = ["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={small_corpus}",
           "checkpoint.interval=10", "checkpoint.keep_last=10", "train.steps=60"]
    proc, tag = spawn_keel(cmd, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: catches(proc.pid, sig), 60, "the launcher's first statements to catch the signal", proc)
        wait_for(lambda: moment(run_dir, tag), 120, moment.__name__, proc)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=180)
        wait_for(lambda: not tagged(tag), 10, "every process of the job to end")
    finally:
        kill_tagged(tag)
    assert proc.returncode == 75, err
    assert "Traceback" not in err
    after = tree_digest(run_dir / "checkpoints")
    assert {k: v for k, v in after.items() if k in before} == before, "every checkpoint file is kept, byte for byte"
    assert not events_of(run_dir, "resume") or max(int(e["step"]) for e in events_of(run_dir, "resume")) == 40


def test_a_worker_crash_shows_the_workers_own_traceback(small_corpus: Path, tmp_path: Path) -> None:
    """An exception in a worker (a bug, not bad input) reaches the console with the worker's traceback, and
    without the launcher's."""
    crash = ['callbacks=[{path = "tests.dist.crash_probe:RaiseAtStep", args = {step = 2}}]']
    result = run_keel(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), *SMALL_RUN,
                       f"data.dir={small_corpus}", "train.steps=4", *crash], cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]  # failed, not to be retried as it is
    assert "Traceback" in result.stderr and 'crash_probe.py", line' in result.stderr, result.stderr[-3000:]
    assert "RuntimeError: raised by crash_probe at step 2" in result.stderr
    assert "in _poll" not in result.stderr  # the agent's own frames


# ---------------------------------------------------------------- a final save the volume refuses

FINAL_STEP = 4
REFUSALS = {"ENOSPC": "fill_disk_before_checkpoint", "EROFS": "read_only_before_checkpoint"}


def refused_final_save(corpus: Path, volume: Path, run_dir: Path, refusal: str) -> list[str]:
    """A short run whose only save, the last step's, meets a real `refusal` of the volume under checkpoint.dir
    (the injector fills it up, or remounts it read-only, just before)."""
    return ["--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={corpus}", f"train.steps={FINAL_STEP}",
            f"checkpoint.dir={volume / 'checkpoints'}",
            f'drill.inject=["{REFUSALS[refusal]}:path={volume},step={FINAL_STEP}"]']


def assert_refused_final_save(run_dir: Path, refusal: str, console: str) -> None:
    (failed,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint"
                 and e["action"] == "failed"]
    assert failed["step"] == FINAL_STEP and failed["detail"]["volume_error"] == refusal, failed
    assert "the final checkpoint could not be written" in console
    assert "the next save retries" not in console, "no save comes after the last step's"
    assert "not retrying" not in console, "the launcher takes 73 as the workers' own answer"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("refusal, max_restarts, elastic", [
    ("ENOSPC", 1, False), ("EROFS", 0, False),  # a restart to spare is not spent; none to spare ends it alike
    ("ENOSPC", 1, True),  # an elastic job's agent (--nnodes) decides as a single node's does
])
def test_a_final_save_the_volume_refuses_ends_the_job_with_73_and_no_restart(
        small_corpus: Path, tmp_path: Path, refusal: str, max_restarts: int, elastic: bool) -> None:
    nodes = ["--nnodes", "1:1", "--rdzv-endpoint", f"localhost:{free_port()}"] if elastic else []
    with tmpfs(tmp_path / "volume", "8m") as volume:
        run_dir = tmp_path / "run"
        result = run_keel(["train", "--nproc", "2", "--max-restarts", str(max_restarts), *nodes,
                           *refused_final_save(small_corpus, volume, run_dir, refusal)], cwd=tmp_path)
        assert result.returncode == EXIT_STORAGE, result.stderr[-3000:]
        assert_refused_final_save(run_dir, refusal, result.stdout + result.stderr)
        assert len(events_of(run_dir, "start")) == 2, "no restart was spent on it"
        assert not list((volume / "checkpoints").glob("step-*")), "nothing committed, nothing left half-written"


@pytest.mark.timeout(300)
def test_replica_groups_end_with_73_when_the_writing_groups_final_save_is_refused(small_corpus: Path,
                                                                                  tmp_path: Path) -> None:
    """The group that writes the run's checkpoints exits 73; the other finishes its steps without a save of
    its own, which does not make the run's end a success."""
    pytest.importorskip("torchft")
    with tmpfs(tmp_path / "volume", "8m") as volume:
        run_dir = tmp_path / "run"
        result = run_keel(["train", "--replica-groups", "2", "--nproc", "1", "--max-restarts", "1",
                           *refused_final_save(small_corpus, volume, run_dir, "ENOSPC")], cwd=tmp_path, timeout=280)
    assert result.returncode == EXIT_STORAGE, result.stderr[-3000:]
    ended = {e["detail"]["group"]: e["detail"]["exit_code"] for e in events_of(run_dir, "group")
             if e["action"] == "ended"}
    assert sorted(ended.values()) == [0, EXIT_STORAGE], ended
    (writer,) = [g for g, code in ended.items() if code == EXIT_STORAGE]
    assert_refused_final_save(run_dir / "groups" / str(writer), "ENOSPC", result.stdout + result.stderr)
    assert len(events_of(run_dir / "groups" / str(writer), "start")) == 1, "no restart was spent on it"


@pytest.mark.timeout(240)
def test_plain_torchrun_reports_the_workers_73(small_corpus: Path, tmp_path: Path) -> None:
    """torch's own agent knows no keel codes: it exits 1 and names the worker's 73 as the root cause."""
    with tmpfs(tmp_path / "volume", "8m") as volume:
        run_dir = tmp_path / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "keel",
               "train", *refused_final_save(small_corpus, volume, run_dir, "EROFS")]
        result = subprocess.run(cmd, cwd=tmp_path, env=keel_env(), capture_output=True, text=True, timeout=200)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(rf"exitcode\s*:\s*{EXIT_STORAGE}\b", result.stderr), result.stderr[-3000:]
    assert_refused_final_save(run_dir, "EROFS", result.stdout + result.stderr)
