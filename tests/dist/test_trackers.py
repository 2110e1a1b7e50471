"""Experiment trackers fed by real runs: a real MLflow tracking server on loopback, read back with its client,
and W&B in offline mode, its run files read back with wandb's own record format. A run SIGKILLed and
resumed continues the same tracker run; a tracker server killed mid-run never stops training."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, free_port, kill_tagged, run_keel, spawn_keel

pytestmark = pytest.mark.dist

KILLED = ['drill.inject=["kill:step=12,rank=0"]', "--max-restarts", "1", "checkpoint.interval=5"]


class MlflowServer:
    """`mlflow server` on loopback with a SQLite store and artifacts under `root`."""

    def __init__(self, root: Path) -> None:
        root.mkdir()
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", self.url.rpartition(":")[2],
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--artifacts-destination", str(root / "artifacts")],
            cwd=root, stdout=subprocess.DEVNULL, stderr=(root / "server.log").open("w"), start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")

    def client(self):
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        from mlflow import MlflowClient

        return MlflowClient(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    pytest.importorskip("mlflow")
    server = MlflowServer(tmp_path / "mlflow")
    try:
        yield server
    finally:
        server.stop()


def train_cmd(corpus: Path, run_dir: Path, *extra: str, steps: int = 24) -> list[str]:
    return ["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={steps}",
            f"data.dir={corpus}", "monitor.telemetry_interval_s=0", *extra]


def last_per_step(run_dir: Path, key: str) -> dict[int, float]:
    """`key`'s value per step in metrics.jsonl, the newest where a resume redid the step."""
    return {r["step"]: r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if key in r}


def logged_keys(run_dir: Path) -> set[str]:
    return {k for r in read_jsonl(run_dir / "metrics.jsonl") for k, v in r.items()
            if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool)}


def test_mlflow_gets_every_metric_and_the_config_and_a_resume_appends_to_the_same_run(
        small_corpus: Path, tmp_path: Path, mlflow_server: MlflowServer) -> None:
    run_dir = tmp_path / "run"
    result = run_keel(train_cmd(small_corpus, run_dir, *KILLED, "monitor.mlflow.enabled=true",
                                f"monitor.mlflow.tracking_uri={mlflow_server.url}", "monitor.mlflow.experiment=pre",
                                'monitor.mlflow.tags=["team=lm"]'), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resume"]
    assert resumed, "the kill was not resumed"
    client = mlflow_server.client()
    experiment = client.get_experiment_by_name("pre")
    (run,) = client.search_runs([experiment.experiment_id])  # one MLflow run across the kill
    saved = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert saved == {"run_id": run.info.run_id, "tracking_uri": mlflow_server.url, "key": saved["key"],
                     "sent_step": 24}
    assert run.info.status == "FINISHED" and run.data.tags["keel.state"] == "finished"
    assert run.data.tags["team"] == "lm" and run.data.tags["keel.run_dir"] == str(run_dir.resolve())
    assert run.info.run_name == run_dir.name and run.data.tags["keel.config"] == "tiny"  # named after its directory
    assert set(run.data.metrics) == logged_keys(run_dir)  # every metric keel logs, under its own name
    for key in ("train/loss", "optim/lr", "val/loss"):  # each step's newest value is keel's
        history = {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                     key=lambda m: m.timestamp)}
        assert history == pytest.approx(last_per_step(run_dir, key), rel=1e-6)
    assert min(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == 1
    assert (run.data.params["model.dim"], run.data.params["train.steps"]) == ("64", "24")
    assert run.data.params["monitor.mlflow.experiment"] == "pre"
    assert run.data.tags["checkpoint"] == str(run_dir / "checkpoints" / "step-000024")
    # the newest of each kind of event (the resume is from step 10, or 5 when the save of step 10 was still being
    # written at the kill)
    assert run.data.tags["event.resume"].startswith(f"step {resumed[-1]['step']}: resume")
    assert run.data.tags["event.finish"].startswith("step 24: finished")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.toml", "report.html"} <= artifacts


def test_an_mlflow_run_started_before_its_id_was_kept_is_continued_not_started_again(
        tmp_path: Path, mlflow_server: MlflowServer) -> None:
    from keel.config import Config, TrackerQueueConfig
    from keel.monitor.trackers import TRACKERS, TrackerChannel
    from keel.monitor.tracking.registry import make_backend

    # What a SIGKILL inside the first start's `open` leaves: the key kept, the server's run made, no id kept.
    run_dir, cfg = tmp_path / "run", Config(name="tiny")
    run_dir.mkdir()
    cfg.monitor.mlflow.tracking_uri = mlflow_server.url
    (run_dir / TRACKERS).write_text(json.dumps({"mlflow": {"key": "k1"}}))
    first = make_backend("mlflow", cfg, run_dir).open(None, "k1")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 4.0 - s}) + "\n"
                                                   for s in (1, 2, 3)))
    TrackerChannel("mlflow", make_backend("mlflow", cfg, run_dir), cfg, run_dir, TrackerQueueConfig(),
                   lambda text, detail: None, start_step=3).close("finished", timeout_s=60)
    client = mlflow_server.client()
    (run,) = client.search_runs([client.get_experiment_by_name("keel").experiment_id])
    assert run.info.run_id == first["run_id"] and run.info.status == "FINISHED"
    assert json.loads((run_dir / TRACKERS).read_text())["mlflow"] == {**first, "key": "k1", "sent_step": 3}
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")} == \
        {1: 3.0, 2: 2.0, 3: 1.0}


def test_a_tracker_server_killed_mid_run_does_not_stop_training(small_corpus: Path, tmp_path: Path,
                                                                 mlflow_server: MlflowServer) -> None:
    run_dir = tmp_path / "run"
    proc, tag = spawn_keel(train_cmd(small_corpus, run_dir, "monitor.mlflow.enabled=true",
                                     f"monitor.mlflow.tracking_uri={mlflow_server.url}", "monitor.mlflow.timeout_s=2",
                                     "monitor.trackers.close_timeout_s=5", "monitor.trackers.queue=20",
                                     'drill.inject=["slow:rank=-1,seconds=0.2,from_step=1,steps=60"]', steps=60),
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = mlflow_server.client()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the tracker run has its first metrics: the server goes down
            runs = client.search_runs([client.get_experiment_by_name("keel").experiment_id]) \
                if client.get_experiment_by_name("keel") else []
            if runs and "train/loss" in runs[0].data.metrics:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the run never reached the MLflow server")
        mlflow_server.stop()
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_tagged(tag)
    assert proc.returncode == 0, out[-3000:]
    assert max(last_per_step(run_dir, "train/loss")) == 60
    (warned, *_) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "tracker"][-1:]
    assert warned["detail"]["tracker"] == "mlflow" and warned["detail"]["dropped"] + warned["detail"]["failed"] > 0
    assert "warning: tracker mlflow:" in out and "training goes on" in out
    assert "report was not attached" in out  # the server is still down after the run


# ---------------------------------------------------------------- Weights & Biases, offline


def wandb_records(path: Path) -> Iterator:
    """The records of a .wandb run file: wandb's protobuf Records in a LevelDB-style log (32 KiB blocks of
    chunks, each with a 7-byte header: CRC, length, type full/first/middle/last) after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += chunk


def wandb_run(run_dir: Path) -> dict:
    """What the offline run files under RUN_DIR/wandb hold: (run directory, run id) of each run record, names,
    tags, config, history by step, summary, artifacts."""
    seen: dict = {"ids": [], "names": set(), "tags": set(), "config": {}, "history": {}, "summary": {},
                  "artifacts": []}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                seen["ids"].append((path.parent.name, record.run.run_id))
                seen["names"] |= {record.run.display_name} - {""}
                seen["tags"] |= set(record.run.tags)
                seen["config"].update({c.key: json.loads(c.value_json) for c in record.run.config.update})
            elif kind == "config":
                seen["config"].update({c.key: json.loads(c.value_json) for c in record.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                seen["history"].setdefault(items["_step"], {}).update(items)
            elif kind == "summary":
                seen["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                        for i in record.summary.update})
            elif kind == "artifact":
                seen["artifacts"].append(record.artifact.type)
    return seen


def test_wandb_offline_run_files_hold_the_run_and_a_resume_continues_the_same_run(small_corpus: Path,
                                                                                   tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    result = run_keel(train_cmd(small_corpus, run_dir, *KILLED, "monitor.wandb.enabled=true",
                                "monitor.wandb.mode=offline", 'monitor.wandb.tags=["proxy"]'),
                      cwd=tmp_path, env={"WANDB_API_KEY": "", "WANDB_DISABLE_SERVICE": ""})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = wandb_run(run_dir)
    saved = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    # the first start, the restart after the kill and the report's attachment: one run id
    segments = {segment for segment, _ in seen["ids"]}
    assert len(segments) == 3 and {run_id for _, run_id in seen["ids"]} == {saved["id"]}
    assert {"proxy", "config=tiny", "resume", "checkpoint", "finish"} <= seen["tags"]
    assert seen["names"] == {run_dir.name}  # named after its run directory, the config's name a tag
    assert seen["config"]["model"]["dim"] == 64 and seen["config"]["train"]["steps"] == 24
    expected = last_per_step(run_dir, "train/loss")
    assert {step: row["train/loss"] for step, row in seen["history"].items() if "train/loss" in row} == \
        pytest.approx(expected, rel=1e-6)
    assert logged_keys(run_dir) <= {k for row in seen["history"].values() for k in row}
    assert seen["summary"]["checkpoint"] == str(run_dir / "checkpoints" / "step-000024")
    assert seen["summary"]["keel/state"] == "finished" and "report" in seen["artifacts"]
