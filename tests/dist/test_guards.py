"""Guards against real faults in real multi-process runs: each faulted run is compared with a clean
run that does what the guard should have done (skip a step, omit a stretch of data, or nothing)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, run_keel

pytestmark = pytest.mark.dist

STEPS = 40
# Snapshots every 10 steps; a spike rolls back at least 5 steps and skips at least 8 batches.
GUARDS = ["guard.snapshot_interval=10", "guard.rollback_steps=5", "guard.skip_batches=8", "guard.spike.warmup=20",
          "guard.spike.window=40"]
# The tests of the replicas' fingerprints and of re-execution take the at-rest check (on by default) away: it would
# catch a flip in stored state first, at the next step.
NO_AT_REST = "guard.sdc.at_rest_interval=0"
LAYOUTS = {"fsdp2": ["parallel.dp_shard=2"], "dp2_replicated": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
           "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.global_batch=16"],
           "dp4_replicated": ["parallel.dp_replicate=4", "parallel.dp_shard=1", "train.global_batch=16"]}


def train(corpus: Path, run_dir: Path, *extra: str, nproc: int = 2, steps: int = STEPS,
          expect: int = 0) -> None:
    cmd = ["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={steps}",
           f"data.dir={corpus}", *GUARDS, *extra]
    result = run_keel(cmd, cwd=run_dir.parent)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]


def together(*runs: Callable[[], object]) -> None:
    """Independent runs, two at a time: a run leaves much of two cores idle (while its launcher imports,
    its workers meet and exit), and every guard here acts on steps, losses and bits, never on time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        for made in [pool.submit(run) for run in runs]:
            made.result()


def events(run_dir: Path, kind: str = "guard") -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def final_state(run_dir: Path, steps: int = STEPS) -> str:
    return state_sha256(run_dir / "checkpoints" / f"step-{steps:06d}")


def train_state(run_dir: Path, steps: int = STEPS) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{steps:06d}" / "train_state.json").read_text())


def final_loss(run_dir: Path) -> float:
    return [r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r][-1]


@pytest.fixture(scope="module")
def clean(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """Clean reference runs, one per layout, made on first use."""
    made: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in made:
            run_dir = tmp_path_factory.mktemp("clean") / layout
            train(small_corpus, run_dir, *LAYOUTS[layout], nproc=4 if "16" in LAYOUTS[layout][-1] else 2)
            assert not events(run_dir), "a clean run takes no guard action"
            made[layout] = run_dir
        return made[layout]

    return get


def test_nan_on_one_rank_skips_that_step_on_every_rank(small_corpus: Path, tmp_path: Path) -> None:
    faulted, told = tmp_path / "nan", tmp_path / "told-to-skip"
    together(lambda: train(small_corpus, faulted, 'drill.inject=["nan_grads:step=12,rank=1"]'),
             lambda: train(small_corpus, told, 'drill.inject=["skip_update:step=12"]'))

    [skip] = events(faulted)
    assert (skip["step"], skip["action"], skip["detail"]["guard"]) == (12, "skip", "numerics")
    assert skip["detail"]["ranks"] == [1], "the event names the rank whose gradients held the NaN"
    assert [(e["step"], e["action"]) for e in events(told)] == [(12, "skip")]
    assert final_state(faulted) == final_state(told), "the skip is exact: nothing else changed"
    assert train_state(faulted)["guards"]["counts"]["numerics_skip"] == 1


def test_poisoned_batch_is_rolled_back_and_its_data_skipped(small_corpus: Path, tmp_path: Path) -> None:
    steps = 80
    faulted, omitted = tmp_path / "poisoned", tmp_path / "omits-the-window"
    together(lambda: train(small_corpus, faulted, 'drill.inject=["poison_batch:batch=49"]', steps=steps),
             lambda: train(small_corpus, omitted, "data.skip_batches=[[40, 50]]", steps=steps))

    spike, rolled = events(faulted)
    assert (spike["step"], spike["action"], spike["detail"]["guard"]) == (50, "rollback", "spike")
    assert spike["detail"]["loss"] > 1.5 * spike["detail"]["loss_median"], "detected at the poisoned step"
    assert rolled["action"] == "rolled_back" and rolled["detail"]["to_step"] == 40
    assert rolled["detail"]["source"] == "the in-memory snapshot of step 40"
    assert rolled["detail"]["skipped_batches"] == [40, 50]  # from the snapshot through the poisoned batch
    assert train_state(faulted, steps)["loader"]["skips"] == [[40, 50]]

    # The run that omitted the same stretch of data from the start.
    assert final_loss(faulted) == pytest.approx(final_loss(omitted), rel=0.02)
    assert final_state(faulted, steps) == final_state(omitted, steps), "and in fact bitwise equal"


def test_without_snapshots_a_rollback_reads_the_checkpoint_and_lowers_the_learning_rate(
        small_corpus: Path, tmp_path: Path) -> None:
    steps = 80
    run_dir = tmp_path / "from-disk"
    train(small_corpus, run_dir, 'drill.inject=["poison_batch:batch=49"]', "guard.snapshot_interval=0",
          "guard.lr_scale=0.5", "guard.lr_scale_steps=5", steps=steps)
    _, rolled = events(run_dir)
    assert rolled["detail"]["source"] == f"checkpoint {run_dir / 'checkpoints' / 'step-000040'}"
    assert rolled["detail"]["skipped_batches"] == [40, 50] and rolled["detail"]["lr_scale"] == 0.5
    lrs = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        if "optim/lr" in record:
            lrs.setdefault(record["step"], []).append(record["optim/lr"])
    # Steps 41-50 ran twice: before the spike at the scheduled rate, after the rollback at half of it for 5 steps.
    assert [lrs[s][1] / lrs[s][0] for s in range(41, 48)] == pytest.approx([0.5] * 5 + [1.0] * 2)
    assert final_loss(run_dir) == pytest.approx(3.0, abs=0.6)


def test_a_majority_of_replicas_names_the_odd_one_at_once(clean, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "four-replicas"
    together(lambda: train(small_corpus, run_dir, *LAYOUTS["dp4_replicated"], "guard.sdc.fingerprint_interval=10",
                           NO_AT_REST, 'drill.inject=["bitflip:step=25,rank=1,target=params,tensor=0,element=7,bit=0"]',
                           nproc=4),
             lambda: clean("dp4_replicated"))
    quarantine, rolled = events(run_dir)
    assert (quarantine["step"], quarantine["action"], quarantine["detail"]["outvoted"]) == (30, "quarantine", [1])
    assert quarantine["detail"]["ranks"] == [1], "outvoted by three replicas: no re-execution needed to name it"
    assert rolled["detail"]["to_step"] == 20
    assert final_state(run_dir) == final_state(clean("dp4_replicated"))


def test_a_spike_that_keeps_coming_back_escalates_then_stops(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "persistent"
    train(small_corpus, run_dir, 'drill.inject=["poison_batch:batch=69,count=40"]', "guard.snapshots=3", steps=100,
          expect=3)
    decided = events(run_dir)
    spikes = [e["step"] for e in decided if e["action"] == "rollback"]
    skips = [e["detail"]["skipped_batches"] for e in decided if e["action"] == "rolled_back"]
    # Each repeat goes further back and skips twice as many batches (8, 16, 32), always past the spike's.
    assert spikes == [70, 61, 51] and skips == [[60, 70], [50, 71], [40, 72]]
    assert [e["detail"]["repeat"] for e in decided if e["action"] == "rollback"] == [0, 1, 2]
    assert (decided[-1]["step"], decided[-1]["action"]) == (41, "stop")
    assert "3 rollbacks" in decided[-1]["detail"]["reason"]
    assert not (run_dir / "checkpoints" / "step-000100").exists()


def test_bit_flip_in_replicated_parameters_is_caught_by_fingerprints(clean, small_corpus: Path,
                                                                      tmp_path: Path) -> None:
    run_dir = tmp_path / "flipped"
    # The run shares the cores with its clean reference, which slows one of its ranks or the other: the
    # straggler check (timed, not part of what is judged here) is off, so its alerts are the guards' alone.
    together(lambda: train(small_corpus, run_dir, *LAYOUTS["dp2_replicated"], "guard.sdc.fingerprint_interval=10",
                           NO_AT_REST, "health.straggler.interval=0",
                           'drill.inject=["bitflip:step=25,rank=1,target=params,tensor=3,element=5,bit=22"]'),
             lambda: clean("dp2_replicated"))
    decided = events(run_dir)
    assert (decided[0]["step"], decided[0]["action"]) == (30, "rollback"), "caught at the next check"
    assert decided[0]["detail"]["tied"] == [0, 1]
    assert decided[1]["detail"]["to_step"] == 20, "back to the newest verified state"
    [named] = [e for e in decided if e["action"] == "quarantine"]
    assert named["step"] == 30 and "rank(s) 1 named" in named["detail"]["reason"]
    [record] = json.loads((run_dir / "quarantine.json").read_text())
    # Rank 1's loss departs in the step after its flip; the healthy replica's only later, through the averaged
    # gradients (in step 27 or 28: whether one step's drift shows in its loss's bits depends on the CPU's kernels).
    departed = record["evidence"]["departed_at"]
    assert record["ranks"] == [1] and record["hosts"] and departed["1"] == 26 and departed["0"] in (27, 28)
    assert [e["action"] for e in events(run_dir, "alert")] == ["sdc_suspect"]
    assert final_state(run_dir) == final_state(clean("dp2_replicated")), "the flip left no trace"


def test_a_rollback_goes_to_the_newest_verified_state_whether_in_memory_or_on_disk(clean, small_corpus: Path,
                                                                                    tmp_path: Path) -> None:
    # Snapshots every 50 steps, checkpoints every 10: the newest verified state is checkpoint 20, not snapshot 0.
    run_dir = tmp_path / "flipped"
    train(small_corpus, run_dir, *LAYOUTS["dp2_replicated"], "guard.sdc.fingerprint_interval=10", NO_AT_REST,
          "guard.snapshot_interval=50", "checkpoint.interval=10",
          'drill.inject=["bitflip:step=25,rank=1,target=params,tensor=3,element=5,bit=22"]')
    rolled = next(e for e in events(run_dir) if e["action"] == "rolled_back")
    assert rolled["detail"]["to_step"] == 20 and "step-000020" in rolled["detail"]["source"]
    assert (run_dir / "checkpoints" / "step-000020").exists(), "the verified checkpoint is kept"
    assert final_state(run_dir) == final_state(clean("dp2_replicated")), "the flip left no trace"


@pytest.mark.parametrize(("target", "tensor", "bit"), [("params", 3, 0), ("exp_avg_sq", 2, 23)])
def test_a_bit_flipped_at_rest_in_a_sharded_layout_is_caught_at_the_next_step_and_its_rank_named(
        target: str, tensor: int, bit: int, clean, small_corpus: Path, tmp_path: Path) -> None:
    """No replica holds rank 1's shard: its own seal, taken after the update of a step drawn at random, no longer
    matches before the update of the next (the default check, every step). The lowest mantissa bit of a parameter,
    or an exponent bit of a second moment: flips that nothing else in the run notices."""
    step = random.randint(1, STEPS - 2)
    run_dir = tmp_path / "flipped"
    together(lambda: train(small_corpus, run_dir, *LAYOUTS["fsdp2"],
                           f'drill.inject=["bitflip:step={step},rank=1,target={target},tensor={tensor},element=5,'
                           f'bit={bit}"]'),
             lambda: clean("fsdp2"))
    decided = events(run_dir)
    assert (decided[0]["step"], decided[0]["action"], decided[0]["detail"]["detector"]) == (
        step + 1, "quarantine", "at_rest"), f"flipped after step {step}"
    assert decided[0]["detail"]["ranks"] == [1] and decided[0]["detail"]["sealed_step"] == step
    [flipped] = [e["detail"]["param"] for e in events(run_dir, "drill")]
    assert decided[0]["detail"]["tensors"] == {"1": [flipped if target == "params" else f"{flipped}/{target}"]}
    # Back to the newest snapshot (every 10 steps, taken before the flip of a step it shares).
    assert decided[1]["action"] == "rolled_back" and decided[1]["detail"]["to_step"] == step // 10 * 10
    assert json.loads((run_dir / "quarantine.json").read_text())[0]["ranks"] == [1]
    assert final_state(run_dir) == final_state(clean("fsdp2")), f"the flip after step {step} left no trace"


def test_bit_flip_in_a_gradient_is_caught_by_replay(clean, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "flipped"
    together(lambda: train(small_corpus, run_dir, *LAYOUTS["fsdp2"], "guard.sdc.replay_interval=5",
                           'drill.inject=["bitflip:step=25,rank=1,target=grads,tensor=3,element=5,bit=3"]'),
             lambda: clean("fsdp2"))
    decided = events(run_dir)
    assert (decided[0]["step"], decided[0]["action"], decided[0]["detail"]["detector"]) == (25, "quarantine", "replay")
    assert decided[0]["detail"]["ranks"] == [1] and decided[0]["detail"]["differing_gradients"] == {"1": 1}
    assert decided[1]["action"] == "rolled_back" and decided[1]["detail"]["to_step"] == 20
    assert json.loads((run_dir / "quarantine.json").read_text())[0]["ranks"] == [1]
    assert final_state(run_dir) == final_state(clean("fsdp2"))


def test_an_update_computed_wrong_is_caught_by_its_re_execution_and_its_rank_named(clean, small_corpus: Path,
                                                                                    tmp_path: Path) -> None:
    """Rank 1's update of step 25 writes a parameter with a flipped bit, as a fault in its arithmetic would. The
    replay of step 25 finds its gradients right, and the update re-executed into scratch before it tells it
    apart: no replica is needed."""
    run_dir = tmp_path / "flipped"
    together(lambda: train(small_corpus, run_dir, *LAYOUTS["fsdp2"], "guard.sdc.replay_interval=5",
                           'drill.inject=["bitflip:step=25,rank=1,target=update,tensor=3,element=5,bit=1"]'),
             lambda: clean("fsdp2"))
    decided = events(run_dir)
    [flipped] = [e["detail"]["param"] for e in events(run_dir, "drill")]
    assert (decided[0]["step"], decided[0]["action"], decided[0]["detail"]["detector"]) == (
        25, "quarantine", "update_replay")
    assert decided[0]["detail"]["ranks"] == [1] and decided[0]["detail"]["tensors"] == {"1": [flipped]}
    assert decided[1]["action"] == "rolled_back" and decided[1]["detail"]["to_step"] == 20
    assert final_state(run_dir) == final_state(clean("fsdp2")), "the wrong update left no trace"


def test_quarantine_exit_leaves_only_verified_checkpoints_and_the_rerun_loses_nothing(
        clean, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "hsdp"
    flip = 'drill.inject=["bitflip:step=25,rank=1,target=exp_avg,tensor=2,element=0,bit=30"]'
    common = [*LAYOUTS["hsdp2x2"], "guard.sdc.fingerprint_interval=10", "checkpoint.interval=10", NO_AT_REST]
    together(lambda: train(small_corpus, run_dir, *common, "guard.sdc.response=exit", flip, nproc=4, expect=76),
             lambda: clean("hsdp2x2"))
    # Rank 1's huge first moment blows up its replica's next update: the numerics guard fires, the check it
    # calls finds the replicas of rank 1's shard (1 and 3) disagreeing, and re-execution names rank 1.
    decided = events(run_dir)
    assert [(e["detail"]["guard"], e["action"]) for e in decided] == [
        ("numerics", "skip"), ("sdc", "rollback"), ("sdc", "rolled_back"), ("sdc", "quarantine")]
    assert decided[1]["detail"]["tied"] == [1, 3] and decided[2]["detail"]["to_step"] == 20
    [record] = json.loads((run_dir / "quarantine.json").read_text())
    assert record["ranks"] == [1] and 25 < record["step"] <= 30
    # Nothing after the last verified step (20) was checkpointed: the check before a save would have failed.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000010", "step-000020"]

    train(small_corpus, run_dir, *common, nproc=4)  # the restart, on healthy hardware
    assert [e["step"] for e in events(run_dir, "resume")] == [20]
    assert final_state(run_dir) == final_state(clean("hsdp2x2"))


def test_no_false_positives_from_every_detector_at_every_step_of_three_layouts(small_corpus: Path,
                                                                               tmp_path: Path) -> None:
    """Default thresholds, a replay (its update re-executed), a replica comparison and an at-rest check (the
    default) after every step, three layouts: not one guard action. That is 200 replays and 60 fingerprint
    comparisons, as many as 1,000 steps with the detectors every 5 steps make: a replay recomputes its own step,
    and a comparison after every step sees a replica depart in the step it departs (the steps of a longer run are
    the same kernels and collectives). The spike guard, whose decision depends only on the history of losses and
    gradient norms, makes its decisions of 2,000 steps on their recorded values (tests/unit/guard/test_guards.py);
    here it decides live in every layout once past its warmup of 50 steps."""
    stress = ["guard.sdc.fingerprint_interval=1", "guard.sdc.replay_interval=1", "checkpoint.interval=500",
              "eval.interval=0", "monitor.interval=50"]
    default_spike = ["guard.spike.warmup=50", "guard.spike.window=100"]
    # No step runs under the profiler to measure the time in collectives (a measurement, not a guard). The
    # straggler check keeps its default interval where there are ranks to compare; one process has none.
    unprofiled = ["monitor.profile_interval=0"]
    runs = (("single", 1, 80), ("dp2_replicated", 2, 60), ("fsdp2", 2, 60))

    def make(layout: str, nproc: int, steps: int) -> None:
        alone = ["health.straggler.interval=0"] if nproc == 1 else []
        train(small_corpus, tmp_path / layout, *LAYOUTS.get(layout, []), *stress, *default_spike, *unprofiled,
              *alone, nproc=nproc, steps=steps)

    # The one-process run beside the two 2-process runs, one after the other.
    together(lambda: make(*runs[0]), lambda: [make(*run) for run in runs[1:]])
    replays = checks = 0
    for layout, _, steps in runs:
        run_dir = tmp_path / layout
        assert events(run_dir) == [], layout
        counts = train_state(run_dir, steps)["guards"]["counts"]
        assert counts["sdc_replays"] == steps
        assert counts.get("sdc_checks", 0) == (steps if layout == "dp2_replicated" else 0)
        replays, checks = replays + counts["sdc_replays"], checks + counts.get("sdc_checks", 0)
    assert (replays, checks) == (200, 60)


def test_attention_logits_that_keep_growing_are_rolled_back_then_stop_the_run(small_corpus: Path,
                                                                             tmp_path: Path) -> None:
    """Measured on this run: the largest attention logit passes 3.0 by step 20 (a sampled step); the spike guard
    rolls back (to the snapshot of step 10, data skipped, the learning rate lowered) and the logits grow back
    past it each time, until the guard stops the run."""
    run_dir = tmp_path / "logits"
    train(small_corpus, run_dir, "monitor.signals_interval=5", "guard.spike.attn_logit_threshold=3.0",
          steps=STEPS, expect=3)
    decided = events(run_dir)
    rollbacks = [e for e in decided if e["action"] == "rollback"]
    assert [e["step"] for e in rollbacks] == [20, 20, 20]
    assert all(e["detail"]["reason"].startswith("the largest attention logit ") and
               e["detail"]["attn_logit_max"] > 3.0 for e in rollbacks)
    assert (decided[-1]["action"], "3 rollbacks" in decided[-1]["detail"]["reason"]) == ("stop", True)
    assert not (run_dir / "checkpoints" / f"step-{STEPS:06d}").exists()
