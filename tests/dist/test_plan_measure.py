"""`keel plan --measure` on this machine: a calibration run, then the plan's fastest layouts trained here as
`keel train` runs them, each beside its prediction, and a cluster file that plans the next question alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.config import load_config
from keel.plan.layout import config_layout, parse_layout
from tests.conftest import SMALL_RUN, run_keel

pytestmark = pytest.mark.dist


def test_measure_trains_the_plans_fastest_layouts_here_and_writes_the_cluster_file_of_the_next_plan(
        small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "measured"
    question = ["plan", "--gpus", "2", "--hardware", "cpu", "--tokens", "1e6", "--trials", "20", "--json",
                *SMALL_RUN, f"data.dir={small_corpus}"]
    result = run_keel([*question, "--measure", "2", "--measure-steps", "8", "--measure-dir", str(out)], cwd=tmp_path,
                      timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout)["measured"]
    rows = measured["rows"]
    assert [r["planned_rank"] for r in rows] == [1, 2]
    for n, row in enumerate(rows, start=1):
        # Each measured run trained the very layout the plan predicted.
        cfg = load_config(out / f"layout-{n}" / "config.toml", [])
        assert config_layout(cfg, 2)[0] == parse_layout(row["spec"], 2)
        assert row["measured_s"] > 0 and row["measured_gib"] > 0
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert measured["best"] == min(rows, key=lambda r: r["measured_s"])
    assert measured["measured_order"][0] == measured["best"]["layout"]
    # The cluster file plans the next question as the calibration did, with no run to calibrate on.
    again = run_keel([*question, "--cluster", measured["cluster_file"]], cwd=tmp_path, timeout=60)
    assert again.returncode == 0, again.stderr
    planned = {r["layout"]: r["step_s"] for r in json.loads(again.stdout)["layouts"]}
    assert {r["layout"]: planned[r["layout"]] for r in rows} == pytest.approx(
        {r["layout"]: r["predicted_s"] for r in rows})
    # Its runs are kept: a second --measure into the same directory is refused before anything trains.
    refused = run_keel([*question, "--measure", "1", "--measure-dir", str(out)], cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "not empty" in refused.stderr
    twice = run_keel([*question, "--measure", "1", "--calibrate", str(out / "calibration")], cwd=tmp_path, timeout=60)
    assert twice.returncode == 2 and "drop one of them" in twice.stderr
