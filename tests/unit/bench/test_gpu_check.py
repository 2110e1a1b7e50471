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
    run = results["runs"]["compile off"]
    assert run["run"]["exit_code"] == 0
    got = run["figures"]
    assert got["tokens_per_s"] > 0 and got["keel_mfu"] > 0
    assert got["checkpoint_first_blocking_s"] > 0 and got["checkpoint_later_blocking_s"] > 0
    assert got["predicted_bytes"] > 0
    # What only a CUDA device measures is missing, with the reason, never a zero.
    for figure in ("mfu", "peak_allocated_bytes", "measured_over_predicted", "peak_reserved_bytes",
                   "fragmentation", "nvml/gpu_utilization_ratio", "nvml/gpu_power_watts"):
        assert got[figure] is None and got["missing"][figure]
    # The MoE run (compile off): measured on active FLOPs; it saves once, at the end, so no later save is missing.
    moe, sizes = results["runs"]["moe, compile off"], results["sizes"]["moe, compile off"]
    assert moe["run"]["exit_code"] == 0
    assert moe["figures"]["tokens_per_s"] > 0 and moe["figures"]["keel_mfu"] > 0
    assert sizes["active_parameters"] < sizes["parameters"]
    assert sizes["flops_per_token"] > results["sizes"]["compile off"]["flops_per_token"]  # its routers
    assert "checkpoint_later_blocking_s" not in moe["figures"]
    assert not any(m.startswith("moe, compile off: checkpoint") for m in results["missing"])
    assert "compile on: not run (--compile off)" in results["missing"]
    assert any(m.startswith("compile off: peak_allocated_bytes") for m in results["missing"])
    table = printed[printed.rindex("figure "):]
    assert "tokens/s (steady)" in table and "checkpoint blocking, later save" in table
    assert "moe, compile off" in table.splitlines()[0]
    later = next(line for line in table.splitlines() if line.startswith("checkpoint blocking, later save"))
    assert later.split()[-1] == "-"  # not a figure of the MoE run, rather than a missing one
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
