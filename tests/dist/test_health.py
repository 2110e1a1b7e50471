"""A run that outlives its failures: pause and preemption, hangs, stragglers, kills, preflight and an
elastic job that leaves a quarantined node out. Real `keel train` processes, real signals, and the
final state compared with an uninterrupted run's."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, free_port, kill_tagged, run_keel, spawn_keel

pytestmark = pytest.mark.dist

STEPS = 40
SLOW = 'drill.inject=["slow:rank=-1,seconds=0.1"]'  # every rank 0.1 s slower per step: time to act mid-run


def train_cmd(corpus: Path, run_dir: Path, *extra: str, nproc: int = 2, steps: int = STEPS) -> list[str]:
    return ["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={steps}",
            f"data.dir={corpus}", *extra]


def final_checkpoint(run_dir: Path, steps: int = STEPS) -> Path:
    return run_dir / "checkpoints" / f"step-{steps:06d}"


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if kind is None or e["kind"] == kind]


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while status(run_dir).get("step", 0) < step:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout} s"
        time.sleep(0.05)


# The uninterrupted run, `reference_run` (tests/conftest.py), is train_cmd(corpus, run_dir) saving every 10 steps.


@pytest.mark.parametrize("how", ["keel_pause", "sigterm_to_launcher", "sigterm_to_one_worker"])
def test_pause_checkpoints_exits_75_and_rerun_is_bitwise_equal(how: str, reference_run: Path, small_corpus: Path,
                                                               tmp_path: Path) -> None:
    run_dir = tmp_path / "P"
    extra = [SLOW] if how != "sigterm_to_one_worker" else ['drill.inject=["signal:step=15,rank=1,signal=SIGTERM"]']
    cmd = train_cmd(small_corpus, run_dir, *extra)
    proc, tag = spawn_keel(cmd, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if how == "keel_pause":
            wait_for_step(run_dir, 10, proc)
            asked = run_keel(["pause", str(run_dir)], cwd=tmp_path)
            assert asked.returncode == 0, asked.stderr
        elif how == "sigterm_to_launcher":
            wait_for_step(run_dir, 10, proc)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        kill_tagged(tag)
    assert proc.returncode == 75, err[-3000:]
    paused = events(run_dir, "pause")
    assert len(paused) == 1 and paused[0]["detail"]["saved"], paused
    step = paused[0]["step"]
    assert 10 <= step < STEPS if how != "sigterm_to_one_worker" else step == 15
    assert paused[0]["detail"]["reason"] == {"keel_pause": "keel pause", "sigterm_to_launcher": "SIGTERM",
                                             "sigterm_to_one_worker": "asked on 1 other rank(s)"}[how]
    assert status(run_dir)["state"] == "paused"
    assert not (run_dir / "PAUSE").exists(), "the pause request must be consumed"
    verified = run_keel(["ckpt", "verify", str(run_dir / "checkpoints" / f"step-{step:06d}")], cwd=tmp_path)
    assert verified.returncode == 0 and "verified" in verified.stdout, verified.stdout + verified.stderr

    again = run_keel(cmd, cwd=tmp_path)  # the same command resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert [e["step"] for e in events(run_dir, "resume")] == [step]
    assert state_sha256(final_checkpoint(run_dir)) == state_sha256(final_checkpoint(reference_run))
    assert status(run_dir)["state"] == "finished"


# Timeouts that find a hang in seconds: learned after 5 steps, at their 6 s floor (collective 3 s < step 6 s),
# beats every 0.5 s. A synchronous save every 5 steps: the one before each fault is committed when it lands.
FAST_HANGS = ["health.watchdog.warmup_steps=5", "health.watchdog.min_timeout_s=6", "health.watchdog.poll_s=0.5",
              "checkpoint.interval=5", "checkpoint.async_save=false"]
# (fault, rank, step) in the order they land: a rank stopped (SIGSTOP), one asleep in Python (its watchdog
# thread still answers), one spinning in C holding the GIL (running, but neither beating nor answering).
HANGS = {
    2: [("asleep", 1, 13), ("stopped", 1, 18), ("stopped", 0, 23), ("busy", 1, 28), ("busy", 0, 33)],
    4: [("stopped", 0, 8), ("stopped", 3, 13)],  # the store's host, and a rank of the other half
}
FOUR = ["train.micro_batch=2"]  # 2 of the 8 sequences of a step on each of 4 ranks


def hang_spec(fault: str, rank: int, step: int) -> str:
    return {"asleep": f"hang:step={step},rank={rank}", "busy": f"hang:step={step},rank={rank},busy=true",
            "stopped": f"signal:step={step},rank={rank},signal=SIGSTOP"}[fault]


@pytest.mark.parametrize("nproc", sorted(HANGS))
def test_each_stopped_or_hung_rank_is_named_within_the_learned_timeout_and_the_run_resumes_bitwise(
        nproc: int, reference_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    """Each fault leaves its peers waiting in a collective, where the first to time out is a waiter: the
    `hang` event names the faulty rank alone, whoever found the hang (the waiter when the faulty rank can
    still answer, else the launcher, from its process state, its silent heartbeat, or the ranks that did not
    answer the alarm), and the workers restart from the last checkpoint."""
    faults = HANGS[nproc]
    steps = STEPS if nproc == 2 else 15
    extra = [] if nproc == 2 else FOUR
    if nproc == 2:
        reference = final_checkpoint(reference_run)  # the same run, uninterrupted, saving every 10 steps
    else:
        clean = run_keel(train_cmd(small_corpus, tmp_path / "clean", *extra, nproc=4, steps=steps), cwd=tmp_path)
        assert clean.returncode == 0, clean.stderr[-3000:]
        reference = final_checkpoint(tmp_path / "clean", steps)
    run_dir = tmp_path / "H"
    inject = ", ".join(f'"{hang_spec(*f)}"' for f in faults)
    cmd = train_cmd(small_corpus, run_dir, *extra, *FAST_HANGS, f"drill.inject=[{inject}]",
                    "--max-restarts", str(len(faults)), nproc=nproc, steps=steps)
    result = run_keel(cmd, cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]

    hangs, landed = events(run_dir, "hang"), events(run_dir, "drill")
    assert [(h["step"], h["detail"]["stuck_ranks"]) for h in hangs] == [(step, [rank]) for _, rank, step in faults]
    for (fault, rank, _), hang, drill in zip(faults, hangs, landed, strict=True):
        detail = hang["detail"]
        assert detail["detected_by"] == ("launcher" if fault != "asleep" else 1 - rank), detail
        assert detail["section"] == "step" and detail["hosts"] == [socket.gethostname()], detail
        # Found within the learned step timeout (6 s) after it landed, with a margin for the machine's load.
        step_timeout = detail["timeouts"]["step"]
        assert 6.0 <= step_timeout < 10 and hang["time"] - drill["time"] <= step_timeout + 5, (hang, drill)
        if fault != "asleep":
            assert detail["process_states"][str(rank)] == ("stopped" if fault == "stopped" else "running"), detail
            assert rank not in detail["waiting_ranks"] and detail["waiting_ranks"], detail
            # The workers are ended at once (a stopped one takes no SIGTERM), to be started again: by the
            # launcher's SIGKILL, or, on a loaded machine, by a waiter's own exit (1) when its collective's timeout
            # ends it first; never by the faulty rank ending itself.
            ended = next(e for e in events(run_dir, "failure") if e["time"] >= hang["time"])
            codes = ended["detail"]["exit_codes"]
            assert codes in ([-9], [1], [-9, 1]) and ended["time"] - hang["time"] < 5, ended
            assert codes != [1] or rank not in ended["detail"]["ranks"], ended
        if fault == "busy":  # a rank spinning in C still writes its stacks when asked (faulthandler, in C)
            stacks = (run_dir / "logs" / f"stacks-rank-{rank}.txt").read_text()
            asked = stacks.split("stacks asked by the launcher")
            assert any(f"rank(s) {rank} stopped" in part and "in deliver" in part for part in asked), stacks[-3000:]

    assert [e["step"] for e in events(run_dir, "resume")] == [step // 5 * 5 for _, _, step in faults]
    assert state_sha256(final_checkpoint(run_dir, steps)) == state_sha256(reference)


def test_straggler_is_named_within_50_steps(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "S"
    result = run_keel(train_cmd(small_corpus, run_dir, 'drill.inject=["slow:rank=1,factor=3"]',
                                "health.straggler.interval=10", steps=60), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    first = events(run_dir, "straggler")[0]
    assert first["step"] <= 50 and first["detail"]["rank"] == 1 and first["detail"]["host"], first
    assert first["detail"]["ratio"] > 1.5
    alerts = [e for e in events(run_dir, "alert") if e["action"] == "straggler"]
    assert alerts and "rank 1" in alerts[0]["detail"]["message"]


def test_no_straggler_in_a_clean_run_of_200_steps(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "C"
    result = run_keel(train_cmd(small_corpus, run_dir, "health.straggler.interval=10", "monitor.interval=50",
                                "eval.interval=0", "checkpoint.interval=200", steps=200), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert events(run_dir, "straggler") == []
    ratios = [r["health/slowest_rank_ratio"] for r in read_jsonl(run_dir / "metrics.jsonl")
              if "health/slowest_rank_ratio" in r]
    assert ratios, "the straggler check must have run"


@pytest.mark.parametrize("attempts, no_progress, max_restarts, message", [
    (3, 5, 2, "the workers failed 3 times (--max-restarts 2); not retrying"),  # the restart budget
    (9, 2, 8, "2 restarts in a row did not get past step 24; not retrying"),  # stopped before the budget
])
def test_repeated_failures_stop_with_do_not_requeue(attempts: int, no_progress: int, max_restarts: int, message: str,
                                                    small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "K"
    # A synchronous save: step 20's checkpoint is committed before the kill in step 25 (a background one
    # on shared cores may not be, and the next start would begin from step 0 instead of resuming).
    result = run_keel(train_cmd(small_corpus, run_dir, f'drill.inject=["kill:step=25,rank=1,times={attempts}"]',
                                f"health.no_progress_restarts={no_progress}", "checkpoint.async_save=false",
                                "--max-restarts", str(max_restarts)), cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-3000:]
    assert message in result.stdout
    assert len(events(run_dir, "resume")) == 2


def test_a_read_only_checkpoint_directory_is_refused_before_any_worker_starts(small_corpus: Path,
                                                                              tmp_path: Path) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only file system here: {mounted.stderr.strip()}")
    try:
        run_dir = tmp_path / "RO"
        result = run_keel(train_cmd(small_corpus, run_dir, "health.preflight=fail",
                                    f"checkpoint.dir={read_only}/checkpoints"), cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(read_only)], check=True)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (f"keel: error: checkpoint.dir '{read_only}/checkpoints' cannot be created: "
                                     f"'{read_only}' is on a read-only file system; pass a directory this user may "
                                     f"write in")
    assert not run_dir.exists(), "nothing is created"


def test_preflight_names_the_rank_whose_collective_is_wrong(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "AR"
    result = run_keel(train_cmd(small_corpus, run_dir, "health.preflight=fail",
                                'drill.inject=["wrong_allreduce:rank=1"]'), cwd=tmp_path)
    assert result.returncode == 76, result.stderr[-3000:]
    assert "preflight: allgather_correct FAILED on node" in result.stdout
    (record,) = json.loads((run_dir / "quarantine.json").read_text())
    assert record["source"] == "preflight" and record["ranks"] == [1], record
    (pre,) = events(run_dir, "preflight")
    failed = [c for c in pre["detail"]["checks"] if not c["ok"]]
    assert [(c["name"], c["rank"]) for c in failed] == [("allgather_correct", 1)]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_elastic_job_leaves_a_quarantined_node_and_finishes_on_the_other(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "E"
    steps = 160
    cmd = train_cmd(small_corpus, run_dir, 'drill.inject=["slow:rank=-1,seconds=0.05"]', "monitor.interval=10",
                    "eval.interval=0", "--nnodes", "1:2", "--rdzv-endpoint", f"localhost:{free_port()}",
                    nproc=1, steps=steps)  # no restarts allowed: a node leaving does not use one up
    # Node a starts first, so it hosts the rendezvous store (the endpoint's node must not be the one to leave).
    a, tag_a = spawn_keel(cmd, cwd=tmp_path, env={"KEEL_NODE": "a"}, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    time.sleep(3)
    b, tag_b = spawn_keel(cmd, cwd=tmp_path, env={"KEEL_NODE": "b"}, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    # The uninterrupted 2-process run the losses are compared with: made while node a finishes alone.
    reference_dir = tmp_path / "E-reference"
    reference_cmd = train_cmd(small_corpus, reference_dir, "monitor.interval=10", "eval.interval=0", steps=steps)
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            deadline = time.monotonic() + 120
            while not [e for e in events(run_dir, "start") if e["detail"]["world_size"] == 2] or status(
                    run_dir).get("step", 0) < 30:
                assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, "the job did not form"
                time.sleep(0.1)
            marked = run_keel(["quarantine", str(run_dir), "b", "--reason", "drill"], cwd=tmp_path)
            assert marked.returncode == 0, marked.stderr
            out_b, err_b = b.communicate(timeout=120)
            reference_made = pool.submit(run_keel, reference_cmd, tmp_path)
            out_a, err_a = a.communicate(timeout=240)
        finally:
            kill_tagged(tag_a)
            kill_tagged(tag_b)
        reference = reference_made.result()
    assert b.returncode == 76, err_b[-3000:]
    assert "node b is listed in quarantine.json" in out_b
    assert a.returncode == 0, err_a[-3000:]
    story = [(e["kind"], e["detail"].get("world_size")) for e in events(run_dir)
             if e["kind"] in ("start", "leave", "resume", "finish") and e["rank"] == 0]
    # Node a may train alone until b joins its rendezvous (a job of 1 to 2 nodes starts with 1): it then
    # pauses at a step, and both resume from that checkpoint.
    formed = story.index(("start", 2))
    assert story[:formed] in ([], [("start", 1)]), story
    assert story[formed:] == [("start", 2), *[("resume", None)] * formed, ("leave", None), ("start", 1),
                              ("resume", None), ("finish", None)], story
    (leave,) = events(run_dir, "leave")
    assert leave["detail"]["nodes"] == ["b"] and leave["detail"]["saved"]
    resume = events(run_dir, "resume")[-1]
    assert resume["step"] == leave["step"]  # nothing lost: the leave wrote the checkpoint it resumes from
    # The same global batches: the one-node run accumulates twice the micro-batches per step.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_seen"] == steps * 8 * 64
    # The same batches as an uninterrupted 2-process run: the losses after the resume match it (one
    # process sums the micro-batches in another order: equal to rounding, not bitwise).
    assert reference.returncode == 0, reference.stderr[-3000:]
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    expected = {r["step"]: r["train/loss"] for r in read_jsonl(reference_dir / "metrics.jsonl") if "train/loss" in r}
    after = [s for s in expected if s > leave["step"]]
    assert after and all(s in losses for s in after)
    for s in after:
        assert losses[s] == pytest.approx(expected[s], rel=2e-3), s
