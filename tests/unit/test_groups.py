"""The replica-group launcher's command for each group: its own run directory and launcher flags, the
run's checkpoint directory, nothing of the user's group flags left over."""

from __future__ import annotations

from pathlib import Path

from keel.config import load_config
from keel.groups import group_argv


def test_each_group_gets_its_own_run_directory_and_the_runs_checkpoints() -> None:
    cfg = load_config(None, ["fault_tolerance.replica_groups=2"])
    argv = ["train", "--replica-groups", "2", "--nproc=4", "--run-dir", "runs/x", "--max-restarts", "1",
            "train.steps=3"]
    assert group_argv(argv, cfg, Path("/r"), 1, 4, 7) == [
        "train", "train.steps=3", "--run-dir", "/r/groups/1", "--nproc", "4", "--max-restarts", "7",
        "fault_tolerance.replica_groups=2", "checkpoint.dir=/r/checkpoints"]
    shared = load_config(None, ["fault_tolerance.replica_groups=2", "checkpoint.dir=s3://b/ckpt"])
    assert group_argv(["train"], shared, Path("/r"), 0, 1, 0)[-1] == "checkpoint.dir=s3://b/ckpt"
