"""The replica-group launcher's command for each group: its own run directory and launcher flags, the
run's checkpoint directory, its restart budget alone to end it, nothing of the user's group flags left over;
and what it says when a group ends."""

from __future__ import annotations

from pathlib import Path

from keel.config import load_config
from keel.groups import group_argv, group_lost
from keel.report.status import summary, summary_lines
from keel.rundir.events import EventLog, read_jsonl


def test_each_group_gets_its_own_run_directory_and_the_runs_checkpoints() -> None:
    cfg = load_config(None, ["fault_tolerance.replica_groups=2"])
    argv = ["train", "--replica-groups", "2", "--nproc=4", "--run-dir", "runs/x", "--max-restarts", "1",
            "train.steps=3"]
    assert group_argv(argv, cfg, Path("/r"), 1, 4, 7) == [
        "train", "train.steps=3", "--run-dir", "/r/groups/1", "--nproc", "4", "--max-restarts", "7",
        "fault_tolerance.replica_groups=2", "checkpoint.dir=/r/checkpoints", "health.no_progress_restarts=8"]
    shared = load_config(None, ["fault_tolerance.replica_groups=2", "checkpoint.dir=s3://b/ckpt"])
    assert "checkpoint.dir=s3://b/ckpt" in group_argv(["train"], shared, Path("/r"), 0, 1, 0)


def test_a_group_given_up_while_others_train_raises_an_alert_and_a_status_line(tmp_path: Path) -> None:
    for group in (0, 1, 2):
        (tmp_path / "groups" / str(group)).mkdir(parents=True)
    events = EventLog(tmp_path / "events.jsonl", rank=-1)
    ended = group_lost(events, tmp_path, groups=3)
    ended(2, 3, 2)  # its launcher gave up while two groups run
    ended(1, 0, 1)  # finished
    ended(0, 1, 0)  # the last to end: nobody is left to go on without it
    events.close()
    alerts = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "alert"]
    assert [(e["action"], e["detail"]["group"], e["detail"]["exit_code"], e["detail"]["groups_left"])
            for e in alerts] == [("replica_group_lost", 2, 3, 2)]
    lines = summary_lines(summary(tmp_path))
    assert any(line.strip().startswith("given up: replica group 2 was given up") for line in lines), lines
