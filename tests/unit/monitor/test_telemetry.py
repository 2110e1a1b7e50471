"""Node telemetry measured for real on this machine: psutil, the local disk, and NVML where it exists."""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from keel.monitor.telemetry import Reading, Telemetry, _link_state
from keel.rundir.events import JsonlSink

HAS_NVIDIA_DEVICES = Path("/dev/nvidiactl").exists()
HAS_PYNVML = importlib.util.find_spec("pynvml") is not None


class Recorder:
    """What the telemetry hands out: samples and unavailable reports, in order."""

    def __init__(self) -> None:
        self.samples: list[list[Reading]] = []
        self.reports: list[tuple[str, str, bool]] = []

    def unavailable(self, source: str, reason: str, applies: bool) -> None:
        self.reports.append((source, reason, applies))

    def reasons(self, name: str) -> list[str]:
        return [reason for source, reason, _ in self.reports if source == name]

    def applies(self, name: str) -> list[bool]:
        return [applies for source, _, applies in self.reports if source == name]


def telemetry(storage_dir: Path | str | None, interval_s: float = 60.0,
              on_sample: Callable[[list[Reading]], None] | None = None) -> tuple[Telemetry, Recorder]:
    rec = Recorder()
    return Telemetry(interval_s, storage_dir, on_sample or rec.samples.append, rec.unavailable), rec


def by_key(readings: list[Reading]) -> dict[str, float]:
    keys = [r.key() for r in readings]
    assert len(keys) == len(set(keys)), "a sample names a reading twice"
    return {r.key(): r.value for r in readings}


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def probe_files(directory: Path) -> list[Path]:
    return list(directory.rglob(".keel-telemetry-*"))


def test_reading_key_renders_labels_in_order() -> None:
    assert Reading("storage_free_bytes", 1.0).key() == "storage_free_bytes"
    ecc = Reading("gpu_ecc_errors_total", 2.0, (("gpu", "0"), ("type", "corrected")), "counter")
    assert ecc.key() == "gpu_ecc_errors_total{gpu=0,type=corrected}"


def test_host_cpu_and_memory(tmp_path: Path) -> None:
    t, _ = telemetry(tmp_path)
    first = by_key(t.sample())
    # No interval has passed yet: the CPU share is not measured, so it is absent rather than 0.
    assert "host_cpu_utilization_ratio" not in first
    busy_until = time.perf_counter() + 0.2
    while time.perf_counter() < busy_until:
        pass
    second = by_key(t.sample())
    assert 0 < second["host_cpu_utilization_ratio"] <= 1  # one busy core for 0.2 s
    assert 0 < second["host_memory_used_bytes"] <= second["host_memory_total_bytes"]
    assert second["host_memory_total_bytes"] == psutil.virtual_memory().total


def test_storage_free_space_and_write_latency_leave_no_file(tmp_path: Path) -> None:
    t, rec = telemetry(tmp_path)
    for _ in range(3):
        readings = by_key(t.sample())
        assert 0 <= readings["storage_free_bytes"] <= readings["storage_total_bytes"]
        assert readings["storage_total_bytes"] == shutil.disk_usage(tmp_path).total
        assert readings["storage_free_ratio"] == pytest.approx(
            readings["storage_free_bytes"] / readings["storage_total_bytes"])
        assert 0 < readings["storage_write_latency_seconds"] < 10
    assert list(tmp_path.iterdir()) == []
    assert rec.reasons("storage") == [] and rec.reasons("storage_latency") == []


def test_storage_dir_not_created_yet_is_measured_on_its_parent_volume(tmp_path: Path) -> None:
    target = tmp_path / "checkpoints" / "run"
    t, rec = telemetry(target)
    readings = by_key(t.sample())
    assert readings["storage_total_bytes"] == shutil.disk_usage(tmp_path).total
    assert "storage_write_latency_seconds" not in readings
    assert not (tmp_path / "checkpoints").exists()  # telemetry never creates the checkpoint directory
    assert rec.reasons("storage") == []
    target.mkdir(parents=True)
    assert "storage_write_latency_seconds" in by_key(t.sample())  # measured as soon as it exists
    assert probe_files(tmp_path) == []


def test_storage_dir_removed_between_samples(tmp_path: Path) -> None:
    target = tmp_path / "checkpoints"
    target.mkdir()
    t, rec = telemetry(target)
    assert "storage_write_latency_seconds" in by_key(t.sample())
    shutil.rmtree(target)
    readings = by_key(t.sample())
    assert "storage_free_bytes" in readings and "storage_write_latency_seconds" not in readings
    assert not target.exists() and rec.reasons("storage") == []


@pytest.mark.parametrize("location", ["s3://bucket/checkpoints", Path("s3://bucket/checkpoints"), None])
def test_storage_off_the_local_disk_is_unavailable(location: Path | str | None) -> None:
    t, rec = telemetry(location)
    for _ in range(3):
        assert not any(r.name.startswith("storage_") for r in t.sample())
    assert rec.reasons("storage") == ["checkpoints are not on a local volume"]
    assert rec.applies("storage") == [False], "nothing local to measure: not a failure"


@pytest.mark.skipif(HAS_NVIDIA_DEVICES, reason="this node has NVIDIA GPUs")
def test_gpu_unavailable_is_reported_once_and_measures_nothing(tmp_path: Path) -> None:
    t, rec = telemetry(tmp_path)
    for _ in range(3):
        assert not any(r.name.startswith("gpu_") for r in t.sample())
    [reason] = rec.reasons("gpu")
    assert rec.applies("gpu") == [False], "a node without NVIDIA GPUs has nothing for NVML to measure"
    if HAS_PYNVML:
        assert reason.startswith("NVML could not start")
    else:
        assert reason == "nvidia-ml-py is not installed (pip install 'keel-pretrain[gpu]')"
    assert rec.reasons("xid") == []
    t.stop()


@pytest.mark.skipif(not (HAS_NVIDIA_DEVICES and HAS_PYNVML), reason="needs NVIDIA GPUs and nvidia-ml-py")
def test_gpu_readings_on_a_gpu_node(tmp_path: Path) -> None:
    t, rec = telemetry(tmp_path)
    try:
        readings = by_key(t.sample() + t.sample())
    finally:
        t.stop()
    assert rec.reasons("gpu") == []
    assert 0 <= readings["gpu_utilization_ratio{gpu=0}"] <= 1
    assert 0 < readings["gpu_memory_used_bytes{gpu=0}"] <= readings["gpu_memory_total_bytes{gpu=0}"]
    assert 0 < readings["gpu_temperature_celsius{gpu=0}"] < 120
    assert 0 < readings["gpu_power_watts{gpu=0}"] < 2000
    assert 1e8 < readings["gpu_sm_clock_hertz{gpu=0}"] < 5e9
    assert "gpu_throttle_reasons{gpu=0}" in readings
    # Each is either measured or reported unavailable, never both, never neither.
    assert ("gpu_xid_errors_total{gpu=0}" in readings) != bool(rec.reasons("xid"))
    assert ("gpu_ecc_errors_total{gpu=0,type=uncorrected}" in readings) != bool(rec.reasons("gpu_ecc"))


def test_network_counters_or_unavailable(tmp_path: Path) -> None:
    loopback = {"lo"} | {nic for nic, s in psutil.net_if_stats().items() if "loopback" in s.flags.split(",")}
    nics = [nic for nic in psutil.net_io_counters(pernic=True) if nic not in loopback]
    t, rec = telemetry(tmp_path)
    network = [r for r in t.sample() if r.name.startswith("network_")]
    if not nics:
        assert network == [] and rec.applies("network") == [False]
        return
    assert rec.reasons("network") == []
    expected = {f"{name}{{interface={nic},direction={d}}}" for nic in nics
                for name in ("network_errors_total", "network_drops_total") for d in ("rx", "tx")}
    assert {r.key() for r in network if r.name in ("network_errors_total", "network_drops_total")} == expected
    sysfs = Path("/sys/class/net")
    links = {f"network_carrier_changes_total{{interface={nic}}}" for nic in nics
             if (sysfs / nic / "carrier_changes").exists()}
    assert {r.key() for r in network if r.name == "network_carrier_changes_total"} == links
    assert all(r.value >= 0 and (r.kind == "counter") == r.name.endswith("_total") for r in network)


def test_a_links_carrier_changes_and_state_are_read_as_the_kernel_states_them(tmp_path: Path) -> None:
    for nic, changes, state in (("eth0", "7\n", "down\n"), ("tun0", "0\n", "unknown\n")):
        (tmp_path / nic).mkdir()
        (tmp_path / nic / "carrier_changes").write_text(changes)
        (tmp_path / nic / "operstate").write_text(state)
    assert {r.key(): (r.value, r.kind) for r in _link_state("eth0", tmp_path)} == {
        "network_carrier_changes_total{interface=eth0}": (7.0, "counter"),
        "network_link_up{interface=eth0}": (0.0, "gauge")}
    # A link that does not report its state has no up or down to tell.
    assert [r.name for r in _link_state("tun0", tmp_path)] == ["network_carrier_changes_total"]
    assert _link_state("gone", tmp_path) == []


def test_thread_samples_repeatedly_and_stops_promptly(tmp_path: Path) -> None:
    t, rec = telemetry(tmp_path, interval_s=0.02)
    t.start()
    wait_for(lambda: len(rec.samples) >= 4)
    started = time.monotonic()
    t.stop()
    assert time.monotonic() - started < 1
    delivered = len(rec.samples)
    time.sleep(0.1)
    assert len(rec.samples) == delivered  # the thread is gone
    assert all("host_memory_used_bytes" in by_key(s) for s in rec.samples)
    assert probe_files(tmp_path) == []


def test_stop_interrupts_a_long_interval(tmp_path: Path) -> None:
    t, rec = telemetry(tmp_path, interval_s=60)
    t.start()
    wait_for(lambda: len(rec.samples) == 1)  # the first sample comes right away
    started = time.monotonic()
    t.stop()
    assert time.monotonic() - started < 1
    assert len(rec.samples) == 1


def test_a_failing_source_neither_stops_the_thread_nor_the_others(tmp_path: Path) -> None:
    # A component longer than NAME_MAX: stat() fails with ENAMETOOLONG on every sample.
    t, rec = telemetry(tmp_path / ("x" * 300), interval_s=0.02)
    t.start()
    wait_for(lambda: len(rec.samples) >= 4)
    t.stop()
    [reason] = rec.reasons("storage")
    assert reason.startswith("OSError") and "too long" in reason
    assert rec.applies("storage") == [True], "a source that should measure and fails is a failure"
    for sample in rec.samples:
        keys = by_key(sample)
        assert "host_memory_used_bytes" in keys
        assert not any(k.startswith("storage_") for k in keys)


def test_a_failing_sink_does_not_stop_the_thread(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "telemetry.jsonl")
    sink.close()  # every write now fails with EBADF
    calls: list[int] = []

    def deliver(readings: list[Reading]) -> None:
        calls.append(len(readings))
        sink.write({"readings": by_key(readings)})

    t, rec = telemetry(tmp_path, interval_s=0.02, on_sample=deliver)
    t.start()
    wait_for(lambda: len(calls) >= 4)
    t.stop()
    [reason] = rec.reasons("telemetry")
    assert "delivering a sample failed" in reason and "OSError" in reason


@pytest.mark.skipif(HAS_NVIDIA_DEVICES and HAS_PYNVML, reason="NVML reads this node's GPUs")
def test_gpus_that_nvml_cannot_read_are_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import keel.monitor.telemetry as telemetry_module

    monkeypatch.setattr(telemetry_module, "nvidia_present", lambda: True)  # a GPU node: NVML should measure
    t, rec = telemetry(tmp_path)
    assert not any(r.name.startswith("gpu_") for r in t.sample())
    assert rec.applies("gpu") == [True]
    t.stop()
