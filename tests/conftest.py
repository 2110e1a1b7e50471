"""Shared fixtures: a small prepared corpus and a runner for real `keel` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A small, fixed slice of the standard library: enough text for a few hundred sequences, fast to prepare.
SMALL_SOURCES = [str(Path(sysconfig.get_paths()["stdlib"]) / name) for name in ("json", "email", "logging")]

# A model small enough that a 40-step, 2-process run takes seconds.
SMALL_RUN = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
    "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.log_interval=1",
    "optim.warmup_steps=5", "eval.interval=20", "eval.sequences=8", "checkpoint.interval=20",
]


def keel_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _alive_in_group(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def run_keel(args: list[str], cwd: Path, timeout: float = 240,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `keel ARGS` as a real process in its own session (with `env` added to its environment).
    Fails on timeout, or if anything it started outlives it; either way (and if the test itself is
    interrupted) the whole group is killed."""
    proc = subprocess.Popen([sys.executable, "-m", "keel", *args], cwd=cwd, env={**keel_env(), **(env or {})},
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    leftovers: list[int] = []
    try:
        out, err = proc.communicate(timeout=timeout)
        leftovers = _alive_in_group(proc.pid)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"keel {' '.join(args)} timed out after {timeout}s\n{out}\n{err}")
    finally:
        if proc.poll() is None or _alive_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    if leftovers:
        pytest.fail(f"keel {' '.join(args)} left processes behind: {leftovers}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from keel.data.prepare import prepare

    out = tmp_path_factory.mktemp("corpus") / "small"
    prepare(SMALL_SOURCES, out, val_fraction=0.05)
    return out
