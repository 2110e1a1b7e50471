"""The status file read against the run lock: a dead job is told from a running or a paused one."""

from __future__ import annotations

from pathlib import Path

from keel.rundir.lock import RunLock
from keel.rundir.status import job_alive, read_status, run_status, write_status


def test_status_tells_a_dead_job_from_a_running_one(tmp_path: Path) -> None:
    write_status(tmp_path, "running", 12, checkpoint="/x/step-000010")
    assert read_status(tmp_path)["step"] == 12
    info = run_status(tmp_path)
    assert info["state"] == "failed" and "killed or crashed" in info["reason"]  # nobody holds the lock
    with RunLock(tmp_path):
        assert job_alive(tmp_path)
        assert run_status(tmp_path)["state"] == "running"
    with RunLock(tmp_path, node="b"):  # one lock per node in an elastic job
        assert job_alive(tmp_path)
    assert not job_alive(tmp_path)
    write_status(tmp_path, "paused", 20, checkpoint="/x/step-000020", reason="SIGTERM")
    info = run_status(tmp_path)
    assert (info["state"], info["step"], info["last_checkpoint"]) == ("paused", 20, "/x/step-000020")
