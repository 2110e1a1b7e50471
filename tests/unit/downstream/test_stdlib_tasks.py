"""keel's shipped tasks: their data are the held-out documents of the corpus `make train` prepares, made again
byte for byte from a fresh `keel data prepare --config tiny`, and lm-eval builds the tasks from them offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from keel.downstream.stdlib_tasks import HELDOUT, MADE_WITH, NEXT_LINE, TASKS, heldout_documents, write
from tests.conftest import run_keel


def test_the_shipped_task_data_are_made_again_from_the_built_in_corpus(tmp_path: Path) -> None:
    if sys.version_info[:3] != MADE_WITH:
        pytest.skip(f"the shipped files come from Python {MADE_WITH}'s standard library")
    done = run_keel(["data", "prepare", "--config", "tiny", "--out", str(tmp_path / "stdlib")], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (tmp_path / "tasks").mkdir()
    written = write(tmp_path / "stdlib", tmp_path / "tasks")
    assert [p.name for p in written] == [NEXT_LINE, HELDOUT]
    for path in written:
        assert path.read_bytes() == (TASKS / path.name).read_bytes(), path.name
    assert len(heldout_documents(tmp_path / "stdlib")) == 17  # the corpus's validation documents, all of them


def test_the_questions_have_one_real_next_line_among_four() -> None:
    rows = [json.loads(line) for line in (TASKS / NEXT_LINE).read_text(encoding="utf-8").splitlines()]
    heldout = [json.loads(line)["text"] for line in (TASKS / HELDOUT).read_text(encoding="utf-8").splitlines()]
    assert len(rows) > 150 and len(heldout) > 10
    for row in rows:
        assert len(set(row["choices"])) == 4 and 0 <= row["answer"] < 4
        assert row["context"].endswith("\n") and 0 < len(row["context"]) <= 400
    answers = [row["answer"] for row in rows]
    assert all(answers.count(k) > len(rows) / 8 for k in range(4)), "the real line's place is drawn at random"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # lm-eval 0.4.13 prefers TaskManager.load
def test_lm_eval_builds_the_shipped_tasks_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from keel.downstream.tasks import check_tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    manager = check_tasks(["keel_stdlib_next_line", "keel_stdlib_heldout"], [])
    tasks = manager.load_task_or_group(["keel_stdlib_next_line", "keel_stdlib_heldout"])
    sizes = {name: len(task.dataset["test"]) for name, task in tasks.items()}
    assert sizes == {"keel_stdlib_next_line": 186, "keel_stdlib_heldout": 17}
