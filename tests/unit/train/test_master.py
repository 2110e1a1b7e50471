"""train.param_dtype = "bf16": bf16 weights and gradients in the passes, fp32 master weights everywhere else, so
that checkpoints move between bf16- and fp32-parameter runs and a restart resumes bitwise."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from keel.checkpoint.manager import checkpoint_root
from keel.checkpoint.manifest import step_name
from keel.config import load_config
from keel.health.signals import StopRequests
from keel.health.watchdog import Watchdog
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.monitor.run_monitor import RunMonitor
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import Dist
from keel.rundir.events import RunLog, read_jsonl
from keel.train.master import Bf16Params
from keel.train.setup import attempt_started
from keel.train.step import forward_backward
from keel.train.trainer import Trainer
from keel.train.worker import ENDED
from tests.conftest import SMALL_RUN
from tests.unit.model.test_model import TINY, tokens
from tests.unit.train.conftest import IN_PROCESS

BF16 = ["train.precision=bf16", "train.param_dtype=bf16"]
FP32_PARAMS = ["train.precision=bf16"]


def held_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for p in model.parameters())


def test_the_passes_hold_bf16_parameters_and_gradients_and_the_fp32_masters_come_back() -> None:
    model = Llama(TINY)
    init_weights(model, 0)
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = tokens()
    batches = [(x[:, :-1], x[:, 1:])] * 2
    forward_backward(model, batches, autocast_dtype=torch.bfloat16)
    fp32_bytes = held_bytes(model)
    fp32_grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with Bf16Params([model]).computing():
        forward_backward(model, batches, autocast_dtype=torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
        assert held_bytes(model) * 2 == fp32_bytes  # 4 bytes per parameter in place of 8 (the masters: 4 more)
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32 and torch.equal(p, masters[name]), name
        torch.testing.assert_close(p.grad, fp32_grads[name], rtol=0.1, atol=2e-3, msg=name)


class Runs:
    """Trainers of SMALL_RUN in this process, each in its own run directory."""

    def __init__(self, corpus: Path, root: Path, stack: ExitStack) -> None:
        self.corpus, self.root, self.stack = corpus, root, stack

    def build(self, name: str, *overrides: str, resume: str = "never") -> Trainer:
        run_dir = self.root / name
        cfg = load_config(None, [*SMALL_RUN, f"data.dir={self.corpus}", *IN_PROCESS, "checkpoint.keep_last=10",
                                 *overrides])
        ctx = Dist(0, 1, torch.device("cpu"))
        layout = Layout.build("cpu", resolve_degrees(cfg, 1))
        log = self.stack.enter_context(RunLog(run_dir, 0, layout.describe()))
        requests = StopRequests(run_dir, 0)
        self.stack.callback(requests.close)
        watchdog = Watchdog(cfg.health.watchdog, run_dir, 0, 1, log.events, log.say)
        monitor = RunMonitor(cfg.monitor, run_dir, 0, ctx.device, log, attempt_started(),
                             checkpoint_root(cfg, run_dir).path())
        self.stack.callback(monitor.stop)
        trainer = Trainer(cfg, run_dir, ctx, layout, log, requests, watchdog, monitor)
        self.stack.callback(trainer.close)
        assert trainer.build(resume, (), [], {}) is None
        return trainer

    def fit(self, name: str, *overrides: str, resume: str = "never") -> Trainer:
        trainer = self.build(name, *overrides, resume=resume)
        code = trainer.fit()
        trainer.monitor.close(ENDED.get(code, "failed"))
        assert code == 0
        return trainer


@pytest.fixture
def runs(small_corpus: Path, tmp_path: Path, group: None) -> Iterator[Runs]:
    with ExitStack() as stack:
        yield Runs(small_corpus, tmp_path, stack)


def losses(trainer: Trainer) -> list[float]:
    return [r["train/loss"] for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "train/loss" in r]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.parts[0].named_parameters()}


def optimizer_state(trainer: Trainer) -> list[torch.Tensor]:
    return [t for s in trainer.optimizers[0].state.values() for t in s.values()]


def test_bf16_parameters_train_close_to_fp32_parameters_under_bf16(runs: Runs) -> None:
    fp32, bf16 = losses(runs.fit("fp32", *FP32_PARAMS)), losses(runs.fit("bf16", *BF16))
    assert len(fp32) == len(bf16) == 6 and bf16[-1] < bf16[0] - 0.5  # it learns
    gap = max(abs(a - b) for a, b in zip(fp32, bf16, strict=True))
    assert gap < 0.02  # bf16 weights: a rounding apart


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_restart_of_a_bf16_parameter_run_resumes_it_bitwise(runs: Runs, precision: str) -> None:
    overrides = ["train.param_dtype=bf16", f"train.precision={precision}"]  # fp8: torchao's, emulated on a CPU
    whole = runs.fit("whole", *overrides)
    latest = whole.manager.latest()  # step 6's; step 4's is beside it
    assert latest is not None
    resumed = runs.fit("resumed", *overrides, resume=str(Path(latest).with_name(step_name(4))))
    assert resumed.state.step == 6
    expected, got = weights(whole), weights(resumed)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(whole), optimizer_state(resumed), strict=True))


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(BF16, FP32_PARAMS), (FP32_PARAMS, BF16)])
def test_a_checkpoint_moves_between_bf16_and_fp32_parameter_runs(runs: Runs, saved_by: list[str],
                                                                 loaded_by: list[str]) -> None:
    saver = runs.fit("saver", *saved_by)
    saved = saver.manager.latest()
    assert saved is not None
    loader = runs.build("loader", *loaded_by, "train.steps=8", resume=saved)
    assert loader.state.step == 6
    expected, got = weights(saver), weights(loader)
    assert all(got[name].dtype == torch.float32 and torch.equal(got[name], expected[name]) for name in expected)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(saver), optimizer_state(loader), strict=True))
    assert loader.fit() == 0 and loader.state.step == 8
