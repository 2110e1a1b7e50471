"""The MoE benchmark's figures: the loss at equal training FLOPs read off the validation curve, the balancing
rows, and the profiled step's all-to-all told apart from the other collectives."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench.moe import CollectiveShare, at, balancing, dense_vs_moe
from keel.config import load_config
from keel.core.callbacks import Build, Step
from keel.core.state import TrainState
from keel.model.flops import flops_per_token
from keel.monitor.metrics import covered

REPO = Path(__file__).resolve().parents[3]


def test_overlapping_collectives_count_once() -> None:
    assert covered([(0, 2e6), (1e6, 3e6), (5e6, 6e6)]) == pytest.approx(4.0)
    assert covered([]) == 0.0


def test_a_curve_is_read_linearly_between_its_points_and_not_beyond_them() -> None:
    points = [(10.0, 3.0), (20.0, 2.0), (40.0, 1.0)]
    assert at(points, 15.0) == pytest.approx(2.5) and at(points, 30.0) == pytest.approx(1.5)
    assert at(points, 40.0) == 1.0
    with pytest.raises(ValueError, match="outside"):
        at(points, 41.0)


def test_both_models_are_compared_at_the_dense_runs_flops_the_moes_loss_interpolated() -> None:
    steps = [20, 40]
    dense = {"config": "configs/tiny.toml", "val_loss": list(zip(steps, [3.0, 2.5], strict=True))}
    moe = {"config": "configs/tiny_moe.toml", "val_loss": list(zip(steps, [2.9, 2.4], strict=True))}
    got = dense_vs_moe(dense, moe, tokens_per_step=8192, seq_len=256)
    f_dense, f_moe = (flops_per_token(load_config(REPO / c, []).model, 256) for c in (dense["config"],
                                                                                     moe["config"]))
    assert f_moe > f_dense  # the same active experts' width: the routers alone cost more
    assert got["flops_budget"] == pytest.approx(40 * 8192 * f_dense)
    d, m = got["models"]["dense"], got["models"]["moe"]
    assert d["loss_at_tokens"] == d["loss_at_flops"] == 2.5 and m["loss_at_tokens"] == 2.4
    # The MoE reaches the budget between its evaluations at steps 20 and 40, at step 40 · f_dense / f_moe.
    assert m["loss_at_flops"] == pytest.approx(2.9 - 0.5 * (40 * f_dense / f_moe - 20) / 20)
    assert m["active"] < m["parameters"] and d["active"] == d["parameters"]


def test_each_rate_is_summed_up_by_its_first_last_and_second_half_imbalance() -> None:
    def run(rate: float, imbalance: list[float]) -> dict:
        points = [(10 * (i + 1), v) for i, v in enumerate(imbalance)]
        return {"rate": rate, "imbalance_max": points, "val_loss": [(40, 2.0 + rate)],
                "imbalance_layers": {"moe/imbalance/layer_1": points}}

    rows = balancing([run(0.01, [4.0, 2.0, 1.5, 1.3]), run(0.0, [4.0, 4.0, 3.8, 3.6])], steps=40)
    assert [r["rate"] for r in rows] == [0.0, 0.01]
    assert rows[1]["first"] == (10, 4.0) and rows[1]["last"] == (40, 1.3)
    assert rows[1]["second_half_mean"] == pytest.approx(1.4)  # steps 30 and 40
    assert rows[1]["layers_last"] == {"1": 1.3} and rows[1]["val_loss"] == pytest.approx(2.01)


def test_the_profiled_step_tells_the_all_to_all_apart_from_the_other_collectives(group: None,
                                                                                 tmp_path: Path) -> None:
    share = CollectiveShare(every=2)
    share.on_build(Build([], [], 0, 1, tmp_path, lambda *a, **k: None, print))
    for number in (1, 2, 3, 4):
        step = Step(number=number, state=TrainState(), last=number == 4)
        share.on_step_start(step)
        rows = torch.ones(100_000, 64)
        dist.all_to_all_single(torch.empty_like(rows), rows)
        dist.all_reduce(torch.ones(100_000))
        time.sleep(0.05)  # the step's own work
        share.on_step_end(step)
    # Step 2 alone: step 4 is a multiple too, but the last (a save may end it).
    (record,) = [json.loads(line) for line in (tmp_path / "collectives-rank0.jsonl").read_text().splitlines()]
    assert record["step"] == 2
    assert 0 < record["all_to_all_share"] <= record["comm_share"] < 1
