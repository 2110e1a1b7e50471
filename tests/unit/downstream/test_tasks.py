"""The task index: the include directories' own when they hold every task named, lm-eval's with them else."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.downstream.tasks import check_tasks
from tests.dist.test_downstream import write_tasks


def test_tasks_of_the_include_directories_alone_are_found_without_lm_evals_own(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    tasks = str(write_tasks(tmp_path / "tasks"))
    own = check_tasks(["keel_choice", "keel_text"], [tasks])
    assert {"keel_choice", "keel_text"} <= set(own.all_tasks) and "hellaswag" not in own.all_tasks
    both = check_tasks(["keel_choice", "hellaswag"], [tasks])  # one of lm-eval's: its whole index, with the dir's
    assert {"keel_choice", "hellaswag"} <= set(both.all_tasks)
