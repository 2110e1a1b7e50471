"""A mixture-of-experts model trains as on one process in every layout that splits its batch, sequence or layers
(real `keel train` runs, gloo, fp32): the same losses, and the same selection biases moved by the experts' loads
summed over every rank's tokens."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.dist.test_layouts import CONCURRENT, STEPS, assert_same_training, losses, train

pytestmark = pytest.mark.dist

MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.dense_layers=1", "model.moe.bias_update_rate=0.01"]
AUX = ["model.moe.aux_loss_coeff=0.01", "model.moe.z_loss_coeff=0.001"]
# Each layout beside expert parallelism (ep2_cp2, ep2_pp2, tp2_ep2) rather than also alone: every run costs
# seconds of start-up, and the experts' exchanges are what these layouts have to get right.
RUNS = {"one": (1, []), "dp2": (2, ["monitor.profile_interval=5"]),
        "ep2": (2, ["parallel.ep=2", "guard.sdc.replay_interval=1", "monitor.profile_interval=5"]),
        "ep4": (4, ["parallel.ep=4"]),
        "ep2_cp2": (2, ["parallel.cp=2", "parallel.dp_shard=1", "parallel.ep=2"]),
        "ep2_hsdp": (4, ["parallel.dp_replicate=2", "parallel.ep=2"]),
        "ep2_pp2": (4, ["parallel.pp=2", "parallel.ep=2"]),
        "tp2_ep2": (4, ["parallel.tp=2", "parallel.ep=2"]),
        "groups2": (1, ["--replica-groups", "2", "checkpoint.interval=100"]),
        "aux_one": (1, AUX), "aux_ep2": (2, [*AUX, "parallel.ep=2"])}


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


@pytest.mark.parametrize("name", ["dp2", "ep2", "ep4", "ep2_cp2", "ep2_hsdp", "tp2_ep2"])
def test_an_expert_model_trains_like_one_process(name: str, runs: dict[str, Path]) -> None:
    assert_same_training(runs[name], runs["one"], range(1, STEPS + 1))
    assert biases(runs[name]) == biases(runs["one"])


def test_auxiliary_losses_train_alike_on_one_process_and_split_over_ranks(runs: dict[str, Path]) -> None:
    """Each rank averages the balance and z-losses over its own sequences and the ranks' gradients are averaged:
    the one-process run's mean over all sequences."""
    assert_same_training(runs["aux_ep2"], runs["aux_one"], range(1, STEPS + 1))
    assert losses(runs["aux_one"]) != losses(runs["one"])


def test_replica_groups_sum_the_expert_loads_and_move_their_biases_as_one_job(runs: dict[str, Path]) -> None:
    """Two replica groups of one process each are dp2 with the gradient average made by torchft: each group's
    loads are summed with the other's, so both groups route as the ranks of one job do, and the biases come
    out the same."""
    want = losses(runs["dp2"])
    for group in (0, 1):
        got = losses(runs["groups2"] / "groups" / str(group))
        assert sorted(got) == list(range(1, STEPS + 1))
        assert all(math.isclose(got[s], want[s], rel_tol=1e-5) for s in got), (group, got, want)
    assert biases(runs["groups2"]) == biases(runs["dp2"])
    # The router's metrics count both groups' tokens, as dp2's count both ranks'.
    def routed(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k.startswith(("moe/load", "moe/entropy"))}
                for r in read_jsonl(run_dir / "metrics.jsonl") if "moe/imbalance_max" in r]
    for got, want in zip(routed(runs["groups2"] / "groups" / "1"), routed(runs["dp2"]), strict=True):
        assert got.keys() == want.keys() and got
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key


def test_a_pipelined_expert_model_trains_like_one_process_up_to_near_ties(runs: dict[str, Path]) -> None:
    """The pipeline rounds otherwise (by 1e-7) than one process; a token almost equally drawn to two experts may
    then choose the other, which moves the losses by 1e-5 to 2e-4 over ten steps and a bias by a step or two."""
    got, want = losses(runs["ep2_pp2"]), losses(runs["one"])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert all(math.isclose(got[s], want[s], rel_tol=1e-3) for s in got), (got, want)
    assert got[1] == pytest.approx(want[1], rel=1e-6)  # before any update: the same routing
    apart = [abs(a - b) for x, y in zip(biases(runs["ep2_pp2"]), biases(runs["one"]), strict=True)
             for a, b in zip(x, y, strict=True)]
    assert max(apart) <= 2 * 0.01 + 1e-6


def test_the_selection_biases_move_towards_balance_and_the_loads_are_logged(runs: dict[str, Path]) -> None:
    moved = biases(runs["one"])
    assert not any(moved[0]) and all(any(layer) for layer in moved[1:])  # the first block is dense
    # Each step moves every expert by ±rate, below the mean load up and above it down: never further than that.
    assert all(abs(b) <= STEPS * 0.01 + 1e-6 for layer in moved for b in layer)
    logged = [r for r in read_jsonl(runs["one"] / "metrics.jsonl") if "moe/imbalance_max" in r]
    assert logged and all(r["moe/imbalance_max"] >= 1.0 for r in logged)


def test_every_replayed_expert_parallel_step_is_bitwise_equal_to_its_original(runs: dict[str, Path]) -> None:
    """ep = 2 with the SDC replay after every step: the all-to-all exchanges of a recomputation route and sum
    exactly as the first computation did, so no replay ever differs."""
    state = json.loads((runs["ep2"] / "checkpoints" / f"step-{STEPS:06d}" / "train_state.json").read_text())
    assert state["guards"]["counts"]["sdc_replays"] == STEPS
    assert [e for e in read_jsonl(runs["ep2"] / "events.jsonl") if e["kind"] == "guard"] == []


def test_the_all_to_all_exchanges_share_of_a_profiled_step_is_measured(runs: dict[str, Path]) -> None:
    profiled = [r for r in read_jsonl(runs["ep2"] / "metrics.jsonl") if "time/all_to_all_s" in r]
    assert {5, 10} <= {r["step"] for r in profiled}  # measured there, carried by the records after them
    assert all(0 < r["time/all_to_all_s"] <= r["time/comm_s"] for r in profiled)
    assert all(0 < r["time/all_to_all_share"] < 1 for r in profiled)
    unsplit = [r for r in read_jsonl(runs["dp2"] / "metrics.jsonl") if "time/all_to_all_s" in r]
    assert unsplit and all(r["time/all_to_all_s"] == 0 < r["time/comm_s"] for r in unsplit)


def test_an_expert_parallel_run_resumes_bitwise_after_a_sigkill(runs: dict[str, Path], small_corpus: Path,
                                                               tmp_path: Path) -> None:
    """ep = 2: rank 1 SIGKILLed in the middle of step 8, once; the agent restarts the workers from step 5 and the
    run ends bitwise equal to the uninterrupted one."""
    killed = tmp_path / "killed"
    train(small_corpus, killed, 2, *MOE, *RUNS["ep2"][1], 'drill.inject=["kill:step=8,rank=1"]',
          "checkpoint.async_save=false", "--max-restarts", "1")
    assert [e["step"] for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"] == [5]
    final = f"checkpoints/step-{STEPS:06d}"
    assert state_sha256(killed / final) == state_sha256(runs["ep2"] / final)


@pytest.mark.parametrize(("saved", "nproc", "overrides"), [("ep4", 2, ["parallel.ep=2"]), ("ep2", 1, [])],
                         ids=["ep4_to_ep2", "ep2_to_one"])
def test_an_expert_parallel_checkpoint_resumes_on_fewer_expert_ranks(saved: str, nproc: int, overrides: list[str],
                                                                    runs: dict[str, Path], small_corpus: Path,
                                                                    tmp_path: Path) -> None:
    """The experts are saved sharded along the expert dimension; resumed at step 5 over fewer expert-parallel
    ranks (and another FSDP degree), the run goes on as the uninterrupted one-process run."""
    resumed = tmp_path / "resumed"
    train(small_corpus, resumed, nproc, *MOE, *overrides, "--resume",
          str(runs[saved] / "checkpoints" / "step-000005"))
    assert_same_training(resumed, runs["one"], range(6, STEPS + 1))
    assert biases(resumed) == biases(runs["one"])
