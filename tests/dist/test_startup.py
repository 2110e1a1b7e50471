"""What a job's start and its restarts cost: the launcher imports no checkpointing or tensor-parallel code,
and a restart by the agent reuses its job's preflight and measured peak instead of measuring again."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from keel.rundir.events import read_jsonl
from keel.train.reuse import PROBES
from tests.conftest import SMALL_RUN, TAG, keel_env, kill_tagged, tagged

pytestmark = pytest.mark.dist

# `keel train` as its command line runs it, writing the modules it loaded when it exits.
RECORDING_LAUNCHER = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "keel"
runpy.run_module("keel", run_name="__main__")
"""
# What only workers need: DCP, DTensor and FSDP, pipelining and the compiler it loads.
WORKERS_ONLY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp",
                "torch.distributed.pipelining", "torch._dynamo")


def test_a_restarted_worker_group_reuses_its_jobs_probes_and_the_launcher_loads_no_worker_code(
        small_corpus: Path, tmp_path: Path) -> None:
    run_dir, modules = tmp_path / "R", tmp_path / "launcher-modules.json"
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-c", RECORDING_LAUNCHER, str(modules), "train", "--nproc", "2", "--max-restarts", "1",
           "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={small_corpus}", "train.steps=3",
           'drill.inject=["kill:step=2,rank=1"]']
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**keel_env(), TAG: tag}, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=240)
        assert not tagged(tag), "the job left processes behind"
    finally:
        kill_tagged(tag)
    assert proc.returncode == 0, err[-3000:]
    loaded = set(json.loads(modules.read_text()))
    assert "torch.distributed.launcher.api" in loaded  # it did launch the workers
    workers_only = sorted(m for m in loaded if m.startswith(WORKERS_ONLY))
    assert not workers_only, workers_only

    events = list(read_jsonl(run_dir / "events.jsonl"))
    starts = [e for e in events if e["kind"] == "start" and e["rank"] == 0]
    assert [s["detail"]["attempt"] for s in starts] == [0, 1], starts  # rank 1's SIGKILL, one restart
    first, second = [e for e in events if e["kind"] == "preflight"]
    assert first["action"] == "passed" and "reused" not in first["detail"]
    # Kept as the first group's checks ran, and reused by the second.
    assert second["action"] == "passed" and abs(second["detail"]["reused"] - first["time"]) < 5
    assert second["time"] > starts[0]["time"]
    assert second["detail"]["checks"] == first["detail"]["checks"]
    # The CPU's matmul peak was measured by the first worker group only.
    probes = json.loads((run_dir / PROBES).read_text())
    assert probes["peak_flops"]["time"] < starts[1]["time"] and probes["peak_flops"]["value"] > 0
