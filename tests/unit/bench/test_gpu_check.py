"""bench/gpu_check.py's dry run on the CPU: keel's real training run and checkpoints at a tiny size, the table
and results file it writes, and the missing CUDA figures named and failing the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpu_check import main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")


def test_the_dry_run_measures_what_a_cpu_can_and_names_the_cuda_figures_missing(
        small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu_check.json"
    # Compiling on a CPU takes minutes: the compiled run is left out and must be reported as not run.
    code = main(["--cpu-dry-run", "--compile", "off", "--data-dir", str(small_corpus), "--out", str(out),
                 "--work", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 2
    results = json.loads(out.read_text())
    assert results["mode"] == "cpu-dry-run"
    run = results["runs"]["1b keel eager"]
    assert run["run"]["exit_code"] == 0
    got = run["figures"]
    assert got["tokens_per_s"] > 0 and got["keel_mfu"] > 0
    assert got["checkpoint_first_blocking_s"] > 0 and got["checkpoint_later_blocking_s"] > 0
    assert got["predicted_bytes"] > 0
    # What only a CUDA device measures is missing, with the reason, never a zero.
    for figure in ("mfu", "peak_allocated_bytes", "measured_over_predicted", "peak_reserved_bytes",
                   "fragmentation", "nvml/gpu_utilization_ratio", "nvml/gpu_power_watts"):
        assert got[figure] is None and got["missing"][figure]
    assert "1b keel: not run (--compile off)" in results["missing"]
    # The fp8 and mixture-of-experts runs, eager with --compile off, beside it on the same model and batch, and
    # both shapes' keel and bare runs (at the dry run's tiny size).
    for name in ("1b keel fp8", "1b keel moe", "3b keel", "3b keel fp8", "1b bare", "3b bare"):
        assert results["runs"][name]["run"]["exit_code"] == 0 and results["runs"][name]["figures"]["tokens_per_s"] > 0
    assert results["runs"]["1b keel moe"]["figures"]["predicted_bytes"] > got["predicted_bytes"]  # every expert
    assert any(m.startswith("1b keel eager: peak_allocated_bytes") for m in results["missing"])
    # The bare loop reports what it measures; keel's own figures are not its.
    bare = results["runs"]["1b bare"]["figures"]
    assert "keel_mfu" not in bare and bare["peak_reserved_bytes"] is None and bare["missing"]["mfu"]
    # torchtitan is not run on a CPU, with the reason; its spec is written from the real configs and its log
    # parser checked on the recorded line of its format.
    for shape, flavour in (("1b", "1B"), ("3b", "3B")):
        assert results["not_run"][f"{shape} torchtitan"]
        spec = results["torchtitan"][f"{shape} torchtitan"]["spec"]
        assert spec["flavor"] == flavour and spec["seq_len"] == 2048 and spec["global_batch"] == 16
    assert results["torchtitan"]["sample_log"]["parsed"][0]["tokens_per_s"] == 57_312
    # Ratios that lack a run say which and why.
    assert results["ratios"]["3b keel/bare"] > 0 and results["ratios"]["3b keel/torchtitan"] is None
    assert "3b torchtitan" in results["ratios_missing"]["3b keel/torchtitan"]
    table = printed[printed.rindex("figure "):]
    assert "tokens/s (steady)" in table and "checkpoint blocking, later save" in table and "3b keel/bare" in table
    assert f"{got['tokens_per_s']:,.0f}" in table and "MISSING" in table
    assert "33% to 39% MFU" in printed  # torchtitan's figure as context
    assert "the CUDA figures are missing" in printed.splitlines()[-1]
    assert not list(tmp_path.glob("keel-gpu-check-*"))  # the runs' checkpoints are gone


@NO_CUDA
def test_without_a_cuda_device_it_says_so_in_one_line_and_exits_2(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu_check.json"
    assert main(["--out", str(out)]) == 2
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "no CUDA device" in printed[0]
    assert not out.exists()
