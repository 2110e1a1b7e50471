"""Context parallelism computes the same training as one process: real `keel train` runs (torchrun, gloo, fp32)
of 1,024-token sequences split over 2 or 4 ranks, alone and with FSDP, tensor and pipeline parallelism, attending
causally or within documents; a SIGKILL on a context-parallel layout resumes bitwise, and its checkpoint resumes
at other context-parallel degrees."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.conftest import run_keel
from tests.dist.test_layouts import CONCURRENT, RUN, STEPS, assert_same_training, short_documents

pytestmark = pytest.mark.dist

__all__ = ["short_documents"]  # the fixture, shared with the layouts' document runs

SEQ = 1024
LONG = [*RUN, f"model.max_seq_len={SEQ}", f"train.seq_len={SEQ}"]
DOCUMENTS = ["data.document_mask=true", "data.document_positions=true", "eval.sequences=4"]  # its corpus is short
LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "cp2xdp2": (4, ["parallel.cp=2", "parallel.dp_shard=2"]),
    "cp2xtp2": (4, ["parallel.cp=2", "parallel.tp=2"]),
}
# The layouts combined with CP make the warmup's five steps (seconds each here; the same learning rates as the
# first five of the references' ten): the references' checkpoint of step 5 is what they are compared with.
SHORT = 5
# cp2 causally and within documents; with FSDP causally, with TP within documents (the mask over head shards),
# pipelined once; and the one-process references. A layout pairs with one way of attending, not with both.
# Each run: its processes, its overrides and its steps.
RUNS = {
    "one": (1, [], STEPS), "one_documents": (1, DOCUMENTS, STEPS),
    "cp2": (*LAYOUTS["cp2"], STEPS), "cp2_documents": (2, [*LAYOUTS["cp2"][1], *DOCUMENTS], STEPS),
    "cp2xdp2": (4, LAYOUTS["cp2xdp2"][1], SHORT),
    "cp2xtp2_documents": (4, [*LAYOUTS["cp2xtp2"][1], *DOCUMENTS], SHORT),
    "cp2xpp2": (4, ["parallel.cp=2", "parallel.pp=2"], SHORT),
}


def train(corpus: Path, run_dir: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    return run_keel(["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *LONG, f"data.dir={corpus}", *extra],
                    cwd=run_dir.parent, timeout=600)


@pytest.fixture(scope="module")
def runs(small_corpus: Path, short_documents: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("context")

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        nproc, overrides, steps = RUNS[name]
        corpus = short_documents if "document" in name else small_corpus
        return root / name, train(corpus, root / name, nproc, *overrides, f"train.steps={steps}")

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        return dict(zip(RUNS, pool.map(run, RUNS), strict=True))


@pytest.mark.parametrize("name", [name for name in RUNS if not name.startswith("one")])
def test_context_parallel_layout_trains_like_one_process(name: str, runs: dict) -> None:
    (reference, first), (run_dir, result) = runs["one_documents" if "document" in name else "one"], runs[name]
    assert first.returncode == 0 and result.returncode == 0, (first.stderr + result.stderr)[-3000:]
    steps = RUNS[name][2]
    worst = assert_same_training(run_dir, reference, range(1, steps + 1))
    print(f"{name}: largest parameter difference after {steps} steps {worst:.2e}")


def test_a_context_parallel_run_resumes_bitwise_after_sigkill(runs: dict, short_documents: Path,
                                                              tmp_path: Path) -> None:
    """cp2 within documents: rank 1 SIGKILLed in step 8 once, the save of step 5 synchronous; the agent restarts
    the workers and the run ends bitwise equal to the uninterrupted one."""
    reference, result = runs["cp2_documents"]
    assert result.returncode == 0, result.stderr[-3000:]
    killed = tmp_path / "killed"
    done = train(short_documents, killed, 2, *RUNS["cp2_documents"][1], 'drill.inject=["kill:step=8,rank=1"]',
                 "checkpoint.async_save=false", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"] == [5]
    final = f"checkpoints/step-{STEPS:06d}"
    assert state_sha256(killed / final) == state_sha256(reference / final)


@pytest.mark.parametrize(("nproc", "cp"), [(1, 1), (4, 4)], ids=["cp1", "cp4"])
def test_a_context_parallel_checkpoint_resumes_at_another_degree(nproc: int, cp: int, runs: dict,
                                                                  small_corpus: Path, tmp_path: Path) -> None:
    """Saved at cp=2 in step 5, resumed at cp=1 or cp=4 for 5 more steps: the same run as the uninterrupted
    one-process run."""
    saved, result = runs["cp2"]
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "resumed"
    done = train(small_corpus, resumed, nproc, f"parallel.cp={cp}", "--resume",
                 str(saved / "checkpoints" / "step-000005"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_training(resumed, runs["one"][0], range(6, STEPS + 1))
