"""`keel train --nproc N`, in process: a warning when N asks more processes of a CPU than it has cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from keel.cli import main
from keel.cli.train import warn_oversubscribed


def stopped_start(tmp_path: Path, capsys: pytest.CaptureFixture, nproc: int, device: str) -> list[str]:
    """stderr of a `keel train` with `nproc` processes on `device`, stopped by a bad --accept-change, which is
    checked right after the device and before anything is created: what the launcher says up to there."""
    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), "--nproc", str(nproc), "--accept-change", "no.such_key",
                 f"train.device={device}", "train.micro_batch=1", f"train.global_batch={nproc}",
                 f"eval.sequences={nproc}"]) == 2
    assert not run_dir.exists()
    err = capsys.readouterr().err.splitlines()
    assert len(err) >= 1 and "no.such_key" in err[-1], err
    return err[:-1]


def test_more_processes_than_cpu_cores_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cores = len(os.sched_getaffinity(0))
    assert stopped_start(tmp_path, capsys, cores + 1, "cpu") == [
        f"keel: warning: --nproc {cores + 1} starts {cores + 1} processes on {cores} visible CPU cores: they take "
        f"turns on the cores and every step of every process is slower (up to --nproc {cores} runs at full speed)"]
    assert stopped_start(tmp_path, capsys, cores, "cpu") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_more_processes_than_cpu_cores_is_no_warning_on_gpus(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cores = len(os.sched_getaffinity(0))
    assert stopped_start(tmp_path, capsys, cores + 1, "cuda") == []


def test_replica_groups_count_every_group_s_processes(capsys: pytest.CaptureFixture) -> None:
    cores = len(os.sched_getaffinity(0))
    warn_oversubscribed(torch.device("cpu"), cores, 1)
    warn_oversubscribed(torch.device("cpu"), cores, 2)
    assert capsys.readouterr().err.splitlines() == [
        f"keel: warning: --nproc {cores} x 2 replica groups start {2 * cores} processes on {cores} visible CPU "
        f"cores: they take turns on the cores and every step of every process is slower (up to --nproc "
        f"{max(1, cores // 2)} runs at full speed)"]
