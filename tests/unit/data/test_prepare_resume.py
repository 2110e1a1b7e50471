"""An interrupted `keel data prepare` resumes from its completion markers and writes the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from keel.config import DataConfig, SourceConfig
from keel.data.prepare import prepare, tasks_of
from keel.data.sources import resolve_inputs
from tests.conftest import keel_env

LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def contents(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.timeout(240)
def test_killed_prepare_resumes_to_byte_identical_output(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    vocabulary = ["".join(rng.choice(LETTERS, rng.integers(3, 9))) for _ in range(20_000)]
    for i in range(16):
        docs = [" ".join(vocabulary[j] for j in rng.integers(0, len(vocabulary), 400)) for _ in range(150)]
        docs += docs[:10]  # exact duplicates, so that dedup has work after the resume
        (src / f"part-{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tasks = len(tasks_of(resolve_inputs({"main": [str(src)]})))
    assert tasks >= 3  # files are scanned in tasks of several: enough of them to stop between two
    reference = tmp_path / "reference"
    prepare(DataConfig(sources={"main": SourceConfig(paths=[str(src)])}, workers=1), reference)

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "keel", "data", "prepare", "--source", str(src), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=keel_env(), start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(tmp_path.glob(".out.work-*/*.scan")):
        assert proc.poll() is None, "the prepare finished before it could be interrupted"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its worker processes, in the middle of the scan
    proc.wait()
    done_before = len(list(tmp_path.glob(".out.work-*/*.scan")))
    assert 1 <= done_before < tasks and not out.exists()

    rerun = subprocess.run(cmd, cwd=tmp_path, env=keel_env(), capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    assert contents(out) == contents(reference)
    assert not list(tmp_path.glob(".out.work-*")) and not list(tmp_path.glob(".out.tmp-*"))
