"""`keel drill` end to end on the small model: the quick suite's real faults in real runs, judged against
cached clean references, every promise kept; and a recovery whose detector is switched off reported as a
broken promise with a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.drill.scenarios import QUICK, REPLICA_ATOL, catalog
from keel.rundir.events import read_jsonl
from tests.conftest import run_keel

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

FIELDS = {"scenario", "promise", "promise_kept", "detect_s", "recover_s", "steps_lost"}
# The quick suite's scenarios less those whose recovery a test of its own rehearses with the same real fault: a
# kill during a save (tests/dist/test_checkpoint.py), a hang (test_health.py), a preemption (test_health.py's
# pauses, test_slurm.py), a flipped gradient bit caught by replay and a flipped parameter bit caught at rest
# (test_guards.py), and a replica group lost and healed (test_replica_groups.py; test_drill_moe.py drills it).
# Each costs a run or two.
REHEARSED_ELSEWHERE = ("kill_during_save", "hang", "preemption", "bitflip_grads", "bitflip_params_sharded",
                       "group_loss")
TESTED = [name for name in QUICK if name not in REHEARSED_ELSEWHERE]


@pytest.fixture(scope="module")
def quick(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    cwd = tmp_path_factory.mktemp("drill")
    done = run_keel(["drill", "--suite", "quick", "--scenario", ",".join(TESTED), "--json", "--workdir", "runs/drill",
                     f"data.dir={small_corpus}"], cwd=cwd, timeout=600)
    assert done.returncode == 0, _broken(done.stdout) or done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout)
    return cwd, {r["scenario"]: r for r in results}


def _broken(stdout: str) -> str:
    """The scorecard rows of the scenarios whose promise was broken, whole: the tail of the JSON shows
    only the last scenarios, which usually kept theirs."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError:
        return ""
    return "\n".join(json.dumps(r) for r in rows if not r.get("promise_kept"))


def test_the_quick_suite_keeps_every_promise(quick) -> None:
    _, results = quick
    assert list(results) == TESTED
    for r in results.values():
        assert set(r) >= FIELDS, r
        assert r["promise_kept"], (r["scenario"], r["broken"], r["events"])
        assert r["detected_by"] is not None and r["detect_s"] >= 0 and r["recover_s"] is not None
        assert r["restart_s"] > 0 and r["restart_steps_lost"] >= 0, "a plain restart's cost stands beside each"


def test_a_rank_killed_mid_step_restarts_and_ends_bitwise_equal(quick) -> None:
    _, results = quick
    killed = results["kill_mid_step"]
    assert killed["state_equal"] and killed["losses_equal"] and killed["compare"] == "bitwise"
    assert killed["detected_by"] == "failure/restart" and killed["detect_s"] > 0 and killed["recover_s"] > 0
    # The kill lands in step 15, five steps after the checkpoint of step 10; a background write still
    # in flight then (a loaded machine) is discarded and the run starts over: either way every step
    # completed since the resume point is made again.
    resumed = 10 if "resume/resume@10" in killed["events"] else 0
    assert killed["steps_recomputed"] == 14 - resumed
    assert killed["restart_steps_lost"] == 4
    injected = killed["events"].index("drill/inject@15")
    assert killed["events"][injected + 1].startswith("failure/restart@")
    assert killed["goodput"] < killed["reference_goodput"]


def test_a_node_lost_with_the_memory_tier_on_two_nodes_is_restored_from_the_others_memory(quick) -> None:
    cwd, results = quick
    lost = results["node_loss_restored_from_memory"]
    assert lost["detected_by"] == "failure/restart" and lost["compare"].startswith("close"), lost
    run_dir = cwd / "runs/drill/scenarios/node_loss_restored_from_memory"
    events = read_jsonl(run_dir / "events.jsonl")
    # Two nodes (the second joining), then the one left alone: it restores a step both had saved to memory,
    # its copy holding the lost node's files as well, and reads the state of no storage checkpoint.
    starts = [e["detail"]["world_size"] for e in events if e["kind"] == "start" and e["rank"] == 0]
    assert starts[-2:] == [2, 1], starts
    (restored,) = [e for e in events if e["kind"] == "memory" and e["action"] == "restored"]
    both = [e["step"] for e in events if e["kind"] == "memory" and e["action"] == "committed"
            and e["detail"].get("nodes") == 2]
    assert restored["step"] in both and restored["detail"]["nodes"] == 1, (restored, both)
    assert [e["detail"]["tier"] for e in events if e["kind"] == "resume"][-1] == "memory"


def test_a_rank_killed_while_its_memory_copy_is_written_leaves_the_step_before_whole(quick) -> None:
    cwd, results = quick
    killed = results["kill_during_memory_save"]
    events = read_jsonl(cwd / "runs/drill/scenarios/kill_during_memory_save/events.jsonl")
    (fired,) = [e for e in events if e["kind"] == "drill" and e["action"] == "inject"]
    # The step being copied is never published; the one before it is restored on both nodes, from memory.
    (restored,) = [e for e in events if e["kind"] == "memory" and e["action"] == "restored"]
    assert restored["step"] == fired["step"] - 2 and restored["detail"]["nodes"] == 2, (fired, restored)
    assert not [e for e in events if e["kind"] == "memory" and e["action"] == "committed"
                and e["step"] == fired["step"] and e["time"] < restored["time"]]
    # Lost: the steps since the step before (2), and those made while the killed copy was written (1 or 2).
    assert killed["state_equal"] and killed["losses_equal"] and killed["steps_lost"] <= 4, killed


def test_a_nan_skips_one_update_exactly_as_a_run_told_to_skip_it(quick) -> None:
    _, results = quick
    nan = results["nan_grads"]
    assert nan["compare"] == 'reference_with: drill.inject=["skip_update:step=15"]'
    assert (nan["detected_by"], nan["detect_steps"], nan["recover_s"]) == ("guard/skip", 0, 0.0)
    assert (nan["updates_skipped"], nan["steps_recomputed"], nan["steps_lost"]) == (1, 0, 1)


def test_a_corrupted_checkpoint_is_skipped_and_the_previous_one_resumed(quick) -> None:
    _, results = quick
    corrupt = results["corrupt_checkpoint"]
    assert corrupt["state_equal"] and corrupt["launches"][0]["exit"] != 0
    assert corrupt["detected_by"] == "checkpoint/skipped"
    assert corrupt["events"].index("checkpoint/skipped@20") < corrupt["events"].index("resume/resume@10")


def test_the_scorecard_is_a_section_of_the_report(quick) -> None:
    cwd, results = quick
    drill = json.loads((cwd / "runs/drill/drill.json").read_text())
    assert [r["scenario"] for r in drill["results"]] == TESTED and drill["baseline"]["restart_s"] > 0
    references = list((cwd / "runs/drill/references").iterdir())
    assert len(references) == 2, "one clean run per config and layout, and one told to skip the NaN's update"
    done = run_keel(["report", "runs/drill"], cwd=cwd, timeout=60)
    assert done.returncode == 0, done.stderr
    page = (cwd / "runs/drill/report.html").read_text()
    assert "<h2>Failure drills</h2>" in page and f"{len(TESTED)} of {len(TESTED)} promises kept" in page
    done = run_keel(["report", "runs/drill/scenarios/kill_mid_step"], cwd=cwd, timeout=60)
    assert done.returncode == 0, done.stderr
    page = (cwd / "runs/drill/scenarios/kill_mid_step/report.html").read_text()
    assert "<h2>Failure drills</h2>" in page and "<h2>Training</h2>" in page and \
        results["kill_mid_step"]["promise"] in page


def test_a_recovery_with_its_detector_switched_off_is_reported_broken(quick, small_corpus: Path) -> None:
    cwd, _ = quick
    # The same flipped gradient bit with replays off: nothing looks there, yet the scenario promises an exact end.
    done = run_keel(["drill", "--scenario", "bitflip_grads", "--workdir", "runs/drill", f"data.dir={small_corpus}",
                     "guard.sdc.replay_interval=0"], cwd=cwd, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "BROKEN: final state differs from the reference; no guard/quarantine event: the fault went undetected" \
        in done.stdout, done.stdout
    assert "0 of 1 promises kept" in done.stdout
    (result,) = json.loads((cwd / "runs/drill/drill.json").read_text())["results"]
    assert result["promise_kept"] is False and result["detected_by"] is None and not result["state_equal"]


def test_every_scenario_delivers_a_fault_and_names_its_detector() -> None:
    for s in catalog().values():
        assert s.inject or s.outside or s.lose_node_at or s.network, s.name
        assert s.detect[0], s.name


def test_a_killed_lighthouse_is_back_at_once_and_nothing_is_lost(quick, small_corpus: Path) -> None:
    cwd, _ = quick  # beside the quick suite's cached references, with a fault-free replica-group run of its own
    done = run_keel(["drill", "--scenario", "lighthouse_restart", "--json", "--workdir", "runs/drill",
                     f"data.dir={small_corpus}"], cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (r,) = json.loads(done.stdout)
    assert r["promise_kept"], (r["broken"], r["events"])
    assert r["detected_by"] == "lighthouse/restarted" and r["detect_s"] < 2.0
    assert r["steps_lost"] == 0 and r["heals"] == 0 and r["param_max_abs_diff"] <= REPLICA_ATOL
