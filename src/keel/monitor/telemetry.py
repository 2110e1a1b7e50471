"""Per-node hardware, network and storage telemetry, sampled by one low-overhead daemon thread per node.

Each source (host, gpu, network, storage) measures what this node can measure. A source that cannot is
reported once through `on_unavailable(source, reason, applies)` and its readings are simply absent: a reading
of zero always means zero was measured. `applies` tells a source that has nothing to measure on this node (no
GPU, no interface besides loopback, checkpoints off the local disk, a query the GPU does not support) from one
that should measure and fails. A sample only reads counters and makes one small fsync'd write, so
it costs milliseconds: no subprocesses, no sleeping.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from keel.core.net import LINK_STATES
from keel.paths import nearest_existing

PROBE_BYTES = 4096
MAX_XID_EVENTS_PER_SAMPLE = 256  # drains a burst without letting a storm of events stall the sample


@dataclass(frozen=True)
class Reading:
    name: str  # Prometheus-style without the keel_ prefix, e.g. "gpu_temperature_celsius"
    value: float
    labels: tuple[tuple[str, str], ...] = ()  # e.g. (("gpu", "0"),)
    kind: str = "gauge"  # "counter" for monotonic totals (ECC errors, network errors/drops, XID errors)

    def key(self) -> str:
        """`gpu_temperature_celsius{gpu=0}`; just the name when there are no labels."""
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f"{k}={v}" for k, v in self.labels) + "}"


class Unavailable(Exception):
    """This node cannot measure the source at all: it is reported once and not tried again. `applies` is
    False when there is nothing here for it to measure."""

    def __init__(self, reason: str, applies: bool = True) -> None:
        super().__init__(reason)
        self.applies = applies


Report = Callable[[str, str, bool], None]  # source, reason, whether the source applies to this node


def nvidia_present() -> bool:
    """Whether this node has NVIDIA GPUs for NVML to measure: the driver's control device or its /proc entry."""
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()


class Source:
    name = ""

    def open(self) -> None:
        """Called once, from the sampling thread, before the first read. Raises Unavailable."""

    def read(self) -> list[Reading]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what open() took; open() may be called again afterwards."""


class HostSource(Source):
    name = "host"

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def read(self) -> list[Reading]:
        vm = psutil.virtual_memory()
        # total - available: memory the kernel cannot hand out without swapping, the figure an OOM follows.
        readings = [Reading("host_memory_used_bytes", float(vm.total - vm.available)),
                    Reading("host_memory_total_bytes", float(vm.total))]
        ratio = self._cpu_ratio()
        if ratio is not None:
            readings.insert(0, Reading("host_cpu_utilization_ratio", ratio))
        return readings

    def _cpu_ratio(self) -> float | None:
        """Busy share of all CPUs since the previous sample, from our own last cpu_times(): psutil's
        cpu_percent(interval=None) keeps its baseline per calling thread and returns 0.0 when no tick has
        passed, which would be a zero that was never measured. None on the first sample."""
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # guest is inside user
        last, self._last = self._last, (idle, total)
        if last is None or total - last[1] <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - (idle - last[0]) / (total - last[1])))

    def close(self) -> None:
        self._last = None


class NetworkSource(Source):
    """Interface error and drop counters, and each link's state: a flapping link or a full ring buffer shows here
    before NCCL times out. A link's carrier changes (a cable pulled or put back, a port reset) are counted by the
    kernel since the interface appeared (/sys/class/net/NIC/carrier_changes), so a flap between two samples is
    seen at the next one."""

    name = "network"

    def __init__(self) -> None:
        self._loopback: set[str] = {"lo"}

    def open(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # flags are missing on some platforms: "lo" will do
            self._loopback |= {nic for nic, s in psutil.net_if_stats().items() if "loopback" in s.flags.split(",")}
        if not self._interfaces():
            raise Unavailable("no network interface besides loopback", applies=False)

    def _interfaces(self) -> dict[str, Any]:
        return {nic: c for nic, c in psutil.net_io_counters(pernic=True).items() if nic not in self._loopback}

    def read(self) -> list[Reading]:
        readings = []
        for nic, c in sorted(self._interfaces().items()):
            for name, rx, tx in (("network_errors_total", c.errin, c.errout),
                                 ("network_drops_total", c.dropin, c.dropout)):
                readings.append(Reading(name, float(rx), (("interface", nic), ("direction", "rx")), "counter"))
                readings.append(Reading(name, float(tx), (("interface", nic), ("direction", "tx")), "counter"))
            readings += _link_state(nic)
        return readings


def _link_state(nic: str, root: Path = Path("/sys/class/net")) -> list[Reading]:
    """The interface's carrier changes (a counter) and whether its link is up; nothing the kernel does not say
    (an interface without carrier reporting is `unknown`)."""
    readings, labels = [], (("interface", nic),)
    with contextlib.suppress(OSError, ValueError):
        changes = float((root / nic / "carrier_changes").read_text())
        readings.append(Reading("network_carrier_changes_total", changes, labels, "counter"))
    with contextlib.suppress(OSError):
        state = (root / nic / "operstate").read_text().strip()
        if state in LINK_STATES:
            readings.append(Reading("network_link_up", LINK_STATES[state], labels))
    return readings


def is_url(location: str) -> bool:
    # pathlib folds "s3://b" into "s3:/b": a scheme of two or more letters followed by ":/" is a URL too.
    return "://" in location or re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/", location) is not None


class StorageSource(Source):
    """Free space and write latency of the checkpoint volume: a filling disk or a slow mount fails the
    next checkpoint, so it is worth seeing before it does."""

    name = "storage"

    def __init__(self, storage_dir: Path | str | None, report: Report) -> None:
        self._location = None if storage_dir is None else os.fspath(storage_dir)
        self._report = report
        self._block = os.urandom(PROBE_BYTES)

    def open(self) -> None:
        if self._location is None or is_url(self._location):
            raise Unavailable("checkpoints are not on a local volume", applies=False)

    def read(self) -> list[Reading]:
        directory = Path(self._location or ".")
        volume = nearest_existing(directory)
        usage = shutil.disk_usage(volume)
        readings = [Reading("storage_free_bytes", float(usage.free)),
                    Reading("storage_total_bytes", float(usage.total))]
        if usage.total > 0:
            readings.append(Reading("storage_free_ratio", usage.free / usage.total))
        if volume == directory and directory.is_dir() and os.access(directory, os.W_OK):
            try:
                readings.append(Reading("storage_write_latency_seconds", self._probe(directory)))
            except OSError as e:  # e.g. a full disk: free space above still tells why
                self._report("storage_latency", f"the write probe in {directory} failed: {e}", True)
        return readings

    def _probe(self, directory: Path) -> float:
        # pid and host in the name: ranks of several nodes may share the volume and have equal pids.
        path = directory / f".keel-telemetry-{os.getpid()}-{socket.gethostname()}"
        started = time.perf_counter()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, self._block)
                os.fsync(fd)
            finally:
                os.close(fd)
            return time.perf_counter() - started
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class GpuSource(Source):
    """NVML counters of this node's GPUs, and XID errors (the driver's fault reports) as a running count."""

    name = "gpu"

    def __init__(self, gpus: list[int] | None, report: Report) -> None:
        self._gpus, self._report = gpus, report
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self._xid: dict[int, int] = {}  # GPU index → XID errors seen since open(), for registered GPUs
        self._unsupported: set[str] = set()
        self._new_reasons = True

    def open(self) -> None:
        present = nvidia_present()  # without NVIDIA GPUs, neither a missing library nor NVML's failure matters
        try:
            import pynvml
        except ImportError:
            raise Unavailable("nvidia-ml-py is not installed (pip install 'keel-pretrain[gpu]')", present) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise Unavailable(f"NVML could not start: {e}", present) from None
        self._nvml = pynvml  # from here on close() shuts NVML down
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise Unavailable(f"NVML could not count the GPUs: {e}") from None
        indices = list(range(count)) if self._gpus is None else self._gpus
        if not indices:
            raise Unavailable("no GPU on this node", applies=False)
        missing = [i for i in indices if not 0 <= i < count]
        if missing:
            raise Unavailable(f"GPU {missing[0]} does not exist: NVML sees {count}")
        self._handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self._watch_xid()

    def _watch_xid(self) -> None:
        nvml = self._nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            self._report("xid", f"NVML event sets are not available: {e}", True)
            return
        refused = []
        for i, handle in self._handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
                self._xid[i] = 0
            except nvml.NVMLError as e:
                refused.append(f"GPU {i}: {e}")
        if refused:
            self._report("xid", "XID events cannot be watched on " + "; ".join(refused), True)

    def read(self) -> list[Reading]:
        nvml = self._nvml
        self._drain_xid()
        readings = []
        for i, h in self._handles.items():
            gpu = (("gpu", str(i)),)
            util = self._get("gpu_utilization", nvml.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                readings.append(Reading("gpu_utilization_ratio", util.gpu / 100, gpu))
            memory = self._get("gpu_memory", nvml.nvmlDeviceGetMemoryInfo, h)
            if memory is not None:
                readings += [Reading("gpu_memory_used_bytes", float(memory.used), gpu),
                             Reading("gpu_memory_total_bytes", float(memory.total), gpu)]
            for name, what, fn, args, scale in (
                    ("gpu_temperature_celsius", "gpu_temperature", nvml.nvmlDeviceGetTemperature,
                     (nvml.NVML_TEMPERATURE_GPU,), 1.0),
                    ("gpu_power_watts", "gpu_power", nvml.nvmlDeviceGetPowerUsage, (), 1e-3),
                    ("gpu_sm_clock_hertz", "gpu_sm_clock", nvml.nvmlDeviceGetClockInfo, (nvml.NVML_CLOCK_SM,), 1e6),
                    ("gpu_throttle_reasons", "gpu_throttle", self._throttle_reasons, (), 1.0)):
                value = self._get(what, fn, h, *args)
                if value is not None:
                    readings.append(Reading(name, float(value) * scale, gpu))
            for kind, error_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                     ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                count = self._get("gpu_ecc", nvml.nvmlDeviceGetTotalEccErrors, h, error_type, nvml.NVML_VOLATILE_ECC)
                if count is not None:
                    readings.append(Reading("gpu_ecc_errors_total", float(count), gpu + (("type", kind),), "counter"))
            if i in self._xid:
                readings.append(Reading("gpu_xid_errors_total", float(self._xid[i]), gpu, "counter"))
        return readings

    def _throttle_reasons(self, handle: Any) -> int:
        # Renamed "clocks event reasons" in driver 535; older drivers only export the throttle name.
        nvml = self._nvml
        if self._new_reasons:
            try:
                return nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
            except (AttributeError, nvml.NVMLError_FunctionNotFound):
                self._new_reasons = False
        return nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    def _get(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML query; a query this GPU does not support is reported once (as not applying) and left out.
        Other NVML errors (a GPU fallen off the bus) propagate: the whole source is reported."""
        if what in self._unsupported:
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError_NotSupported as e:
            self._unsupported.add(what)
            self._report(what, f"not supported by this GPU: {e}", False)
            return None

    def _drain_xid(self) -> None:
        nvml = self._nvml
        if self._events is None:
            return
        for _ in range(MAX_XID_EVENTS_PER_SAMPLE):
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)  # 0 ms: never blocks the sample
            except nvml.NVMLError as e:
                if e.value == nvml.NVML_ERROR_TIMEOUT:  # no event pending
                    return
                raise
            if event.eventType & nvml.nvmlEventTypeXidCriticalError:
                index = nvml.nvmlDeviceGetIndex(event.device)
                if index in self._xid:
                    self._xid[index] += 1

    def close(self) -> None:
        nvml, self._nvml = self._nvml, None
        events, self._events = self._events, None
        self._handles, self._xid = {}, {}
        if nvml is None:
            return
        if events is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(events)
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


class Telemetry:
    """Samples every source each `interval_s` seconds on a daemon thread and hands the readings to
    `on_sample`. One instance per node (the trainer starts it on local rank 0 only)."""

    def __init__(self, interval_s: float, storage_dir: Path | str | None, on_sample: Callable[[list[Reading]], None],
                 on_unavailable: Report, gpus: list[int] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"telemetry interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.on_sample, self.on_unavailable = on_sample, on_unavailable
        self.sources: list[Source] = [HostSource(), GpuSource(gpus, self._report), NetworkSource(),
                                      StorageSource(storage_dir, self._report)]
        self._opened: set[str] = set()
        self._dropped: set[str] = set()
        self._reported: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _report(self, source: str, reason: str, applies: bool = True) -> None:
        if source not in self._reported:
            self._reported.add(source)
            self.on_unavailable(source, reason, applies)

    def sample(self) -> list[Reading]:
        """One pass over all sources. A source that cannot measure on this node is dropped; one that
        fails unexpectedly is reported once, contributes nothing this time and is tried again next time."""
        readings: list[Reading] = []
        for source in self.sources:
            if source.name in self._dropped:
                continue
            if source.name not in self._opened:
                self._opened.add(source.name)
                try:
                    source.open()
                except Exception as e:  # noqa: BLE001 - Unavailable, or a driver error while starting
                    self._dropped.add(source.name)
                    source.close()
                    if isinstance(e, Unavailable):
                        self._report(source.name, str(e), e.applies)
                    else:
                        self._report(source.name, f"{type(e).__name__}: {e}")
                    continue
            try:
                readings += source.read()
            except Exception as e:  # noqa: BLE001 - telemetry must never take the run down
                self._report(source.name, f"{type(e).__name__}: {e}")
        return readings

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="keel-telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic()
        while True:
            try:
                self.on_sample(self.sample())
            except Exception as e:  # noqa: BLE001 - a failing sink must not end telemetry for the run
                self._report("telemetry", f"delivering a sample failed: {type(e).__name__}: {e}")
            deadline = max(deadline + self.interval_s, time.monotonic())  # no burst after a slow sample
            if self._stop.wait(deadline - time.monotonic()):
                return

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                return  # stuck inside a driver call: closing NVML under it would be worse than leaking it
            self._thread = None
        for source in self.sources:
            if source.name in self._opened:
                source.close()
        self._opened.clear()
