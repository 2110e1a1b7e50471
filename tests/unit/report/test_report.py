"""The HTML run report and the `keel status` summary: on the files of a real run with a loss spike that
the guard rolls back, and on synthetic run directories for the edge cases (missing files, NaN values,
thousands of steps) and for numbers known in advance (ETA, goodput, alerts)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
from pathlib import Path

import pytest

from keel.errors import KeelError
from keel.report.html import trajectory, write_report
from keel.report.status import summary, summary_lines
from keel.report.svg import MAX_POINTS
from keel.rundir.lock import LOCK
from tests.conftest import SMALL_RUN, run_keel

# 30 steps with a poisoned batch 20: the loss of step 21 spikes and the guard rolls back to step 10.
SPIKE_RUN = ["train.steps=30", "guard.spike.warmup=8", "guard.spike.window=16", "guard.spike.loss_threshold=3",
             "guard.snapshot_interval=10", "guard.rollback_steps=5", "monitor.prometheus_port=0",
             "monitor.telemetry_interval_s=1", 'drill.inject=["poison_batch:batch=20"]']
T0 = 1_800_000_000.0


def train_spiking_run(corpus: Path, run_dir: Path) -> Path:
    result = run_keel(["train", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={corpus}", *SPIKE_RUN],
                      cwd=run_dir.parent, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def real_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_spiking_run(small_corpus, tmp_path_factory.mktemp("report") / "run")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def synthetic_run(path: Path, steps: int = 300, total: int = 1000, state: str = "paused", step_s: float = 0.5,
                  nan_steps: tuple[int, ...] = (), spike: int = 0) -> Path:
    """A run directory with every file, and numbers chosen so that the expected output is known."""
    path.mkdir(parents=True)
    metrics = []
    for s in range(1, steps + 1):
        loss = 2 + 3 * math.exp(-s / 80) + (40.0 if s == spike else 0.0)
        metrics.append({"step": s, "time": T0 + s * step_s, "train/loss": math.nan if s in nan_steps else loss,
                        "optim/lr": 1e-3, "optim/grad_norm": 1 + (s % 7) / 10, "train/tokens_seen": s * 1024,
                        "throughput/tokens_per_s": 2048.0, "throughput/mfu": None, "time/step_s": step_s,
                        "time/data_s": 0.05, "time/forward_backward_s": 0.3, "time/optimizer_s": 0.1,
                        "time/guard_s": 0.02, **({"time/comm_s": 0.1} if s % 50 == 0 else {})})
        if s % 100 == 0:
            metrics.append({"step": s, "val/loss": loss + 0.25})
    write_jsonl(path / "metrics.jsonl", metrics)

    def event(step: int, kind: str, action: str = "", rank: int = 0, **detail: object) -> dict:
        return {"time": T0 + step * step_s, "step": step, "rank": rank, "kind": kind, "action": action,
                "detail": detail}

    write_jsonl(path / "events.jsonl", [
        event(0, "start"), event(100, "checkpoint", "committed", path="c/step-000100"),
        event(150, "guard", "skip", guard="numerics", reason="non-finite loss"),
        event(160, "alert", "throughput_drop", severity="warning", message="slow"),
        event(170, "failure", "workers_died", rank=-1, exit_code=-9), event(0, "start"), event(0, "start", rank=1),
        event(100, "resume", "resume", checkpoint="c/step-000100"),
        *[event(180 + i, "alert", f"rule_{i}", severity="error", message=f"alert {i}") for i in range(6)],
        event(200, "checkpoint", "committed", path="c/step-000200")])
    (path / "status.json").write_text(json.dumps({"state": state, "step": steps, "time": T0 + steps * step_s,
                                                  "checkpoint": str(path / "c/step-000200")}))
    (path / "config.toml").write_text(f'name = "synthetic"\n\n[train]\nsteps = {total}\n')
    buckets = {"productive": 120.0, "startup": 10.0, "checkpoint_blocking": 5.0, "wasted": 15.0, "paused": 0.0}
    history = [{"time": T0 + 30 * k, "step": 60 * k, "buckets": {n: v * k / 5 for n, v in buckets.items()}}
               for k in range(1, 6)]
    (path / "goodput.json").write_text(json.dumps({"version": 1, "started": T0, "updated": T0 + 150, "open": True,
                                                   "ended": "", "attempts": 2, "high_water": steps,
                                                   "recomputed_steps": 70, "buckets": buckets, "history": history,
                                                   "restore_s_by_tier": {"storage": 4.5}}))
    write_jsonl(path / "telemetry.jsonl", [
        {"time": T0 + t, "node": "node-a", "readings": {
            "host_cpu_utilization_ratio": 0.5, "host_memory_used_bytes": 2.0 * 2 ** 30,
            "gpu_temperature_celsius{gpu=0}": 60 + t / 10, "gpu_temperature_celsius{gpu=1}": 61.0,
            "gpu_throttle_reasons{gpu=0}": 0, "storage_write_latency_seconds": 0.002,
            "network_errors_total{interface=eth0,direction=rx}": 3.0,  # constant: no increase, no panel
            "network_drops_total{interface=eth0,direction=rx}": float(t // 30)}}
        for t in range(0, 150, 10)])
    return path


def svg_of(page: str, label: str) -> str:
    start = page.index(f'aria-label="{label}"')
    return page[start:page.index("</svg>", start)]


def paths(svg: str) -> dict[str, list[list[tuple[float, float]]]]:
    """Each series' subpaths (split at gaps) as lists of (x, y)."""
    out = {}
    for name, d in re.findall(r'<path class="series" data-name="([^"]*)"[^>]* d="([^"]*)"', svg):
        out[name] = [[(float(x), float(y)) for x, y in re.findall(r"(-?[\d.]+),(-?[\d.]+)", sub)]
                     for sub in d.split("M")[1:]]
    return out


def markers(svg: str) -> list[tuple[float, int, str]]:
    """(x, step, title) of every event marker."""
    return [(float(cx), int(step), title) for cx, title, step in
            re.findall(r'<circle class="event" cx="([\d.]+)"[^>]*><title>((?:step )(\d+)[^<]*)</title>', svg)]


def test_report_of_a_real_run_with_a_rollback(real_run: Path) -> None:
    out = write_report(real_run)
    assert out == real_run / "report.html"
    page = out.read_text()
    # Self-contained: no scripts, no fetched resources (the SVG namespace is a name, not a request).
    assert "<script" not in page and "src=" not in page and "url(" not in page
    assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", page)

    loss = svg_of(page, "loss and events")
    metrics = [json.loads(line) for line in (real_run / "metrics.jsonl").read_text().splitlines()]
    kept, abandoned = trajectory(metrics, "train/loss")
    assert [r["step"] for r in kept] == list(range(1, 31))  # one record per step on the final trajectory
    assert abandoned, "the rolled-back steps' records were written and are drawn apart"
    train = paths(loss)["train"]
    assert len(train) == 1 and len(train[0]) == 30
    x_of_step = {step: xy[0] for step, xy in zip(range(1, 31), train[0], strict=True)}

    events = [json.loads(line) for line in (real_run / "events.jsonl").read_text().splitlines()]
    rollbacks = [e for e in events if e["kind"] == "guard" and e["action"] == "rollback"]
    assert rollbacks and rollbacks[0]["step"] == 21
    found = markers(loss)
    assert any(step == 21 and "guard rollback" in title for _, step, title in found)
    aligned = [(x, step) for x, step, _ in found if step in x_of_step]
    assert aligned
    for x, step in aligned:  # the timeline's x scale is the loss curve's
        assert x == x_of_step[step]

    assert ">rolled_back<" in page and page.count("<svg") >= 8
    info = summary(real_run)
    assert info["state"] == "finished" and info["step"] == info["total_steps"] == 30 and info["eta_s"] is None
    assert info["train_loss"]["value"] == pytest.approx(json.loads((real_run / "summary.json").read_text())
                                                        ["train_loss"])
    json.dumps(info, allow_nan=False)


def test_missing_files_say_no_data(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "events.jsonl", [{"time": T0, "step": 0, "rank": 0, "kind": "start", "action": "",
                                        "detail": {}}])
    page = write_report(run, tmp_path / "elsewhere" / "r.html").read_text()
    for section in ("Training", "Goodput", "Hardware", "Events"):
        assert f"<h2>{section}</h2>" in page
    assert page.count("no data") >= 8  # curves, step time, goodput, telemetry
    assert "no goodput.json" in page and "no telemetry.jsonl" in page
    assert not (run / "report.html").exists()


def test_a_path_that_is_not_a_run_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(KeelError, match="does-not-exist.*not a keel run directory.*metrics.jsonl"):
        write_report(tmp_path / "does-not-exist")
    with pytest.raises(KeelError, match="not a keel run directory"):
        write_report(tmp_path)  # exists, holds none of a run's files


def test_thousands_of_steps_are_downsampled_and_keep_their_spike(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", steps=5000, total=5000, spike=2500)
    page = write_report(run).read_text()
    for svg in re.findall(r"<svg.*?</svg>", page):
        for subpaths in paths(svg).values():
            assert sum(len(sub) for sub in subpaths) <= MAX_POINTS
    train = paths(svg_of(page, "loss and events"))["train"]
    ys = [y for sub in train for _, y in sub]
    assert len(ys) > 500
    y_top = float(re.search(r'y1="([\d.]+)"', svg_of(page, "loss and events")).group(1))
    assert min(ys) <= y_top + 1  # the one-step spike reaches the top of the plot
    assert len(page) < 600_000


def test_nan_values_are_gaps_and_single_points_are_drawn(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", steps=150, nan_steps=(50, 51, 100))
    page = write_report(run).read_text()
    loss = svg_of(page, "loss and events")
    train = paths(loss)["train"]
    assert [len(sub) for sub in train] == [49, 48, 50]
    assert "validation" not in paths(loss)  # a single validation value (step 100): a point, not a line
    assert len(re.findall(r'<circle class="point" data-name="validation"', loss)) == 1
    assert "NaN" not in page


def test_events_sit_on_the_loss_curves_step_axis(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", steps=300)
    loss = svg_of(write_report(run).read_text(), "loss and events")
    (train,) = paths(loss)["train"]
    x_of_step = dict(zip(range(1, 301), (x for x, _ in train), strict=True))
    found = markers(loss)
    assert {step for _, step, _ in found} >= {100, 150, 160, 170, 180, 185, 200}
    # Both ranks' starts after the failure sit where they resumed; the first start at step 0.
    assert sorted(step for _, step, title in found if "· start" in title) == [0, 100, 100]
    for x, step, _ in found:
        if step:
            assert x == x_of_step[step], step


def test_goodput_and_hardware_panels(tmp_path: Path) -> None:
    page = write_report(synthetic_run(tmp_path / "run")).read_text()
    assert "productive: 2m · 80.0%" in page and "wasted: 15s · 10.0%" in page
    assert "goodput ratio 80.0% of 2m30s" in page and "70 recomputed step(s)" in page
    assert "restored from storage: 4.5s" in page
    assert "paused:" not in page  # an empty bucket gets no bar
    titles = re.findall(r"<h3>node-a · ([^<]*?) ?<", page)
    assert titles == ["host CPU", "host memory used", "GPU temperature · gpu 0", "GPU temperature · gpu 1",
                      "storage write latency", "network drops · interface eth0 direction rx"]
    assert "No increase during the run: network errors on node-a (1 series)" in page


def test_status_summary_of_a_running_job(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", steps=300, total=1000, state="running", step_s=0.5)
    lock = os.open(run / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a live job holds the run lock
    try:
        info = summary(run)
    finally:
        os.close(lock)
    json.dumps(info, allow_nan=False)
    assert info["state"] == "running" and info["step"] == 300 and info["total_steps"] == 1000
    assert info["eta_s"] == pytest.approx(700 * 0.5)
    assert info["train_loss"] == {"step": 300, "value": pytest.approx(2 + 3 * math.exp(-300 / 80))}
    assert info["val_loss"] == {"step": 300, "value": pytest.approx(2 + 3 * math.exp(-300 / 80) + 0.25)}
    assert info["goodput_ratio"] == pytest.approx(0.8)
    assert info["wall_s"] == pytest.approx(150.0)  # goodput's start to the status' time
    # Alerts since the last start, newest first, five at most: the one before the failure is not shown.
    assert [a["action"] for a in info["alerts"]] == ["rule_5", "rule_4", "rule_3", "rule_2", "rule_1"]
    assert info["last_checkpoint"].endswith("c/step-000200")
    text = "\n".join(summary_lines(info))
    assert "running at step 300/1000" in text and "ETA 5m50s (at 0.5 s/step recently)" in text
    assert "goodput 80.0% of 2m30s wall time" in text and "rule_5 (error): alert 5" in text
    assert "last restore: step 100 from the storage tier" in text  # a resume event from before tiers were named
    assert "throughput_drop" not in text.split("recent events:")[0]


def test_status_of_a_paused_run_and_of_a_run_without_metrics(tmp_path: Path) -> None:
    text = "\n".join(summary_lines(summary(synthetic_run(tmp_path / "paused"))))
    assert "paused at step 300/1000" in text and "remaining 5m50s of training once resumed" in text
    run = synthetic_run(tmp_path / "from-memory")
    with (run / "events.jsonl").open("a") as f:
        f.write(json.dumps({"time": T0 + 140, "step": 295, "rank": 0, "kind": "resume", "action": "resume",
                            "detail": {"checkpoint": "/dev/shm/m/step-000295", "tier": "memory", "load_s": 0.125}})
                + "\n")
    text = "\n".join(summary_lines(summary(run)))
    assert "last restore: step 295 from the memory tier in 0.12 s" in text and "(/dev/shm/m/step-000295)" in text
    bare = tmp_path / "bare"
    bare.mkdir()
    info = summary(bare)
    assert info["state"] == "not started" and info["eta_s"] is None and info["goodput_ratio"] is None
    assert "loss: train - · validation -" in "\n".join(summary_lines(info))
    with pytest.raises(KeelError, match="does not exist"):
        summary(tmp_path / "missing")


def test_records_a_rollback_abandoned() -> None:
    records = [{"step": s, "train/loss": float(s)} for s in range(1, 6)] + [{"step": 5, "val/loss": 1.0}]
    records += [{"step": s, "train/loss": -float(s)} for s in range(3, 8)] + [{"step": 7, "val/loss": 2.0}]
    kept, dropped = trajectory(records, "train/loss")
    assert [(r["step"], r["train/loss"]) for r in kept] == [(1, 1.0), (2, 2.0)] + [(s, -s) for s in range(3, 8)]
    assert [r["step"] for r in dropped] == [3, 4, 5]
    assert [r["step"] for r in trajectory(records, "val/loss")[1]] == [5]  # validated, then rolled back past


def test_a_run_of_one_record_draws_points(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"step": 1, "train/loss": 3.0, "time/step_s": 0.1, "time/data_s": 0.01}])
    write_jsonl(run / "telemetry.jsonl", [{"time": T0, "node": "n", "readings": {"host_cpu_utilization_ratio": 0.2}}])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "train/lo')  # a line cut short by a killed writer
    page = write_report(run).read_text()
    assert len(re.findall(r'<circle class="point" data-name="train"', svg_of(page, "loss and events"))) == 1
    assert len(re.findall(r'<circle class="point" data-name="host CPU"', page)) == 1
    assert "<h3>Step time" in page and 'data-name="data"' in page


def test_the_instability_signals_get_a_panel_per_kind_with_a_line_per_layer(tmp_path: Path) -> None:
    plain = synthetic_run(tmp_path / "plain")
    assert "Instability signals" not in write_report(plain).read_text()
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [
        {"step": s, "train/loss": 3.0, "signals/attn_logit_max": 2.0 * s, "signals/log_z_mean": 1.0,
         "signals/log_z_max": 2.0, **{f"signals/{kind}/layer_{i}": s + i for kind in ("attn_logit_max", "act_rms",
                                                                                       "update_rms") for i in (0, 1)}}
        for s in range(1, 4)])
    page = write_report(run).read_text()
    assert "<h2>Instability signals</h2>" in page
    for label in ("Largest attention logit, per layer", "Activation RMS, per layer", "Update RMS, per layer"):
        assert set(paths(svg_of(page, label))) == {"layer 0", "layer 1"}, label
    assert set(paths(svg_of(page, "log Z"))) == {"mean", "max"}
    assert "float8" not in page  # a run without float8 layers has no such panel


def test_a_float8_runs_signals_add_the_share_its_casts_flushed_to_zero(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [
        {"step": s, "train/loss": 3.0, "signals/attn_logit_max": 2.0 * s, "signals/log_z_mean": 1.0,
         "signals/log_z_max": 2.0, **{f"signals/{kind}/layer_{i}": s + i for kind in ("attn_logit_max", "act_rms",
                                                                                       "update_rms") for i in (0, 1)},
         **{f"signals/float8_underflow/layer_{i}": 0.01 * s for i in (0, 1)}} for s in range(1, 4)])
    page = write_report(run).read_text()
    assert set(paths(svg_of(page, "Share of float8 inputs flushed to zero, per layer"))) == {"layer 0", "layer 1"}
