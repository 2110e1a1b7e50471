"""The downstream evaluation of a run: lm-evaluation-harness tasks (eval.downstream_tasks) on the model being
trained, every eval.downstream_interval steps and at the last, logged as eval/TASK/METRIC.

Every rank runs the same requests in the same order, so that the collectives of a sharded model (FSDP's
gathers, tensor parallel's) match; rank 0 publishes the scores. Under context parallelism every rank runs the
texts whole (the model's attention not split for them), as a data-parallel rank does. lm-eval seeds Python's,
NumPy's and torch's generators: their states are put back afterwards, so that a run with evaluations computes
what it would without them.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from keel.config import Config, EvalConfig
from keel.core.callbacks import Callback, Step
from keel.data.shards import Corpus
from keel.data.tokenizer import open_tokenizer
from keel.downstream.scoring import Scorer
from keel.downstream.tasks import check_tasks, run_tasks
from keel.health.watchdog import Watchdog
from keel.model.parallelizable import Parallelizable
from keel.monitor.run_monitor import RunMonitor
from keel.train.components import Builtin

if TYPE_CHECKING:
    from keel.downstream.adapter import KeelLM


def downstream_evaluation(cfg: Config, model: torch.nn.Module, corpus: Corpus, dtype: torch.dtype,
                          watchdog: Watchdog, monitor: RunMonitor, say: Callable[[str], None]) -> list[Callback]:
    """The lm-eval tasks of eval.downstream_tasks on the model being trained, on every rank (none: no component,
    and lm-eval is not imported)."""
    if not cfg.eval.downstream_tasks:
        return []
    from keel.downstream.adapter import KeelLM

    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else None

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        training = model.training
        model.eval()
        with torch.no_grad(), autocast or contextlib.nullcontext(), whole_sequences(model):
            out = model(tokens)
        model.train(training)
        return out

    tokenizer = open_tokenizer(corpus.dir, corpus.manifest["tokenizer"])
    lm = KeelLM(Scorer(logits, tokenizer, cfg.model.max_seq_len, device, cfg.eval.downstream_batch))
    return [DownstreamEvaluation(cfg.eval, lm, watchdog, monitor, say, device)]


@contextlib.contextmanager
def whole_sequences(model: torch.nn.Module) -> Iterator[None]:
    """The model attending over whole texts while it scores them: context parallelism (the model's `context`)
    splits sequences of train.seq_len over the ranks of a group, each of which then runs the same texts whole, as
    a data-parallel rank does."""
    context = getattr(model, "context", None)
    if context is None:
        yield
        return
    split = cast(Parallelizable, model).split_context
    split(None)
    try:
        yield
    finally:
        split(context)


@contextlib.contextmanager
def generators_kept(device: torch.device) -> Iterator[None]:
    """Python's, NumPy's and torch's random states (the device's too) as they were before."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


class DownstreamEvaluation(Builtin):
    """Registered with frequency eval.downstream_interval (the run's length when 0): also called at the last step."""
    priority = 80

    def __init__(self, cfg: EvalConfig, lm: KeelLM, watchdog: Watchdog, monitor: RunMonitor,
                 say: Callable[[str], None], device: torch.device) -> None:
        self.cfg, self.lm, self.watchdog, self.monitor, self.say, self.device = cfg, lm, watchdog, monitor, say, device
        self.manager: Any = check_tasks(cfg.downstream_tasks, cfg.downstream_include)
        os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's progress bars, on every rank's console

    def on_step_end(self, step: Step) -> None:
        number = step.state.step
        if not (step.last or self.cfg.downstream_interval and number % self.cfg.downstream_interval == 0):
            return
        self.watchdog.begin("eval", number)
        with self.monitor.phase("evaluation", whole_step=False), generators_kept(self.device):
            scores = run_tasks(self.lm, self.cfg.downstream_tasks, self.cfg.downstream_include,
                               self.cfg.downstream_limit or None, stderr=False, manager=self.manager)
        self.watchdog.end()
        record = {f"eval/{task}/{metric}": value for task, metrics in scores.items()
                  for metric, value in metrics.items()}
        if not record:  # a rank whose scores lm-eval kept elsewhere
            return
        self.monitor.publish({"step": number, **record})
        step.metrics.update(record)
        self.say(f"step {number}: downstream " + ", ".join(f"{k.removeprefix('eval/')} {v:.4f}"
                                                           for k, v in sorted(record.items())))
