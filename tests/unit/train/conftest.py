"""A Trainer built in this process, as `keel.train.worker.train` builds it, on a one-process gloo group."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from keel.checkpoint.manager import checkpoint_root
from keel.config import CallbackSpec, load_config
from keel.health.signals import StopRequests
from keel.health.watchdog import Watchdog
from keel.monitor.run_monitor import RunMonitor
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import Dist
from keel.rundir.events import RunLog
from keel.train.setup import attempt_started
from keel.train.trainer import Trainer
from tests.conftest import SMALL_RUN

STEPS = 6
# A checkpoint every 2 steps, no evaluation before the last step; nothing that watches from outside the
# process (the preflight, the watchdog's thread, the Prometheus port shared by everything on the machine).
IN_PROCESS = [f"train.steps={STEPS}", "checkpoint.interval=2", "eval.interval=0", "health.preflight=off",
              "health.watchdog.enabled=false", "monitor.prometheus_port=0"]


@pytest.fixture
def build(small_corpus: Path, tmp_path: Path, group: None) -> Iterator[Callable[..., Trainer]]:
    """`build(callbacks, *overrides)`: a Trainer of SMALL_RUN on the small corpus, built and ready to fit."""
    with ExitStack() as stack:
        def trainer(callbacks: list[CallbackSpec] = (), *overrides: str) -> Trainer:
            run_dir = tmp_path / "run"
            cfg = load_config(None, [*SMALL_RUN, f"data.dir={small_corpus}", *IN_PROCESS, *overrides])
            ctx = Dist(0, 1, torch.device("cpu"))
            layout = Layout.build(ctx.device.type, resolve_degrees(cfg, 1))
            log = stack.enter_context(RunLog(run_dir, 0, layout.describe()))
            requests = StopRequests(run_dir, 0)
            stack.callback(requests.close)
            watchdog = Watchdog(cfg.health.watchdog, run_dir, 0, 1, log.events, log.say)
            monitor = RunMonitor(cfg.monitor, run_dir, 0, ctx.device, log, attempt_started(),
                                 checkpoint_root(cfg, run_dir).path())
            stack.callback(monitor.stop)
            built = Trainer(cfg, run_dir, ctx, layout, log, requests, watchdog, monitor)
            stack.callback(built.close)
            assert built.build("never", (), list(callbacks), {}) is None
            return built

        yield trainer
