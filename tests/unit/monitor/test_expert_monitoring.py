"""A mixture-of-experts model's routing metrics on the Prometheus exporter (its real HTTP endpoint), and the
alert rules over them: routing collapse and expert imbalance, with their options."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.config import load_config
from keel.core.net import free_port
from keel.errors import ConfigError
from keel.monitor.alerts import Alerts
from keel.monitor.sinks import PrometheusExporter
from keel.rundir.events import read_jsonl
from tests.unit.monitor.test_monitor import alerts_in, fired, scrape

LABELS = {"run": "r1", "node": "n1", "rank": "0"}

# ---------------------------------------------------------------- the exporter


def test_each_experts_load_is_a_series_labelled_with_its_layer_and_expert() -> None:
    exporter = PrometheusExporter("127.0.0.1", free_port(), LABELS)
    try:
        exporter.publish({"step": 10, "moe/load/layer_1": [0.5, 0.25, 0.25, 0.0], "moe/imbalance/layer_1": 2.0,
                          "moe/load/layer_12": [0.25, 0.25, 0.25, 0.25], "moe/imbalance_max": 2.0,
                          "moe/entropy/layer_1": 1.2, "moe/dropped_tokens/layer_12": 7.0,
                          "other/layer_1": [1.0, 2.0],  # a list keel does not label: left out
                          "notes": ["text"]})
        exporter.publish({"step": 20, "moe/load/layer_1": [0.25, 0.25, 0.5, 0.0]})  # the latest wins
        families = scrape(exporter.port)
    finally:
        exporter.close()
    loads = {(s[1]["layer"], s[1]["expert"]): s[2] for s in families["keel_moe_load"]}
    assert loads == {("1", "0"): 0.25, ("1", "1"): 0.25, ("1", "2"): 0.5, ("1", "3"): 0.0,
                     **{("12", str(e)): 0.25 for e in range(4)}}
    assert all(s[1].keys() == {*LABELS, "layer", "expert"} for s in families["keel_moe_load"])
    assert families["keel_moe_imbalance"] == [("keel_moe_imbalance", {**LABELS, "layer": "1"}, 2.0)]
    assert families["keel_moe_entropy"][0][1]["layer"] == "1"
    assert families["keel_moe_dropped_tokens"] == [("keel_moe_dropped_tokens", {**LABELS, "layer": "12"}, 7.0)]
    assert families["keel_moe_imbalance_max"][0][2] == 2.0
    assert "keel_other" not in families and "keel_notes" not in families


# ---------------------------------------------------------------- the alert rules


def loads(step: int, **layers: list[float]) -> dict:
    return {"step": step, **{f"moe/load/{layer}": shares for layer, shares in layers.items()}}


def observe(alerts: Alerts, *records: dict) -> None:
    for record in records:
        alerts.observe(record["step"], record, steps=10, skipped=0, wall_s=10.0, seconds_since_checkpoint=1.0,
                       checkpoint_interval_s=None)


def test_an_expert_starved_for_the_set_intervals_in_a_row_is_a_collapse(tmp_path: Path) -> None:
    alerts, _, said = alerts_in(tmp_path, moe_collapse_share=0.1, moe_collapse_intervals=3, cooldown_s=0)
    starved, fair = [0.01, 0.33, 0.33, 0.33], [0.25] * 4  # expert 0 at 4% of its fair share
    observe(alerts, loads(10, layer_1=starved, layer_2=fair), loads(20, layer_1=starved, layer_2=fair),
            loads(30, layer_1=fair, layer_2=fair),  # it recovered: the count starts again
            loads(40, layer_1=starved, layer_2=fair), loads(50, layer_1=starved, layer_2=fair))
    assert fired(tmp_path) == []
    observe(alerts, loads(60, layer_1=starved, layer_2=[0.0, 0.5, 0.25, 0.25]))
    (alert,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "alert"]
    assert (alert["step"], alert["action"], alert["detail"]["severity"]) == (60, "moe_collapse", "error")
    assert alert["detail"]["experts"] == [{"layer": 1, "expert": 0, "of_fair": 0.04}]
    assert said[-1] == ("ALERT [error] moe_collapse at step 60: routing collapse: layer 1 expert 0 at 4% of the fair "
                        "load, under 10% for 3 logged intervals in a row")
    observe(alerts, loads(70, layer_1=starved, layer_2=[0.0, 0.5, 0.25, 0.25]),
            loads(80, layer_1=starved, layer_2=[0.0, 0.5, 0.25, 0.25]))
    assert fired(tmp_path)[-1] == "moe_collapse" and "layer 2 expert 0 at 0%" in said[-1], "layer 2's third interval"


def test_a_collapse_is_one_alert_per_incident_and_names_the_first_experts(tmp_path: Path) -> None:
    alerts, _, said = alerts_in(tmp_path, moe_collapse_intervals=1)
    shares = [0.0] * 8 + [1 / 8] * 8
    observe(alerts, *(loads(step, layer_3=shares) for step in (1, 2, 3)))
    assert fired(tmp_path) == ["moe_collapse"], "quiet for the cooldown"
    assert said[0].endswith("layer 3 expert 5 at 0% and 2 more of the fair load, under 10% for 1 logged intervals "
                            "in a row")


def test_a_layer_whose_busiest_expert_takes_over_the_bound_is_imbalanced(tmp_path: Path) -> None:
    alerts, _, said = alerts_in(tmp_path, moe_imbalance_max=3.0)
    observe(alerts, loads(10, layer_1=[0.375, 0.375, 0.125, 0.125], layer_2=[0.75, 0.25, 0.0, 0.0]))
    assert fired(tmp_path) == [], "3.0× the fair load is at the bound, not over it"
    observe(alerts, loads(20, layer_1=[0.25] * 4, layer_2=[0.0, 0.125, 0.0625, 0.8125]))
    (alert,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "alert"]
    assert (alert["action"], alert["detail"]["severity"]) == ("moe_imbalance", "warning")
    assert alert["detail"]["experts"] == [{"layer": 2, "expert": 3, "of_fair": 3.25}]
    assert said[-1].endswith("expert imbalance: layer 2 expert 3 at 3.25× the fair load, over 3×")


def test_a_dense_run_has_no_expert_rule_to_answer(tmp_path: Path) -> None:
    alerts, _, _ = alerts_in(tmp_path, moe_collapse_intervals=1, moe_imbalance_max=1.01)
    observe(alerts, {"step": 1, "train/loss": 3.0}, {"step": 2, "moe/load/layer_1": []})
    assert fired(tmp_path) == []


@pytest.mark.parametrize(("override", "expect"), [
    ("moe_collapse_share=0", "monitor.alerts.moe_collapse_share = 0.0 is out of range: must be > 0"),
    ("moe_collapse_share=1", "monitor.alerts.moe_collapse_share = 1: at 1 or more, experts of any layer not "
                             "perfectly balanced count as collapsed; expected a fraction of the fair share below 1"),
    ("moe_collapse_intervals=0", "monitor.alerts.moe_collapse_intervals = 0 is out of range: must be >= 1"),
    ("moe_imbalance_max=1", "monitor.alerts.moe_imbalance_max = 1.0 is out of range: must be > 1"),
    ("moe_imbalance_max='high'", "monitor.alerts.moe_imbalance_max = 'high': expected a number"),
])
def test_bad_expert_alert_options_are_refused_in_one_line(override: str, expect: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"monitor.alerts.{override}"])
    assert expect in str(refused.value) and len(str(refused.value).splitlines()) == 1
    options = load_config(None, ["monitor.alerts.moe_collapse_share=0.2", "monitor.alerts.moe_collapse_intervals=5",
                                 "monitor.alerts.moe_imbalance_max=8"]).monitor.alerts
    assert (options.moe_collapse_share, options.moe_collapse_intervals, options.moe_imbalance_max) == (0.2, 5, 8.0)
