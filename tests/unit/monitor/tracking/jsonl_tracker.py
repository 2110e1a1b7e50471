"""A tracker as the one file that adds it to keel would be (`src/keel/monitor/tracking/jsonl_backend.py`): its config
section and its backend, a file of JSON lines under the run directory, with no client library. The tests add
this file to the package keel.monitor.tracking (tests.package_files.added_module); nothing imports it from here,
where it would register for good."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from keel.config import Config, option, to_toml
from keel.monitor.tracking.registry import tracker


@dataclass
class JsonlConfig:
    enabled: bool = option(False, "append the run's records to a JSON Lines file of the run directory")
    file: str = option("tracker.jsonl", "the file's name, under the run directory")
    every: int = option(1, "keep one metrics record in this many steps", ge=1)


@tracker("jsonl", config=JsonlConfig)
class JsonlBackend:

    def __init__(self, section: JsonlConfig, run_name: str, config_name: str, run_dir: Path) -> None:
        self.section, self.path = section, run_dir / section.file
        self.names = {"run": run_name, "config": config_name}

    def write(self, kind: str, **record: object) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"kind": kind, **record}) + "\n")

    def open(self, saved: dict | None, key: str) -> dict:
        self.write("open", resumed=saved is not None, **self.names)
        return {"file": str(self.path)}

    def config(self, cfg: Config) -> None:
        self.write("config", toml=to_toml(cfg))

    def metrics(self, step: int, values: dict[str, float], time_s: float) -> None:
        if step % self.section.every == 0:
            self.write("metrics", step=step, values=values)

    def event(self, step: int, kind: str, text: str) -> None:
        self.write("event", step=step, event=kind, text=text)

    def link(self, key: str, value: str) -> None:
        self.write("link", key=key, value=value)

    def artifact(self, path: Path) -> None:
        self.write("artifact", path=str(path))

    def close(self, ended: str) -> None:
        self.write("close", ended=ended)
