"""RunMonitor: what watches a run from inside each worker, behind a few calls from the training loop.

It owns the metrics registry, the goodput ledger, the sinks (metrics.jsonl, TensorBoard, the
Prometheus exporter), the alert rules and, on each node's local rank 0, the telemetry thread.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.config import MonitorConfig
from keel.core.replica import GROUP_ENV
from keel.errors import ConfigError
from keel.monitor.alerts import Alerts
from keel.monitor.goodput import GoodputLedger
from keel.monitor.metrics import MetricsRegistry
from keel.monitor.sinks import PrometheusExporter, Sink, TensorBoardSink, bind_error, serve_exporter
from keel.monitor.telemetry import Reading, Telemetry
from keel.rundir.events import JsonlSink, RunLog
from keel.rundir.quarantine import node_name

TELEMETRY = "telemetry.jsonl"
DEFAULT_PORT = 9400  # the exporter's when monitor.prometheus_port is unset
PORT_SEARCH = 100  # ports above a taken default one that an exporter tries


@dataclass
class Timer:
    started: float
    seconds: float = 0.0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def replica_group() -> str | None:
    """This process's replica group, None outside replica groups."""
    return os.environ.get(GROUP_ENV)


def run_labels(run_dir: Path, rank: int) -> dict[str, str]:
    """The labels of every series and alert: run, node, rank and, in a replica group, the group. A group's
    directory is RUN_DIR/groups/G: its series carry the run's name, not the group's number."""
    run_dir, group = run_dir.resolve(), replica_group()
    labels = {"run": run_dir.name, "node": node_name(), "rank": str(rank)}
    if group is not None:
        if run_dir.name == group and run_dir.parent.name == "groups":
            labels["run"] = run_dir.parent.parent.name
        labels["replica_group"] = group
    return labels


def exporter_port(mc: MonitorConfig, local: int, local_world: int, group: int) -> int:
    """The port of local rank `local`'s exporter: from monitor.prometheus_port (9400 when unset), replica groups on
    one host take consecutive blocks of ports, group G the G-th (one port per node, or one per local rank with
    per = rank)."""
    per_rank = mc.prometheus_per == "rank"
    block = local_world if per_rank else 1
    return (mc.prometheus_port or DEFAULT_PORT) + group * block + (local if per_rank else 0)


def check_exporter_ports(mc: MonitorConfig, nproc: int) -> None:
    """Before this node's workers start: a port set in monitor.prometheus_port that one of their exporters could
    not serve on is refused (an unset one moves to the next free port instead)."""
    if not mc.prometheus_port:
        return
    group = int(replica_group() or 0)
    for local in range(nproc if mc.prometheus_per == "rank" else 1):
        port = exporter_port(mc, local, nproc, group)
        if (e := bind_error(mc.prometheus_host, port)) is not None:
            raise ConfigError(_port_refused(mc, port, e))


def _port_refused(mc: MonitorConfig, port: int, e: OSError) -> str:
    return (f"monitor.prometheus_port = {mc.prometheus_port}: the exporter cannot serve on {mc.prometheus_host}:{port} "
            f"({e.strerror or e}); set a free port, leave it unset to take {DEFAULT_PORT} or the next free one, or "
            f"set 0 for no exporter")


class RunMonitor:
    def __init__(self, mc: MonitorConfig, run_dir: Path, rank: int, device: Any, log: RunLog, started: float,
                 storage_dir: str) -> None:
        self.log, self.rank0 = log, rank == 0
        self.step = 0
        self._skipped: float = 0  # steps the guards skipped, at the last interval
        self.registry = MetricsRegistry(device)
        self.ledger = GoodputLedger(run_dir, started, write=self.rank0)
        self.labels = run_labels(run_dir, rank)
        self.alerts = Alerts(mc.alerts, log.events, log.say, self.labels)
        # Where metrics records go besides metrics.jsonl and the exporter (TensorBoard, the trackers).
        self.sinks: list[Sink] = [TensorBoardSink(run_dir / "tensorboard")] if self.rank0 and mc.tensorboard else []
        self.ended: str | None = None  # how the run ended, once it has (None: it failed)
        self.exporter: PrometheusExporter | None = None
        if mc.prometheus_port != 0 and (local_rank() == 0 or mc.prometheus_per == "rank"):
            self.exporter = self._start_exporter(mc)
        if self.exporter is not None:
            self.exporter.set("keel_step_stall_threshold_seconds", mc.alerts.stall_s)
        self.telemetry: Telemetry | None = None
        self.telemetry_sink: JsonlSink | None = None
        if mc.telemetry_interval_s > 0 and local_rank() == 0:
            self.telemetry_sink = JsonlSink(run_dir / TELEMETRY)
            self.telemetry = Telemetry(mc.telemetry_interval_s, storage_dir, self._on_telemetry, self.unavailable,
                                       gpus=None)
            self.telemetry.start()

    def _start_exporter(self, mc: MonitorConfig) -> PrometheusExporter | None:
        """The exporter on this process's port, said in one line. An unset monitor.prometheus_port takes the next
        free port when the rule's is taken (a second run on the machine); a port set and taken is bad input."""
        port = exporter_port(mc, local_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                             int(replica_group() or 0))
        try:
            exporter = serve_exporter(mc.prometheus_host, port, self.labels,
                                      search=0 if mc.prometheus_port else PORT_SEARCH)
        except OSError as e:
            if mc.prometheus_port:
                raise ConfigError(_port_refused(mc, port, e)) from None
            above = f" or the {PORT_SEARCH} ports above it" if e.errno == errno.EADDRINUSE else ""
            self.unavailable("prometheus", f"cannot serve on {mc.prometheus_host}:{port}{above} ({e.strerror or e})")
            return None
        host = f"[{mc.prometheus_host}]" if ":" in mc.prometheus_host else mc.prometheus_host
        moved = f" (port {port} is taken)" if exporter.port != port else ""
        self.log.say(f"Prometheus metrics at http://{host}:{exporter.port}/metrics{moved}")
        return exporter

    def unavailable(self, source: str, reason: str, applies: bool = True) -> None:
        """A source of telemetry (or the exporter) that this node cannot provide: said once, never zeros. One that
        does not apply here (no GPU on a CPU machine) stays off the console: events.jsonl and the log have it."""
        self.log.events.emit("telemetry", self.step, "unavailable", source=source, reason=reason, applies=applies)
        if applies:
            self.log.say(f"warning: telemetry: {source} unavailable: {reason}")
        else:
            self.log.say.log(f"telemetry: {source} does not apply here: {reason}")

    def _on_telemetry(self, readings: list[Reading]) -> None:
        """On the telemetry thread, every monitor.telemetry_interval_s."""
        if self.telemetry_sink is not None:
            self.telemetry_sink.write({"time": round(time.time(), 3), "node": self.labels["node"],
                                       "readings": {r.key(): r.value for r in readings}})
        if self.exporter is not None:
            for r in readings:
                self.exporter.set(f"keel_{r.name}", r.value, r.labels, r.kind)
        self.alerts.observe_telemetry(readings, self.step)
        if self.rank0:  # every rank waits for the stuck one: rank 0 speaks for the run
            self.alerts.check_stall(self.step)

    # ------------------------------------------------------------------ from the training loop
    def begin(self, guard_metrics: dict[str, float]) -> None:
        """The loop starts: the first step's stall clock starts now; skips counted before this start
        (restored with the guards) are not this interval's."""
        self._skipped = sum(v for k, v in guard_metrics.items() if k.endswith("_skip_total"))
        self._stall_clock_starts()

    @contextmanager
    def phase(self, bucket: str, metric: str = "", whole_step: bool = True) -> Iterator[Timer]:
        """A part of a step. The time before it is the step's own work (productive); its own time goes
        to the goodput `bucket` and, if named, to the registry's `metric`. In a recomputed step all of
        it is wasted, unless the part is not the step's own (`whole_step = False`: evaluation,
        checkpoint blocking), which runs between two steps: no step is stalled while it runs, and the
        next step's stall clock starts when it ends."""
        self.ledger.spent("productive")
        if not whole_step:
            self.alerts.hold()
            if self.exporter is not None:  # KeelStepStalled ignores a timestamp of 0
                self.exporter.set("keel_last_step_timestamp_seconds", 0.0)
        timer = Timer(time.perf_counter())
        try:
            yield timer
        finally:
            if not whole_step:
                self._stall_clock_starts()
        timer.seconds = time.perf_counter() - timer.started
        if metric:
            self.registry.add(metric, timer.seconds)
        if whole_step:
            self.ledger.spent(bucket)
        else:
            self.ledger.charge(bucket)

    def step_done(self, step: int) -> None:
        """Every step: the heartbeat (what the stalled-step rules watch) and the goodput high-water mark."""
        self.step = step
        self.ledger.step_done(step)
        self._stall_clock_starts()

    def _stall_clock_starts(self) -> None:
        self.alerts.step_done()
        if self.exporter is not None:
            self.exporter.set("keel_last_step_timestamp_seconds", time.time())

    def publish(self, record: dict[str, Any]) -> None:
        """A metrics record to every sink."""
        self.log.metric(record)
        for sink in self.sinks:
            sink.write(record)
        if self.exporter is not None:
            self.exporter.publish(record)

    def interval(self, record: dict[str, Any], steps: int, seconds_since_checkpoint: float,
                 checkpoint_interval_s: float | None) -> None:
        """Every monitor.interval steps, on every rank (the record is global, `steps` were made since the
        last one): goodput, the sinks, the alert rules over metrics."""
        self.ledger.flush(record["step"])
        record.update(self.ledger.metrics())
        record["time"] = round(time.time(), 3)
        skipped = sum(v for k, v in record.items() if k.startswith("guard/") and k.endswith("_skip_total"))
        if self.exporter is not None:
            self.exporter.set("keel_checkpoint_interval_seconds", checkpoint_interval_s or 0.0)
            self.exporter.set("keel_skipped_steps_total", skipped, kind="counter")
            self.exporter.set("keel_rollbacks_total", record.get("guard/rollbacks_total", 0), kind="counter")
            for rule, count in self.alerts.fired.items():
                self.exporter.set("keel_alerts_total", count, (("rule", rule),), "counter")
        self.publish(record)
        if self.rank0:
            self.alerts.observe(record["step"], record, steps, skipped - self._skipped, self.ledger.mark -
                                self.ledger.data["started"], seconds_since_checkpoint, checkpoint_interval_s)
        self._skipped = skipped

    def checkpoint_committed(self) -> None:
        if self.exporter is not None:
            self.exporter.set("keel_checkpoint_last_commit_timestamp_seconds", time.time())

    def close(self, ended: str) -> None:
        """The worker ends normally (finished, paused, stopped): the ledger is closed."""
        self.ledger.close(self.step, ended)
        self.ended = ended

    def stop(self) -> None:
        """On every exit path: threads and the server stop, files close, the sinks end (told how the run ended)."""
        if self.telemetry is not None:
            self.telemetry.stop()
        if self.telemetry_sink is not None:
            self.telemetry_sink.close()
        self.alerts.close()
        for sink in self.sinks:
            sink.close(self.ended)
        if self.exporter is not None:
            self.exporter.close()
