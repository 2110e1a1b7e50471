"""`keel drill` on replica groups: a group SIGKILLed mid-step and a SIGKILLed lighthouse, each a real
`keel train --replica-groups 2 --nproc 1` judged against the cached fault-free replica-group run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.drill.scenarios import REPLICA_ATOL
from keel.drill.scorecard import format_scorecard
from tests.conftest import run_keel

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def drilled(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cwd = tmp_path_factory.mktemp("drill_replicas")
    done = run_keel(["drill", "--scenario", "group_loss,lighthouse_restart", "--json", "--workdir", "runs/drill",
                     f"data.dir={small_corpus}"], cwd=cwd, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {r["scenario"]: r for r in json.loads(done.stdout)}
    references = sorted(json.loads(p.read_text())["groups"]
                        for p in (cwd / "runs/drill/references").glob("*/drill-reference.json"))
    assert references == [1, 2], "the plain restart's reference, and one fault-free replica-group run"
    return results


def test_a_lost_group_heals_while_the_survivor_loses_no_step(drilled: dict[str, dict]) -> None:
    r = drilled["group_loss"]
    assert r["promise_kept"], (r["broken"], r["events"])
    assert r["detected_by"] == "quorum/change" and 0 < r["detect_s"] and r["recover_s"] > 0 and r["heals"] == 1
    assert r["steps_lost"] == 0 and r["param_max_abs_diff"] <= REPLICA_ATOL
    assert "[1] drill/inject@6" in r["events"] and "[1] quorum/heal" in " ".join(r["events"])
    assert r["restart_steps_lost"] == 5, "a plain restart would have made the steps since the start again"


def test_a_killed_lighthouse_is_back_at_once_and_nothing_is_lost(drilled: dict[str, dict]) -> None:
    r = drilled["lighthouse_restart"]
    assert r["promise_kept"], (r["broken"], r["events"])
    assert r["detected_by"] == "lighthouse/restarted" and r["detect_s"] < 2.0
    assert r["steps_lost"] == 0 and r["heals"] == 0 and r["param_max_abs_diff"] <= REPLICA_ATOL


def test_the_scorecard_tells_the_survivors_longest_step(drilled: dict[str, dict]) -> None:
    card = format_scorecard(list(drilled.values()))
    assert "2 of 2 promises kept" in card
    assert "group_loss: 2 replica groups; the survivors' longest step" in card
