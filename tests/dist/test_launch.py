"""`torchrun -m keel train` works as well as `keel train --nproc`: keel runs as a worker of an
external elastic agent, and the workers prepare the built-in corpus once between them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from keel.data.shards import open_corpus
from keel.monitor.sinks import read_jsonl
from tests.conftest import SMALL_RUN, keel_env

pytestmark = pytest.mark.dist


@pytest.mark.timeout(240)
def test_external_torchrun_prepares_the_corpus_once_and_trains(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "keel", "train", *SMALL_RUN, "train.steps=3"]
    result = subprocess.run(cmd, cwd=tmp_path, env=keel_env(), capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr
    corpus = open_corpus(tmp_path / "data" / "stdlib")  # built by the workers, checksums verified
    assert corpus.manifest["sources"]["main"]["paths"] == ["stdlib"]
    assert not list((tmp_path / "data").glob(".stdlib.tmp-*")), "no half-written corpus is left"
    run_dir = tmp_path / "runs" / "tiny"
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1]
    assert all(e["detail"]["world_size"] == 2 for e in starts)
    assert (run_dir / "checkpoints" / "step-000003" / "manifest.json").exists()
    assert result.stdout.count("preparing the built-in corpus") <= 1
