"""The run lock: a run directory another job holds is refused, and looking creates nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from keel.errors import KeelError
from keel.rundir.lock import RunLock


def test_a_held_run_directory_is_refused_before_the_lock_is_taken(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    RunLock(run_dir).check_free()  # a new run: nothing to hold, nothing made
    assert not run_dir.exists()
    with RunLock(run_dir):
        with pytest.raises(KeelError, match=f"is in use by another keel job \\(pid {os.getpid()} on "):
            RunLock(run_dir).check_free()
        RunLock(run_dir, node="b").check_free()  # another node's lock of an elastic job is its own
    RunLock(run_dir).check_free()  # released with its holder
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", ".lock.workers"]
