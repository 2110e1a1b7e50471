"""A mixture-of-experts model's routing metrics on the Prometheus exporter (its real HTTP endpoint)."""

from __future__ import annotations

from keel.core.net import free_port
from keel.monitor.sinks import PrometheusExporter
from tests.unit.monitor.test_monitor import scrape

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
