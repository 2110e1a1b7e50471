"""The monitor's parts in one process: Prometheus names and exporter, goodput ledger, alert rules,
the webhook against a real HTTP server and TensorBoard files."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from keel.config import AlertsConfig, MonitorConfig
from keel.monitor.alerts import Alerts, Webhook
from keel.monitor.goodput import BUCKETS, GoodputLedger, account_exit, read_ledger
from keel.monitor.metrics import MetricsRegistry
from keel.monitor.run_monitor import RunMonitor
from keel.monitor.sinks import PrometheusExporter, TensorBoardSink, prometheus_name
from keel.monitor.telemetry import Reading
from keel.rundir.events import EventLog, RunLog, read_jsonl
from tests.conftest import free_port

# ---------------------------------------------------------------- registry (one rank; tests/dist has two)


def test_registry_reduces_each_metric_by_its_type_in_one_pass() -> None:
    registry = MetricsRegistry(torch.device("cpu"))
    for step in range(1, 5):
        registry.add("time/data_s", 0.1 * step)
        registry.add("memory/peak_bytes", torch.tensor(float(step * 100)), reduce="max")
        registry.add("tokens", torch.tensor(8.0), reduce="sum")
    out = registry.reduce()
    assert out == pytest.approx({"time/data_s": 0.25, "memory/peak_bytes": 400.0, "tokens": 32.0})
    assert registry.reduce() == {}, "a reduction starts a new interval"
    with pytest.raises(ValueError, match="median"):
        registry.add("x", 1.0, reduce="median")


# ---------------------------------------------------------------- Prometheus


@pytest.mark.parametrize(("key", "name"), [
    ("train/loss", "keel_train_loss"),
    ("throughput/tokens_per_s", "keel_throughput_tokens_per_second"),
    ("throughput/mfu", "keel_throughput_mfu_ratio"),
    ("time/step_s", "keel_time_step_seconds"),
    ("train/tokens_seen", "keel_train_tokens_total"),
    ("memory/peak_bytes_max_rank", "keel_memory_peak_bytes_max_rank"),
    ("guard/rollbacks_total", "keel_guard_rollbacks_total"),
])
def test_metric_keys_map_to_prometheus_conventions(key: str, name: str) -> None:
    assert prometheus_name(key) == name


def scrape(port: int) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_exporter_serves_the_latest_values_with_run_node_rank_labels() -> None:
    labels = {"run": "r1", "node": "n1", "rank": "0"}
    exporter = PrometheusExporter("127.0.0.1", free_port(), labels)
    try:
        exporter.publish({"step": 7, "train/loss": 3.5, "throughput/tokens_per_s": 1000.0, "goodput/ratio": 0.5,
                          "goodput/productive_s": 12.0, "train/tokens_seen": 512, "throughput/mfu": None,
                          "note": "text is not a metric"})
        exporter.set("keel_gpu_temperature_celsius", 71.0, (("gpu", "0"),))
        exporter.publish({"step": 8, "train/loss": 3.25, "signals/act_rms/layer_0": 1.5,
                          "signals/act_rms/layer_11": 2.5})
        families = scrape(exporter.port)
    finally:
        exporter.close()
    assert families["keel_train_loss"] == [("keel_train_loss", labels, 3.25)], "the latest value"
    assert families["keel_train_step"][0][2] == 8
    assert families["keel_throughput_tokens_per_second"][0][2] == 1000.0
    assert families["keel_goodput_seconds"] == [("keel_goodput_seconds_total", {**labels, "bucket": "productive"},
                                                 12.0)]
    assert families["keel_train_tokens"][0][0] == "keel_train_tokens_total", "a counter"
    assert families["keel_gpu_temperature_celsius"][0][1] == {**labels, "gpu": "0"}
    assert "keel_throughput_mfu_ratio" not in families, "an unknown value is left out, not zero"
    per_layer = sorted(families["keel_signals_act_rms"], key=lambda sample: sample[2])
    assert per_layer == [("keel_signals_act_rms", {**labels, "layer": "0"}, 1.5),
                         ("keel_signals_act_rms", {**labels, "layer": "11"}, 2.5)]


def test_exporter_on_a_taken_port_raises_oserror() -> None:
    first = PrometheusExporter("127.0.0.1", free_port(), {"run": "a", "node": "n", "rank": "0"})
    try:
        with pytest.raises(OSError):
            PrometheusExporter("127.0.0.1", first.port, {"run": "b", "node": "n", "rank": "0"})
    finally:
        first.close()


# ---------------------------------------------------------------- goodput ledger


def test_ledger_charges_are_contiguous_and_persisted(tmp_path: Path) -> None:
    ledger = GoodputLedger(tmp_path, started=1000.0, write=True)
    ledger.charge("startup", 1002.0)
    ledger.charge("checkpoint_restore", 1003.0)
    for step, end in ((1, 1004.0), (2, 1005.5)):
        ledger.begin_step(step)
        ledger.charge("data_wait", end - 0.25)
        ledger.charge("productive", end)
        ledger.step_done(step)
    ledger.flush(2)
    data = read_ledger(tmp_path)
    assert data["buckets"]["productive"] == pytest.approx(0.5) and data["buckets"]["data_wait"] == pytest.approx(2.0)
    assert sum(data["buckets"].values()) == pytest.approx(data["updated"] - data["started"]) == 5.5
    assert data["open"] and data["high_water"] == 2 and data["attempts"] == 1
    assert data["history"][-1]["step"] == 2


def test_each_start_restore_is_kept_by_tier_across_starts(tmp_path: Path) -> None:
    first = GoodputLedger(tmp_path, started=0.0, write=True)
    first.restored(40, "storage", 2.5)
    first.flush(40)
    second = GoodputLedger(tmp_path, started=10.0, write=True)
    second.restored(55, "memory", 0.25)
    second.restored(60, "memory", 0.5)
    second.flush(60)
    data = read_ledger(tmp_path)
    assert data["restore_s_by_tier"] == {"storage": 2.5, "memory": 0.75}
    assert [(r["step"], r["tier"], r["seconds"]) for r in data["restores"]] == [
        (40, "storage", 2.5), (55, "memory", 0.25), (60, "memory", 0.5)]


def make_steps(ledger: GoodputLedger, steps: range, ends_at: Callable[[int], float], flush_every: int = 0) -> None:
    """Steps as the trainer makes them: each ends at `ends_at(step)`, its time wasted when recomputed."""
    for step in steps:
        ledger.begin_step(step)
        ledger.charge("wasted" if ledger.recomputing else "productive", ends_at(step))
        ledger.step_done(step)
        if flush_every and step % flush_every == 0:
            ledger.flush(step)


def test_a_crash_gap_is_down_time_and_recomputed_steps_are_wasted(tmp_path: Path) -> None:
    first = GoodputLedger(tmp_path, started=0.0, write=True)
    make_steps(first, range(1, 6), float)
    first.flush(5)  # then the process dies: the ledger stays open at t=5

    second = GoodputLedger(tmp_path, started=9.0, write=True)
    assert second.buckets["failed_down"] == pytest.approx(4.0)
    second.charge("startup", 10.0)
    make_steps(second, range(4, 8), lambda step: 10.0 + step - 3)  # resumed from the checkpoint of step 3
    assert second.buckets["wasted"] == pytest.approx(2.0) and second.data["recomputed_steps"] == 2
    second.close(7, "finished")
    data = read_ledger(tmp_path)
    assert not data["open"] and data["ended"] == "finished" and data["attempts"] == 2
    assert sum(data["buckets"].values()) == pytest.approx(data["updated"] - data["started"])


def test_a_survivors_share_of_a_missing_group_moves_to_replica_cover_and_keeps_the_total(tmp_path: Path) -> None:
    ledger = GoodputLedger(tmp_path, started=0.0, write=False)
    ledger.charge("replica_quorum", 1.0)
    ledger.charge("productive", 5.0)
    ledger.move(2.0, "productive", "replica_cover")  # half of a 4 s step computed the missing group's share
    ledger.move(99.0, "productive", "replica_cover")  # never more than the bucket holds
    assert ledger.buckets["replica_cover"] == pytest.approx(4.0) and ledger.buckets["productive"] == 0.0
    assert sum(ledger.buckets.values()) == pytest.approx(5.0)


def test_steps_made_after_the_last_flush_count_as_recomputed_after_a_crash(tmp_path: Path) -> None:
    first = GoodputLedger(tmp_path, started=0.0, write=True)
    make_steps(first, range(1, 15), float, flush_every=5)
    # The process dies in step 15: goodput.json last says step 10, the run got to step 14.
    assert read_ledger(tmp_path)["high_water"] == 10
    second = GoodputLedger(tmp_path, started=20.0, write=True)
    make_steps(second, range(11, 17), lambda step: 20.0 + step - 10)  # resumed from the checkpoint of step 10
    assert second.data["recomputed_steps"] == 4 and second.buckets["wasted"] == pytest.approx(4.0)


def test_a_pause_gap_is_idle_and_the_launcher_accounts_the_exit(tmp_path: Path) -> None:
    ledger = GoodputLedger(tmp_path, started=0.0, write=True)
    ledger.charge("productive", 10.0)
    ledger.data["high_water"] = 3
    ledger.close(3, "paused")
    closed_at = read_ledger(tmp_path)["updated"]
    account_exit(tmp_path, now=closed_at + 0.5)
    assert read_ledger(tmp_path)["buckets"]["startup"] == pytest.approx(closed_at - 10.0 + 0.5)
    resumed = GoodputLedger(tmp_path, started=closed_at + 100.0, write=True)
    assert resumed.buckets["paused"] == pytest.approx(99.5)
    assert resumed.buckets["failed_down"] == 0.0
    assert set(resumed.metrics()) >= {"goodput/ratio", "goodput/interval_ratio", *(f"goodput/{b}_s" for b in BUCKETS)}


# ---------------------------------------------------------------- alert rules


class Said(list):
    def __call__(self, message: str) -> None:
        self.append(message)


def alerts_in(tmp_path: Path, **cfg: object) -> tuple[Alerts, EventLog, Said]:
    events, said = EventLog(tmp_path / "events.jsonl", rank=0), Said()
    return Alerts(AlertsConfig(**cfg), events, said, {"run": "t", "node": "n", "rank": "0"}), events, said


def fired(tmp_path: Path) -> list[str]:
    return [e["action"] for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "alert"]


def test_a_spike_and_its_rollback_are_one_alert_and_nonfinite_skips_none(tmp_path: Path) -> None:
    alerts, events, said = alerts_in(tmp_path)
    events.emit("guard", 50, "skip", guard="numerics", reason="non-finite loss or gradients")
    events.emit("guard", 60, "rollback", guard="spike", reason="loss 9.1 > 3 × median")
    events.emit("guard", 60, "rolled_back", guard="spike", to_step=50)
    events.emit("guard", 70, "rolled_back", guard="numerics", to_step=65)
    events.emit("guard", 75, "rolled_back", guard="sdc", to_step=70)  # the SDC guard says sdc_suspect itself
    events.emit("alert", 80, "straggler", severity="warning", message="rank 1 is 2.0× slower")
    assert fired(tmp_path) == ["loss_spike", "rollback", "straggler"]
    assert alerts.fired == {"loss_spike": 1, "rollback": 1, "straggler": 1}
    assert any(line.startswith("ALERT [error] loss_spike at step 60") for line in said)


def test_metric_rules_fire_once_per_incident(tmp_path: Path) -> None:
    alerts, _, _ = alerts_in(tmp_path, cooldown_s=3600, throughput_for_s=60)
    window = dict(steps=10, skipped=0, wall_s=10.0, seconds_since_checkpoint=1.0, checkpoint_interval_s=100.0)
    # One interval every 20 s: a slow stretch of 40 s is noise, one that lasts 60 s is a drop.
    for step, tps in enumerate([1000] * 8 + [600, 600, 1000] + [600] * 5, start=1):
        alerts.observe(step, {"throughput/tokens_per_s": tps}, **window, now=20.0 * step)
    assert [(e["step"], e["action"]) for e in read_jsonl(tmp_path / "events.jsonl")] == [(15, "throughput_drop")]
    alerts.observe(20, {}, **{**window, "skipped": 2})
    alerts.observe(21, {"goodput/ratio": 0.5}, **{**window, "wall_s": 7200.0})
    alerts.observe(22, {"goodput/ratio": 0.5}, **{**window, "wall_s": 60.0})  # too young to judge
    alerts.observe(23, {}, **{**window, "seconds_since_checkpoint": 250.0})
    alerts.observe(24, {"signals/attn_logit_max": 900.0}, **window)  # under alerts.attention_logit
    alerts.observe(25, {"signals/attn_logit_max": 1500.0}, **window)
    assert fired(tmp_path) == ["throughput_drop", "nan_skip_rate", "goodput_low", "checkpoint_overdue",
                               "attention_logit_growth"]


def test_telemetry_rules_and_a_stalled_step(tmp_path: Path) -> None:
    alerts, _, _ = alerts_in(tmp_path, stall_s=5)
    gpu = (("gpu", "0"),)
    ecc = (("gpu", "0"), ("type", "uncorrected"))
    alerts.observe_telemetry([Reading("storage_free_ratio", 0.2), Reading("gpu_temperature_celsius", 60, gpu),
                              Reading("gpu_ecc_errors_total", 3, ecc, "counter")], step=1)
    assert fired(tmp_path) == [], "errors from before the run are not new"
    alerts.observe_telemetry([Reading("storage_free_ratio", 0.01), Reading("gpu_temperature_celsius", 95, gpu),
                              Reading("gpu_ecc_errors_total", 4, ecc, "counter"),
                              Reading("gpu_ecc_errors_total", 9, (("gpu", "0"), ("type", "corrected")), "counter")],
                             step=2)
    assert fired(tmp_path) == ["storage_nearly_full", "gpu_hot", "gpu_ecc"]
    link = (("interface", "eth0"),)
    alerts.observe_telemetry([Reading("network_carrier_changes_total", 2, link, "counter")], step=3)
    alerts.observe_telemetry([Reading("network_carrier_changes_total", 2, link, "counter")], step=4)
    assert fired(tmp_path)[-1] == "gpu_ecc", "carrier changes from before the run, and none since, are no flap"
    alerts.observe_telemetry([Reading("network_carrier_changes_total", 4, link, "counter")], step=5)
    flap = read_jsonl(tmp_path / "events.jsonl")[-1]
    assert (flap["action"], flap["step"]) == ("link_flapped", 5)
    assert flap["detail"]["message"] == ("link flapped on node n: interface eth0, 2 carrier change(s) since the "
                                         "last sample")
    alerts.step_done()
    alerts.check_stall(7, now=alerts.last_step_time + 4)
    alerts.check_stall(7, now=alerts.last_step_time + 6)
    alerts.check_stall(7, now=alerts.last_step_time + 9)
    assert fired(tmp_path)[-1] == "step_stalled" and fired(tmp_path).count("step_stalled") == 1



def test_an_evaluation_or_a_save_between_steps_is_never_a_stalled_step(tmp_path: Path) -> None:
    mc = MonitorConfig(prometheus_port=free_port(), telemetry_interval_s=0, alerts=AlertsConfig(stall_s=5))
    with RunLog(tmp_path, 0) as log:
        monitor = RunMonitor(mc, tmp_path, 0, torch.device("cpu"), log, time.time(), str(tmp_path))
        try:
            monitor.begin({})
            assert monitor.exporter is not None
            for bucket in ("evaluation", "checkpoint_blocking"):
                with monitor.phase(bucket, whole_step=False):
                    monitor.alerts.check_stall(3, now=time.time() + 60)  # far past stall_s, between steps
                    between = scrape(monitor.exporter.port)["keel_last_step_timestamp_seconds"][0][2]
                monitor.alerts.check_stall(3, now=time.time() + 4)  # the next step's clock starts after it
                assert between == 0, "KeelStepStalled ignores a rank between steps"
                assert scrape(monitor.exporter.port)["keel_last_step_timestamp_seconds"][0][2] > 0
            assert fired(tmp_path) == []
            with monitor.phase("guard_checks"):  # a part of the step: its time is the step's
                monitor.alerts.check_stall(3, now=time.time() + 60)
            assert fired(tmp_path) == ["step_stalled"]
        finally:
            monitor.stop()


# ---------------------------------------------------------------- webhook


class Receiver(http.server.BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append({"content_type": self.headers["Content-Type"], **json.loads(body)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A real HTTP server on a free loopback port, answering with `handler`; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver():
    Receiver.received = []
    with serving(Receiver) as base:
        yield f"{base}/hook", Receiver.received


def test_webhook_posts_each_alert_once_as_json(tmp_path: Path, receiver) -> None:
    url, received = receiver
    alerts, events, _ = alerts_in(tmp_path, webhook=url)
    events.emit("guard", 12, "rollback", guard="spike", reason="loss spiked")
    events.emit("guard", 12, "rolled_back", guard="spike", to_step=10)
    alerts.close()  # waits for the queue to drain
    assert len(received) == 1
    (post,) = received
    assert post["content_type"] == "application/json"
    assert (post["alert"], post["severity"], post["step"], post["run"], post["node"]) == \
        ("loss_spike", "error", 12, "t", "n")
    assert "loss spiked" in post["message"]


class ChatService(http.server.BaseHTTPRequestHandler):
    """Answers a POST the way Slack's incoming webhooks (/slack: a `text` string, or `blocks`) and Discord's
    webhooks (/discord: a non-empty `content` of at most 2,000 characters, or `embeds`) do: 400 for a body
    they would not post."""
    posted: list[tuple[str, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/slack":
            ok = isinstance(body.get("text"), str) and body["text"].strip() or bool(body.get("blocks"))
            status, reply = (200, b"ok") if ok else (400, b"no_text")
        else:
            content = body.get("content")
            ok = isinstance(content, str) and content.strip() != "" and len(content) <= 2000 or \
                bool(body.get("embeds"))
            status, reply = (204, b"") if ok else (400, b'{"message": "Cannot send an empty message", "code": 50006}')
        if ok:
            type(self).posted.append((self.path, body))
        self.send_response(status)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def chat_service():
    ChatService.posted = []
    with serving(ChatService) as base:
        yield base, ChatService.posted


@pytest.mark.parametrize("service", ["slack", "discord"])
def test_chat_services_post_each_alert_as_one_line(tmp_path: Path, chat_service, service: str) -> None:
    base, posted = chat_service
    alerts, events, said = alerts_in(tmp_path, webhook=f"{base}/{service}", webhook_retries=0)
    events.emit("guard", 12, "rollback", guard="spike", reason="loss 9.1 > 3 × median")
    events.emit("hang", 30, "detected", reason="rank 1 stuck\nin forward_backward " + "x" * 3000)
    alerts.close()
    assert (alerts.webhook.sent, alerts.webhook.failed) == (2, 0) and not [m for m in said if "webhook" in m]
    (_, spike), (_, hang) = posted
    line = "[error] loss_spike in run t at step 12: guard rollback: loss 9.1 > 3 × median"
    assert spike["text"] == spike["content"] == line
    assert (spike["alert"], spike["severity"], spike["step"], spike["run"]) == ("loss_spike", "error", 12, "t")
    assert len(hang["content"]) == 2000 and "\n" not in hang["content"] and hang["content"].endswith("x…")
    assert hang["content"].startswith("[critical] hang in run t at step 30: hang detected: rank 1 stuck in forward")


@pytest.mark.parametrize("service", ["slack", "discord"])
def test_chat_services_refuse_an_alert_without_its_line(chat_service, service: str) -> None:
    base, posted = chat_service
    said = Said()
    hook = Webhook(f"{base}/{service}", timeout_s=5.0, retries=0, warn=said)
    hook.post({"run": "t", "alert": "loss_spike", "severity": "error", "step": 12, "message": "loss spiked"})
    hook.close()
    assert (hook.sent, hook.failed, posted) == (0, 1, [])
    assert "400" in said[0]


def test_a_refused_webhook_never_blocks_and_is_reported_once() -> None:
    said = Said()
    hook = Webhook(f"http://127.0.0.1:{free_port()}/nobody", timeout_s=1.0, retries=1, warn=said)
    started = time.perf_counter()
    for i in range(300):  # more than the queue holds
        hook.post({"alert": "x", "i": i})
    posting_s = time.perf_counter() - started
    deadline = time.monotonic() + 10
    while hook.failed < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    hook.close(grace_s=0.2)
    assert hook.failed >= 1 and hook.dropped > 0 and hook.sent == 0
    assert len(said) == 1 and "webhook" in said[0]
    assert posting_s < 1.0, "posting only queues (a refused POST then waits 1 s before its retry)"


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    for step in (10, 20):
        sink.write({"step": step, "train/loss": 5.0 - step / 10, "throughput/mfu": None, "flag": True})
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/loss"]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 4.0), (20, 3.0)]


# ---------------------------------------------------------------- one exporter per node or per rank


@pytest.mark.parametrize("per", ["node", "rank"])
def test_exporter_per_node_is_local_rank_0_and_per_rank_is_port_plus_local_rank(tmp_path: Path, monkeypatch,
                                                                                 per: str) -> None:
    from keel.config import load_config
    from keel.monitor.run_monitor import RunMonitor
    from keel.rundir.events import RunLog

    base = free_port()
    cfg = load_config(None, [f"monitor.prometheus_port={base}", f"monitor.prometheus_per={per}",
                             "monitor.telemetry_interval_s=0"])
    monkeypatch.setenv("LOCAL_RANK", "1")
    with RunLog(tmp_path, rank=1) as log:
        monitor = RunMonitor(cfg.monitor, tmp_path, 1, torch.device("cpu"), log, time.time(), str(tmp_path))
        try:
            monitor.begin({})
            monitor.step_done(1)
            if per == "node":
                assert monitor.exporter is None
            else:
                families = scrape(base + 1)
                ((_, labels, value),) = families["keel_last_step_timestamp_seconds"]
                assert labels == {"run": tmp_path.name, "node": labels["node"], "rank": "1"} and value > 0
        finally:
            monitor.stop()


# ---------------------------------------------------------------- what the monitor says on the console


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port another process's server holds (a listening socket, as a second run's exporter)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def monitor_in(tmp_path: Path, mc: MonitorConfig) -> RunMonitor:
    log = RunLog(tmp_path, 0)
    return RunMonitor(mc, tmp_path, 0, torch.device("cpu"), log, time.time(), str(tmp_path))


def test_a_source_that_does_not_apply_stays_off_the_console(tmp_path: Path, capsys) -> None:
    monitor = monitor_in(tmp_path, MonitorConfig(prometheus_port=0, telemetry_interval_s=0))
    try:
        monitor.unavailable("gpu", "no GPU on this node", applies=False)
        monitor.unavailable("storage_latency", "the write probe failed: No space left on device", applies=True)
    finally:
        monitor.stop()
        monitor.log.__exit__()
    assert capsys.readouterr().out.splitlines() == [
        "warning: telemetry: storage_latency unavailable: the write probe failed: No space left on device"]
    events = [(e["detail"]["source"], e["detail"]["applies"]) for e in read_jsonl(tmp_path / "events.jsonl")
              if e["kind"] == "telemetry" and e["action"] == "unavailable"]
    assert events == [("gpu", False), ("storage_latency", True)], "both stay in events.jsonl (keel status)"
    assert "telemetry: gpu does not apply here: no GPU on this node" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_an_unset_port_moves_past_a_taken_one_and_is_said_once(tmp_path: Path, capsys, monkeypatch) -> None:
    import keel.monitor.run_monitor as run_monitor

    with held_port() as taken:
        monkeypatch.setattr(run_monitor, "DEFAULT_PORT", taken)  # what 9400 is to an unset monitor.prometheus_port
        monitor = monitor_in(tmp_path, MonitorConfig(telemetry_interval_s=0))
        try:
            assert monitor.exporter is not None and monitor.exporter.port > taken
            monitor.step_done(1)
            assert "keel_last_step_timestamp_seconds" in scrape(monitor.exporter.port)
            served = monitor.exporter.port
        finally:
            monitor.stop()
            monitor.log.__exit__()
    out = capsys.readouterr().out.splitlines()
    assert out == [f"Prometheus metrics at http://127.0.0.1:{served}/metrics (port {taken} is taken)"]
    assert not any(e["kind"] == "telemetry" for e in read_jsonl(tmp_path / "events.jsonl"))


def test_a_port_set_and_taken_is_refused_in_one_line(tmp_path: Path) -> None:
    from keel.errors import ConfigError
    from keel.monitor.run_monitor import check_exporter_ports

    with held_port() as taken:
        mc = MonitorConfig(prometheus_port=taken, telemetry_interval_s=0)
        with pytest.raises(ConfigError) as before:  # what `keel train` checks before any worker starts
            check_exporter_ports(mc, nproc=2)
        with pytest.raises(ConfigError) as inside:  # a worker that lost the port after that check
            monitor_in(tmp_path, mc)
        check_exporter_ports(MonitorConfig(prometheus_port=None), nproc=2)  # unset: the next free one will do
        check_exporter_ports(MonitorConfig(prometheus_port=0), nproc=2)  # no exporter
    for e in (before, inside):
        message = str(e.value)
        assert len(message.splitlines()) == 1 and f"127.0.0.1:{taken}" in message and "in use" in message
        assert f"monitor.prometheus_port = {taken}" in message and "leave it unset" in message


def test_per_rank_ports_are_checked_for_every_local_rank(tmp_path: Path) -> None:
    from keel.errors import ConfigError
    from keel.monitor.run_monitor import check_exporter_ports
    from keel.monitor.sinks import bind_error

    with held_port() as taken:
        if bind_error("127.0.0.1", taken - 1) is not None:
            pytest.skip(f"port {taken - 1}, below the held one, is taken too")
        check_exporter_ports(MonitorConfig(prometheus_port=taken - 1, prometheus_per="node"), nproc=2)
        with pytest.raises(ConfigError, match=f":{taken} "):  # local rank 1 of 2 serves base + 1
            check_exporter_ports(MonitorConfig(prometheus_port=taken - 1, prometheus_per="rank"), nproc=2)
