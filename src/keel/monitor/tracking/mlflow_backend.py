"""MLflow as an experiment tracker (its section `[monitor.mlflow]`: MlflowConfig): a run of the tracking server's
experiment, the config as its parameters, every metric under keel's names, events as tags. The client is
imported on the tracker's thread, only where the tracker is enabled (the mlflow extra)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.checkpoint.identity import flat_config as settings
from keel.config import Config, option
from keel.monitor.tracking.registry import tracker

# MLflow's limits per log_batch call, and on a key's characters.
MLFLOW_PARAMS_PER_CALL, MLFLOW_METRICS_PER_CALL, MLFLOW_TAG_CHARS = 100, 1000, 5000
_MLFLOW_KEY = re.compile(r"[^\w./\- :]")
# The state a keel run ended in → MLflow's run status (a paused run is resumed later into the same MLflow run).
MLFLOW_KEY_TAG = "keel.run_key"  # the tag that finds a run again whose id was never kept
MLFLOW_STATUS = {"finished": "FINISHED", "paused": "KILLED", "stopped": "KILLED", "failed": "FAILED"}


@dataclass
class MlflowConfig:
    enabled: bool = option(False, "log the run to MLflow (needs the mlflow extra): the resolved config as "
                           "parameters, every metric under keel's names, events as tags, the final checkpoint's "
                           "path and the report; a resumed run continues the same MLflow run")
    tracking_uri: str = option("", "the tracking server, e.g. http://mlflow:5000 (empty: MLFLOW_TRACKING_URI, else "
                               "MLflow's own default)")
    experiment: str = option("keel", "experiment the run is logged under (created if missing)")
    run_name: str = option("", "the MLflow run's name (empty: the run directory's name)")
    tags: list[str] = option([], "tags of the MLflow run, each `KEY=VALUE` (or `KEY`, set to true)")
    timeout_s: float = option(10.0, "seconds one request to the server may take before it is retried or given "
                              "up; training never waits for the tracker", gt=0, le=3600)


def flat_config(cfg: Config) -> dict[str, str]:
    """The resolved config as `section.key` → text (lists as JSON), the way MLflow shows parameters."""
    return {key: json.dumps(value) if isinstance(value, list) else str(value)
            for key, value in settings(cfg).items()}


def mlflow_key(key: str) -> str:
    """keel's metric names are MLflow's, but for characters MLflow refuses (a data source's name may hold any)."""
    return _MLFLOW_KEY.sub("_", key)


@tracker("mlflow", config=MlflowConfig, client="mlflow")
class MlflowBackend:

    def __init__(self, mc: MlflowConfig, run_name: str, config_name: str, run_dir: Path) -> None:
        self.mc, self.run_name, self.config_name, self.run_dir = mc, mc.run_name or run_name, config_name, run_dir
        # Requests give up quickly: the queue holds what is not sent yet, and a dead server must not hold
        # the end of the run for MLflow's default two minutes per request.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(math.ceil(mc.timeout_s)))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.client: Any = None
        self.run_id = ""

    def open(self, saved: dict | None, key: str) -> dict:
        from mlflow import MlflowClient  # on the tracker's thread: its import takes seconds

        self.client = MlflowClient(self.mc.tracking_uri or None)
        uri = str(self.client.tracking_uri)
        if saved and saved.get("tracking_uri") == uri:  # the same server: continue its run
            self.run_id = saved["run_id"]
        else:  # MLflow names its runs itself: one started before its id was kept is found by its key's tag
            experiment = self.client.get_experiment_by_name(self.mc.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else
                             self.client.create_experiment(self.mc.experiment))
            found = self.client.search_runs([experiment_id], filter_string=f"tags.`{MLFLOW_KEY_TAG}` = '{key}'",
                                            max_results=1)
            if not found:
                self.run_id = self.client.create_run(experiment_id, run_name=self.run_name,
                                                     tags=self.tags(key)).info.run_id
                return {"run_id": self.run_id, "tracking_uri": uri}
            self.run_id = found[0].info.run_id
        self.client.update_run(self.run_id, "RUNNING")  # a continued run ended KILLED or FAILED, or was cut off
        return {"run_id": self.run_id, "tracking_uri": uri}

    def tags(self, key: str) -> dict[str, str]:
        """A new run's tags: the configured ones (`KEY=VALUE`, or a bare `KEY` as true), where its run directory
        is, the name of its config and the keel run's key."""
        tags = {key: value if sep else "true" for key, sep, value in (tag.partition("=") for tag in self.mc.tags)}
        config = {"keel.config": self.config_name} if self.config_name else {}
        return {**tags, "keel.run_dir": str(self.run_dir.resolve()), **config, MLFLOW_KEY_TAG: key}

    def config(self, cfg: Config) -> None:
        """The resolved config as parameters (MLflow keeps a parameter's first value: a value changed on
        resume is a `config.changed.KEY` tag) and as config.toml."""
        from mlflow.entities import Param, RunTag

        from keel.config import to_toml

        flat = flat_config(cfg)
        logged = self.client.get_run(self.run_id).data.params
        params = [Param(k, v[:6000]) for k, v in flat.items() if k not in logged]
        tags = [RunTag(f"config.changed.{k}", v[:MLFLOW_TAG_CHARS]) for k, v in flat.items()
                if k in logged and logged[k] != v[:6000]]
        for i in range(0, max(len(params), len(tags)), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_PARAMS_PER_CALL],
                                  tags=tags[i:i + MLFLOW_PARAMS_PER_CALL])
        self.client.log_text(self.run_id, to_toml(cfg), "config.toml")

    def metrics(self, step: int, values: dict[str, float], time_s: float) -> None:
        from mlflow.entities import Metric

        batch = [Metric(mlflow_key(k), v, int(time_s * 1000), step) for k, v in values.items()]
        for i in range(0, len(batch), MLFLOW_METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=batch[i:i + MLFLOW_METRICS_PER_CALL])

    def event(self, step: int, kind: str, text: str) -> None:
        """The newest event of each kind, as the tag `event.KIND` (the whole log is events.jsonl)."""
        self.client.set_tag(self.run_id, f"event.{mlflow_key(kind)}", text[:MLFLOW_TAG_CHARS])

    def link(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value[:MLFLOW_TAG_CHARS])

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, ended: str) -> None:
        self.client.set_tag(self.run_id, "keel.state", ended)
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(ended, "FAILED"))
