"""What runs beside context parallelism computes what it computes without it: real `keel train` runs (torchrun,
gloo, fp32) attending within documents, cp = 2 against one process or against cp = 2 eager. Compiled blocks
train as eager ones (the ring attention runs eagerly between their graphs); the instability signals of the
sampled steps, the attention logits among them (the whole sequence's keys gathered at their true positions),
equal the one-process run's; the downstream scores of the last step equal the one-process run's (every rank
scores the texts whole)."""

from __future__ import annotations

import math
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.rundir.events import read_jsonl
from tests.conftest import run_keel
from tests.dist.test_context_parallel import DOCUMENTS
from tests.dist.test_layouts import CONCURRENT, RUN, STEPS, losses, short_documents

pytestmark = pytest.mark.dist

__all__ = ["short_documents"]  # the fixture

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SIGNALS = ["monitor.signals_interval=2"]  # every other step: the logits grow over the 10 steps
SAMPLED = range(2, STEPS + 1, 2)
# Perplexity over windows of the model's context and multiple choice after contexts longer than it: texts of
# lengths that no 2 × cp divides. Scored once, at the last step.
DOWNSTREAM = ['eval.downstream_tasks=["keel_stdlib_heldout", "keel_stdlib_next_line"]', "eval.downstream_limit=3"]
COMPILED_STEPS = 3  # a compiled run spends its seconds compiling: a few steps show it trains alike
RUNS = {
    "one": (1, [*SIGNALS, *DOWNSTREAM]),
    "cp2": (2, ["parallel.cp=2", *SIGNALS, *DOWNSTREAM]),
    "cp2_compiled": (2, ["parallel.cp=2", "parallel.compile=true", f"train.steps={COMPILED_STEPS}"]),
}


@pytest.fixture(scope="module")
def runs(short_documents: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("context_features")

    def run(name: str) -> subprocess.CompletedProcess:
        nproc, overrides = RUNS[name]
        return run_keel(["train", "--nproc", str(nproc), "--run-dir", str(root / name), *RUN, *DOCUMENTS,
                         f"data.dir={short_documents}", *overrides], cwd=root, timeout=600, env=OFFLINE)

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        results = dict(zip(RUNS, pool.map(run, RUNS), strict=True))
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
    return {name: root / name for name in RUNS}


def record(run_dir: Path, step: int, prefix: str) -> dict[str, float]:
    """The metrics of `step` whose names start with `prefix`."""
    return {k: v for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == step
            for k, v in r.items() if k.startswith(prefix)}


def test_compiled_blocks_train_like_eager_under_context_parallelism(runs: dict[str, Path]) -> None:
    """Losses within rtol 1e-5: fused kernels round differently, nothing else differs."""
    got, want = losses(runs["cp2_compiled"]), losses(runs["cp2"])
    assert sorted(got) == list(range(1, COMPILED_STEPS + 1))
    for step, loss in got.items():
        assert math.isclose(loss, want[step], rel_tol=1e-5), (step, loss, want[step])


def test_instability_signals_under_context_parallelism_equal_one_process(runs: dict[str, Path]) -> None:
    """Every signal of every sampled step within rtol 1e-4 (as the layouts' are), the attention logits among them:
    cp = 2 scores each rank's queries against the keys of the whole sequence, causally and within documents."""
    for step in SAMPLED:
        got, want = record(runs["cp2"], step, "signals/"), record(runs["one"], step, "signals/")
        assert got.keys() == want.keys() and "signals/attn_logit_max/layer_3" in want, sorted(want)
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-4), (step, key, got[key], value)


def test_downstream_scores_under_context_parallelism_equal_one_process(runs: dict[str, Path]) -> None:
    """The last step's scores within rtol 1e-4: the model trained alike, and scored the same texts whole."""
    got, want = record(runs["cp2"], STEPS, "eval/keel_stdlib"), record(runs["one"], STEPS, "eval/keel_stdlib")
    assert got.keys() == want.keys() and {"eval/keel_stdlib_heldout/byte_perplexity",
                                          "eval/keel_stdlib_next_line/acc"} <= want.keys(), sorted(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-4), (key, got[key], value)
