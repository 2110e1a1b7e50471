"""A tracker added to keel as one file (tests/unit/monitor/tracking/jsonl_tracker.py, added to the package
keel.monitor.tracking as jsonl_backend.py): its section `[monitor.jsonl]` is loaded, checked, written back and
documented as the built-in sections are, and `monitor.jsonl.enabled=true` feeds it a real training run."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keel.checkpoint.identity import flat_config, setting_changes
from keel.cli import main
from keel.config import INT_MAX, MonitorConfig, load_config, reference, to_toml
from keel.config.sections import SECTIONS
from keel.errors import ConfigError
from keel.monitor.tracking.registry import BACKENDS, check_trackers, enabled_trackers
from keel.train.trainer import Trainer
from tests.package_files import added_module

BACKEND = (Path(__file__).parent / "jsonl_tracker.py").read_text()


@pytest.fixture
def jsonl(tmp_path: Path) -> Iterator[str]:
    with added_module("keel.monitor.tracking", "jsonl_backend", BACKEND, tmp_path / "added", BACKENDS,
                      SECTIONS[MonitorConfig]) as module:
        yield module


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tracker_added_as_one_file_is_enabled_by_its_section_and_fed_a_real_run(
        jsonl: str, build: Callable[..., Trainer]) -> None:
    trainer = build([], "monitor.jsonl.enabled=true", "monitor.jsonl.every=2")
    assert enabled_trackers(trainer.cfg) == ["jsonl"]
    code = trainer.fit()
    trainer.monitor.close("finished")
    trainer.monitor.stop()  # the trackers end with the monitor
    assert code == 0
    run_dir = trainer.run_dir
    got = records(run_dir / "tracker.jsonl")
    assert got[0] == {"kind": "open", "resumed": False, "run": run_dir.name, "config": "tiny"}
    config = tomllib.loads(got[1]["toml"])["monitor"]["jsonl"]
    assert config == {"enabled": True, "file": "tracker.jsonl", "every": 2}
    metrics = [r for r in got if r["kind"] == "metrics"]
    assert [r["step"] for r in metrics if "train/loss" in r["values"]] == [2, 4, 6], "one step in monitor.jsonl.every"
    assert any("val/loss" in r["values"] for r in metrics)
    assert [Path(r["value"]).name for r in got if r["kind"] == "link"] == ["step-000002", "step-000004",
                                                                             "step-000006"]
    assert {"start", "checkpoint", "finish"} <= {r["event"] for r in got if r["kind"] == "event"}
    assert got[-1] == {"kind": "close", "ended": "finished"}
    assert json.loads((run_dir / "trackers.json").read_text())["jsonl"]["sent_step"] == 6
    # The run directory keeps the section: its config.toml reads back as the run's config, and a resume compares
    # it with the checkpoint's config as any other setting.
    saved = load_config(run_dir / "config.toml")
    assert saved == trainer.cfg and saved.monitor.jsonl.every == 2
    manifest = json.loads((run_dir / "checkpoints" / "step-000006" / "manifest.json").read_text())
    assert manifest["config"]["monitor"]["jsonl"] == {"enabled": True, "file": "tracker.jsonl", "every": 2}
    assert setting_changes(manifest["config"], saved) == {}
    saved.monitor.jsonl.every = 3
    assert setting_changes(manifest["config"], saved) == {"monitor.jsonl.every": [2, 3]}


def test_a_tracker_section_is_loaded_checked_written_and_documented_as_a_builtin_one(
        jsonl: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[monitor.jsonl]\nenabled = true\nevery = 5\n')
    cfg = load_config(path, ["monitor.jsonl.file=records.jsonl"])
    section = cfg.monitor.jsonl
    assert (section.enabled, section.every, section.file) == (True, 5, "records.jsonl")
    assert load_config(None).monitor.jsonl.enabled is False, "the defaults of the section"
    assert "[monitor.jsonl]\nenabled = true\nfile = \"records.jsonl\"\nevery = 5\n" in to_toml(cfg)
    assert flat_config(cfg)["monitor.jsonl.every"] == 5
    check_trackers(cfg)  # no client library to look for
    for override, message in [
            ("monitor.jsonl.evry=2", "unknown config key 'evry' in [monitor.jsonl]; did you mean 'every'?"),
            ("monitor.jsonl.every=0", f"monitor.jsonl.every = 0 is out of range: must be >= 1 and <= {INT_MAX}"),
            ("monitor.jsonl.enabled=1", "monitor.jsonl.enabled = 1: expected true or false"),
            ("monitor.jsonl.every.x=1", "override 'monitor.jsonl.every.x=1': 'monitor.jsonl.every' is not a section")]:
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert str(info.value) == message
        assert main(["config", override]) == 2
        assert capsys.readouterr().err.splitlines() == [f"keel: error: {message}"]
    path.write_text('[monitor.jsonl]\nevery = "often"\n')
    with pytest.raises(ConfigError, match=r"^monitor.jsonl.every = 'often': expected an integer$"):
        load_config(path)
    assert ("monitor.jsonl.every", "int", "1", "keep one metrics record in this many steps") in reference()
    assert main(["config", "--reference"]) == 0
    assert "| `monitor.jsonl.file` | str | `\"tracker.jsonl\"` | the file's name, under the run directory |" in \
        capsys.readouterr().out


def test_without_its_file_a_tracker_section_is_an_unknown_key(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"^unknown config key 'jsonl' in \[monitor\]; known keys: .*alerts, "
                                          r"trackers, mlflow, wandb$"):
        load_config(None, ["monitor.jsonl.enabled=true"])
    assert all(not key.startswith("monitor.jsonl.") for key, *_ in reference())
