"""A mixture-of-experts run's routing metrics are the run's, not the layout's (real `keel train` runs, gloo, fp32):
split over 2 processes by tensor parallelism, whose ranks count the same tokens, or by expert parallelism, whose
ranks count their own, the loads and dropped tokens of every logged step are those of one process, exactly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.dist.test_layouts import CONCURRENT, STEPS, train
from tests.dist.test_moe import MOE
from tests.dist.test_moe_guards import routing

pytestmark = pytest.mark.dist

CAPACITY = [*MOE, "model.moe.capacity_factor=1.0"]
LAYOUTS = {"one": (1, []), "tp2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]), "ep2": (2, ["parallel.ep=2"])}


def test_tensor_and_expert_parallel_runs_log_the_routing_of_one_process(small_corpus: Path, tmp_path: Path) -> None:
    def run(name: str) -> dict[int, dict]:
        nproc, layout = LAYOUTS[name]
        train(small_corpus, tmp_path / name, nproc, *CAPACITY, "monitor.interval=2", *layout)
        return routing(tmp_path / name)

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        logged = dict(zip(LAYOUTS, pool.map(run, LAYOUTS), strict=True))
    one = logged["one"]
    assert sorted(one) == list(range(2, STEPS + 1, 2)) and any(r["moe/dropped_tokens/layer_1"] for r in one.values())
    for name in ("tp2", "ep2"):
        assert sorted(logged[name]) == sorted(one), name
        for step, record in logged[name].items():
            exact = {k: v for k, v in record.items() if not k.startswith("moe/entropy/")}
            assert exact == {k: v for k, v in one[step].items() if not k.startswith("moe/entropy/")}, (name, step)
            assert record["moe/entropy/layer_1"] == pytest.approx(one[step]["moe/entropy/layer_1"], rel=1e-6)
