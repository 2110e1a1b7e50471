"""Which replica groups a fingerprint comparison names: the minority against a majority, every group
when there is none, nobody when all agree; and the watchdog over a quorum that never ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from keel.errors import EXIT_REPLICA_WAIT
from keel.rundir.events import read_jsonl
from keel.train.replicas import disagreeing


def rows(*values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_the_groups_outvoted_by_a_majority_are_named() -> None:
    assert disagreeing(rows((1, 2), (1, 2), (1, 2))) == []
    assert disagreeing(rows((1, 2), (1, 3), (1, 2))) == [1]
    assert disagreeing(rows((5, 2), (1, 2), (1, 2), (1, 2))) == [0]


def test_without_a_majority_every_group_is_suspect() -> None:
    assert disagreeing(rows((1, 2), (1, 3))) == [0, 1]
    assert disagreeing(rows((1,), (2,), (3,))) == [0, 1, 2]
    assert disagreeing(rows((1,), (1,), (2,), (2,))) == [0, 1, 2, 3]


STUCK = """
import sys, time
from pathlib import Path
from keel.config import FaultToleranceConfig
from keel.core.state import TrainState
from keel.rundir.events import EventLog
from keel.train.replicas import ReplicaGroups

groups = ReplicaGroups.__new__(ReplicaGroups)  # the watchdog alone: no torchft manager needed
groups.cfg = FaultToleranceConfig(quorum_timeout_s=0.1, heartbeat_timeout_s=0.1, timeout_s=0.1)
groups.group, groups.rank0, groups.say, groups.state = 1, True, print, TrainState(step=7)
groups.events = EventLog(Path(sys.argv[1]) / "events.jsonl", rank=0)
with groups._bounded("quorum"):
    time.sleep(600)  # a wait inside torchft that never ends
"""


def test_a_quorum_that_outlives_every_timeout_ends_the_worker_for_its_agent_to_restart(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", STUCK, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == EXIT_REPLICA_WAIT, done.stderr
    assert "replica group 1's quorum did not end within" in done.stdout
    assert 'File "<string>", line 14 in <module>' in done.stderr  # every thread's stack: the main one sleeps
    (stuck,) = read_jsonl(tmp_path / "events.jsonl")
    assert (stuck["kind"], stuck["action"], stuck["step"], stuck["detail"]["group"]) == ("quorum", "stuck", 7, 1)
