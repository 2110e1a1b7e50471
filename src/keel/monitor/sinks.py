"""Where metrics go besides metrics.jsonl (keel.rundir.events): TensorBoard event files (optional) and a
Prometheus exporter; experiment trackers are sinks too (keel.monitor.trackers)."""

from __future__ import annotations

import errno
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server


class Sink(Protocol):
    """A destination of every metrics record of rank 0."""

    def write(self, record: dict[str, Any]) -> None: ...
    def close(self, ended: str | None) -> None: ...  # ended: finished, paused, stopped; None: the run failed


class TensorBoardSink:
    """Scalars of every metrics record, for TensorBoard (RUN_DIR/tensorboard)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from keel.errors import ConfigError

            raise ConfigError("monitor.tensorboard = true needs the tensorboard package: pip install "
                              "'keel-pretrain[tensorboard]', or set monitor.tensorboard=false") from None
        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self, ended: str | None = None) -> None:
        self.writer.close()


_PER_LAYER = re.compile(r"(.+)/layer_(\d+)")
# Per-layer lists of metrics.jsonl, and the label that numbers their elements: `moe/load/layer_3 = [shares]` →
# keel_moe_load{layer="3", expert="0"}, ... (keel.train.experts)
INDEXED = {"moe/load": "expert"}


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
        from prometheus_client import CollectorRegistry

        self.labels = labels
        self._lock = threading.Lock()
        # name → (kind, extra label names, {extra label values: value})
        self._families: dict[str, tuple[str, tuple[str, ...], dict[tuple[str, ...], float]]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.server = _metrics_server(host, port, self.registry)
        self.port = self.server.server_address[1]

    def set(self, name: str, value: float, labels: tuple[tuple[str, str], ...] = (), kind: str = "gauge") -> None:
        with self._lock:
            family = self._families.setdefault(name, (kind, tuple(k for k, _ in labels), {}))
            family[2][tuple(v for _, v in labels)] = float(value)

    def publish(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record: every numeric value under its Prometheus name."""
        for key, value in record.items():
            if isinstance(value, list):
                self._publish_list(key, value)
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key.startswith("goodput/") and key.endswith("_s"):
                bucket = key.removeprefix("goodput/").removesuffix("_s")
                self.set("keel_goodput_seconds_total", value, (("bucket", bucket),), "counter")
            elif key == "step":
                self.set("keel_train_step", value)
            elif layered := _PER_LAYER.fullmatch(key):  # signals/act_rms/layer_3 → keel_signals_act_rms{layer="3"}
                self.set(prometheus_name(layered.group(1)), value, (("layer", layered.group(2)),))
            else:
                name = prometheus_name(key)
                self.set(name, value, kind="counter" if name.endswith("_total") else "gauge")

    def _publish_list(self, key: str, values: list) -> None:
        layered = _PER_LAYER.fullmatch(key)
        label = INDEXED.get(layered.group(1)) if layered else None
        if layered is None or label is None:
            return
        for i, value in enumerate(values):
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.set(prometheus_name(layered.group(1)), value, (("layer", layered.group(2)), (label, str(i))))

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


SERVE_POLL_S = 0.02  # how long closing an exporter waits for its server's loop to notice


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  # a scrape is no news
        pass


def _metrics_server(host: str, port: int, registry: Any) -> WSGIServer:
    """prometheus_client's WSGI server on host:port, served from a daemon thread whose loop looks for a shutdown
    every SERVE_POLL_S (its own start_http_server's loop looks every half second: a worker that leaves its
    process group in place, keel.core.generations, would wait that long to serve again)."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # an IPv6 host binds as IPv6
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
    server: WSGIServer = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SERVE_POLL_S}, daemon=True,
                     name="keel-metrics-server").start()
    return server


def serve_exporter(host: str, port: int, labels: dict[str, str], search: int = 0) -> PrometheusExporter:
    """The exporter on `port`, or on the first free one of the `search` ports above it while it is taken.
    Raises OSError: the port's own error, or the last port's when all are taken."""
    last = min(port + search, 65535)
    for candidate in range(port, last):
        try:
            return PrometheusExporter(host, candidate, labels)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    return PrometheusExporter(host, last, labels)


def bind_error(host: str, port: int) -> OSError | None:
    """Why an exporter could not serve on host:port now (None: it could), tried the way its server binds."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:  # socket.gaierror included: a host that does not resolve
        return e
    return None
