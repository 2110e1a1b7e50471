"""`keel plan --measure`'s part that needs no training: a planned layout as `keel train` overrides. (The cluster
file it writes: test_cluster.py; the calibration's step time: test_throughput.py; the whole of it:
tests/dist/test_plan_measure.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.config import load_config
from keel.plan.layout import Layout, config_layout
from keel.plan.measure import train_overrides

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("layout", [
    Layout(dp_shard=4, micro_batch=4),
    Layout(tp=2, dp_replicate=2, micro_batch=8),
    Layout(pp=2, dp_shard=2, micro_batch=1, ac="full"),
    Layout(pp=2, v=2, dp_shard=2, micro_batch=2),
    Layout(pp=2, v=2, dp_shard=2, micro_batch=2, schedule="interleaved_zb"),
    Layout(pp=2, dp_shard=2, micro_batch=1, schedule="gpipe"),
    Layout(cp=2, dp_shard=2, micro_batch=2, ac="selective"),
])
def test_a_planned_layout_is_trained_as_the_planner_reads_it_back(layout: Layout) -> None:
    cfg = load_config(REPO / "configs" / "tiny.toml", train_overrides(layout))
    assert config_layout(cfg, layout.gpus()) == (layout, [])  # the schedule too
