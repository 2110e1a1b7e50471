"""`keel plan --calibrate-sweep` on this machine: real processes time the planned model's kernels and the
collectives, the figures go into a cluster file that plans the next question alike, and with `--measure` the
plan's fastest layout is trained here beside its prediction from those figures alone."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tests.conftest import SMALL_RUN, run_keel

pytestmark = pytest.mark.dist


def test_the_sweep_writes_the_kernel_and_link_figures_the_next_plan_reads_and_measure_checks_them(
        small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "calibrated"
    question = ["plan", "--gpus", "2", "--hardware", "cpu", "--tokens", "1e6", "--trials", "20", "--json",
                *SMALL_RUN, f"data.dir={small_corpus}"]
    result = run_keel([*question, "--calibrate-sweep", "--measure", "1", "--measure-steps", "6", "--measure-dir",
                       str(out)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    swept = answer["calibration_sweep"]
    assert swept["processes"] == 2 and sorted(p.name for p in out.glob("rank-*.json")) == ["rank-0.json",
                                                                                             "rank-1.json"]
    # Every kernel and collective of the sweep, measured and as the step model times it with the figures fitted.
    parts = [r["part"] for r in swept["rows"]]
    assert parts.count("gemm") == 3 + 5 and parts.count("gemm_fp8") == 0  # squares, the model's; no CPU float8
    assert all(parts.count(kind) == 3 for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))
    assert all(r["measured_s"] > 0 and r["modelled_s"] > 0 for r in swept["rows"])
    figures = tomllib.loads(Path(swept["cluster_file"]).read_text())
    assert {"peak_tflops", "memory_gbps", "intra_gbps", "net_gbps", "attention_forward_efficiency",
            "attention_backward_efficiency", "memory_efficiency"} <= figures.keys()
    assert figures["peak_tflops"] == pytest.approx(swept["measured"]["peak_tflops"])
    # The plan printed is the one those figures give.
    assert answer["efficiency"]["compute"] == pytest.approx(0.7905)
    assert "the cluster file's" in answer["kernels"]["source"]
    # --measure trained the plan's first layout, with no calibration run, beside its prediction.
    measured = answer["measured"]
    assert measured["calibration"] is None and not (out / "calibration").exists()
    (row,) = measured["rows"]
    assert row["planned_rank"] == 1 and row["measured_s"] > 0
    assert (out / "layout-1" / "metrics.jsonl").is_file()
    # The file plans the next question alike, with nothing measured again.
    again = run_keel([*question, "--cluster", swept["cluster_file"]], cwd=tmp_path, timeout=60)
    assert again.returncode == 0, again.stderr
    planned = {r["layout"]: r["step_s"] for r in json.loads(again.stdout)["layouts"]}
    assert planned[row["layout"]] == pytest.approx(row["predicted_s"])


def test_a_sweep_that_cannot_run_here_is_refused_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "calibrated"
    question = ["plan", "--gpus", "2", "--tokens", "1e6", "--calibrate-sweep", "--measure-dir", str(out)]
    elsewhere = run_keel([*question, "--hardware", "h100"], cwd=tmp_path, timeout=60)
    assert elsewhere.returncode == 2
    assert elsewhere.stderr.strip().splitlines()[-1].endswith(
        "--calibrate-sweep --hardware h100: this machine has no CUDA device; run the sweep on a node of the cluster, "
        "or pass --hardware cpu to measure this machine")
    assert not out.exists()
    both = run_keel([*question, "--hardware", "cpu", "--calibrate", str(tmp_path)], cwd=tmp_path, timeout=60)
    assert both.returncode == 2 and "drop one of them" in both.stderr and not out.exists()
    out.mkdir()
    (out / "kept").write_text("a previous sweep's")
    full = run_keel([*question, "--hardware", "cpu"], cwd=tmp_path, timeout=60)
    assert full.returncode == 2 and "not empty" in full.stderr
    assert [p.name for p in out.iterdir()] == ["kept"]
