"""Weights & Biases as an experiment tracker (its section `[monitor.wandb]`: WandbConfig): a run of the project,
online or written offline under the run directory, the config, every metric under keel's names, event kinds as
tags. The client is imported on the tracker's thread, only where the tracker is enabled (the wandb extra)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from keel.config import Config, option
from keel.monitor.tracking.registry import tracker

WANDB_TAG_CHARS = 64


@dataclass
class WandbConfig:
    enabled: bool = option(False, "log the run to Weights & Biases (needs the wandb extra): the resolved config, "
                           "every metric under keel's names, event kinds as tags, the final checkpoint's path and "
                           "the report; a resumed run continues the same W&B run")
    project: str = option("keel", "the W&B project")
    entity: str = option("", "the W&B team or user (empty: the account's default)")
    run_name: str = option("", "the W&B run's name (empty: the run directory's name)")
    tags: list[str] = option([], "tags of the W&B run")
    mode: str = option("online", "online (sent as it runs), offline (written under RUN_DIR/wandb, `wandb sync` "
                       "uploads it later)", choices=("online", "offline"))


@tracker("wandb", config=WandbConfig, client="wandb")
class WandbBackend:

    def __init__(self, wc: WandbConfig, run_name: str, config_name: str, run_dir: Path) -> None:
        self.wc, self.run_name, self.config_name, self.run_dir = wc, wc.run_name or run_name, config_name, run_dir
        self.run: Any = None

    def open(self, saved: dict | None, key: str) -> dict:
        import wandb

        # The run's own files only: no console capture, system metrics, code or package list (keel
        # monitors the machine itself).
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                  save_code=False, disable_git=True, x_save_requirements=False)
        # W&B takes a run's id from its caller: the key, so that a start stopped before keeping it continues it.
        self.run = wandb.init(project=self.wc.project, entity=self.wc.entity or None, name=self.run_name,
                              tags=self.tags(), mode=cast(Any, self.wc.mode), dir=str(self.run_dir),
                              id=saved["id"] if saved else key, resume="allow",
                              settings=settings)
        return {"id": self.run.id, "project": self.wc.project, "mode": self.wc.mode}

    def tags(self) -> list[str]:
        """A new run's tags: the configured ones and `config=NAME` (W&B's tags are words of at most 64
        characters)."""
        return [*self.wc.tags, *([f"config={self.config_name}"[:WANDB_TAG_CHARS]] if self.config_name else [])]

    def config(self, cfg: Config) -> None:
        self.run.config.update(dataclasses.asdict(cfg), allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float], time_s: float) -> None:
        self.run.log(values, step=step)

    def event(self, step: int, kind: str, text: str) -> None:
        """Each kind of event seen becomes a tag of the run; its newest is in the summary as `event/KIND`."""
        if kind not in self.run.tags:
            self.run.tags = (*self.run.tags, kind)
        self.run.summary[f"event/{kind}"] = text

    def link(self, key: str, value: str) -> None:
        self.run.summary[key] = value

    def artifact(self, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.id}-{path.stem}", type=path.stem)
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self, ended: str) -> None:
        self.run.summary["keel/state"] = ended
        self.run.finish(exit_code=0 if ended in ("finished", "paused") else 1)
