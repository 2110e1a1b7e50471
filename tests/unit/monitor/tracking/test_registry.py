"""Experiment trackers register by their module of keel.monitor.tracking: a tracker added as one new module file
is enabled by its config section, made with its section and the run's names, and fed the run's metrics and
events on its own thread, as MLflow and W&B are."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.config import Config
from keel.core.state import TrainState
from keel.monitor.trackers import TRACKERS, Trackers
from keel.monitor.tracking.mlflow_backend import MlflowBackend
from keel.monitor.tracking.registry import BACKENDS, check_trackers, enabled_trackers
from keel.monitor.tracking.wandb_backend import WandbBackend
from tests.package_files import added_module

# A tracker as its own module of keel.monitor.tracking would be: a client that needs no library and keeps
# what it is given. Its section (`monitor.recorder`) is set on the config by the test.
RECORDER = """
    from dataclasses import dataclass
    from pathlib import Path

    from keel.config import Config
    from keel.monitor.tracking.registry import tracker

    MADE = []


    @dataclass
    class RecorderConfig:
        enabled: bool = False
        project: str = "demo"


    @tracker("recorder")
    class Recorder:
        def __init__(self, section: RecorderConfig, run_name: str, config_name: str, run_dir: Path) -> None:
            self.given = (section.project, run_name, config_name, run_dir)
            self.calls: list[tuple] = []
            MADE.append(self)

        def open(self, saved: dict | None) -> dict:
            self.calls.append(("open", saved))
            return {"run": "r-1"}

        def config(self, cfg: Config, resumed: bool) -> None:
            self.calls.append(("config", cfg.name, resumed))

        def metrics(self, step: int, values: dict[str, float], time_s: float) -> None:
            self.calls.append(("metrics", step, values))

        def event(self, step: int, kind: str, text: str) -> None:
            self.calls.append(("event", step, kind, text))

        def link(self, key: str, value: str) -> None:
            self.calls.append(("link", key, value))

        def artifact(self, path: Path) -> None: ...

        def close(self, ended: str) -> None:
            self.calls.append(("close", ended))
"""


@pytest.fixture
def recorder(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "added").mkdir()
    with added_module("keel.monitor.tracking", "recorder", RECORDER, tmp_path / "added", BACKENDS) as module:
        yield module


def test_mlflow_and_wandb_register_by_their_modules_with_their_clients() -> None:
    kinds = BACKENDS.all()
    assert [(name, kind.make, kind.client, kind.extra) for name, kind in kinds.items()] == [
        ("mlflow", MlflowBackend, "mlflow", "mlflow"), ("wandb", WandbBackend, "wandb", "wandb")]


def test_a_new_tracker_registers_by_its_file_alone_and_receives_the_runs_records(recorder: str,
                                                                                tmp_path: Path) -> None:
    cfg = Config(name="tiny")
    assert enabled_trackers(cfg) == [], "a tracker without its config section is off"
    module = importlib.import_module(recorder)
    cfg.monitor.recorder = module.RecorderConfig(enabled=True)  # type: ignore[attr-defined]
    assert enabled_trackers(cfg) == ["recorder"]
    check_trackers(cfg)  # no client library to look for
    run_dir = tmp_path / "tiny-lr1e-3"
    run_dir.mkdir()
    emitted: list[tuple] = []
    trackers = Trackers(cfg, run_dir, lambda *a, **kw: emitted.append(a), lambda _: None)
    trackers.on_start(TrainState())
    trackers.write({"step": 1, "time": 1.0, "train/loss": 2.5, "ok": True})
    trackers.on_event({"kind": "guard", "step": 1, "action": "skip", "detail": {"guard": "numerics"}})
    trackers.on_checkpoint_saved(TrainState(step=1), "/ckpt/step-1")
    trackers.close("finished")
    made = module.MADE[-1]
    assert made.given == ("demo", "tiny-lr1e-3", "tiny", run_dir)
    assert made.calls == [("open", None), ("config", "tiny", False), ("metrics", 1, {"train/loss": 2.5}),
                          ("event", 1, "guard", "step 1: skip (guard=numerics)"),
                          ("link", "checkpoint", "/ckpt/step-1"), ("close", "finished")]
    assert json.loads((run_dir / TRACKERS).read_text()) == {"recorder": {"run": "r-1", "sent_step": 1}}
    assert emitted == [], "nothing was dropped or refused"


def test_a_new_tracker_left_disabled_by_its_section_is_never_made(recorder: str, tmp_path: Path) -> None:
    module = importlib.import_module(recorder)
    cfg = Config()
    cfg.monitor.recorder = module.RecorderConfig(enabled=False)  # type: ignore[attr-defined]
    trackers = Trackers(cfg, tmp_path, lambda *a, **kw: None, lambda _: None)
    trackers.on_start(TrainState())
    trackers.close("finished")
    assert enabled_trackers(cfg) == [] and module.MADE == []
