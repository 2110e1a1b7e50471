"""Where metrics and events go: the run directory's JSONL files (always), TensorBoard event files
(optional) and a Prometheus exporter."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class JsonlSink:
    """One JSON object per line. Each record is a single write() on an O_APPEND descriptor, so lines
    from several processes never interleave."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, allow_nan=True) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventLog:
    """events.jsonl: `{"time", "step", "rank", "kind", "action", "detail"}` per decision or fault."""

    def __init__(self, path: Path, rank: int) -> None:
        self.sink, self.rank = JsonlSink(path), rank
        self.listeners: list[Callable[[dict], None]] = []  # the alert rules watch the events

    def emit(self, kind: str, step: int, action: str = "", **detail: Any) -> None:
        record = {"time": round(time.time(), 3), "step": step, "rank": self.rank, "kind": kind, "action": action,
                  "detail": detail}
        self.sink.write(record)
        for listener in list(self.listeners):
            listener(record)

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        self.listeners.append(listener)

    def unsubscribe(self, listener: Callable[[dict], None]) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def close(self) -> None:
        self.sink.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file. A line that does not parse is skipped: a writer killed in the middle
    of a line (SIGKILL, a full disk) must not make the run unreadable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def host() -> str:
    from keel.health.quarantine import node_name

    return node_name()


class RunLog:
    """The run directory's outputs for one rank: events, metrics (rank 0 writes them) and messages."""

    def __init__(self, run_dir: Path, rank: int, layout: str = "") -> None:
        from keel.monitor.progress import Progress

        run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(run_dir / "events.jsonl", rank)
        self.metrics = JsonlSink(run_dir / "metrics.jsonl") if rank == 0 else None
        self.say = Progress(run_dir / "logs" / f"rank-{rank}.log", echo=rank == 0, layout=layout)

    def metric(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.close()
        if self.metrics is not None:
            self.metrics.close()
        self.say.close()


class TensorBoardSink:
    """Scalars of every metrics record, for TensorBoard (RUN_DIR/tensorboard)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from keel.errors import ConfigError

            raise ConfigError("monitor.tensorboard = true needs the tensorboard package: pip install "
                              "'keel[tensorboard]', or set monitor.tensorboard=false") from None
        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def prometheus_name(key: str) -> str:
    """metrics.jsonl key → Prometheus name: `throughput/tokens_per_s` → `keel_throughput_tokens_per_second`,
    `time/step_s` → `keel_time_step_seconds`, `throughput/mfu` → `keel_throughput_mfu_ratio`."""
    if key == "train/tokens_seen":
        return "keel_train_tokens_total"
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    name = re.sub(r"_per_s$", "_per_second", name)
    name = re.sub(r"_s$", "_seconds", name)
    if name.endswith("mfu"):
        name += "_ratio"
    return f"keel_{name}"


class PrometheusExporter:
    """An HTTP endpoint (prometheus_client) that serves the latest value of each metric with the labels
    run, node and rank. Values are set from the training loop (a dict update under a lock) and turned
    into metric families only when Prometheus scrapes."""

    def __init__(self, host: str, port: int, labels: dict[str, str]) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.labels = labels
        self._lock = threading.Lock()
        # name → (kind, extra label names, {extra label values: value})
        self._families: dict[str, tuple[str, tuple[str, ...], dict[tuple[str, ...], float]]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_address[1]

    def set(self, name: str, value: float, labels: tuple[tuple[str, str], ...] = (), kind: str = "gauge") -> None:
        with self._lock:
            family = self._families.setdefault(name, (kind, tuple(k for k, _ in labels), {}))
            family[2][tuple(v for _, v in labels)] = float(value)

    def publish(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record: every numeric value under its Prometheus name."""
        for key, value in record.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key.startswith("goodput/") and key.endswith("_s"):
                bucket = key.removeprefix("goodput/").removesuffix("_s")
                self.set("keel_goodput_seconds_total", value, (("bucket", bucket),), "counter")
            elif key == "step":
                self.set("keel_train_step", value)
            else:
                name = prometheus_name(key)
                self.set(name, value, kind="counter" if name.endswith("_total") else "gauge")

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        base_names, base_values = list(self.labels), list(self.labels.values())
        with self._lock:
            families = {name: (kind, names, dict(series)) for name, (kind, names, series) in self._families.items()}
        for name, (kind, names, series) in sorted(families.items()):
            if kind == "counter":
                family: Any = CounterMetricFamily(name.removesuffix("_total"), name, labels=base_names + list(names))
            else:
                family = GaugeMetricFamily(name, name, labels=base_names + list(names))
            for values, value in series.items():
                family.add_metric(base_values + list(values), value)
            yield family

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
