"""The memory tier spread over two nodes (two launchers of one job, each with its own memory): a whole node lost
at a random step (its launcher and workers SIGKILLed together, its memory gone with it) and replaced by a fresh
one restores from the memory the surviving node holds, its own and its buddy's copy, pulling the lost node's
files from it and opening no file of the checkpoint storage. Later the node and its buddy are lost together
(here both nodes, memories and all): the job started again falls back to the newest storage checkpoint. The run
ends bitwise equal to the run that never failed."""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.checkpoint.memory import memory_root
from keel.core.net import free_port
from keel.rundir.events import read_jsonl
from keel.rundir.status import read_status
from tests.conftest import SMALL_RUN, kill_tagged, spawn_keel
from tests.dist.test_memory_tier import Watch

pytestmark = pytest.mark.dist


def _node(args: list[str], n: int, cwd: Path) -> tuple[subprocess.Popen, str]:
    with (cwd / f"node-{n}.log").open("a") as log:
        return spawn_keel(args, cwd, env={"KEEL_NODE": f"node-{n}"}, text=True, stdout=log,
                          stderr=subprocess.STDOUT)


def _args(run_dir: Path, small_corpus: Path) -> list[str]:
    return ["train", "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"localhost:{free_port()}",
            "--max-restarts", "2", "--run-dir", str(run_dir), *SMALL_RUN, "train.steps=40", f"data.dir={small_corpus}",
            "checkpoint.interval=20", "checkpoint.keep_last=10", "checkpoint.memory_interval=5",
            'drill.inject=["slow:rank=-1,seconds=0.2"]']


def _reach(run_dir: Path, step: int) -> int:
    deadline = time.monotonic() + 180
    while int(read_status(run_dir).get("step", 0)) < step and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(read_status(run_dir).get("step", 0))


def test_a_lost_node_restores_from_its_buddys_memory_reading_no_storage_and_with_its_buddy_from_storage_bitwise(
        small_corpus: Path, reference_run: Path, tmp_path: Path) -> None:
    # Storage saves at 20 and 40, memory every 5 steps (each node holding its own rank's files and its buddy's).
    # The node is lost after the storage save of step 20, and both nodes after the memory save that follows the
    # first restore (of 20 or 25 at the latest: at 25 or 30) and before the storage save of step 40.
    step, both = random.choice(range(23, 29)), random.choice(range(32, 37))
    run_dir = tmp_path / "nodes"
    args = _args(run_dir, small_corpus)
    memories = [memory_root("", run_dir, f"node-{n}") for n in range(2)]
    nodes = [_node(args, n, tmp_path) for n in range(2)]
    watch = None
    try:
        _reach(run_dir, step)
        kill_tagged(nodes[1][1])  # the node lost: its launcher and its worker, at once
        lost_at = int(read_status(run_dir).get("step", 0))
        assert sorted(p.name for p in memories[1].glob("step-*")), "node 1 held copies in its memory"
        shutil.rmtree(memories[1])  # its memory with it: the replacement starts with none
        stored = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "manifest.json").exists())
        held = max(int(p.name[5:11]) for p in memories[0].glob("step-*"))
        watch = Watch(memories[0], stored)
        nodes[1] = _node(args, 1, tmp_path)  # the replacement, under the lost node's name
        both_at = _reach(run_dir, both)
        for _, tag in nodes:  # the node and its buddy lost together, the memory of each with it
            kill_tagged(tag)
        for memory in memories:
            shutil.rmtree(memory, ignore_errors=True)
        args = _args(run_dir, small_corpus)  # the job requeued: its nodes start again, at a new endpoint
        nodes = [_node(args, n, tmp_path) for n in range(2)]
        codes = [proc.wait(timeout=240) for proc, _ in nodes]
    finally:
        if watch is not None:
            watch.close()
        for _, tag in nodes:
            kill_tagged(tag)
    logs = [(tmp_path / f"node-{n}.log").read_text()[-3000:] for n in range(2)]
    assert codes == [0, 0], logs
    assert [p.name for p in stored] == ["step-000020"], "the storage tier had its own checkpoint"
    # No file of the state is read from the storage. Its manifest (metadata, no state) may be: the replacement's
    # launcher, a fresh command, checks its config against the run's newest checkpoint before anything starts.
    opened = watch.opened_before_save_of(held)
    assert {f.split("/")[-1] for f in opened} <= {"manifest.json"}, f"the restore read the storage: {opened}"
    events = read_jsonl(run_dir / "events.jsonl")
    (restored,) = [r for r in events if r["kind"] == "memory" and r["action"] == "restored"]
    resumed = [r for r in events if r["kind"] == "resume"]
    # Rank 0's: from the buddy's memory after the node was lost, then, with no memory left anywhere, from the newest
    # storage checkpoint.
    assert [(r["step"], r["detail"]["tier"]) for r in resumed] == [(restored["step"], "memory"), (20, "storage")], \
        (lost_at, both_at, resumed)
    assert restored["step"] % 5 == 0 and lost_at - restored["step"] <= 6, (lost_at, restored)
    # The replacement pulled its rank's files (its shard, its RNG streams) from node 0's copy of them.
    assert restored["detail"]["nodes"] == 2 and restored["detail"]["from_peers_bytes"] > 100_000, restored
    assert state_sha256(run_dir / "checkpoints" / "step-000040") == \
        state_sha256(reference_run / "checkpoints" / "step-000040"), f"lost at step {lost_at}"
    assert not any(m.exists() for m in memories), "each launcher removes its node's memory tier when the job ends"
