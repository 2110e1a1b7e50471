"""Shared fixtures: a small prepared corpus and a runner for real `keel` processes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import sysconfig
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keel.config import CleanConfig, DataConfig, DecontamConfig, DedupConfig, SourceConfig
from keel.core.net import free_port
from keel.drill import procs

REPO = Path(__file__).resolve().parents[1]

# Session runs of several processes: a test that uses one is a multi-process test (marker `dist`), so that
# `make test` makes each run once, in its serial part, rather than once in each worker of its parallel one.
SHARED_RUNS = {"reference_run", "replica_run"}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SHARED_RUNS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)


# A small, fixed slice of the standard library: enough text for a few hundred sequences, fast to prepare.
SMALL_SOURCES = [str(Path(sysconfig.get_paths()["stdlib"]) / name) for name in ("json", "email", "logging")]


def small_data(sources: list[str], val_fraction: float = 0.05) -> DataConfig:
    """The test corpus's settings: its documents as they are read, without cleaning, dedup or
    decontamination, so that the corpus, and every run's data order, stays what the multi-process tests'
    expected steps and losses were measured on."""
    return DataConfig(sources={"main": SourceConfig(paths=sources)}, val_fraction=val_fraction,
                      clean=CleanConfig(enabled=False), dedup=DedupConfig(exact=False, near=False),
                      decontam=DecontamConfig(enabled=False))

# A model small enough that a 40-step, 2-process run takes seconds. The preflight's storage and all-reduce
# probes are sized to such a model: 4 MiB instead of the default 64 (the checks are the same).
SMALL_RUN = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
    "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "monitor.interval=1",
    "optim.warmup_steps=5", "eval.interval=20", "eval.sequences=8", "checkpoint.interval=20",
    "health.preflight_probe_mib=4",
]


def keel_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return env


TAG = "KEEL_TEST_TAG"


def tagged(tag: str) -> list[int]:
    """Live processes started by the `keel` command tagged `tag`, whatever session they run in."""
    return procs.tagged(tag, TAG)


def kill_tagged(tag: str, wait_s: float = 10.0) -> None:
    procs.kill_tagged(tag, wait_s, TAG)


def spawn_keel(args: list[str], cwd: Path, env: dict[str, str] | None = None,
               **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start `keel ARGS` in its own session, tagged so that `kill_tagged` finds all it started."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "keel", *args], cwd=cwd,
                            env={**keel_env(), **(env or {}), TAG: tag}, start_new_session=True, **popen)
    return proc, tag


def run_keel(args: list[str], cwd: Path, timeout: float = 240,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `keel ARGS` as a real process (with `env` added to its environment). Fails on timeout, or
    if anything it started outlives it; either way (and if the test itself is interrupted) everything
    it started is killed."""
    proc, tag = spawn_keel(args, cwd, env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    leftovers: list[int] = []
    try:
        out, err = proc.communicate(timeout=timeout)
        leftovers = tagged(tag)
    except subprocess.TimeoutExpired:
        kill_tagged(tag)
        out, err = proc.communicate()
        pytest.fail(f"keel {' '.join(args)} timed out after {timeout}s\n{out}\n{err}")
    finally:
        kill_tagged(tag)
    if leftovers:
        pytest.fail(f"keel {' '.join(args)} left processes behind: {leftovers}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A real filesystem of `size` (tmpfs) mounted at `mount`, to fill up or remount read-only; skips
    the test where mounting is not allowed (it is for root, as in CI)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def group() -> Iterator[None]:
    """A one-process gloo group, for the collectives of code run in the test's own process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from keel.data.prepare import prepare

    out = tmp_path_factory.mktemp("corpus") / "small"
    prepare(small_data(SMALL_SOURCES), out)
    return out


@pytest.fixture(scope="session")
def reference_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 steps of SMALL_RUN on 2 processes, uninterrupted, with a checkpoint every 10 steps (all kept):
    the run that an interrupted, restarted or resumed run must end bitwise equal to. (When a run saves
    changes nothing it computes: tests/dist/test_checkpoint.py checks that.)"""
    run_dir = tmp_path_factory.mktemp("runs") / "A"
    result = run_keel(["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, "train.steps=40",
                       f"data.dir={small_corpus}", "checkpoint.interval=10", "checkpoint.keep_last=10"],
                      cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr
    return run_dir


@dataclasses.dataclass
class ReplicaRun:
    """A finished run of 2 replica groups whose group 1 was SIGKILLed and healed, with what was read from it
    while it ran: each group's last exporter page, and `keel status` of the run while group 1 was down."""
    run_dir: Path
    pages: dict[int, str]
    while_down: dict


@pytest.fixture(scope="session")
def replica_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaRun]:
    from keel.report.status import summary

    run_dir = tmp_path_factory.mktemp("replicas") / "ft"
    port = free_port()  # group G serves port + G
    # Group 0 is paced only while group 1 is down (down_s: see test_replica_groups), so that group 1 is back and
    # healed before the run ends; then both go at their own speed.
    faults = '"slow:rank=-1,seconds=0.4,while_missing=true", "kill:step=5,rank=-1,group=1,down_s=3"'
    args = ["train", "--replica-groups", "2", "--nproc", "1", "--run-dir", str(run_dir), *SMALL_RUN, "train.steps=40",
            f"data.dir={small_corpus}", "fault_tolerance.max_restarts=2", f"monitor.prometheus_port={port}",
            f"drill.inject=[{faults}]"]
    log = run_dir.parent / "keel.log"
    with open(log, "w") as out:
        proc, tag = spawn_keel(args, run_dir.parent, stdout=out, stderr=subprocess.STDOUT)
    pages: dict[int, str] = {}
    while_down: dict = {}
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            for group in (0, 1):
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port + group}/metrics", timeout=2) as page:
                        text = page.read().decode()
                    if "keel_ft_participants" in text:
                        pages[group] = text
            if not while_down and re.search(r"^keel_ft_participants\{.*\} 1\.0$", pages.get(0, ""), re.M):
                while_down = summary(run_dir)
            time.sleep(0.3)
        if proc.poll() is None:
            pytest.fail("the replica-group run did not end within 300 s")
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        kill_tagged(tag)
    yield ReplicaRun(run_dir, pages, while_down)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A moto S3 server in its own process on a free loopback port, with a bucket `keel`; yields the environment
    that points boto3 and s3fs at it."""
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    port = free_port()
    log = open(tmp_path_factory.mktemp("s3") / "moto.log", "w")  # noqa: SIM115
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=log, start_new_session=True)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "keel",
           "AWS_SECRET_ACCESS_KEY": "keel", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto server did not start"
                time.sleep(0.2)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="keel",
                     aws_secret_access_key="keel", region_name="us-east-1").create_bucket(Bucket="keel")
        yield env
    finally:
        server.kill()
        server.wait()
        log.close()
