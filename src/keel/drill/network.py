"""Network faults, rehearsed on nodes that are network namespaces of their own (keel.drill.netns): the job's
commands, one per node, and the fault on one node's link at a chosen step, put right once it did what it
rehearses. Each launch ends as a drill's launch does (exit code, seconds, what was done from outside, processes
left behind)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keel.drill.netns import RDZV_PORT, Cluster
from keel.drill.procs import Launch
from keel.drill.scenarios import CLOSE, FLAP_LINK, FLAPPING, PULL_CABLE, SLOW_LINK, Scenario
from keel.rundir.events import read_jsonl
from keel.rundir.status import read_status
from keel.train import lighthouse as lighthouse_script

SLOW_LINK_MBIT = 50  # a slowed port: a 4 MiB link probe takes about 0.7 s instead of milliseconds
LIGHTHOUSE_PORT = 29510  # on node 0, beside the first replica group
GROUP_STEPS_ALONE = 3  # steps the groups left make without the one cut off before its cable goes back

# `keel train ARGS` for one node: its own extra flags in, the whole command line out.
NodeArgs = Callable[[tuple[str, ...]], list[str]]


def launch_nodes(scenario: Scenario, run_dir: Path, node_args: NodeArgs, per_node: int, workdir: Path,
                 timeout: float) -> dict[str, Any]:
    """A job of `scenario.nodes` nodes of `per_node` processes (node 0 hosts the rendezvous), and the network
    fault on the victim's link from `fault_step` on. The job's exit is that of the nodes not hit; the hit node's
    own (`victim_exit`) is judged apart."""
    victim = scenario.victim % scenario.nodes
    # Where the job goes on without a node, it is elastic.
    nodes = f"1:{scenario.nodes}" if scenario.compare == CLOSE else str(scenario.nodes)
    with Cluster(scenario.nodes) as cluster:
        jobs = [cluster.keel(n, node_args(("--nnodes", nodes, "--rdzv-endpoint", f"{cluster.address(0)}:{RDZV_PORT}",
                                           "--local-addr", cluster.address(n))), workdir,
                             run_dir / f"drill-node-{n}.log") for n in range(scenario.nodes)]
        left = per_node * (scenario.nodes - 1)
        sent = _fault(cluster, victim, scenario, jobs, timeout, run_dir,
                      lambda: newest_world(run_dir) == left)
        return _ended(jobs, victim, sent, timeout)


def launch_groups(scenario: Scenario, run_dir: Path, group_args: Callable[[int, str], list[str]], workdir: Path,
                  timeout: float) -> dict[str, Any]:
    """Replica groups of one node each (`--replica-groups` on a cluster: each group's own command, told its group
    and the lighthouse, which runs on node 0), and the victim group's cable pulled at the first group's
    `fault_step`; put back once the groups left made GROUP_STEPS_ALONE steps without it."""
    victim, survivor = scenario.victim % scenario.groups, run_dir / "groups" / "0"
    with Cluster(scenario.groups) as cluster:
        bind = f"{cluster.address(0)}:{LIGHTHOUSE_PORT}"
        cluster.keel(0, [], workdir, run_dir / "lighthouse.log", program=lighthouse_script.command(
            1, bind, join_timeout_s=60.0, heartbeat_timeout_s=1.0))
        jobs = [cluster.keel(g, group_args(g, f"http://{bind}"), workdir, run_dir / f"drill-node-{g}.log",
                             env={"KEEL_REPLICA_GROUP": str(g), "KEEL_REPLICA_ROOT": str(run_dir)})
                for g in range(scenario.groups)]
        alone: list[int] = []  # the first group's step when it went on without the lost one

        def mended() -> bool:
            if not alone:
                alone.extend(e["step"] for e in read_jsonl(survivor / "events.jsonl")
                             if e["kind"] == "quorum" and e["detail"].get("participants") == scenario.groups - 1)
            return bool(alone) and int(read_status(survivor).get("step", 0)) >= alone[-1] + GROUP_STEPS_ALONE

        sent = _fault(cluster, victim, scenario, jobs, timeout, survivor, mended)
        return _ended(jobs, victim, sent, timeout)


def _fault(cluster: Cluster, victim: int, scenario: Scenario, jobs: list[Launch], timeout: float, watched: Path,
           cable_back: Callable[[], bool]) -> dict[str, Any]:
    """Waits for `watched` to reach the fault step, hits the victim's link, and puts it right once the fault did
    what it rehearses: a pulled cable once `cable_back()`, a slowed port once a straggler was named. Returns when
    and where it struck ({} if the job ended first)."""
    sent: dict[str, Any] = {}
    undone = False
    while not undone and all(job.proc.poll() is None for job in jobs) and time.time() - jobs[0].started < timeout:
        step = int(read_status(watched).get("step", 0))
        if not sent and step >= scenario.fault_step:
            sent = {"time": time.time(), "step": step, "node": cluster.hostname(victim)}
            undone = _hit(cluster, victim, scenario.network)
        elif sent and scenario.network == PULL_CABLE and cable_back():
            cluster.link_up(victim)
            undone = True
        elif sent and scenario.network == SLOW_LINK and any(
                e["kind"] == "straggler" for e in read_jsonl(watched / "events.jsonl")):
            cluster.unthrottle(victim)
            undone = True
        time.sleep(0.1)
    return sent


def _hit(cluster: Cluster, node: int, fault: str) -> bool:
    """The network fault on `node`'s link; whether it is over already (a flap puts the link back itself)."""
    if fault == PULL_CABLE:
        cluster.link_down(node)
    elif fault in (FLAP_LINK, FLAPPING):
        cluster.flap(node, *((5.0, 1) if fault == FLAP_LINK else (2.0, 3)))
        return True
    else:
        cluster.throttle(node, mbit=SLOW_LINK_MBIT)
    return False


def _ended(jobs: list[Launch], victim: int, sent: dict[str, Any], timeout: float) -> dict[str, Any]:
    codes = [job.wait(timeout) for job in jobs]
    leftovers = [pid for job in jobs for pid in job.leftovers()]
    return {"exit": next((c for n, c in enumerate(codes) if c != 0 and n != victim), 0), "victim_exit": codes[victim],
            "seconds": round(time.time() - jobs[0].started, 2), "outside": sent, "leftovers": leftovers,
            "started": jobs[0].started}


def newest_world(run_dir: Path) -> int:
    """The world size of the run's newest start."""
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start"]
    return int(starts[-1]["detail"].get("world_size", 0)) if starts else 0
