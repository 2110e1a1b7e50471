"""`keel eval`'s bad input: one line, exit 2, before any model is loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import keel_env


def keel_eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keel", "eval", *args], capture_output=True, text=True, cwd=cwd,
                          env={**keel_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["{run}", "--tasks", "t", "--limit", "0"], "--limit 0: expected 1 or more"),
    (["{run}", "--tasks", "t", "--batch-size", "-1"], "--batch-size -1: expected 1 or more"),
    (["{run}", "--tasks", "t", "--num-fewshot", "-2"], "--num-fewshot -2: expected 0 or more"),
    (["{root}/nowhere", "--tasks", "t"], "does not exist; pass a run directory"),
    (["{run}", "--tasks", " , "], "no tasks given"),
    (["{run}", "--tasks", "t", "--include", "{root}/missing"], "--include '{root}/missing' does not exist"),
    (["{run}", "--tasks", "no_such_task_anywhere", "--include", "{root}/tasks"],
     "unknown task 'no_such_task_anywhere': not an lm-eval task, nor keel's (keel_stdlib_heldout, "
     "keel_stdlib_next_line), nor in {root}/tasks"),
    (["{run}", "--tasks", "t", "--out", "{root}"], "--out '{root}' is a directory; pass the path of a file to write"),
])
def test_bad_eval_input_is_one_line_with_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    pytest.importorskip("lm_eval")
    (tmp_path / "run").mkdir()
    (tmp_path / "tasks").mkdir()
    done = keel_eval(*[a.format(run=tmp_path / "run", root=tmp_path) for a in args], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message.format(root=tmp_path) in lines[0], done.stderr
