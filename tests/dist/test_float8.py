"""train.precision = fp8 (torchao's float8, emulated on a CPU) in real `keel train` runs: a SIGKILLed run resumes
bitwise, a checkpoint moves between fp8 and bf16 runs (it holds the high-precision weights), and a mixture of
experts' float8 experts split over expert-parallel ranks train as on one process."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.dist.test_layouts import STEPS, losses, train
from tests.dist.test_moe import MOE

pytest.importorskip("torchao")
pytestmark = pytest.mark.dist

PRECISIONS = {"fp8": ["train.precision=fp8"], "bf16": ["train.precision=bf16"],
              "tensorwise": ["train.precision=fp8", "train.float8_recipe=tensorwise"]}
# Tensor parallelism over float8 emulated on a CPU takes seconds a step: three steps (within the warmup, so
# with the learning rates of the ten-step runs they are compared with) show each scale computed as on one process.
TP_STEPS = 3
TP2 = ["parallel.tp=2", "parallel.dp_shard=1", f"train.steps={TP_STEPS}"]
RUNS = {**{name: (1, overrides) for name, overrides in PRECISIONS.items()},
        "tensorwise_dp2": (2, PRECISIONS["tensorwise"]),  # FSDP: its weights all-gathered in float8
        "tp2": (2, [*PRECISIONS["fp8"], *TP2]), "tensorwise_tp2": (2, [*PRECISIONS["tensorwise"], *TP2]),
        "moe": (1, [*PRECISIONS["fp8"], *MOE]),  # routed experts in float8 grouped GEMMs
        "moe_ep2": (2, [*PRECISIONS["fp8"], *MOE, "parallel.ep=2"])}


@pytest.fixture(scope="module")
def runs(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("float8")

    names = list(RUNS)

    def run(name: str) -> Path:
        nproc, overrides = RUNS[name]
        train(small_corpus, root / name, nproc, *overrides)
        return root / name

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(run, names), strict=True))


def test_a_float8_run_trains_close_to_bf16_and_resumes_bitwise_after_a_sigkill(runs: dict[str, Path],
                                                                              small_corpus: Path,
                                                                              tmp_path: Path) -> None:
    fp8, bf16 = losses(runs["fp8"]), losses(runs["bf16"])
    assert all(math.isclose(fp8[s], bf16[s], rel_tol=0.01) for s in bf16) and fp8 != bf16
    killed = tmp_path / "killed"
    train(small_corpus, killed, 1, *PRECISIONS["fp8"], 'drill.inject=["kill:step=8,rank=0"]',
          "checkpoint.async_save=false", "--max-restarts", "1")
    assert [e["step"] for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"] == [5]
    final = f"checkpoints/step-{STEPS:06d}"
    assert state_sha256(killed / final) == state_sha256(runs["fp8"] / final)


def test_a_float8_run_sharded_by_fsdp_with_float8_all_gathers_trains_as_one_process(runs: dict[str, Path]) -> None:
    """Tensorwise scales are the whole tensor's amax, which FSDP's float8 all-gather computes over the shards. One
    process casts its fp32 weights under autocast, FSDP its bf16 gathered ones: the losses part by a few 1e-4."""
    got, want = losses(runs["tensorwise_dp2"]), losses(runs["tensorwise"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(math.isclose(got[s], want[s], rel_tol=2e-3) for s in want), (got, want)


@pytest.mark.parametrize(("split", "whole"), [("tp2", "fp8"), ("tensorwise_tp2", "tensorwise")])
def test_float8_layers_split_by_tensor_parallelism_train_as_on_one_process(split: str, whole: str,
                                                                        runs: dict[str, Path]) -> None:
    """Each scale is a whole row's or the whole tensor's, computed on the gathered input as on one process."""
    got, want = losses(runs[split]), losses(runs[whole])
    assert sorted(got) == list(range(1, TP_STEPS + 1))
    assert all(math.isclose(got[s], want[s], rel_tol=1e-3) for s in got), (got, want)


@pytest.mark.parametrize(("saved", "into"), [("bf16", "fp8"), ("fp8", "bf16")])
def test_a_checkpoint_moves_between_float8_and_bf16_runs(saved: str, into: str, runs: dict[str, Path],
                                                         small_corpus: Path, tmp_path: Path) -> None:
    resumed = tmp_path / "resumed"
    train(small_corpus, resumed, 1, *PRECISIONS[into], "--resume", str(runs[saved] / "checkpoints" / "step-000005"))
    got, continued = losses(resumed), losses(runs[saved])
    assert sorted(got) == list(range(6, STEPS + 1))
    assert all(math.isclose(got[s], continued[s], rel_tol=0.01) for s in got)


def test_float8_experts_split_over_expert_parallel_ranks_train_as_on_one_process(runs: dict[str, Path]) -> None:
    """A float8 scale is per token row, or per expert's weight row or its tokens: the same whichever rank
    computes the expert, so only the order of sums differs."""
    got, want = losses(runs["moe_ep2"]), losses(runs["moe"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(math.isclose(got[s], want[s], rel_tol=1e-3) for s in want), (got, want)
