"""Every layout computes the same training as one process: real `keel train` runs (torchrun, gloo,
fp32), 10 steps from identical init, compared step by step with the one-process run."""

from __future__ import annotations

import math
import re
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from keel.checkpoint.inspect import load_full_state, state_sha256
from keel.rundir.events import read_jsonl
from tests.conftest import REPO, SMALL_RUN, run_keel, small_data

pytestmark = pytest.mark.dist

STEPS = 10
LR = 3e-3
# Four layers so that selective checkpointing wraps some blocks and not others; micro-batches of 2
# so that the global batch of 8 splits over four data-parallel ranks.
RUN = [*SMALL_RUN, "model.n_layers=4", "train.micro_batch=2", f"train.steps={STEPS}", f"optim.lr={LR}",
       "checkpoint.interval=5", "eval.interval=5"]

# Each feature rides on a layout of its own kind rather than on a run of its own (every run costs seconds of
# start-up): activation checkpointing in the data-parallel layouts, GPipe beside PP × DP, the fused cross
# entropy as the loss of the vocabulary-sharded pipeline (the lever runs keep torch's there).
LAYOUTS = {
    "dp2": (2, []),
    "hsdp2x2_ac_full": (4, ["parallel.dp_replicate=2", "parallel.activation_checkpoint=full"]),
    "replicate2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "tp2xdp2_ac_selective": (4, ["parallel.tp=2", "parallel.activation_checkpoint=selective",
                                 "parallel.ac_every=2"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp2_interleaved_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                 "parallel.pp_stages_per_rank=2"]),
    "pp2_interleaved_zb": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_zb",
                               "parallel.pp_stages_per_rank=2"]),
    "pp2xdp2_gpipe": (4, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2xtp2_fused_ce": (4, ["parallel.pp=2", "parallel.tp=2", "train.cross_entropy=fused"]),
    "pp3_uneven": (3, ["parallel.pp=3"]),  # 4 blocks: 1, 2, 1
}
# Every stability lever at once, and μP at twice its base width, the z-loss large enough that a wrong reduction
# over vocabulary shards shows in the gradient norms; run in the layouts whose code paths they touch: QK-norm
# gains over TP's heads, the embedding norm over its sequence shards, the z-loss on vocabulary-sharded logits
# and in the pipeline's loss, μP's output multiplier on sharded logits and its groups in every stage.
LEVERS = ["model.qk_norm=true", "model.embedding_norm=rmsnorm", "train.z_loss=0.1",
          "optim.independent_weight_decay=true", "optim.weight_decay=1e-4", "monitor.signals_interval=5",
          "model.parametrization=mup", "model.base_dim=32"]
LEVER_LAYOUTS = {"dp2": LAYOUTS["dp2"], "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2"])}
# Attention within documents on pipeline stages that see no tokens (the interleaved zero-bubble schedule runs two
# stages per rank, its backward split in two).
# Data parallel and the mask over TP's head shards: tests/dist/test_context_parallel.py.
DOCUMENT_LAYOUTS = ("pp2_1f1b", "pp2_interleaved_zb")
# Layout runs that train at a time: a run leaves much of two cores idle (while its launcher imports, its
# workers meet and exit).
CONCURRENT = 2


def train(corpus: Path, run_dir: Path, nproc: int, *extra: str) -> None:
    result = run_keel(["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *RUN, f"data.dir={corpus}",
                       *extra], cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr[-3000:]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def model_params(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = load_full_state(run_dir / "checkpoints" / f"step-{step:06d}")
    return {k: v for k, v in state.items() if k.startswith("model.")}


def logged(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if key in r}


def assert_same_training(run_dir: Path, reference: Path, steps: range) -> float:
    """Losses within rtol 1e-5 at every step, gradient and update norms (reduced over the layout's
    shards, replicas and stages) within 1e-3; final parameters within 0.1 × peak LR. Returns the
    largest parameter difference seen."""
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(steps)
    for step in steps:
        assert math.isclose(got[step], want[step], rel_tol=1e-5), (step, got[step], want[step])
    for key in ("optim/grad_norm", "optim/update_norm"):
        got_norms, want_norms = logged(run_dir, key), logged(reference, key)
        for step in steps:
            assert math.isclose(got_norms[step], want_norms[step], rel_tol=1e-3), (key, step)
    params, ref_params = model_params(run_dir, steps[-1]), model_params(reference, steps[-1])
    assert params.keys() == ref_params.keys()
    worst = max((params[k] - ref_params[k]).abs().max().item() for k in params)
    assert worst <= 0.1 * LR, worst
    return worst


@pytest.fixture(scope="module")
def one_process(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("layouts") / "one"
    train(small_corpus, run_dir, 1)
    return run_dir


@pytest.fixture(scope="module")
def layout_runs(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every layout's run, CONCURRENT at a time: each is compared with the one-process run step by step
    and number by number, never by time. A run that exits non-zero fails its own test."""
    root = tmp_path_factory.mktemp("layouts")

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        nproc, overrides = LAYOUTS[name]
        run_dir = root / name
        return run_dir, run_keel(["train", "--nproc", str(nproc), "--run-dir", str(run_dir), *RUN,
                                  f"data.dir={small_corpus}", *overrides], cwd=root)

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        return dict(zip(LAYOUTS, pool.map(run, LAYOUTS), strict=True))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(name: str, one_process: Path, layout_runs: dict) -> None:
    run_dir, result = layout_runs[name]
    assert result.returncode == 0, result.stderr[-3000:]
    worst = assert_same_training(run_dir, one_process, range(1, STEPS + 1))
    print(f"{name}: largest parameter difference after {STEPS} steps {worst:.2e} (bound {0.1 * LR:.1e})")


@pytest.fixture(scope="module")
def lever_runs(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The one-process run and LEVER_LAYOUTS' runs, every stability lever on."""
    root = tmp_path_factory.mktemp("levers")

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        nproc, overrides = LEVER_LAYOUTS.get(name, (1, []))
        return root / name, run_keel(["train", "--nproc", str(nproc), "--run-dir", str(root / name), *RUN,
                                      f"data.dir={small_corpus}", *LEVERS, *overrides], cwd=root)

    names = ("one", *LEVER_LAYOUTS)
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        return dict(zip(names, pool.map(run, names), strict=True))


@pytest.mark.parametrize("name", list(LEVER_LAYOUTS))
def test_stability_levers_train_alike_in_every_layout(name: str, lever_runs: dict, one_process: Path) -> None:
    (reference, first), (run_dir, result) = lever_runs["one"], lever_runs[name]
    assert first.returncode == 0 and result.returncode == 0, (first.stderr + result.stderr)[-3000:]
    assert_same_training(run_dir, reference, range(1, STEPS + 1))
    with_levers, without = losses(reference), losses(one_process)
    assert all(with_levers[step] != without[step] for step in range(1, STEPS + 1))  # they change the training
    # The instability signals of the sampled steps read the same global batch in every layout.
    for step in (5, STEPS):
        got, want = signals(run_dir, step), signals(reference, step)
        assert got.keys() == want.keys() and len(want) == 3 + 3 * 4, sorted(want)
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-4), (step, key, got[key], value)


def signals(run_dir: Path, step: int) -> dict[str, float]:
    (record,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == step and "train/loss" in r]
    return {k: v for k, v in record.items() if k.startswith("signals/")}


def test_every_lever_resumes_bitwise_after_a_sigkill(lever_runs: dict, small_corpus: Path, tmp_path: Path) -> None:
    """DP2 with every lever: rank 1 SIGKILLed once step 5 is saved, the agent restarts the workers, and the
    run ends bitwise equal to the uninterrupted one."""
    reference, result = lever_runs["dp2"]
    assert result.returncode == 0, result.stderr[-3000:]
    kill = ['callbacks=[{path = "keel.drill.faults:SigkillAfterCheckpoint", args = {step = 5, rank = 1}}]']
    train(small_corpus, tmp_path / "killed", 2, *LEVERS, *LAYOUTS["dp2"][1], *kill, "--max-restarts", "1")
    events = read_jsonl(tmp_path / "killed" / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "resume"] == [5]
    final = f"checkpoints/step-{STEPS:06d}"
    assert state_sha256(tmp_path / "killed" / final) == state_sha256(reference / final)


@pytest.fixture(scope="module")
def tp2xdp2_step5(layout_runs: dict) -> Path:
    """The TP2 × DP2 layout run's checkpoint of step 5 (RUN saves every 5 steps)."""
    run_dir, result = layout_runs["tp2xdp2_ac_selective"]
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir / "checkpoints" / "step-000005"


@pytest.mark.parametrize(("nproc", "overrides"), [(1, []), (4, ["parallel.pp=2"])], ids=["one_process", "pp2xdp2"])
def test_checkpoint_moves_between_layouts(nproc: int, overrides: list[str], tp2xdp2_step5: Path,
                                          one_process: Path, small_corpus: Path, tmp_path: Path) -> None:
    """Saved in TP2 × DP2 at step 5, resumed in another layout for 5 more steps: the same run as the
    uninterrupted one-process run (model, optimizer state, data cursor and step all carried over)."""
    resumed = tmp_path / "resumed"
    train(small_corpus, resumed, nproc, *overrides, "--resume", str(tp2xdp2_step5))
    assert_same_training(resumed, one_process, range(6, STEPS + 1))


def test_tiny_config_in_tp2_pp2_reports_layout_mfu_and_comm_share(small_corpus: Path, tmp_path: Path) -> None:
    """The command of docs/parallel.md for a 4-process TP2 × PP2 run, shortened to 2 steps of a quarter of the
    batch: still two micro-batches through the two stages per step (what the pipeline's wait is measured on),
    with the preflight's probes sized as in tests.conftest.SMALL_RUN."""
    run_dir = tmp_path / "tiny"
    result = run_keel(["train", "--config", str(REPO / "configs" / "tiny.toml"), "parallel.tp=2", "parallel.pp=2",
                       "--nproc", "4", "--run-dir", str(run_dir), f"data.dir={small_corpus}", "train.steps=2",
                       "train.global_batch=8", "train.micro_batch=4", "health.preflight_probe_mib=4",
                       "monitor.interval=1", "monitor.profile_interval=1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    progress = [line for line in result.stdout.splitlines() if line.startswith("step 2/2 [")]
    assert len(progress) == 1, result.stdout
    assert "| pp2 × tp2 |" in progress[0]
    assert "MFU" not in progress[0], "a CPU's measured matmul rate is no peak to show MFU against"
    assert re.search(r"\| comm \d+% \|", progress[0]), progress[0]
    record = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == 2 and "train/loss" in r][0]
    assert 0 < record["time/comm_s"] < record["time/step_s"] * 4 and record["time/pp_wait_s"] > 0
    assert 0 < record["throughput/mfu"] < 1


def test_compiled_blocks_train_like_eager(one_process: Path, small_corpus: Path, tmp_path: Path) -> None:
    """parallel.compile = true (torch.compile per block, inductor on CPU) over two processes with
    FSDP: the same losses as the eager one-process run, within the tolerance of fused kernels."""
    run_dir = tmp_path / "compiled"
    train(small_corpus, run_dir, 2, "parallel.compile=true", "train.steps=3")
    got, want = losses(run_dir), losses(one_process)
    assert sorted(got) == [1, 2, 3]
    for step, loss in got.items():
        assert math.isclose(loss, want[step], rel_tol=1e-4), (step, loss, want[step])


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus of 400 documents of 60 to 400 bytes, so that every 64-token sequence packs several."""
    from keel.data.prepare import prepare

    root = tmp_path_factory.mktemp("short")
    # Text that keel's own edits leave alone: the corpus, and where its documents fall, stay the same.
    lines = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text().splitlines()
    for i in range(400):
        text, j = "", i
        while len(text) < 60 + (i * 37) % 340:
            text, j = text + lines[j % len(lines)] + "\n", j + 7
        (root / "docs").mkdir(exist_ok=True)
        (root / "docs" / f"{i:03d}.txt").write_text(text)
    prepare(small_data([str(root / "docs")]), root / "corpus")
    return root / "corpus"


@pytest.fixture(scope="module")
def document_runs(short_documents: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """One process and DOCUMENT_LAYOUTS attending within documents (positions restarted), and one process
    attending across them."""
    root = tmp_path_factory.mktemp("documents")
    masked = ["data.document_mask=true", "data.document_positions=true"]
    runs = {"one": (1, masked), "across": (1, []),
            **{name: (LAYOUTS[name][0], [*masked, *LAYOUTS[name][1]]) for name in DOCUMENT_LAYOUTS}}

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        nproc, overrides = runs[name]
        return root / name, run_keel(["train", "--nproc", str(nproc), "--run-dir", str(root / name), *RUN,
                                      f"data.dir={short_documents}", *overrides], cwd=root)

    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        return dict(zip(runs, pool.map(run, runs), strict=True))


@pytest.mark.parametrize("name", DOCUMENT_LAYOUTS)
def test_attention_within_documents_trains_alike_in_every_layout(name: str, document_runs: dict) -> None:
    (reference, first), (run_dir, result), (_, across) = document_runs["one"], document_runs[name], \
        document_runs["across"]
    assert first.returncode == 0 and result.returncode == 0 and across.returncode == 0, \
        (first.stderr + result.stderr + across.stderr)[-3000:]
    assert_same_training(run_dir, reference, range(1, STEPS + 1))
    within, without = losses(reference), losses(document_runs["across"][0])
    assert all(within[step] != without[step] for step in range(1, STEPS + 1))  # the mask changes every step


def test_a_run_attending_within_documents_resumes_bitwise_after_sigkill(document_runs: dict, short_documents: Path,
                                                                       tmp_path: Path) -> None:
    reference, result = document_runs["one"]
    assert result.returncode == 0, result.stderr[-3000:]
    # SIGKILL in the middle of step 8, once; the save of step 5 is synchronous, so it is there to resume from.
    kill = ['drill.inject=["kill:step=8,rank=0"]', "checkpoint.async_save=false"]
    killed = tmp_path / "killed"
    result = run_keel(["train", "--run-dir", str(killed), *RUN, f"data.dir={short_documents}",
                       "data.document_mask=true", "data.document_positions=true", *kill, "--max-restarts", "1"],
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["step"] for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"] == [5]
    final = f"checkpoints/step-{STEPS:06d}"
    assert state_sha256(killed / final) == state_sha256(reference / final)
