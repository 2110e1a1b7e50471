"""A mixture-of-experts model trains as on one process in every layout that splits its batch, sequence or layers
(real `keel train` runs, gloo, fp32): the same losses, and the same selection biases moved by the experts' loads
summed over every rank's tokens."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.rundir.events import read_jsonl
from tests.dist.test_layouts import CONCURRENT, STEPS, assert_same_training, losses, train

pytestmark = pytest.mark.dist

MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.dense_layers=1", "model.moe.bias_update_rate=0.01"]
RUNS = {"one": (1, []), "dp2": (2, []), "pp2": (2, ["parallel.pp=2", "parallel.dp_shard=1"]),
        "cp2": (2, ["parallel.cp=2", "parallel.dp_shard=1"])}


@pytest.fixture(scope="module")
def runs(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")

    def run(name: str) -> Path:
        nproc, overrides = RUNS[name]
        train(small_corpus, root / name, nproc, *MOE, *overrides)
        return root / name

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        return dict(zip(RUNS, pool.map(run, RUNS), strict=True))


def biases(run_dir: Path) -> list[list[float]]:
    state = json.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "train_state.json").read_text())
    return state["experts"]["biases"]


@pytest.mark.parametrize("name", ["dp2", "cp2"])
def test_an_expert_model_trains_like_one_process(name: str, runs: dict[str, Path]) -> None:
    assert_same_training(runs[name], runs["one"], range(1, STEPS + 1))
    assert biases(runs[name]) == biases(runs["one"])


def test_a_pipelined_expert_model_trains_like_one_process_up_to_near_ties(runs: dict[str, Path]) -> None:
    """The pipeline rounds otherwise (by 1e-7) than one process; a token almost equally drawn to two experts may
    then choose the other, which moves the losses by 1e-5 to 2e-4 over ten steps and a bias by a step or two."""
    got, want = losses(runs["pp2"]), losses(runs["one"])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert all(math.isclose(got[s], want[s], rel_tol=1e-3) for s in got), (got, want)
    assert got[1] == pytest.approx(want[1], rel=1e-6)  # before any update: the same routing
    apart = [abs(a - b) for x, y in zip(biases(runs["pp2"]), biases(runs["one"]), strict=True)
             for a, b in zip(x, y, strict=True)]
    assert max(apart) <= 2 * 0.01 + 1e-6


def test_the_selection_biases_move_towards_balance_and_the_loads_are_logged(runs: dict[str, Path]) -> None:
    moved = biases(runs["one"])
    assert not any(moved[0]) and all(any(layer) for layer in moved[1:])  # the first block is dense
    # Each step moves every expert by ±rate, below the mean load up and above it down: never further than that.
    assert all(abs(b) <= STEPS * 0.01 + 1e-6 for layer in moved for b in layer)
    logged = [r for r in read_jsonl(runs["one"] / "metrics.jsonl") if "moe/imbalance_max" in r]
    assert logged and all(r["moe/imbalance_max"] >= 1.0 for r in logged)
