"""Nodes in network namespaces of their own (keel.drill.netns): a job across them trains as one machine does, and
the faults the cluster injects are real ones, seen by the nodes' own interfaces."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.drill.netns import Cluster, unavailable
from keel.drill.procs import Launch
from keel.rundir.events import read_jsonl
from keel.rundir.status import read_status
from tests.conftest import SMALL_RUN, run_keel

pytestmark = [pytest.mark.dist, pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))]

PORT = 29400  # inside node 0's namespace, where nothing else listens


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def two_nodes(cluster: Cluster, run_dir: Path, corpus: Path, tmp_path: Path, *extra: str,
              nodes: tuple[str, ...] = ("--nnodes", "2")) -> list[Launch]:
    """The reference run's job (40 steps of SMALL_RUN on 2 processes) as two nodes of one process each."""
    return [cluster.keel(node, ["train", "--nproc", "1", *nodes, "--rdzv-endpoint",
                                f"{cluster.address(0)}:{PORT}", "--local-addr", cluster.address(node), "--run-dir",
                                str(run_dir), *SMALL_RUN, "train.steps=40", f"data.dir={corpus}",
                                "checkpoint.interval=10", "checkpoint.keep_last=10", *extra],
                        tmp_path, tmp_path / f"node-{node}.log") for node in range(2)]


def assert_finished_as_the_reference(launches: list[Launch], run_dir: Path, reference_run: Path,
                                     tmp_path: Path) -> None:
    codes = [launch.wait(timeout=300) for launch in launches]
    assert codes == [0, 0], [(tmp_path / f"node-{n}.log").read_text()[-3000:] for n in range(2)]
    assert losses(run_dir) == losses(reference_run)
    final = Path("checkpoints") / "step-000040"
    assert state_sha256(run_dir / final) == state_sha256(reference_run / final)


def test_a_job_across_two_namespaced_nodes_ends_bitwise_equal_to_one_machines(reference_run: Path,
                                                                             small_corpus: Path,
                                                                             tmp_path: Path) -> None:
    run_dir = tmp_path / "N"
    with Cluster(2) as cluster:
        assert_finished_as_the_reference(two_nodes(cluster, run_dir, small_corpus, tmp_path), run_dir,
                                         reference_run, tmp_path)
    (start,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start" and e["rank"] == 0]
    assert start["detail"]["world_size"] == 2


def wait_for_step(run_dir: Path, step: int, launches: list[Launch], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while read_status(run_dir).get("step", 0) < step:
        assert time.monotonic() < deadline and all(launch.proc.poll() is None for launch in launches)
        time.sleep(0.1)


def test_a_link_that_flaps_again_and_again_is_an_alert_naming_its_node_and_nothing_is_lost(reference_run: Path,
                                                                                          small_corpus: Path,
                                                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "F"
    with Cluster(2) as cluster:
        launches = two_nodes(cluster, run_dir, small_corpus, tmp_path, "monitor.telemetry_interval_s=0.5",
                             'drill.inject=["slow:rank=-1,seconds=0.1"]')
        wait_for_step(run_dir, 10, launches)
        # Node 1's cable out for 2 s, three times a second apart: its collectives wait, TCP resends.
        cluster.flap(1, down_s=2.0, times=3)
        assert_finished_as_the_reference(launches, run_dir, reference_run, tmp_path)
    alerts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "alert"]
    (flap,) = [e for e in alerts if e["action"] == "link_flapped"]
    assert flap["detail"]["node"] == "node-1" and flap["detail"]["interface"] == "eth0", flap
    # One alert per incident (the rule's cooldown), from the first sample that saw the carrier go.
    assert flap["detail"]["message"].startswith("link flapped on node node-1: interface eth0, ")
    samples = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    changes = [s["readings"]["network_carrier_changes_total{interface=eth0}"] for s in samples
               if s["node"] == "node-1"]
    assert changes and changes[-1] - changes[0] == 6, changes  # down and up, three times
    report = run_keel(["report", str(run_dir), "--out", str(tmp_path / "report.html")], cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "link flapped on node node-1" in (tmp_path / "report.html").read_text()


def wait_for(what, timeout_s: float, launches: list[Launch]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline and all(launch.proc.poll() is None for launch in launches)
        time.sleep(0.2)


def pull_a_cable_at_step_12(cluster: Cluster, node: int, run_dir: Path, corpus: Path, tmp_path: Path,
                            *extra: str) -> tuple[list[Launch], float]:
    """A node's cable pulled at step 12 of an elastic two-node job (node 0 hosts the rendezvous); put back once
    node 0 has restarted alone. Returns the launches and when the cable was pulled. The step timeout is learned
    by step 10; from step 13 a step takes a second, so node 0 alone is still training when node 1 is back."""
    launches = two_nodes(cluster, run_dir, corpus, tmp_path, "health.watchdog.warmup_steps=10",
                         'drill.inject=["slow:rank=-1,seconds=0.1", "slow:rank=-1,seconds=0.9,from_step=13"]', *extra,
                         nodes=("--nnodes", "1:2", "--max-restarts", "2"))
    wait_for_step(run_dir, 12, launches)
    cluster.link_down(node)
    pulled = time.time()
    wait_for(lambda: [e["detail"]["world_size"] for e in read_jsonl(run_dir / "events.jsonl")
                      if e["kind"] == "start"][-1:] == [1], 120, launches)
    cluster.link_up(node)
    return launches, pulled


def assert_cut_off_and_named(run_dir: Path, log: str, pulled: float, culprit: int = 1) -> list[dict]:
    # Node 1 sees the rendezvous go silent and leaves, saying which side its own link puts the fault on.
    assert "keel: node node-1 is cut off from the job: the rendezvous at 10.231.0.1:29400 has not answered" in log
    assert ("this node's link eth0 is down;" if culprit == 1 else
            "this node's link eth0 is up: the fault is the rendezvous host's or between;") in log
    events = read_jsonl(run_dir / "events.jsonl")
    (leave, *_) = [e for e in events if e["kind"] == "leave"]
    assert (leave["action"], leave["detail"]["nodes"]) == ("cut_off", ["node-1"])
    assert leave["detail"]["links_down"] == (["eth0"] if culprit == 1 else [])
    # The hang it caused is named on node 0 within the learned step timeout: the node whose link is dead.
    (hang,) = [e for e in events if e["kind"] == "hang"]
    assert hang["detail"]["hosts"] == [f"node-{culprit}"], hang
    assert hang["detail"]["stuck_ranks"] == [culprit] and ("this node's link eth0 is down" in hang["detail"]["reason"]
                                                           ) == (culprit == 0), hang
    assert hang["time"] - pulled <= hang["detail"]["timeouts"]["step"], (hang["time"] - pulled, hang["detail"])
    return events


def assert_losses_after_resume_match(run_dir: Path, reference_run: Path, resumed_at: int) -> None:
    """The same global batches on another number of processes (the micro-batches accumulated in another order):
    the losses after the resume match the uninterrupted 2-process run's to rounding."""
    after = {s: loss for s, loss in losses(run_dir).items() if s > resumed_at}
    expected = losses(reference_run)
    assert sorted(after) == list(range(resumed_at + 1, 41))
    for s, loss in after.items():
        assert loss == pytest.approx(expected[s], rel=2e-3), s


@pytest.mark.parametrize("node", [1, 0], ids=["a-node", "the-rendezvous-host"])
def test_a_node_cut_off_is_named_the_job_goes_on_without_it_and_it_rejoins_when_its_cable_is_back(
        node: int, reference_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "C"
    with Cluster(2) as cluster:
        launches, pulled = pull_a_cable_at_step_12(cluster, node, run_dir, small_corpus, tmp_path)
        codes = [launch.wait(timeout=240) for launch in launches]
    logs = [(tmp_path / f"node-{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], [log[-3000:] for log in logs]
    events = assert_cut_off_and_named(run_dir, logs[1], pulled, culprit=node)
    assert "keel: node node-1 reaches the rendezvous again after " in logs[1]
    # Alone from the latest checkpoint (node 0 holds the rendezvous: the job goes on there even when its own cable
    # is out), then both again once node 1 rejoined, from the checkpoint node 0 wrote as its workers paused to
    # take node 1 in.
    assert [e["detail"]["world_size"] for e in events if e["kind"] == "start" and e["rank"] == 0][-2:] == [1, 2]
    resumed = [e for e in events if e["kind"] == "resume"]
    assert len(resumed) >= 2 and not (run_dir / "quarantine.json").exists()
    assert_losses_after_resume_match(run_dir, reference_run, resumed[0]["step"])


def test_a_node_cut_off_once_too_often_is_quarantined_and_the_job_ends_without_it(reference_run: Path,
                                                                                 small_corpus: Path,
                                                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "Q"
    with Cluster(2) as cluster:
        launches, pulled = pull_a_cable_at_step_12(cluster, 1, run_dir, small_corpus, tmp_path,
                                                   "health.cut_off_limit=1")
        codes = [launch.wait(timeout=240) for launch in launches]
    logs = [(tmp_path / f"node-{n}.log").read_text() for n in range(2)]
    assert codes == [0, 76], [log[-3000:] for log in logs]
    events = assert_cut_off_and_named(run_dir, logs[1], pulled)
    assert "keel: node node-1 reaches the rendezvous again, but it was cut off 1× (health.cut_off_limit = 1)" in logs[1]
    (record,) = json.loads((run_dir / "quarantine.json").read_text())
    assert record["hosts"] == ["node-1"] and record["source"] == "network", record
    assert [e["detail"]["world_size"] for e in events if e["kind"] == "start"][-1] == 1
    assert_losses_after_resume_match(run_dir, reference_run, [e for e in events if e["kind"] == "resume"][-1]["step"])


THREE_NODES = [*SMALL_RUN, "train.steps=30", "train.global_batch=12", "eval.sequences=12", "checkpoint.interval=30",
               "health.straggler.interval=5", 'drill.inject=["slow:rank=-1,seconds=0.1"]']


def test_a_node_whose_link_is_slowed_is_named_a_straggler_and_nothing_is_lost(small_corpus: Path,
                                                                             tmp_path: Path) -> None:
    alone = run_keel(["train", "--nproc", "3", "--run-dir", str(tmp_path / "one"), *THREE_NODES,
                      f"data.dir={small_corpus}"], cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    run_dir = tmp_path / "S"
    with Cluster(3) as cluster:
        launches = [cluster.keel(node, ["train", "--nproc", "1", "--nnodes", "3", "--rdzv-endpoint",
                                        f"{cluster.address(0)}:{PORT}", "--local-addr", cluster.address(node),
                                        "--run-dir", str(run_dir), *THREE_NODES, f"data.dir={small_corpus}"],
                                 tmp_path, tmp_path / f"node-{node}.log") for node in range(3)]
        wait_for_step(run_dir, 8, launches)
        cluster.throttle(2, mbit=20)  # node 2's port at 20 Mbit/s: every collective waits for it alike
        wait_for(lambda: any(e["kind"] == "straggler" for e in read_jsonl(run_dir / "events.jsonl")), 120,
                 launches)
        cluster.unthrottle(2)
        codes = [launch.wait(timeout=240) for launch in launches]
    assert codes == [0, 0, 0], [(tmp_path / f"node-{n}.log").read_text()[-3000:] for n in range(3)]
    events = read_jsonl(run_dir / "events.jsonl")
    (straggler,) = [e for e in events if e["kind"] == "straggler"]
    detail = straggler["detail"]
    assert detail["link"] and detail["node"] == "node-2" and detail["ratio"] > 10, detail
    assert straggler["step"] in (15, 20, 25), straggler  # two gathers in a row, from the first after the throttle
    (alert,) = [e for e in events if e["kind"] == "alert" and e["action"] == "straggler"]
    assert alert["detail"]["message"].startswith("node node-2 has a slow link: a 4 MiB probe takes "), alert
    assert not [e for e in events if e["kind"] in ("hang", "failure")]
    # A slow link delays; it changes nothing computed.
    assert losses(run_dir) == losses(tmp_path / "one")
    final = Path("checkpoints") / "step-000030"
    assert state_sha256(run_dir / final) == state_sha256(tmp_path / "one" / final)


def _send(cluster: Cluster, megabytes: int, connect_s: float = 5.0) -> float | None:
    """Seconds to send `megabytes` from node 1 to a server listening on node 0; None when node 1 cannot connect
    within `connect_s`."""
    server = subprocess.Popen(["ip", "netns", "exec", cluster.namespace(0), sys.executable, "-c",
                               f"import socket; s = socket.create_server(('', {PORT})); c, _ = s.accept()\n"
                               "while c.recv(1 << 16): pass"])
    try:
        time.sleep(0.5)  # the server listening
        started = time.monotonic()
        sent = subprocess.run(["ip", "netns", "exec", cluster.namespace(1), sys.executable, "-c",
                               f"import socket\ns = socket.create_connection(('{cluster.address(0)}', {PORT}), "
                               f"timeout={connect_s})\ns.sendall(bytes({megabytes << 20})); s.close()"],
                              capture_output=True, timeout=120)
        return time.monotonic() - started if sent.returncode == 0 else None
    finally:
        server.kill()
        server.wait(timeout=30)


def test_a_pulled_cable_a_flap_and_a_slow_port_are_real_on_the_node() -> None:
    with Cluster(2) as cluster:
        before = cluster.link_state(1)
        assert before["operstate"] == "up"
        cluster.link_down(1)
        assert cluster.link_state(1)["operstate"] != "up"
        assert _send(cluster, 1, connect_s=2) is None, "nothing reaches node 0 without a cable"
        cluster.link_up(1)
        cluster.flap(1, down_s=0.2)
        after = cluster.link_state(1)
        assert after["operstate"] == "up"
        # Down and up, twice: each is a change of carrier the node's kernel counts.
        assert int(after["carrier_changes"]) >= int(before["carrier_changes"]) + 4, (before, after)
        fast = _send(cluster, 4)
        cluster.throttle(1, mbit=8)  # 4 MiB at 8 Mbit/s: about 4 s
        slow = _send(cluster, 4)
        cluster.unthrottle(1)
    assert fast is not None and slow is not None and slow > 3.0 and slow > 3 * fast, (fast, slow)
    assert not any(ns.startswith(cluster.prefix) for ns in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split()), "the namespaces are removed"
