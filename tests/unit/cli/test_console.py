"""What a person reads on the console: no profiler library lines, no bandwidth line for one process, a finish
line that says when nothing was validated, `keel status` events as short readable lines, a command piped into
`head` ending quietly, and never an MFU above 100%."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from keel.monitor.metrics import StepMeter
from keel.rundir.status import readable
from tests.conftest import REPO, SMALL_RUN, keel_env, run_keel


@pytest.fixture(scope="module")
def profiled_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("console") / "run"
    result = run_keel(["train", "--run-dir", str(run_dir), *SMALL_RUN, f"data.dir={small_corpus}", "train.steps=2",
                       "monitor.profile_interval=1", "eval.final=false", "eval.interval=0"], cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout + result.stderr


def test_a_profiled_one_process_run_prints_only_keel_lines(profiled_run: tuple[Path, str]) -> None:
    run_dir, console = profiled_run
    assert "USDT" not in console and "profiler_start" not in console  # the profiler library's own lines
    assert "bus bandwidth" not in console and "over 1 ranks" not in (run_dir / "events.jsonl").read_text()
    assert "no validation (eval.final = false)" in console and "validation loss nan" not in console


def test_status_events_are_short_readable_lines(profiled_run: tuple[Path, str]) -> None:
    run_dir, _ = profiled_run
    result = run_keel(["status", str(run_dir), "--events", "20"], cwd=run_dir.parent)
    events = result.stdout.split("recent events:\n")[1].splitlines()
    assert any("preflight passed mode=warn, checks=" in e and "passed" in e.split("checks=")[1] for e in events)
    assert all(len(e) < 240 and "{'" not in e for e in events)  # no dict dumped whole
    start = next(e for e in events if " start " in e)
    assert re.search(r"process_started=\d\d:\d\d:\d\d, entered=\d\d:\d\d:\d\d", start), start  # clock times


def test_readable_details_count_checks_and_show_times_as_clock_times() -> None:
    detail = {"checks": [{"name": "a", "ok": True}, {"name": "b", "ok": False}], "entered": 1796231224.38,
              "loss": 3.14159265, "path": "x" * 100}
    text = readable(detail)
    assert text.startswith("checks=1/2 passed (failed: b), entered=")
    assert ", loss=3.142, path=" + "x" * 57 + "..." in text


def test_a_command_whose_reader_goes_away_ends_quietly(tmp_path: Path) -> None:
    pipe = subprocess.run(f"{sys.executable} -m keel config --reference | head -1", shell=True, cwd=REPO,
                          env=keel_env(), capture_output=True, text=True, timeout=60)
    assert pipe.stdout.startswith("| key |") and pipe.stderr == ""


def test_mfu_above_one_is_not_reported() -> None:
    meter = StepMeter(tokens_per_step=1000, flops_per_step=1e12, world_size=1, peak_flops=1e9)
    meter.step_done()
    record = meter.window()
    assert record["throughput/mfu"] is None and record["throughput/tflops_per_device"] > 0.001
