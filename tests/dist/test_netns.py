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
from keel.drill.netns import RDZV_PORT as PORT
from keel.drill.netns import Cluster, unavailable
from keel.drill.procs import Launch
from keel.rundir.events import read_jsonl
from keel.rundir.status import read_status
from tests.conftest import SMALL_RUN

pytestmark = [pytest.mark.dist, pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))]



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


def wait_for(what, timeout_s: float, launches: list[Launch]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline and all(launch.proc.poll() is None for launch in launches)
        time.sleep(0.2)


def pull_a_cable_at_step_12(cluster: Cluster, node: int, run_dir: Path, corpus: Path, tmp_path: Path,
                            *extra: str) -> tuple[list[Launch], float]:
    """A node's cable pulled at step 12 of an elastic two-node job (node 0 hosts the rendezvous); put back once
    node 0 has restarted alone. (`keel drill --suite network` pulls either node's cable and puts it back: see
    tests/dist/test_drill_network.py.) Returns the launches and when the cable was pulled. The step timeout is learned
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


def assert_cut_off_and_named(run_dir: Path, log: str, pulled: float) -> list[dict]:
    # Node 1 sees the rendezvous go silent and leaves, its own link down.
    assert "keel: node node-1 is cut off from the job: the rendezvous at 10.231.0.1:29400 has not answered" in log
    assert "this node's link eth0 is down;" in log
    events = read_jsonl(run_dir / "events.jsonl")
    (leave, *_) = [e for e in events if e["kind"] == "leave"]
    assert (leave["action"], leave["detail"]["nodes"], leave["detail"]["links_down"]) == \
        ("cut_off", ["node-1"], ["eth0"])
    # The hang it caused is named on node 0 within the learned step timeout.
    (hang,) = [e for e in events if e["kind"] == "hang"]
    assert (hang["detail"]["stuck_ranks"], hang["detail"]["hosts"]) == ([1], ["node-1"]), hang
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
