"""Monitoring of real runs: a real Prometheus server scrapes keel's exporter and fires the shipped
rules, an injected spike reaches a real webhook once, TensorBoard files read back, the goodput ledger
accounts a SIGKILL and restart, and the registry reduces across real ranks."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from keel.monitor.metrics import MetricsRegistry
from keel.rundir.events import read_jsonl
from tests.conftest import REPO, SMALL_RUN, free_port, kill_tagged, run_keel, spawn_keel

pytestmark = pytest.mark.dist

SPIKE = ["guard.snapshot_interval=10", "guard.rollback_steps=5", "guard.skip_batches=8", "guard.spike.warmup=20",
         "guard.spike.window=40", 'drill.inject=["poison_batch:batch=49"]']


def train_cmd(corpus: Path, run_dir: Path, *extra: str, steps: int = 60, nproc: int = 2) -> list[str]:
    return ["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={steps}",
            f"data.dir={corpus}", *extra]


def alerts_of(run_dir: Path) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "alert"]


# ---------------------------------------------------------------- the registry across ranks


def _reduce_on_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        registry = MetricsRegistry(torch.device("cpu"))
        for step in range(3):  # rank r adds r + step: a host float, a device tensor for max and sum
            registry.add("time/data_s", float(rank + step))
            registry.add("memory/peak", torch.tensor(float(10 * rank + step)), reduce="max")
            registry.add("tokens", torch.tensor(float(rank + 1)), reduce="sum")
        result = registry.reduce()
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_registry_reduces_across_ranks_and_steps(tmp_path: Path) -> None:
    out = tmp_path / "reduced.json"
    mp.start_processes(_reduce_on_rank, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    # mean of {0,1,2} and {1,2,3}; max over ranks and steps; sum of 3 × 1 and 3 × 2
    assert json.loads(out.read_text()) == pytest.approx({"time/data_s": 1.5, "memory/peak": 12.0, "tokens": 9.0})


# ---------------------------------------------------------------- a real Prometheus server


class Prometheus:
    """A Prometheus server on loopback with keel's scrape config and rules, scraping every second."""

    def __init__(self, workdir: Path, target_port: int) -> None:
        deploy = REPO / "deploy" / "prometheus"
        config = yaml.safe_load((deploy / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(deploy / name) for name in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=open(workdir / "prometheus.log", "w"))  # noqa: SIM115
        self.wait_for(lambda: self.get("/-/ready") is not None, 30, "Prometheus to start")

    def get(self, path: str) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                body = response.read()
        except OSError:
            return None
        return json.loads(body) if path.startswith("/api") else {}

    def query(self, expr: str) -> list[dict]:
        answer = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        return answer["data"]["result"] if answer else []

    def firing(self) -> list[str]:
        answer = self.get("/api/v1/alerts")
        return [a["labels"]["alertname"] for a in answer["data"]["alerts"] if a["state"] == "firing"] if answer else []

    def wait_for(self, condition, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := condition():
                return value
            time.sleep(0.5)
        pytest.fail(f"timed out waiting for {what}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus server (Debian package "
                    "prometheus; .ci/run installs it)")
def test_prometheus_scrapes_the_run_and_fires_the_stalled_step_rule(small_corpus: Path, tmp_path: Path) -> None:
    port = free_port()
    prometheus = Prometheus(tmp_path, port)
    run_dir = tmp_path / "run"
    # Rank 1 hangs in step 40; the watchdog would end the run only after a minute, the stall rule says so at 3 s.
    proc, tag = spawn_keel(train_cmd(small_corpus, run_dir, f"monitor.prometheus_port={port}",
                                     "monitor.alerts.stall_s=3", "monitor.telemetry_interval_s=1",
                                     'drill.inject=["hang:step=40,rank=1"]', steps=200),
                           tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        prometheus.wait_for(lambda: prometheus.query("keel_train_step >= 39"), 120, "the run to reach step 39")
        loss = prometheus.query("keel_train_loss")
        assert loss and all(0 < float(s["value"][1]) < 10 for s in loss)
        assert {(s["metric"]["run"], s["metric"]["rank"]) for s in loss} == {(run_dir.name, "0")}
        assert float(prometheus.query("keel_throughput_tokens_per_second")[0]["value"][1]) > 0
        assert 0 < float(prometheus.query("keel_goodput_ratio")[0]["value"][1]) <= 1
        buckets = {s["metric"]["bucket"]: float(s["value"][1])
                   for s in prometheus.query("keel_goodput_seconds_total")}
        assert buckets["productive"] > 0 and buckets["startup"] > 0
        assert prometheus.query("keel_host_memory_used_bytes"), "the node's telemetry is scraped too"
        assert "KeelStepStalled" not in prometheus.firing()

        prometheus.wait_for(lambda: "KeelStepStalled" in prometheus.firing(), 60, "KeelStepStalled to fire")
        assert float(prometheus.query("keel_train_step")[0]["value"][1]) == 39
        stalled = prometheus.wait_for(lambda: [a for a in alerts_of(run_dir) if a["action"] == "step_stalled"], 30,
                                      "the in-process step_stalled alert")
        assert stalled[0]["step"] == 39 and stalled[0]["rank"] == 0
    finally:
        kill_tagged(tag)
        proc.wait(timeout=30)
        prometheus.close()


# ---------------------------------------------------------------- webhook, TensorBoard, telemetry


class Hook(http.server.BaseHTTPRequestHandler):
    received: list[dict] = []
    hold_s = 0.0  # how long the server keeps each request before it answers

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append({"at": time.time(), **body})
        time.sleep(type(self).hold_s)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serve(hold_s: float = 0.0) -> tuple[http.server.ThreadingHTTPServer, str]:
    Hook.received, Hook.hold_s = [], hold_s
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/alerts"


HOLD_S = 20.0


@pytest.fixture(scope="module")
def spike_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """One run with a poisoned batch at step 50, a webhook that holds each POST open for 20 s before it
    answers, TensorBoard, and telemetry every second."""
    run_dir = tmp_path_factory.mktemp("spike") / "run"
    server, url = serve(hold_s=HOLD_S)
    try:
        result = run_keel(train_cmd(small_corpus, run_dir, *SPIKE, f"monitor.alerts.webhook={url}",
                                    "monitor.alerts.webhook_timeout_s=30", "monitor.tensorboard=true",
                                    "monitor.telemetry_interval_s=1", "monitor.interval=5", steps=80),
                          cwd=run_dir.parent)
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir, list(Hook.received), result.stdout


def test_a_spike_reaches_the_webhook_exactly_once(spike_run) -> None:
    run_dir, received, stdout = spike_run
    spikes = [post for post in received if post["alert"] == "loss_spike"]
    assert len(spikes) == 1, received
    # Every alert of the run (a noisy machine may add a throughput drop) was posted once, in order.
    assert [(p["alert"], p["step"]) for p in received] == [(a["action"], a["step"]) for a in alerts_of(run_dir)]
    (post,) = spikes
    assert (post["alert"], post["severity"], post["step"], post["rank"]) == ("loss_spike", "error", 50, 0)
    assert (post["run"], post["node"]) == (run_dir.name, os.environ.get("KEEL_NODE") or os.uname().nodename)
    assert "loss" in post["message"]
    assert "ALERT [error] loss_spike at step 50" in stdout


def test_tensorboard_files_hold_the_run_scalars(spike_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = spike_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "throughput/tokens_per_s", "goodput/ratio", "time/forward_backward_s",
            "checkpoint/blocking_s"} <= tags
    logged = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(r["step"], pytest.approx(r["train/loss"], rel=1e-6)) for r in logged]


def test_telemetry_is_sampled_and_missing_sources_said_once(spike_run) -> None:
    run_dir, _, _ = spike_run
    samples = read_jsonl(run_dir / "telemetry.jsonl")
    assert len(samples) >= 2 and {s["node"] for s in samples} == {samples[0]["node"]}, "one sampler per node"
    readings = samples[-1]["readings"]
    assert 0 < readings["host_memory_used_bytes"] <= readings["host_memory_total_bytes"]
    assert 0 < readings["storage_free_ratio"] <= 1 and readings["storage_write_latency_seconds"] > 0
    assert not any(key.startswith("gpu_") for s in samples for key in s["readings"])
    gone = [e["detail"]["source"] for e in read_jsonl(run_dir / "events.jsonl")
            if e["kind"] == "telemetry" and e["action"] == "unavailable"]
    assert gone.count("gpu") == 1


def test_a_webhook_that_holds_the_post_does_not_hold_training_up(spike_run) -> None:
    # (A webhook that refuses connections is tests/unit/monitor/test_monitor.py's.)
    run_dir, received, _ = spike_run
    post = received[0]
    after = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r and r["time"] > post["at"]]
    assert after and after[-1]["step"] == 80 and after[-1]["time"] < post["at"] + HOLD_S, \
        "the run trained on, to its end, while the alert's POST was held open"


# ---------------------------------------------------------------- goodput across a crash


@pytest.mark.timeout(300)
def test_goodput_ledger_accounts_a_sigkill_and_its_restart(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    started = time.time()
    # Rank 1 is SIGKILLed in step 30; the agent restarts the workers, which resume from step 20.
    result = run_keel(train_cmd(small_corpus, run_dir, 'drill.inject=["kill:step=30,rank=1"]', "--max-restarts", "1",
                                steps=40), cwd=tmp_path)
    ended = time.time()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ledger = json.loads((run_dir / "goodput.json").read_text())
    buckets = ledger["buckets"]
    total = sum(buckets.values())
    assert ledger["attempts"] == 2 and not ledger["open"] and ledger["ended"] == "finished"
    assert total == pytest.approx(ledger["updated"] - ledger["started"], rel=0.01), "no second counted twice"
    assert started <= ledger["started"] + 0.05 and ledger["updated"] <= ended
    # What is outside: Python starting before keel is imported, and the interpreter's exit after the last word.
    assert total == pytest.approx(ended - started, abs=0.01 * (ended - started) + 1.5)
    assert buckets["failed_down"] > 0 and buckets["checkpoint_restore"] > 0 and buckets["paused"] == 0

    # Steps 21-29 were made twice; the second time is wasted. metrics.jsonl has their wall times.
    assert ledger["high_water"] == 40 and ledger["recomputed_steps"] == 9
    second_time = {}
    seen: set[int] = set()
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        if "time/step_s" in record:
            if record["step"] in seen:
                second_time[record["step"]] = record["time/step_s"]
            seen.add(record["step"])
    assert sorted(second_time) == list(range(21, 30))
    assert buckets["wasted"] == pytest.approx(sum(second_time.values()), rel=0.10)
