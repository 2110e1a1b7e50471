"""`keel sweep` for real: a 2×2 grid (learning rate × width) of `keel train` runs, two at once. Killed with
SIGKILL while its points train, the sweep takes its points down with it; rerun, it trains only the points that
had not finished (a killed one resumes from its checkpoint) and its sweep.json equals an uninterrupted sweep's."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from keel.rundir.events import read_jsonl
from tests.conftest import run_keel, spawn_keel, tagged

pytestmark = pytest.mark.dist

SHAPE = ["model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64", "train.seq_len=64",
         "train.global_batch=8", "train.micro_batch=8", "optim.warmup_steps=5", "eval.interval=0",
         "eval.sequences=8", "checkpoint.interval=10", "monitor.interval=1", "health.preflight=off"]
GRID = ["--grid", "optim.lr=1e-3..1e-2:2", "--grid", "model.dim=32,64", "--steps", "30", "--parallel", "2"]


def sweep_args(out: Path, corpus: Path) -> list[str]:
    return ["sweep", *GRID, *SHAPE, f"data.dir={corpus}", "--out", str(out), "--target", "model.dim=128"]


def count_starts(point: Path) -> int:
    return sum(e["kind"] == "start" for e in read_jsonl(point / "events.jsonl"))


def test_a_killed_sweep_reruns_only_its_missing_points_and_ends_as_an_uninterrupted_one(
        small_corpus: Path, tmp_path: Path) -> None:
    whole = run_keel(sweep_args(tmp_path / "whole", small_corpus), cwd=tmp_path, timeout=300)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    result = json.loads((tmp_path / "whole" / "sweep.json").read_text())
    assert result["complete"] and result["metric"] == "val_loss"
    assert [(p["lr"], p["width"]) for p in result["points"]] == [(1e-3, 32), (1e-3, 64), (1e-2, 32), (1e-2, 64)]
    assert all(p["step"] == 30 and not p["diverged"] and p["val_loss"] < p["initial_loss"] for p in result["points"])
    (series,) = result["series"]
    assert [w["width"] for w in series["widths"]] == [32, 64]
    assert result["target"]["width"] == 128 and result["target"]["lrs"][""] > 0
    assert "recommended lr at width 128" in whole.stdout
    assert (tmp_path / "whole" / "sweep.html").read_text().count("<svg") == 1
    planned = run_keel(["plan", "--gpus", "8", "--tokens", "1e9", "--trials", "20", "--sweep", str(tmp_path / "whole"),
                        "--json", *SHAPE, "model.dim=128"], cwd=tmp_path, timeout=60)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["tuning"]["lr"] == pytest.approx(result["target"]["lrs"][""])

    out = tmp_path / "killed"
    proc, tag = spawn_keel(sweep_args(out, small_corpus), tmp_path)
    deadline = time.monotonic() + 240
    while not list(out.glob("points/*/checkpoints/step-000010")):
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before a point checkpointed"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    while tagged(tag):  # its points die with it (parent-death signal), or the rerun would meet their run locks
        assert time.monotonic() < deadline, f"points outlived the killed sweep: {tagged(tag)}"
        time.sleep(0.1)
    before = {d.name: (d / "status.json").read_text() if (d / "status.json").exists() else ""
              for d in out.glob("points/*")}
    unfinished = [name for name, status in before.items() if '"finished"' not in status]
    assert unfinished, "every point had finished before the kill"
    starts_before = {name: count_starts(out / "points" / name) for name in before}  # a point killed early has none

    rerun = run_keel(sweep_args(out, small_corpus), cwd=tmp_path, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    done_before = 4 - len(unfinished) - (4 - len(before))
    assert f"{done_before} done already, {4 - done_before} to run" in rerun.stdout
    assert (out / "sweep.json").read_bytes() == (tmp_path / "whole" / "sweep.json").read_bytes()
    for name in before:  # each unfinished point started once more; finished points were left alone
        assert count_starts(out / "points" / name) == starts_before[name] + (name in unfinished), name
    resumed = [e for name in unfinished for e in read_jsonl(out / "points" / name / "events.jsonl")
               if e["kind"] == "resume"]
    assert resumed and all(e["step"] >= 10 for e in resumed)


def test_a_sweep_directory_refuses_another_grid(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "s"
    (out).mkdir()
    (out / "sweep_spec.json").write_text(json.dumps({"grid": [["optim.lr", ["0.001"]]]}))
    result = run_keel(sweep_args(out, small_corpus), cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "holds a sweep with another grid" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["sweep_spec.json"]


def test_a_sigterm_pauses_the_running_points_and_the_sweep(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "paused"
    args = ["sweep", "--grid", "optim.lr=1e-3", "--steps", "5000", *SHAPE, f"data.dir={small_corpus}", "--out",
            str(out)]
    proc, tag = spawn_keel(args, tmp_path)
    deadline = time.monotonic() + 120
    while '"running"' not in ((out / "points" / "000-lr1e-3" / "status.json").read_text()
                              if (out / "points" / "000-lr1e-3" / "status.json").exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75
    status = json.loads((out / "points" / "000-lr1e-3" / "status.json").read_text())
    assert status["state"] == "paused" and status["checkpoint"] and not tagged(tag)
    assert not json.loads((out / "sweep.json").read_text())["complete"]
