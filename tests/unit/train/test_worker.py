"""A worker's imports: a run without a pipeline loads neither torch's pipelining nor the compiler it pulls in."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import keel_env

LOADS = "import sys, keel.train.worker; print(' '.join(sorted(sys.modules)))"


def test_a_worker_imports_no_pipelining_until_a_pipeline_is_built() -> None:
    done = subprocess.run([sys.executable, "-c", LOADS], env=keel_env(), capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    assert "keel.train.trainer" in loaded and "torch.distributed.fsdp" in loaded
    assert not {m for m in loaded if m.startswith(("torch.distributed.pipelining", "torch._dynamo"))}
    assert "keel.parallel.pipeline" not in loaded
