"""Replica groups (torchft): a group lost mid-run heals from its live peer while the other keeps training,
and the run computes what the fault-free run computes: the same rows of tokens at every step, the same
tokens seen, the same final state within the tolerance of another summation order.

Every run is a real `keel train --replica-groups 2`: a torchft lighthouse on loopback, one torchrun agent per
group, real SIGKILLs (of a group's processes, and of the lighthouse)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from keel.drill.runner import lighthouse_pid
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, kill_tagged, run_keel, spawn_keel, tagged

pytestmark = pytest.mark.dist

STEPS = 40
FAULT_AT = 10
# In a run with a killed lighthouse, every group sleeps this long in each step from the fault's on, so that the
# lighthouse is back well before the run ends; the sleep changes nothing the run computes, and the steps before
# the fault, or a run without one, go at their own pace.
PACE = f"slow:rank=-1,seconds=0.4,from_step={FAULT_AT}"
# After a kill, the live groups sleep this long in every step they make without the killed one: up to 21 s
# over the 30 steps left, time for it to restart and heal (3-7 s on an idle machine) on a loaded one; once
# it has healed, both go at their own pace.
WHILE_MISSING = "slow:rank=-1,seconds=0.7,while_missing=true"
# A killed group stays down this long before its restart builds anything: past the lighthouse's heartbeat
# timeout, so that the survivor goes on without it (restarted workers are otherwise back within a second,
# and the survivor's quorum waits for them instead).
DOWN_S = 3
TOLERANCE = 1e-4  # float32 sums in another order, compounded over the steps after the fault


def ft_cmd(corpus: Path, run_dir: Path, *fault: str, paced: bool = False) -> list[str]:
    probe = f'callbacks=[{{path = "tests.dist.replica_probe:StepLedger", args = {{out = "{run_dir / "probe"}"}}}}]'
    killed = any("kill" in f for f in fault) and not paced
    faults = ", ".join(f'"{f}"' for f in (PACE if paced else "", WHILE_MISSING if killed else "", *fault) if f)
    return ["train", "--replica-groups", "2", "--nproc", "1", "--run-dir", str(run_dir), *SMALL_RUN,
            f"train.steps={STEPS}", f"data.dir={corpus}", "eval.interval=0", "checkpoint.interval=100",
            "fault_tolerance.max_restarts=2", probe, f"drill.inject=[{faults}]"]


def ledger(run_dir: Path, group: int, kind: str = "state") -> dict[int, dict]:
    """Each step's record of the group's rank 0 (the last, for a step attempted more than once)."""
    return {r["step"]: r for r in read_jsonl(run_dir / "probe" / f"{group}-0.jsonl") if r["kind"] == kind}


def rows_by_step(run_dir: Path) -> dict[int, Counter]:
    """The rows of tokens each step's update was computed from, over every group that contributed to it."""
    out: dict[int, Counter] = {}
    for group in sorted(int(p.name.split("-")[0]) for p in (run_dir / "probe").glob("*-0.jsonl")):
        for step, record in ledger(run_dir, group, "rows").items():
            out.setdefault(step, Counter()).update(record["rows"])
    return out


def final_params(run_dir: Path, group: int) -> list[torch.Tensor]:
    return torch.load(run_dir / "probe" / f"{group}-0-final.pt")


def group_events(run_dir: Path, group: int, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "groups" / str(group) / "events.jsonl") if e["kind"] == kind]


@pytest.fixture(scope="module")
def fault_free(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ft") / "clean"
    done = run_keel(ft_cmd(small_corpus, run_dir), cwd=run_dir.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def assert_same_run(faulted: Path, clean: Path) -> None:
    """Every step trained on the rows the fault-free run trained on; same tokens seen; final state within
    the tolerance; the healed group bitwise equal to the survivor at every step both made."""
    assert rows_by_step(faulted) == rows_by_step(clean)
    survivor, healed = ledger(faulted, 0), ledger(faulted, 1)
    assert survivor[STEPS]["tokens_seen"] == ledger(clean, 0)[STEPS]["tokens_seen"]
    assert survivor[STEPS]["loader_batch"] == ledger(clean, 0)[STEPS]["loader_batch"] == STEPS
    assert survivor[STEPS]["consumed"] == ledger(clean, 0)[STEPS]["consumed"]
    heal = group_events(faulted, 1, "quorum")[-1]
    assert heal["action"] == "heal"
    later = [s for s in healed if s > heal["step"]]
    assert later and max(later) == STEPS
    for s in later:
        assert (healed[s]["params"], healed[s]["optimizer"]) == (survivor[s]["params"], survivor[s]["optimizer"]), s
    for a, b in zip(final_params(faulted, 0), final_params(clean, 0), strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0), (a - b).abs().max()
    assert abs(survivor[STEPS]["loss"] - ledger(clean, 0)[STEPS]["loss"]) < TOLERANCE


def test_fault_free_groups_hold_the_same_state_and_split_every_batch(fault_free: Path) -> None:
    g0, g1 = ledger(fault_free, 0), ledger(fault_free, 1)
    both = sorted(set(g0) & set(g1))
    assert both == list(range(1, STEPS + 1))  # the first quorum waits for every group
    for s in both:
        assert (g0[s]["params"], g0[s]["optimizer"]) == (g1[s]["params"], g1[s]["optimizer"])
    r0, r1 = ledger(fault_free, 0, "rows"), ledger(fault_free, 1, "rows")
    for s in both:
        assert len(r0[s]["rows"]) == len(r1[s]["rows"]) == 4  # half of the global batch of 8 each
        assert not set(r0[s]["rows"]) & set(r1[s]["rows"])
    checkpoints = sorted(p.name for p in (fault_free / "checkpoints").glob("step-*"))
    assert checkpoints == [f"step-{STEPS:06d}"]  # one group writes the run's checkpoints


def test_group_killed_mid_step_heals_from_its_live_peer(fault_free: Path, small_corpus: Path,
                                                        tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    done = run_keel(ft_cmd(small_corpus, run_dir, f"kill:step={FAULT_AT},rank=-1,group=1,down_s={DOWN_S}"),
                    cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(group_events(run_dir, 0, "start")) == 1, "the surviving group must never restart"
    assert len(group_events(run_dir, 1, "start")) == 2
    survivor = ledger(run_dir, 0)
    assert sorted(survivor) == list(range(1, STEPS + 1)), "no step of the survivor is lost or repeated"
    assert len({r["pid"] for r in survivor.values()}) == 1
    alone = [s for s, r in ledger(run_dir, 0, "rows").items() if len(r["rows"]) == 8]
    assert alone, "while the other group is missing, the survivor takes its share of the global batch"
    assert_same_run(run_dir, fault_free)
    buckets = json.loads((run_dir / "groups" / "0" / "goodput.json").read_text())["buckets"]
    assert buckets["replica_cover"] > 0 and buckets["replica_quorum"] > 0 and buckets["failed_down"] == 0
    healed_buckets = json.loads((run_dir / "groups" / "1" / "goodput.json").read_text())["buckets"]
    assert healed_buckets["failed_down"] > 0, "the killed group's downtime is charged to it"


def test_group_killed_inside_the_gradient_all_reduce_leaves_the_survivor_training(
        fault_free: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "in_reduce"
    # The heal goes over the groups' process group this time (torchft's PG transport, which needs numpy).
    done = run_keel([*ft_cmd(small_corpus, run_dir, f"kill_in_reduce:step={FAULT_AT},group=1"),
                     "fault_tolerance.transport=pg"], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(group_events(run_dir, 0, "start")) == 1, "the surviving group must never restart"
    retries = [e for e in group_events(run_dir, 0, "quorum") if e["action"] == "retry"]
    assert [e["step"] for e in retries] == [FAULT_AT - 1], "the step the peer died in is made again, once"
    assert sorted(ledger(run_dir, 0)) == list(range(1, STEPS + 1))
    assert_same_run(run_dir, fault_free)


def test_spike_rollback_is_taken_by_every_group_at_the_same_step(small_corpus: Path, tmp_path: Path) -> None:
    """A group healed mid-run rolls back with the survivor: the same spike, the same target, the same
    snapshot (every group takes one when a group joins), and bitwise equal states after it."""
    run_dir = tmp_path / "spike"
    guards = ["guard.snapshot_interval=10", "guard.rollback_steps=5", "guard.skip_batches=4",
              "guard.spike.warmup=20", "guard.spike.window=40"]
    faults = f'drill.inject=["{WHILE_MISSING}", "kill:step={FAULT_AT},rank=-1,group=1", "poison_batch:batch=34"]'
    done = run_keel([*ft_cmd(small_corpus, run_dir), *guards, faults], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    heal = group_events(run_dir, 1, "quorum")[-1]
    assert heal["action"] == "heal" and heal["step"] < 35, "the killed group must be back before the spike"
    rollbacks = [[(e["step"], e["detail"]["to_step"]) for e in group_events(run_dir, g, "guard")
                  if e["action"] == "rolled_back"] for g in (0, 1)]
    # The poisoned batch 34 is step 35's: the event carries the step the run had reached, 34.
    assert rollbacks[0] == rollbacks[1] and len(rollbacks[0]) == 1 and rollbacks[0][0][0] == 34
    survivor, healed = ledger(run_dir, 0), ledger(run_dir, 1)
    for s in range(rollbacks[0][0][1] + 1, STEPS + 1):
        assert (healed[s]["params"], healed[s]["optimizer"]) == (survivor[s]["params"], survivor[s]["optimizer"]), s


def test_a_replica_group_checkpoint_resumes_as_a_single_job(fault_free: Path, small_corpus: Path,
                                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "single"
    checkpoint = fault_free / "checkpoints" / f"step-{STEPS:06d}"
    done = run_keel(["train", "--run-dir", str(run_dir), "--resume", str(checkpoint), *SMALL_RUN,
                     f"train.steps={STEPS + 2}", f"data.dir={small_corpus}", "eval.interval=0"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert [e["step"] for e in resumed] == [STEPS]
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS + 2


def test_a_group_whose_state_flipped_a_bit_is_caught_and_both_roll_back(fault_free: Path, small_corpus: Path,
                                                                        tmp_path: Path) -> None:
    """Two groups that disagree cannot say which is wrong: both go back to the last state they shared
    and make the steps again, ending bitwise where the fault-free run ends."""
    run_dir = tmp_path / "bitflip"
    done = run_keel([*ft_cmd(small_corpus, run_dir, "bitflip:step=12,rank=0,group=1,target=params,bit=20"),
                     "guard.sdc.fingerprint_interval=5", "guard.snapshot_interval=5"], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for group in (0, 1):
        alerts = [e for e in group_events(run_dir, group, "alert") if e["action"] == "sdc_suspect"]
        assert [(e["step"], e["detail"]["suspects"], e["detail"]["verified_step"]) for e in alerts] == \
            [(15, [0, 1], 10)]
        rolled = [e for e in group_events(run_dir, group, "guard") if e["action"] == "rolled_back"]
        assert [(e["step"], e["detail"]["to_step"]) for e in rolled] == [(15, 10)]
    for a, b in zip(final_params(run_dir, 1), final_params(fault_free, 0), strict=True):
        assert torch.equal(a, b)


def test_lighthouse_killed_mid_run_is_restarted_and_the_groups_train_on(fault_free: Path, small_corpus: Path,
                                                                        tmp_path: Path) -> None:
    run_dir = tmp_path / "lighthouse"
    proc, tag = spawn_keel(ft_cmd(small_corpus, run_dir, paced=True), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while json.loads(_read(run_dir / "groups" / "0" / "status.json") or "{}").get("step", 0) < FAULT_AT:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        killed = lighthouse_pid(run_dir)
        os.kill(killed, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
        assert not tagged(tag), "nothing outlives the run"
    finally:
        kill_tagged(tag)
    assert proc.returncode == 0, out[-3000:]
    (restarted,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["action"] == "restarted"]
    assert restarted["kind"] == "lighthouse" and restarted["detail"]["exit_code"] == -signal.SIGKILL
    assert restarted["detail"]["pid"] != killed and restarted["detail"]["address"] == \
        read_jsonl(run_dir / "events.jsonl")[0]["detail"]["address"], "the same port, a new process"
    assert restarted["detail"]["restart_s"] < 2.0
    for group in (0, 1):
        assert len(group_events(run_dir, group, "start")) == 1, f"group {group} kept its processes"
        assert sorted(ledger(run_dir, group)) == list(range(1, STEPS + 1))
    assert rows_by_step(run_dir) == rows_by_step(fault_free)
    survivor, other, clean = ledger(run_dir, 0), ledger(run_dir, 1), ledger(fault_free, 0)
    for s in range(1, STEPS + 1):
        assert (survivor[s]["params"], survivor[s]["optimizer"]) == (other[s]["params"], other[s]["optimizer"]), s
    assert survivor[STEPS]["tokens_seen"] == clean[STEPS]["tokens_seen"]
    for a, b in zip(final_params(run_dir, 0), final_params(fault_free, 0), strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0), (a - b).abs().max()


def survivor_steps_s(run_dir: Path, until: int = STEPS) -> list[float]:
    """How long each of the survivor's (group 0's) committed steps up to `until` took, from the end of the one
    before."""
    times = [r["time"] for s, r in sorted(ledger(run_dir, 0).items()) if s <= until]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_a_group_killed_again_as_it_joins_and_the_lighthouse_then_make_no_one_wait_for_ever(
        fault_free: Path, small_corpus: Path, tmp_path: Path) -> None:
    """Group 1 SIGKILLed in step 11, its new worker SIGKILLed again as it joins, the lighthouse SIGKILLed a second
    later: torchft's waits on it (a quorum of three processes for two groups, its process group configured from
    a member that is gone, a quorum numbered again by a new lighthouse) end within their timeouts, the survivor
    keeps its process and the run ends as the fault-free run."""
    run_dir = tmp_path / "rejoin"
    cmd = ft_cmd(small_corpus, run_dir, f"kill:step={FAULT_AT + 1},rank=-1,group=1",
                 "kill_joining:group=1,after_s=0.2,lighthouse_after_s=1", paced=True)
    bounds = ["fault_tolerance.timeout_s=20", "fault_tolerance.quorum_timeout_s=20"]
    done = run_keel([*cmd, *bounds], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kills = [e for e in group_events(run_dir, 1, "drill") if "kill" in e["detail"]["fault"]]
    assert [e["detail"]["fault"].partition(":")[0] for e in kills] == ["kill", "kill_joining"]
    (restarted,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["action"] == "restarted"]
    assert restarted["kind"] == "lighthouse"
    assert len(group_events(run_dir, 0, "start")) == 1, "the surviving group must never restart"
    assert len({r["pid"] for r in ledger(run_dir, 0).values()}) == 1
    assert sorted(ledger(run_dir, 0)) == list(range(1, STEPS + 1))
    assert len(group_events(run_dir, 1, "start")) == 3
    assert not [e for e in group_events(run_dir, 0, "quorum") + group_events(run_dir, 1, "quorum")
                if e["action"] == "stuck"], "no worker had to be ended by the quorum's watchdog"
    assert max(survivor_steps_s(run_dir)) < 20, "no wait ran to a timeout (20 s)"
    assert_same_run(run_dir, fault_free)


def test_a_group_killed_in_its_heal_and_the_lighthouse_in_a_transfer_cost_the_survivor_a_heartbeat(
        fault_free: Path, small_corpus: Path, tmp_path: Path) -> None:
    """Group 1 SIGKILLed in step 10 (its restart held back, so that the survivor goes on alone first) and its new
    worker again as it heals (the live state received): the survivor notices within the heartbeat timeout (1 s),
    not the collective timeout (30 s here). Group 1 SIGKILLed again in step 25, and the lighthouse as the
    survivor hands it its state: the heal completes, the run goes on."""
    run_dir = tmp_path / "in_heal"
    cmd = ft_cmd(small_corpus, run_dir, f"kill:step={FAULT_AT},rank=-1,group=1,down_s={DOWN_S}",
                 "kill_healing:group=1",
                 "kill:step=25,rank=-1,group=1", "kill_lighthouse_serving:group=0,from_step=25", paced=True)
    done = run_keel([*cmd, "fault_tolerance.timeout_s=30", "fault_tolerance.max_restarts=3"], cwd=tmp_path,
                    timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fired = [(e["detail"]["fault"].partition(":")[0], e["detail"]["attempt"]) for g in (0, 1)
             for e in group_events(run_dir, g, "drill") if "kill" in e["detail"]["fault"]]
    assert sorted(fired) == [("kill", 0), ("kill", 2), ("kill_healing", 1), ("kill_lighthouse_serving", 0)]
    assert [e["kind"] for e in read_jsonl(run_dir / "events.jsonl") if e["action"] == "restarted"] == ["lighthouse"]
    assert len(group_events(run_dir, 0, "start")) == 1, "the surviving group must never restart"
    assert sorted(ledger(run_dir, 0)) == list(range(1, STEPS + 1))
    steps_s = survivor_steps_s(run_dir, until=24)  # before the lighthouse is killed
    paced_s = sorted(steps_s)[len(steps_s) // 2]
    # The bound asked of a loss during a heal: a heartbeat timeout and two steps, with a margin for a loaded machine.
    assert max(steps_s) <= 1.0 + 2 * paced_s + 1.5, (max(steps_s), paced_s)
    assert [e["action"] for e in group_events(run_dir, 1, "quorum")][-1] == "heal"
    assert_same_run(run_dir, fault_free)


def test_both_groups_killed_resume_together_and_a_group_given_up_is_an_alert(
        fault_free: Path, small_corpus: Path, tmp_path: Path) -> None:
    """Both groups SIGKILLed in the same step: both restart, resume from the newest checkpoint (or the later
    one heals from the first). Group 1 killed once more with its restart budget (1) spent is given up: a
    critical alert and a `keel status` line say so, and group 0 ends the run alone, as the fault-free run ends."""
    run_dir = tmp_path / "both"
    cmd = ft_cmd(small_corpus, run_dir, f"kill:step={FAULT_AT + 1},rank=-1,group=0",
                 f"kill:step={FAULT_AT + 1},rank=-1,group=1", "kill:step=20,rank=-1,group=1", paced=True)
    done = run_keel([*cmd, "fault_tolerance.max_restarts=1", "checkpoint.interval=5"], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    top = read_jsonl(run_dir / "events.jsonl")
    ended = {e["detail"]["group"]: e["detail"]["exit_code"] for e in top if e["kind"] == "group"
             and e["action"] == "ended"}
    assert ended == {0: 0, 1: 3}
    (alert,) = [e for e in top if e["kind"] == "alert"]
    assert (alert["action"], alert["detail"]["severity"], alert["detail"]["group"]) == \
        ("replica_group_lost", "critical", 1)
    status = run_keel(["status", str(run_dir)], cwd=tmp_path)
    assert "given up: replica group 1 was given up" in status.stdout, status.stdout
    # Each restarted group resumes from the newest checkpoint, or, when the other was back first and trains
    # already, heals from it.
    for g in (0, 1):
        assert group_events(run_dir, g, "resume") or \
            [e for e in group_events(run_dir, g, "quorum") if e["action"] == "heal"], g
    assert [len(group_events(run_dir, g, "start")) for g in (0, 1)] == [2, 2]
    assert rows_by_step(run_dir) == rows_by_step(fault_free)
    survivor, clean = ledger(run_dir, 0), ledger(fault_free, 0)
    assert survivor[STEPS]["tokens_seen"] == clean[STEPS]["tokens_seen"]
    for a, b in zip(final_params(run_dir, 0), final_params(fault_free, 0), strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0), (a - b).abs().max()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.parametrize("layout", [["parallel.pp=2", "parallel.dp_shard=1"], ["parallel.dp_shard=2"]],
                         ids=["pipeline", "fsdp2"])
def test_two_process_groups_heal_and_read_more_micro_batches_while_one_is_missing(
        layout: list[str], small_corpus: Path, tmp_path: Path) -> None:
    """Each group a 2-stage pipeline (the survivor runs twice the pipeline micro-batches of the same size
    while the other is missing) or 2 FSDP2 shards: the healed group's ranks equal the survivor's, bitwise."""
    run_dir = tmp_path / "two_process"
    cmd = ft_cmd(small_corpus, run_dir, f"kill:step={FAULT_AT},rank=-1,group=1,down_s={DOWN_S}")
    cmd[cmd.index("--nproc") + 1] = "2"
    done = run_keel([*cmd, *layout, "train.global_batch=16"], cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(group_events(run_dir, 0, "start")) == 2, "the surviving group's two ranks start once"
    heal = group_events(run_dir, 1, "quorum")[-1]
    assert heal["action"] == "heal"
    for rank in (0, 1):
        survivor = {r["step"]: r for r in read_jsonl(run_dir / "probe" / f"0-{rank}.jsonl") if r["kind"] == "state"}
        healed = {r["step"]: r for r in read_jsonl(run_dir / "probe" / f"1-{rank}.jsonl") if r["kind"] == "state"}
        assert sorted(survivor) == list(range(1, STEPS + 1))
        for s in range(heal["step"] + 1, STEPS + 1):
            assert healed[s]["params"] == survivor[s]["params"], (rank, s)
    dp = 2 if "parallel.dp_shard=2" in layout else 1  # rank 0 reads 1/dp of its group's share of the 16
    alone = [s for s, r in ledger(run_dir, 0, "rows").items() if len(r["rows"]) == 16 // dp]
    assert alone and all(len(r["rows"]) in (8 // dp, 16 // dp) for r in ledger(run_dir, 0, "rows").values())


SDC_STEPS = 20  # three groups; group 0's flip after step 12 is caught at step 15, the last verified being step 10
VERIFIED = 10
# Scales one channel of every logit of group 0 by 1.5 or 0.75: without the rollback, its gradients of steps 13
# and 14 leave the survivors' final parameters 1.6e-3 from the fault-free run's, 16 times the tolerance. Group 0
# is the one writing the run's checkpoints: its step-12 checkpoint belongs to the steps the others abandon.
SDC_FLIP = "bitflip:step=12,rank=0,group=0,target=params,tensor=19,bit=22"
SURVIVORS = (1, 2)


def three_groups(corpus: Path, run_dir: Path, fault: str = "") -> list[str]:
    cmd = ft_cmd(corpus, run_dir, fault)
    cmd[cmd.index("--replica-groups") + 1] = "3"
    return [*cmd, f"train.steps={SDC_STEPS}", "train.global_batch=24", "guard.sdc.fingerprint_interval=5",
            "checkpoint.interval=12"]


def test_a_group_outvoted_by_the_others_leaves_and_the_others_roll_back_to_the_verified_state(
        small_corpus: Path, tmp_path: Path) -> None:
    """Of three groups, the one whose state differs from the other two computed wrong: it leaves for good (exit
    76, named in the run's quarantine.json). Its gradients of the steps since the last verified state are in
    the others' weights, so they go back to that state (kept in memory) and make those steps again without it,
    taking its share of every global batch: they end where the fault-free run of three groups ends."""
    clean = tmp_path / "clean"
    done = run_keel(three_groups(small_corpus, clean), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "outvoted"
    done = run_keel(three_groups(small_corpus, run_dir, SDC_FLIP), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads((run_dir / "quarantine.json").read_text())
    assert [(r["source"], r["group"], r["step"]) for r in records] == [("replica_groups", 0, 15)]
    ended = {e["detail"]["group"]: e["detail"]["exit_code"] for e in read_jsonl(run_dir / "events.jsonl")
             if e["kind"] == "group" and e["action"] == "ended"}
    assert ended == {0: 76, 1: 0, 2: 0}
    # The check at step 15 ends the group's step before the probe's hook sees it.
    assert max(ledger(run_dir, 0)) == 14 and len(group_events(run_dir, 0, "start")) == 1
    retired = [e["detail"]["names"] for e in group_events(run_dir, 0, "checkpoint") if e["action"] == "retired"]
    assert retired == [["step-000012"]], "the leaving writer retires its checkpoint of the abandoned steps"
    for group in SURVIVORS:
        assert len(group_events(run_dir, group, "start")) == 1, "the survivors never restart"
        rolled = [e for e in group_events(run_dir, group, "guard") if e["action"] == "rolled_back"]
        assert [(e["step"], e["detail"]["to_step"], e["detail"]["source"]) for e in rolled] == \
            [(15, VERIFIED, f"the in-memory snapshot of step {VERIFIED}")]
    first, second, reference = ledger(run_dir, 1), ledger(run_dir, 2), ledger(clean, 0)
    assert sorted(first) == sorted(second) == list(range(1, SDC_STEPS + 1))
    assert all(first[s]["params"] == second[s]["params"] for s in first)
    # Every step trained on the fault-free run's rows: the verified ones by three groups, those made again
    # after the rollback by the two survivors, half of the global batch of 24 each.
    clean_rows, rows = rows_by_step(clean), rows_by_step(run_dir)
    assert all(rows[s] == clean_rows[s] for s in range(1, VERIFIED + 1))
    for s in range(VERIFIED + 1, SDC_STEPS + 1):
        mine, theirs = (ledger(run_dir, g, "rows")[s]["rows"] for g in SURVIVORS)
        assert len(mine) == len(theirs) == 12 and Counter(mine + theirs) == clean_rows[s], s
    for key in ("tokens_seen", "loader_batch", "consumed"):
        assert first[SDC_STEPS][key] == reference[SDC_STEPS][key], key
    for a, b in zip(final_params(run_dir, 1), final_params(clean, 0), strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE, rtol=0), (a - b).abs().max()
    assert abs(first[SDC_STEPS]["loss"] - reference[SDC_STEPS]["loss"]) < TOLERANCE
    # A survivor writes the checkpoints from the rollback on, the abandoned step 12's again.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000012", "step-000020"]
