"""Drills end to end on the small model: real faults in real runs, judged against cached clean references,
and a recovery that cannot keep its promise reported as broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.drill.runner import Drill
from keel.drill.scenarios import BITWISE, Plan, Scenario, catalog
from keel.drill.scorecard import all_kept, format_scorecard
from tests.conftest import SMALL_RUN

pytestmark = pytest.mark.dist

PLAN = Plan(steps=30, interval=10)  # faults in step 15, checkpoints at 10, 20, 30

# A flip in stored parameters of a sharded layout, with replays and fingerprints off: nothing looks there,
# yet the scenario promises an exact end. The drill must say the promise was broken.
UNWATCHED = Scenario("bitflip_unwatched", "a flipped bit in sharded parameters is caught; the run ends bitwise equal",
                     inject=("bitflip:step=15,rank=1,target=params,tensor=3,element=5,bit=22",), fault_step=15,
                     tuning=("guard.sdc.replay_interval=0", "guard.sdc.fingerprint_interval=0"),
                     compare=BITWISE, detect=("guard", ""), recovered_by=("guard", "rolled_back"))


@pytest.fixture(scope="module")
def drilled(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Drill, dict[str, dict]]:
    drill = Drill(tmp_path_factory.mktemp("drill"), [*SMALL_RUN, f"data.dir={small_corpus}",
                                                     "health.preflight_probe_mib=4"],
                  steps=PLAN.steps, interval=PLAN.interval, timeout=120)
    scenarios = catalog(PLAN)
    results = drill.run_all([scenarios["kill_mid_step"], scenarios["nan_grads"], UNWATCHED])
    print(format_scorecard(results))
    return drill, {r["scenario"]: r for r in results}


def test_a_rank_killed_mid_step_restarts_and_ends_bitwise_equal(drilled) -> None:
    _, results = drilled
    killed = results["kill_mid_step"]
    assert killed["promise_kept"], killed["broken"]
    assert killed["state_equal"] and killed["losses_equal"]
    assert killed["detected_by"] == "failure/restart" and killed["detect_steps"] == 0
    assert killed["detect_s"] > 0 and killed["recover_s"] > 0
    assert killed["steps_recomputed"] == 4, "steps 11-14 are made again after the resume from step 10"
    assert "resume/resume@10" in killed["events"]
    assert killed["events"].index("failure/restart@14") < killed["events"].index("resume/resume@10")
    assert killed["goodput"] < killed["reference_goodput"]


def test_a_nan_skips_one_update_exactly_as_a_run_told_to_skip_it(drilled) -> None:
    _, results = drilled
    nan = results["nan_grads"]
    assert nan["promise_kept"], nan["broken"]
    assert nan["compare"] == 'reference_with: drill.inject=["skip_update:step=15"]'
    assert (nan["detected_by"], nan["detect_steps"], nan["recover_s"]) == ("guard/skip", 0, 0.0)
    assert (nan["updates_skipped"], nan["steps_recomputed"], nan["steps_lost"]) == (1, 0, 1)


def test_an_unwatched_bit_flip_is_reported_as_a_broken_promise(drilled) -> None:
    drill, results = drilled
    flipped = results["bitflip_unwatched"]
    assert flipped["promise_kept"] is False
    assert flipped["detected_by"] is None and not flipped["state_equal"]
    assert any("undetected" in why for why in flipped["broken"])
    assert flipped["reference_dir"] == results["kill_mid_step"]["reference_dir"], "one clean run per config"
    assert len(list((drill.workdir / "references").iterdir())) == 2  # the clean run, and the one told to skip
    card = format_scorecard(list(results.values()))
    assert "BROKEN: " in card and "2 of 3 promises kept" in card
    assert not all_kept(list(results.values()))


def test_scenarios_that_need_missing_machinery_are_listed_not_faked() -> None:
    pending = {name: s.requires for name, s in catalog().items() if s.requires}
    assert set(pending) == {"corrupt_checkpoint", "disk_full", "node_loss", "slow_collective"}
    assert all(not s.inject for s in catalog().values() if s.requires)
