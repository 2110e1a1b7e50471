"""A task whose data must come from the Hugging Face Hub, on a machine that cannot reach it: `keel eval` says so in
one line, naming the task and how to run it offline, exit code 2, before any model is loaded; and keel's own tasks
still run there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from keel.core.net import free_port
from keel.downstream.hub import download_failure
from tests.conftest import keel_env


@pytest.mark.parametrize("how", ["offline by setting", "hub out of reach"])
def test_a_task_that_needs_a_download_is_one_line_without_the_hub(tmp_path: Path, how: str) -> None:
    pytest.importorskip("lm_eval")
    env = {k: v for k, v in keel_env().items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache, whatever this machine has downloaded
    if how == "offline by setting":
        env["HF_HUB_OFFLINE"] = "1"
    else:  # a Hub endpoint nothing listens on: what a machine without network access meets, on any machine
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
        for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(proxy, None)
    (tmp_path / "run").mkdir()  # no checkpoint: the task is refused before one would be looked for
    done = subprocess.run([sys.executable, "-m", "keel", "eval", str(tmp_path / "run"), "--tasks", "hellaswag"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "task 'hellaswag' needs data from the Hugging Face Hub" in lines[0]
    assert "keel_stdlib_next_line" in lines[0] and "--include DIR" in lines[0] and "datasets cache" in lines[0]


def test_only_a_failed_download_is_taken_for_one() -> None:
    try:
        try:
            raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)")
        except ConnectionError as e:
            raise FileNotFoundError("Dataset Rowan/hellaswag is not cached") from e
    except FileNotFoundError as e:
        assert download_failure(e) == "Couldn't reach 'Rowan/hellaswag' on the Hub (LocalEntryNotFoundError)"
    assert download_failure(FileNotFoundError("no such task file")) is None
    assert download_failure(KeyError("acc")) is None
