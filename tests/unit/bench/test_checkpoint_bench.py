"""bench/checkpoint.py runs every measurement through the product's save path and reports each target."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.checkpoint import TARGETS
from tests.conftest import REPO, keel_env


def test_the_checkpoint_benchmark_measures_every_ratio_it_reports(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint.json"
    result = subprocess.run([sys.executable, "bench/checkpoint.py", "--sizes", "smoke", "--repeats", "1",
                             "--dir", str(tmp_path), "--results", str(out)], cwd=REPO, env=keel_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads(out.read_text())["sizes"]["smoke"]
    assert set(row["ratios"]) == set(TARGETS)
    assert all(x["median"] > 0 for x in row["ratios"].values())
    assert row["first_save"]["blocking_s"] > 0 and row["window_steps"] >= 2
    assert all(len(v) == 1 and v[0] > 0 for v in row["timings"].values())
