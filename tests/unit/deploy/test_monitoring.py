"""The Prometheus config, alert rules and Grafana dashboard under deploy/ are valid, tested with promtool, and
query only the metrics keel's exporter serves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

PROMETHEUS = REPO / "deploy/prometheus"
RULES = PROMETHEUS / "keel-rules.yml"
RULE_TESTS = PROMETHEUS / "keel-rules.test.yml"
DASHBOARD = REPO / "deploy/grafana/keel-dashboard.json"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")

# Every name keel's exporter serves: the metrics.jsonl keys, the run's state, and the telemetry readings.
EXPORTED = {
    "keel_train_loss", "keel_val_loss", "keel_optim_lr", "keel_optim_grad_norm", "keel_throughput_tokens_per_second",
    "keel_throughput_mfu_ratio", "keel_time_step_seconds", "keel_time_data_seconds",
    "keel_time_forward_backward_seconds", "keel_time_optimizer_seconds", "keel_time_guard_seconds",
    "keel_time_checkpoint_seconds", "keel_time_comm_seconds", "keel_memory_peak_bytes_max_rank", "keel_goodput_ratio",
    "keel_goodput_interval_ratio", "keel_train_step", "keel_train_tokens_total", "keel_goodput_seconds_total",
    "keel_last_step_timestamp_seconds", "keel_step_stall_threshold_seconds", "keel_alerts_total",
    "keel_checkpoint_last_commit_timestamp_seconds", "keel_checkpoint_interval_seconds", "keel_skipped_steps_total",
    "keel_rollbacks_total",
    # Telemetry.
    "keel_host_cpu_utilization_ratio", "keel_host_memory_used_bytes", "keel_host_memory_total_bytes",
    "keel_gpu_utilization_ratio", "keel_gpu_memory_used_bytes", "keel_gpu_memory_total_bytes",
    "keel_gpu_temperature_celsius", "keel_gpu_power_watts", "keel_gpu_sm_clock_hertz", "keel_gpu_throttle_reasons",
    "keel_gpu_ecc_errors_total", "keel_gpu_xid_errors_total", "keel_network_errors_total", "keel_network_drops_total",
    "keel_network_carrier_changes_total", "keel_network_link_up",
    "keel_storage_free_bytes", "keel_storage_total_bytes", "keel_storage_free_ratio",
    "keel_storage_write_latency_seconds",
}
METRIC_NAME = re.compile(r"keel_[a-z_]+")


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_scrape_config_scrapes_the_exporter_and_loads_the_rules() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["global"] == {"scrape_interval": "15s", "evaluation_interval": "15s"}
    assert config["rule_files"] == [RULES.name]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "keel" and job["honor_labels"] is True and job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["localhost:9400"]}]


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules() -> None:
    checked = promtool("check", "config", "deploy/prometheus/prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(alert_rules())} rules found" in checked.stdout  # the rule file was found and parsed with it
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@needs_promtool
def test_alert_rules_pass_their_unit_tests() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=PROMETHEUS)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_is_tested_firing_and_silent() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) == 15
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and "$labels" in annotations["summary"] + annotations["description"]
    suite = yaml.safe_load(RULE_TESTS.read_text())
    assert suite["rule_files"] == [RULES.name]
    cases = [case for test in suite["tests"] for case in test["alert_rule_test"]]
    assert {case["alertname"] for case in cases} <= set(names)
    fires = {case["alertname"] for case in cases if case.get("exp_alerts")}
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert sorted(set(names) - fires) == []
    assert sorted(set(names) - silent) == []


def test_dashboard_imports_with_variables_rows_and_a_query_per_panel() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("run", "node"):
        assert "label_values(" in variables[name]["definition"] and f", {name})" in variables[name]["definition"]
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Training", "Throughput", "Goodput", "Health", "Hardware"]
    panels = dashboard_panels()
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_rules_and_dashboard_use_only_exported_metric_names() -> None:
    used = set()
    for path in (RULES, DASHBOARD):
        names = set(METRIC_NAME.findall(path.read_text()))
        assert names - EXPORTED == set(), path.name
        used |= names
    for panel_metric in ("keel_train_loss", "keel_goodput_seconds_total", "keel_gpu_xid_errors_total",
                         "keel_storage_write_latency_seconds", "keel_network_drops_total"):
        assert panel_metric in used


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses expressions through a rule file: each query becomes a recording rule, with Grafana's
    # variables replaced by what Grafana would send.
    grafana = {"$__rate_interval": "1m", "$run": ".*", "$node": ".*"}
    records = []
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in grafana.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, target["expr"]
            records.append({"record": f"keel:dashboard:{len(records)}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(records)} rules found" in checked.stdout
