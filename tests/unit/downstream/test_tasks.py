"""The task index: the include directories' own when they hold every task named, lm-eval's with them else; a name
that no task file mentions is refused without either."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keel.downstream.tasks import _indexed, _task_manager, check_tasks, task_files, with_shipped
from keel.errors import ConfigError
from tests.dist.test_downstream import write_tasks


def test_tasks_of_the_include_directories_alone_are_found_without_lm_evals_own(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    tasks = str(write_tasks(tmp_path / "tasks"))
    own = check_tasks(["keel_choice", "keel_text"], [tasks])
    assert {"keel_choice", "keel_text"} <= set(own.all_tasks) and "hellaswag" not in own.all_tasks
    # one of lm-eval's: its whole index, with the dir's (the index alone: without the Hub, check_tasks would also
    # build hellaswag, whose data are not here)
    both = _task_manager(with_shipped([tasks]), ["keel_choice", "hellaswag"])
    assert {"keel_choice", "hellaswag"} <= set(both.all_tasks)
    # Every name of lm-eval's index is written out in one of its task files: what lets a name that none of them
    # mentions be refused without the index.
    import lm_eval.tasks

    text = b"\n".join(p.read_bytes() for p in task_files(Path(lm_eval.tasks.__file__).parent))
    words = set(re.findall(rb"[^\s'\"\[\],:{}]+", text))
    names = [n.encode() for n in set(both.all_tasks) - set(own.all_tasks)]
    assert len(names) > 1000 and [n for n in names if n not in words and n not in text] == []


def test_a_task_no_task_file_mentions_is_refused_without_building_an_index() -> None:
    pytest.importorskip("lm_eval")
    built = _indexed.cache_info().misses
    with pytest.raises(ConfigError, match=r"^unknown task 'hellaswagg': not an lm-eval task, nor keel's "
                                          r"\(keel_stdlib_heldout, keel_stdlib_next_line\) \(pass --include"):
        check_tasks(["hellaswag", "hellaswagg"], [])
    assert _indexed.cache_info().misses == built
