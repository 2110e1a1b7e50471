"""`keel drill`'s network scenarios, on nodes that are network namespaces of their own (keel.drill.netns): the
rendezvous host's cable pulled and put back, a link flapping, a port slowed, a replica group's cable pulled. Each
promise kept, and what each fault leaves in the run as the nodes saw it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from keel.drill.netns import unavailable
from keel.drill.runner import replica_events
from keel.drill.scenarios import NETWORK_SUITE
from keel.rundir.events import read_jsonl
from tests.conftest import run_keel

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))]

# The network suite less cable_pulled: a node's pulled cable named on both sides while the others go on is
# tests/dist/test_netns.py's, and a node rejoining once its cable is back is rendezvous_cable_pulled's here.
TESTED = [name for name in NETWORK_SUITE if name != "cable_pulled"]


@pytest.fixture(scope="module")
def drilled(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    cwd = tmp_path_factory.mktemp("drill")
    done = run_keel(["drill", "--suite", "network", "--scenario", ",".join(TESTED), "--json", "--workdir",
                     "runs/drill", f"data.dir={small_corpus}"], cwd=cwd, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cwd / "runs/drill/scenarios", {r["scenario"]: r for r in json.loads(done.stdout)}


def test_every_network_fault_is_detected_and_its_promise_kept(drilled) -> None:
    _, results = drilled
    assert list(results) == TESTED
    for r in results.values():
        assert r["promise_kept"], (r["scenario"], r["broken"], r["events"])
    # Every cluster is gone, passed or failed: its namespaces, and every process it started (the drill checks
    # the processes of each launch: a leftover breaks the promise).
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ns for ns in listed.split() if ns.startswith("k") and "-n" in ns], listed
    # A flap and a slow port delay the job and change nothing it computes.
    assert results["link_flap"]["state_equal"] and results["slow_link"]["state_equal"]
    assert results["link_flap"]["detected_by"] == "alert/link_flapped"
    assert results["link_flapping"]["detected_by"] == "leave/flapping"
    # The slow port is named within two straggler intervals (5 steps) of the throttle.
    assert results["slow_link"]["detected_by"] == "straggler/log" and results["slow_link"]["detect_steps"] <= 10
    # The rendezvous host's own hang verdict names it, within the learned step timeout of the pull.
    host = results["rendezvous_cable_pulled"]
    assert host["detected_by"] == "hang/restart" and 0 < host["detect_s"] < 60, host


def carrier_changes(run_dir: Path, node: str) -> list[float]:
    samples = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    return [s["readings"]["network_carrier_changes_total{interface=eth0}"] for s in samples if s["node"] == node]


def test_one_flap_is_an_alert_the_node_counted_and_the_report_shows_and_no_quarantine(drilled,
                                                                                    tmp_path: Path) -> None:
    run_dir = drilled[0] / "link_flap"
    (flap,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "alert"]
    assert (flap["action"], flap["detail"]["node"], flap["detail"]["interface"]) == ("link_flapped", "node-1", "eth0")
    assert flap["detail"]["message"].startswith("link flapped on node node-1: interface eth0, ")
    changes = carrier_changes(run_dir, "node-1")
    assert changes and changes[-1] - changes[0] == 2, changes  # down, then up
    assert not (run_dir / "quarantine.json").exists()
    report = run_keel(["report", str(run_dir), "--out", str(tmp_path / "report.html")], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "link flapped on node node-1" in (tmp_path / "report.html").read_text()


def test_a_link_that_keeps_flapping_puts_its_node_in_quarantine_and_the_job_goes_on_without_it(drilled) -> None:
    run_dir = drilled[0] / "link_flapping"
    events = read_jsonl(run_dir / "events.jsonl")
    # One alert per incident (the rule's cooldown), from the first sample that saw the carrier go.
    assert [e["detail"]["node"] for e in events if e["kind"] == "alert" and e["action"] == "link_flapped"] == \
        ["node-1"]
    (record,) = json.loads((run_dir / "quarantine.json").read_text())
    assert (record["hosts"], record["source"]) == (["node-1"], "network"), record
    assert record["reason"] == "its link eth0 flapped 3 times (health.flap_limit = 3)", record
    # The node's own launcher says why it lists itself; then it leaves as a quarantined node does.
    leaves = [e for e in events if e["kind"] == "leave"]
    assert [(e["action"], e["detail"]["nodes"]) for e in leaves] == \
        [("flapping", ["node-1"]), ("quarantine", ["node-1"])], leaves
    assert [e["detail"]["world_size"] for e in events if e["kind"] == "start" and e["rank"] == 0] == [2, 1]


def test_the_rendezvous_hosts_cable_pulled_is_blamed_on_the_host_and_the_other_node_rejoins(drilled) -> None:
    run_dir = drilled[0] / "rendezvous_cable_pulled"
    log = (run_dir / "drill-node-1.log").read_text()
    assert "this node's link eth0 is up: the fault is the rendezvous host's or between;" in log
    assert "keel: node node-1 reaches the rendezvous again after " in log
    events = read_jsonl(run_dir / "events.jsonl")
    (leave,) = [e for e in events if e["kind"] == "leave"]
    assert (leave["detail"]["nodes"], leave["detail"]["links_down"]) == (["node-1"], [])
    (hang,) = [e for e in events if e["kind"] == "hang"]
    assert (hang["detail"]["stuck_ranks"], hang["detail"]["hosts"]) == ([0], ["node-0"]), hang
    assert "rank 0 on node-0 is cut off from the job: this node's link eth0 is down" in hang["detail"]["reason"]
    assert [e["detail"]["world_size"] for e in events if e["kind"] == "start" and e["rank"] == 0] == [2, 1, 2]


def test_a_replica_group_behind_a_dead_link_is_dropped_and_heals_once_it_is_back_the_other_never_stopping(
        drilled) -> None:
    run_dir = drilled[0] / "group_cable_pulled"
    result = drilled[1]["group_cable_pulled"]
    assert (result["detected_by"], result["steps_lost"], result["updates_skipped"]) == ("quorum/change", 0, 0), result
    events = replica_events(run_dir)
    # Group 0 never stopped: one start (its process kept), and no failure of its own.
    assert [e["kind"] for e in events if e["group"] == 0 and e["kind"] in ("start", "failure")] == ["start"]
    pulled = result["fault_step"]
    alone = [e for e in events if e["group"] == 0 and e["kind"] == "quorum" and e["step"] >= pulled
             and e["detail"]["participants"] == 1]
    assert alone, [(e["group"], e["kind"], e["action"], e["detail"]) for e in events if e["kind"] == "quorum"]
    # Group 1 healed from group 0 once its link was back, and both trained together again to the end.
    assert [e for e in events if e["group"] == 1 and e["kind"] == "quorum" and e["action"] == "heal"
            and e["time"] > alone[0]["time"]]
    last = [e for e in events if e["group"] == 0 and e["kind"] == "quorum"][-1]
    assert last["detail"]["participants"] == 2, last


def test_a_slowed_port_names_its_node_and_not_its_neighbours(drilled) -> None:
    run_dir = drilled[0] / "slow_link"
    events = read_jsonl(run_dir / "events.jsonl")
    (straggler,) = [e for e in events if e["kind"] == "straggler"]
    detail = straggler["detail"]
    assert detail["link"] and detail["node"] == "node-2" and detail["ratio"] > 10, detail
    (alert,) = [e for e in events if e["kind"] == "alert"]
    assert alert["detail"]["message"].startswith("node node-2 has a slow link: a 4 MiB probe takes "), alert
    assert not [e for e in events if e["kind"] in ("hang", "failure")]
