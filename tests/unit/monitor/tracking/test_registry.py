"""Experiment trackers register by their module of keel.monitor.tracking: a tracker added as one new module file
declares its config section, is enabled by it, made with it and the run's names, and fed the run's metrics and
events on its own thread, as MLflow and W&B are."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.cli import main
from keel.config import Config, MonitorConfig, load_config
from keel.config.sections import SECTIONS, sections
from keel.core.state import TrainState
from keel.errors import ConfigError
from keel.monitor.trackers import TRACKERS, Trackers
from keel.monitor.tracking.mlflow_backend import MlflowBackend, MlflowConfig
from keel.monitor.tracking.registry import BACKENDS, check_trackers, enabled_trackers, tracker
from keel.monitor.tracking.wandb_backend import WandbBackend, WandbConfig
from tests.package_files import added_module

# A tracker as its own module of keel.monitor.tracking would be: its section (`monitor.recorder`) and a client
# that needs no library and keeps what it is given.
RECORDER = """
    from dataclasses import dataclass
    from pathlib import Path

    from keel.config import Config, option
    from keel.monitor.tracking.registry import tracker

    MADE = []


    @dataclass
    class RecorderConfig:
        enabled: bool = option(False, "keep what the run sends")
        project: str = option("demo", "the project")


    @tracker("recorder", config=RecorderConfig)
    class Recorder:
        def __init__(self, section: RecorderConfig, run_name: str, config_name: str, run_dir: Path) -> None:
            self.given = (section.project, run_name, config_name, run_dir)
            self.calls: list[tuple] = []
            MADE.append(self)

        def open(self, saved: dict | None, key: str) -> dict:
            self.calls.append(("open", saved))
            return {"run": "r-1"}

        def config(self, cfg: Config) -> None:
            self.calls.append(("config", cfg.name))

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
    with added_module("keel.monitor.tracking", "recorder", RECORDER, tmp_path / "added", BACKENDS,
                      SECTIONS[MonitorConfig]) as module:
        yield module


def test_mlflow_and_wandb_register_by_their_modules_with_their_sections_and_clients() -> None:
    kinds = BACKENDS.all()
    assert [(name, kind.make, kind.client, kind.package) for name, kind in kinds.items()] == [
        ("mlflow", MlflowBackend, "mlflow", "mlflow"), ("wandb", WandbBackend, "wandb", "wandb")]
    assert sections(MonitorConfig) == {"mlflow": MlflowConfig, "wandb": WandbConfig}
    monitor = Config().monitor
    assert isinstance(monitor.mlflow, MlflowConfig) and isinstance(monitor.wandb, WandbConfig)


def test_a_new_tracker_registers_by_its_file_alone_and_receives_the_runs_records(recorder: str,
                                                                                tmp_path: Path) -> None:
    cfg = Config(name="tiny")
    assert enabled_trackers(cfg) == [], "a tracker is off by its section's default"
    module = importlib.import_module(recorder)
    assert isinstance(cfg.monitor.recorder, module.RecorderConfig)
    cfg.monitor.recorder.enabled = True
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
    assert made.calls == [("open", None), ("config", "tiny"), ("metrics", 1, {"train/loss": 2.5}),
                          ("event", 1, "guard", "step 1: skip (guard=numerics)"),
                          ("link", "checkpoint", "/ckpt/step-1"), ("close", "finished")]
    (kept,) = json.loads((run_dir / TRACKERS).read_text()).values()
    assert len(kept.pop("key")) == 32 and kept == {"run": "r-1", "sent_step": 1}
    assert emitted == [], "nothing was dropped or refused"


def test_a_new_tracker_left_disabled_by_its_section_is_never_made(recorder: str, tmp_path: Path) -> None:
    module = importlib.import_module(recorder)
    cfg = load_config(None, ["monitor.recorder.enabled=false", "monitor.recorder.project=other"])
    trackers = Trackers(cfg, tmp_path, lambda *a, **kw: None, lambda _: None)
    trackers.on_start(TrainState())
    trackers.close("finished")
    assert enabled_trackers(cfg) == [] and module.MADE == []


def test_a_tracker_whose_section_cannot_switch_it_on_is_refused() -> None:
    @dataclasses.dataclass
    class NoSwitch:
        project: str = "demo"

    with pytest.raises(TypeError, match="the section of the tracker 'x', NoSwitch, needs a field `enabled: bool`"):
        tracker("x", config=NoSwitch)


def test_a_tracker_named_as_an_option_of_monitor_is_refused() -> None:
    @dataclasses.dataclass
    class Section:
        enabled: bool = False

    with pytest.raises(ValueError, match="'interval' cannot name a section of MonitorConfig"):
        tracker("interval", config=Section)(type("Backend", (), {}))
    assert "interval" not in BACKENDS.all()


# A tracker whose client library is a package of its own, not installed here.
REMOTE = """
    from dataclasses import dataclass

    from keel.config import option
    from keel.monitor.tracking.registry import tracker


    @dataclass
    class RemoteConfig:
        enabled: bool = option(False, "log the run to the remote service")


    @tracker("remote", config=RemoteConfig, client="keel_remote_client", package="keel-remote-client")
    class Remote:
        def __init__(self, *args: object) -> None:
            raise AssertionError("never made: its client is missing")
"""


def test_a_tracker_without_its_client_is_refused_before_the_run_naming_the_package_to_install(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with added_module("keel.monitor.tracking", "remote_backend", REMOTE, tmp_path / "added", BACKENDS,
                      SECTIONS[MonitorConfig]):
        message = ("monitor.remote.enabled = true needs the keel_remote_client package: pip install "
                   "keel-remote-client, or set monitor.remote.enabled = false")
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            check_trackers(load_config(None, ["monitor.remote.enabled=true"]))
        assert main(["train", "--run-dir", str(tmp_path / "run"), "monitor.remote.enabled=true"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"keel: error: {message}"]
        assert not (tmp_path / "run").exists()
