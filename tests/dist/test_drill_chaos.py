"""Chaos mode: faults of every kind drawn at random into one run of the small model, judged together
against the clean run told to skip the NaN steps; and a chaos run whose promise cannot hold, reported
broken. The draw and the duration parser are tested without processes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from keel.drill.chaos import (
    CRASHES,
    DEFAULT,
    KINDS,
    WATCHDOG_WARMUP,
    Fault,
    draw,
    judge_chaos,
    layout,
    parse_duration,
    replay_every,
    run_chaos,
    run_faults,
)
from keel.drill.runner import Drill
from keel.drill.scorecard import format_scorecard
from tests.conftest import SMALL_RUN

STEPS, INTERVAL = 40, 10
# A nominal second per step: the draw depends on the seed alone, not on how fast this machine is today.
# Seed 279 with a fault every 3 s on average over 40 s draws 12 faults of all nine kinds, one of each
# that restarts or relaunches the job (kill, hang, kill_during_save, preemption).
SEED, MTBF_S, DURATION_S, STEP_S = 279, 3.0, 40.0, 1.0
DRAWN = [("bitflip_params", 2), ("straggler", 3), ("nan_grads", 4), ("bitflip_grads", 10), ("hang", 11),
         ("preemption", 12), ("kill", 17), ("bitflip_optimizer", 18), ("bitflip_grads", 20), ("bitflip_grads", 25),
         ("kill_during_save", 30), ("nan_grads", 34)]


# ---------------------------------------------------------------- without processes


def test_the_same_seed_draws_the_same_faults_and_another_seed_others() -> None:
    first = draw(SEED, MTBF_S, DURATION_S, STEP_S, STEPS, INTERVAL, DEFAULT)
    assert first == draw(SEED, MTBF_S, DURATION_S, STEP_S, STEPS, INTERVAL, DEFAULT)
    assert [(f.kind, f.step) for f in first] == DRAWN
    assert len(first) >= 10 and len(Counter(f.kind for f in first)) >= 4
    assert first != draw(SEED + 1, MTBF_S, DURATION_S, STEP_S, STEPS, INTERVAL, DEFAULT)
    # The arrival times scale with the step time: the same draw at a tenth of the mtbf and step time.
    assert [(f.kind, f.step) for f in draw(SEED, 0.3, 4.0, 0.1, STEPS, INTERVAL, DEFAULT)] == DRAWN


def _check_bounds(faults: list[Fault], steps: int, interval: int, kinds: tuple[str, ...]) -> None:
    at = [f.step for f in faults]
    assert at == sorted(at) and len(set(at)) == len(at), "one fault per step, in step order"
    assert all(2 <= s <= steps - 1 for s in at)
    assert {f.kind for f in faults} <= set(kinds)
    by_kind: dict[str, list[int]] = {}
    for f in faults:
        by_kind.setdefault(f.kind, []).append(f.step)
        assert f.inject, "an injection for each, and for a preemption the action from outside too"
        assert (f.outside is not None) == (f.kind == "preemption")
        if f.inject:
            assert f.inject.split(":")[0] in ("kill", "hang", "sigkill_during_checkpoint_write", "nan_grads",
                                              "bitflip", "slow")
    assert all(s % interval == 0 for s in by_kind.get("kill_during_save", []))
    assert all(s % replay_every(interval) == 0 for s in by_kind.get("bitflip_grads", []))
    assert all(s >= WATCHDOG_WARMUP + 2 for s in by_kind.get("hang", []))
    nans = by_kind.get("nan_grads", [])
    assert all(b - a >= 2 for a, b in zip(nans, nans[1:], strict=False)), "never two NaN steps in a row"
    crashes = sorted(by_kind.get("kill", []) + by_kind.get("hang", []) + by_kind.get("preemption", []))
    for kind in ("bitflip_params", "bitflip_optimizer"):
        for s in by_kind.get(kind, []):
            check = min(steps, (s // interval + 1) * interval)
            assert not [c for c in crashes if s < c <= check], f"a crash would erase the flip at {s} unseen"
            writes = [c for c in by_kind.get("kill_during_save", []) if c + 1 <= check and s + 1 <= c + interval - 1]
            assert not writes, "a checkpoint write killed after the flip and before its check would erase it"
    for p in by_kind.get("preemption", []):
        assert not [c for c in crashes if p < c <= p + 4], "the pause lands before any other crash"
        assert p <= steps - 6


@pytest.mark.parametrize("steps,interval", [(40, 10), (30, 5), (200, 20)])
def test_drawn_faults_respect_the_bounds_of_the_run(steps: int, interval: int) -> None:
    for seed in range(40):
        _check_bounds(draw(seed, 2.0, float(steps), 1.0, steps, interval, DEFAULT), steps, interval, KINDS)
    few = ("kill", "nan_grads")
    for seed in range(10):
        _check_bounds(draw(seed, 1.0, float(steps), 1.0, steps, interval, few), steps, interval, few)


def test_a_draw_longer_than_the_run_stays_inside_it_and_a_bad_kind_is_refused() -> None:
    faults = draw(0, 0.5, 1000.0, 1.0, 30, 10, ("kill",))
    assert faults and all(2 <= f.step <= 29 for f in faults) and len({f.step for f in faults}) == len(faults)
    with pytest.raises(ValueError, match="expected some of"):
        draw(0, 1.0, 10.0, 1.0, 30, 10, ("poisoned_batch",))
    with pytest.raises(ValueError, match="must be positive"):
        draw(0, 0.0, 10.0, 1.0, 30, 10, DEFAULT)


def test_durations_parse_with_or_without_a_unit() -> None:
    assert [parse_duration(t) for t in ("30s", "10m", "1h", "90", "1.5h", " 2m ")] == [30, 600, 3600, 90, 5400, 120]
    for bad in ("", "10 minutes", "-5s", "0", "1d", "m"):
        with pytest.raises(ValueError, match="30s, 10m, 1h or 90"):
            parse_duration(bad)


def test_a_run_that_left_nothing_is_judged_broken(tmp_path: Path) -> None:
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    run_dir.mkdir()
    ref_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"time": 1.0, "step": 0, "rank": 0, "kind": "start",
                                                      "action": "", "detail": {}}) + "\n")
    faults = draw(SEED, MTBF_S, DURATION_S, STEP_S, STEPS, INTERVAL, DEFAULT)
    result = judge_chaos(faults, run_dir, ref_dir, STEPS, [{"exit": 1, "seconds": 1.0, "leftovers": [4242]}], {})
    assert result["promise_kept"] is False and result["state_equal"] is False
    assert f"no final checkpoint at step {STEPS}" in result["broken"]
    assert "the run ended with exit 1" in result["broken"] and "processes outlived the launcher" in result["broken"]
    assert sum("never fired" in why for why in result["broken"]) == len(faults)
    assert result["detected_by"] == f"0 of {len(faults)} faults"


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def drill(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Drill:
    shape = [o for o in SMALL_RUN if not o.startswith("checkpoint.interval=")]  # the drill sets the interval
    return Drill(tmp_path_factory.mktemp("chaos"), [f"data.dir={small_corpus}", "health.preflight_probe_mib=4"],
                 shape=shape, steps=STEPS, interval=INTERVAL, timeout=240)


@pytest.fixture(scope="module")
def chaos(drill: Drill) -> dict:
    result = run_chaos(drill, SEED, MTBF_S, DURATION_S, step_s=STEP_S)
    print(format_scorecard([result]))
    print(json.dumps(result["faults"], indent=1))
    return result


@pytest.mark.dist
@pytest.mark.slow
def test_faults_of_every_kind_together_end_in_the_promised_state_bitwise(chaos: dict) -> None:
    assert [(f["kind"], f["step"]) for f in chaos["faults"]] == DRAWN
    assert chaos["kinds"] == dict(sorted(Counter(kind for kind, _ in DRAWN).items())) and len(chaos["kinds"]) == 9
    assert chaos["promise_kept"], chaos["broken"]
    assert chaos["state_equal"]
    assert chaos["compare"] == 'reference_with: drill.inject=["skip_update:step=4", "skip_update:step=34"]'
    assert all(f["fired"] for f in chaos["faults"])
    assert {f["kind"]: f["detected_by"].split("/")[0] for f in chaos["faults"]} == {
        "kill": "failure", "kill_during_save": "failure", "hang": "hang", "nan_grads": "guard",
        "bitflip_params": "guard", "bitflip_optimizer": "guard", "bitflip_grads": "guard", "straggler": "straggler",
        "preemption": "pause"}
    assert all(f["detect_s"] is not None and f["recover_s"] is not None for f in chaos["faults"])
    assert chaos["updates_skipped"] == 2 and chaos["steps_recomputed"] > 0
    assert chaos["steps_lost"] == chaos["steps_recomputed"] + 2
    # One relaunch, after the preemption's pause; the crashes were restarts within a launch.
    assert [launch["exit"] for launch in chaos["launches"]] == [75, 0]
    assert sum(f["kind"] in CRASHES for f in chaos["faults"]) == 3
    assert 0 < chaos["goodput"] < chaos["reference_goodput"]
    assert (chaos["seed"], chaos["mtbf_s"], chaos["duration_s"], chaos["step_s"]) == (SEED, MTBF_S, DURATION_S, STEP_S)


@pytest.mark.dist
@pytest.mark.slow
def test_a_bit_flip_no_detector_can_see_among_the_faults_is_reported_as_a_broken_promise(drill: Drill,
                                                                                         chaos: dict) -> None:
    # The same bit flipped in both replicas' parameters, with the at-rest check off: the fingerprints compare
    # replicas and find them agreeing, no step replay looks at parameters. The run keeps the chaos run's NaN steps,
    # so that its reference is the one already made.
    flip = "bitflip:step=15,rank={rank},target=params,tensor=3,element=5,bit=22"
    faults = [*(f for f in draw(SEED, MTBF_S, DURATION_S, STEP_S, STEPS, INTERVAL, DEFAULT) if f.kind == "nan_grads"),
              Fault("bitflip_params", 15, flip.format(rank=0)), Fault("bitflip_params", 15, flip.format(rank=1))]
    references = sorted((drill.workdir / "references").iterdir())
    faults.sort(key=lambda f: f.step)
    result = run_faults(drill, faults, config=layout(drill, ["bitflip_params"]),
                        extra_tuning=("guard.sdc.at_rest_interval=0",), name="unseen")
    print(format_scorecard([result]))
    assert sorted((drill.workdir / "references").iterdir()) == references, "the chaos run's reference, reused"
    assert result["reference_dir"] == chaos["reference_dir"]
    assert result["promise_kept"] is False and not result["state_equal"]
    assert [(f["kind"], f["fired"], f["detected_by"]) for f in result["faults"]] == [
        ("nan_grads", True, "guard/skip"), ("bitflip_params", True, None), ("bitflip_params", True, None),
        ("nan_grads", True, "guard/skip")]
    assert any(why.startswith("final state differs from the reference") for why in result["broken"])
    assert sum("bitflip_params at step 15 went undetected" in why for why in result["broken"]) == 2
    card = format_scorecard([chaos, result])
    assert "BROKEN: " in card and "1 of 2 promises kept" in card
