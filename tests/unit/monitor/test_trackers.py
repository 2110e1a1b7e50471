"""The trackers' channel in one process, with a recording backend in place of a tracker's client (the
real clients against a real MLflow server and W&B files are tests/dist/test_trackers.py): a slow or dead
tracker never blocks the caller, what it loses is counted and said, and a restart sends the history it
missed from metrics.jsonl."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from keel.config import Config, TrackerQueueConfig
from keel.errors import ConfigError
from keel.monitor.trackers import TRACKERS, TrackerChannel, numeric
from keel.monitor.tracking.mlflow_backend import MlflowBackend, flat_config
from keel.monitor.tracking.registry import check_trackers, make_backend
from keel.monitor.tracking.wandb_backend import WandbBackend


class Recording:
    """A tracker that keeps what it is sent; `gate` holds every call until set, `fail` makes them raise."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate, self.fail = gate, fail
        self.calls: list[tuple] = []
        self.opened_with: list[dict | None] = []

    def _call(self, *call: object) -> None:
        if self.gate is not None:
            self.gate.wait()
        if self.fail:
            raise ConnectionError("Connection refused")
        self.calls.append(call)

    def open(self, saved: dict | None, key: str) -> dict:
        self.opened_with.append((saved, key))
        return {"run_id": "r1"}

    def config(self, cfg: Config) -> None: ...

    def metrics(self, step: int, values: dict[str, float], time_s: float) -> None:
        self._call("metrics", step, values)

    def event(self, step: int, kind: str, text: str) -> None:
        self._call("event", kind)

    def link(self, key: str, value: str) -> None: ...
    def artifact(self, path: Path) -> None: ...

    def close(self, ended: str) -> None:
        self.calls.append(("close", ended))


class StoppedInOpen(Recording):
    """A start whose `open` never returns its ids (the process killed there, the tracker's run perhaps made)."""

    def open(self, saved: dict | None, key: str) -> dict:
        super().open(saved, key)
        raise ConnectionError("killed before the ids were kept")


def channel(backend: Recording, run_dir: Path, queue: int = 1000, start_step: int = 0,
            warnings: list | None = None) -> TrackerChannel:
    return TrackerChannel("mlflow", backend, Config(), run_dir, TrackerQueueConfig(queue=queue),
                          lambda text, detail: (warnings if warnings is not None else []).append((text, detail)),
                          start_step)


def test_a_stuck_tracker_never_blocks_and_the_overflow_is_dropped_and_counted(tmp_path: Path) -> None:
    gate, warnings = threading.Event(), []
    backend = Recording(gate)
    ch = channel(backend, tmp_path, queue=5, warnings=warnings)
    started = time.perf_counter()
    for step in range(1, 101):
        ch.put("metrics", step, {"train/loss": 1.0}, 0.0)
    assert time.perf_counter() - started < 1.0, "put waited for the tracker"
    gate.set()
    ch.close("finished", timeout_s=10)
    sent = [c[1] for c in backend.calls if c[0] == "metrics"]
    assert sent == sorted(sent) and 0 < len(sent) <= 6 and ch.dropped == 100 - len(sent)
    assert backend.calls[-1] == ("close", "finished")
    text, detail = warnings[-1]
    assert detail["dropped"] == ch.dropped and f"{ch.dropped} records dropped" in text


def test_a_dead_tracker_is_counted_and_the_close_gives_up_after_its_timeout(tmp_path: Path) -> None:
    warnings: list = []
    dead = Recording(fail=True)
    refusing = channel(dead, tmp_path, warnings=warnings)
    for step in range(1, 4):
        refusing.put("metrics", step, {"train/loss": 1.0}, 0.0)
    refusing.close("finished", timeout_s=10)
    # the first failure rests the tracker: the next records are dropped, its run's end is still tried
    assert (refusing.failed, refusing.dropped) == (1, 2) and dead.calls == [("close", "finished")]
    assert "Connection refused" in warnings[-1][0]
    (tmp_path / "b").mkdir()
    stuck = channel(Recording(threading.Event()), tmp_path / "b")
    stuck.put("metrics", 1, {"train/loss": 1.0}, 0.0)
    started = time.perf_counter()
    stuck.close("finished", timeout_s=0.5)
    assert time.perf_counter() - started < 3 and "close_timeout_s" in stuck.error


def test_a_restart_sends_the_records_the_tracker_missed_up_to_its_step(tmp_path: Path) -> None:
    # The tracker received step 2; the process died at step 6 after its checkpoint of step 4.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 10.0 - s, "time": 1.0}) + "\n"
                                                    for s in range(1, 7)) + '{"step": 7, "train/lo')
    (tmp_path / TRACKERS).write_text(json.dumps({"mlflow": {"run_id": "r1", "key": "k", "sent_step": 2}}))
    backend = Recording()
    ch = channel(backend, tmp_path, start_step=4)
    ch.put("metrics", 5, {"train/loss": 4.5}, 0.0)  # the redone step 5
    ch.close("finished", timeout_s=10)
    assert backend.opened_with == [({"run_id": "r1"}, "k")]
    assert [(c[1], c[2]["train/loss"]) for c in backend.calls if c[0] == "metrics"] == [(3, 7.0), (4, 6.0), (5, 4.5)]
    assert json.loads((tmp_path / TRACKERS).read_text())["mlflow"] == {"run_id": "r1", "key": "k", "sent_step": 5}


def test_the_tracker_run_key_is_kept_before_the_run_is_started_and_reused_by_the_next_start(tmp_path: Path) -> None:
    # The first start is stopped inside `open`: its tracker run may exist, its ids were never kept.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n"
                                                    for s in (1, 2)))
    stopped = StoppedInOpen()
    channel(stopped, tmp_path, start_step=2).close("failed", timeout_s=10)
    ((saved, key),) = stopped.opened_with
    assert saved is None and json.loads((tmp_path / TRACKERS).read_text()) == {"mlflow": {"key": key}}
    restarted = Recording()
    channel(restarted, tmp_path, start_step=2).close("finished", timeout_s=10)
    # the same key, no ids to continue by, so the whole history is sent again
    assert restarted.opened_with == [(None, key)] and [c[1] for c in restarted.calls if c[0] == "metrics"] == [1, 2]
    assert json.loads((tmp_path / TRACKERS).read_text())["mlflow"] == {"run_id": "r1", "key": key, "sent_step": 2}


def test_a_tracker_enabled_on_a_run_with_history_receives_all_of_it(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n"
                                                    for s in (1, 2)))
    backend = Recording()
    ch = channel(backend, tmp_path, start_step=2)
    ch.close("paused", timeout_s=10)
    assert [c[1] for c in backend.calls if c[0] == "metrics"] == [1, 2] and backend.opened_with[0][0] is None


def test_records_become_numeric_series_and_the_config_flat_parameters() -> None:
    assert numeric({"step": 3, "time": 1.5, "train/loss": 2, "ok": True, "name": "x"}) == {"train/loss": 2.0}
    flat = flat_config(Config())
    assert flat["model.dim"] == "256" and flat["data.sources.main.paths"] == '["stdlib"]'
    assert flat["monitor.mlflow.enabled"] == "False"


def test_an_enabled_tracker_without_its_client_is_refused_with_the_extra_to_install(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = Config()
    cfg.monitor.wandb.enabled = True
    with pytest.raises(ConfigError, match=r"monitor.wandb.enabled = true needs the wandb package: pip install "
                                          r"'keel-pretrain\[wandb\]'"):
        check_trackers(cfg)


def test_tracker_runs_are_named_after_their_run_directory_with_the_config_as_a_tag(tmp_path: Path) -> None:
    cfg = Config(name="tiny")
    cfg.monitor.mlflow.tags = ["team=lm", "proxy"]
    cfg.monitor.wandb.tags = ["proxy"]
    run_dir = tmp_path / "tiny-lr1e-2"
    mlflow = make_backend("mlflow", cfg, run_dir)
    wandb = make_backend("wandb", cfg, run_dir)
    assert isinstance(mlflow, MlflowBackend) and isinstance(wandb, WandbBackend)
    assert mlflow.run_name == wandb.run_name == "tiny-lr1e-2"
    assert mlflow.tags("k1") == {"team": "lm", "proxy": "true", "keel.run_dir": str(run_dir.resolve()),
                                 "keel.config": "tiny", "keel.run_key": "k1"}
    assert wandb.tags() == ["proxy", "config=tiny"]
    # A replica group logs the whole run, under the run directory's name; a configured name wins.
    assert make_backend("mlflow", cfg, run_dir / "groups" / "0").run_name == "tiny-lr1e-2"
    cfg.monitor.wandb.run_name = "mine"
    assert make_backend("wandb", cfg, run_dir).run_name == "mine"
