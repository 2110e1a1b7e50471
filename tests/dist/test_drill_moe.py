"""`keel drill` on a mixture-of-experts model whose experts are split over 2 expert-parallel ranks: a flipped bit
in one expert's weights on a layout where each expert shard has a replica, and a replica group of 2
expert-parallel processes lost: real faults in real runs, each promise kept. Short runs (15 steps, a checkpoint
every 5) of the quick suite's small model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.checkpoint.inspect import load_full_state
from keel.drill.scenarios import REPLICA_ATOL
from keel.rundir.events import read_jsonl
from tests.conftest import run_keel

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, INTERVAL = 15, 5
# moe_kill_mid_step's SIGKILL of an expert-parallel rank, resumed bitwise, is tests/dist/test_moe.py's.
TESTED = ["moe_bitflip_expert", "moe_group_loss"]


@pytest.fixture(scope="module")
def moe(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cwd = tmp_path_factory.mktemp("drill_moe")
    done = run_keel(["drill", "--scenario", ",".join(TESTED), "--steps", str(STEPS), "--interval", str(INTERVAL),
                     "--json", "--workdir", "runs/drill", f"data.dir={small_corpus}"], cwd=cwd, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["scenario"]: r for r in json.loads(done.stdout)}
    assert list(results) == TESTED
    for r in results.values():
        assert r["promise_kept"], (r["scenario"], r["broken"], r["events"])
    return results


def final(result: dict, key: str = "run_dir") -> Path:
    return Path(result[key]) / "checkpoints" / f"step-{STEPS:06d}"


def starts(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start"]


def test_a_flipped_bit_in_one_experts_weights_is_caught_by_its_replica_and_its_rank_named(
        moe: dict[str, dict]) -> None:
    """dp_replicate = 2 × ep = 2 on 4 processes: rank 1's expert shard has a replica on rank 3. The fingerprints
    at step 10 tie, the run goes back to the verified step 5 and makes the steps again; the flipped replica's
    state lies far further from the re-executed one, so rank 1 alone is named, and the run ends as the clean one."""
    flip = moe["moe_bitflip_expert"]
    assert flip["state_equal"] and flip["losses_equal"] and flip["detected_by"] == "guard/rollback"
    run_dir = Path(flip["run_dir"])
    events = read_jsonl(run_dir / "events.jsonl")
    (injected,) = [e for e in events if e["kind"] == "drill"]
    assert (injected["step"], injected["rank"], injected["detail"]["param"]) == (8, 1, "layers.1.moe.experts.w1")
    rollback, rolled_back, named = [e["detail"] for e in events if e["kind"] == "guard"]
    assert rollback["tied"] == [1, 3] and rollback["differing_tensors"] == 1
    assert rolled_back["to_step"] == 5 and flip["steps_recomputed"] == 5
    assert named["ranks"] == [1] and named["attributed_by"] == "re-execution"
    assert [q["ranks"] for q in json.loads((run_dir / "quarantine.json").read_text())] == [[1]]
    assert {e["detail"]["world_size"] for e in starts(run_dir)} == {4}


def test_a_lost_replica_group_of_expert_parallel_ranks_heals_while_the_survivor_loses_no_step(
        moe: dict[str, dict]) -> None:
    lost = moe["moe_group_loss"]
    assert lost["detected_by"] in ("quorum/change", "quorum/heal") and lost["heals"] == 1
    assert lost["steps_lost"] == 0 and lost["param_max_abs_diff"] <= REPLICA_ATOL
    assert "[1] drill/inject@3" in lost["events"] and "[1] quorum/heal" in " ".join(lost["events"])
    groups = Path(lost["run_dir"]) / "groups"
    # Two processes in each group: the survivor's two ranks started once, the lost group's twice each.
    assert sorted(e["rank"] for e in starts(groups / "0")) == [0, 1]
    assert sorted(e["rank"] for e in starts(groups / "1")) == [0, 0, 1, 1]
    assert load_full_state(final(lost))["model.layers.1.moe.experts.w1"].shape[0] == 4

