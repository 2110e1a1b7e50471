"""`keel status RUN_DIR` in a few lines (or JSON): the state, step and last checkpoint that
keel.rundir.status reads, plus the ETA, the last losses, the goodput ratio and the alerts raised since
the run last started. Also reads the run directory's files for the HTML report."""

from __future__ import annotations

import json
import math
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.report.svg import finite
from keel.rundir.events import read_jsonl
from keel.rundir.progress import format_duration
from keel.rundir.status import run_status, status_lines

RUN_FILES = ("metrics.jsonl", "events.jsonl", "goodput.json", "telemetry.jsonl", "status.json", "summary.json",
             "config.toml")
RECENT_STEPS = 20  # metrics records whose step time the ETA averages


@dataclass
class Run:
    path: Path
    metrics: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    telemetry: list[dict] = field(default_factory=list)
    goodput: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_run(run_dir: Path) -> Run:
    """Everything the run directory holds; a missing or unreadable file reads as empty."""
    try:
        config = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        config = {}
    return Run(run_dir, read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl"),
               read_jsonl(run_dir / "telemetry.jsonl"), _read_json(run_dir / "goodput.json"),
               _read_json(run_dir / "summary.json"), config)


def last_value(records: list[dict], key: str) -> dict | None:
    """The newest finite value of `key` and its step."""
    for record in reversed(records):
        if finite(record.get(key)):
            return {"step": record.get("step"), "value": record[key]}
    return None


def goodput_ratio(goodput: dict) -> float | None:
    buckets = goodput.get("buckets") or {}
    total = sum(v for v in buckets.values() if finite(v))
    return buckets.get("productive", 0.0) / total if total > 0 and finite(buckets.get("productive", 0.0)) else None


def wall_seconds(run: Run, until: float | None = None) -> float | None:
    """Wall time from the run's first start to its last sign of life (or `until`)."""
    starts = [e["time"] for e in run.events if e.get("kind") == "start" and finite(e.get("time"))]
    first = run.goodput.get("started") if finite(run.goodput.get("started")) else min(starts, default=None)
    if first is None:
        return None
    ends = [e["time"] for e in run.events[-1:] if finite(e.get("time"))]
    ends += [t for t in (run.goodput.get("updated"), until) if finite(t)]
    return max(0.0, max(ends, default=first) - first)


def summarize(run: Run, events: int = 5) -> dict:
    info = run_status(run.path, events)
    total = run.config.get("train", {}).get("steps")
    steps = [r["step"] for r in run.metrics if isinstance(r.get("step"), int)]
    step = info["step"] or (steps[-1] if steps else 0)
    recent = [r["time/step_s"] for r in run.metrics if finite(r.get("time/step_s"))][-RECENT_STEPS:]
    step_s = sum(recent) / len(recent) if recent else None
    remaining = total - step if isinstance(total, int) else None
    eta_s = remaining * step_s if step_s is not None and remaining is not None and info["state"] != "finished" else None
    starts = [i for i, e in enumerate(run.events) if e.get("kind") == "start"]
    since_start = run.events[starts[-1] if starts else 0:]
    alerts = [e for e in since_start if e.get("kind") == "alert"][::-1][:5]
    tokens = last_value(run.metrics, "train/tokens_seen")
    ratio = goodput_ratio(run.goodput)
    return {**info, "name": run.config.get("name") or run.summary.get("name") or run.path.name, "step": step,
            "total_steps": total, "step_s": step_s, "eta_s": eta_s,
            "train_loss": last_value(run.metrics, "train/loss"), "val_loss": last_value(run.metrics, "val/loss"),
            "tokens_seen": tokens["value"] if tokens else run.summary.get("tokens_seen"),
            "goodput_ratio": ratio, "wall_s": wall_seconds(run, info["since"]), "alerts": alerts}


def summary(run_dir: Path, events: int = 5) -> dict:
    """What `keel status RUN_DIR` shows, JSON-serialisable (`--json`)."""
    return json_safe(summarize(load_run(run_dir), events))


def _loss(entry: dict | None) -> str:
    return f"{entry['value']:.4f} (step {entry['step']})" if entry else "-"


def summary_lines(info: dict) -> list[str]:
    total = info.get("total_steps")
    shown = {**info, "step": f"{info['step']}/{total}" if total else info["step"]}
    base = status_lines(shown)  # header, reason, last checkpoint, then one line per recent event
    cut = len(base) - len(info["events"])
    lines = base[:cut]
    if info["eta_s"] is not None and info["step_s"] is not None:
        pace = f"at {info['step_s']:.3g} s/step recently"
        if info["state"] == "running":
            lines.append(f"  ETA {format_duration(info['eta_s'])} ({pace})")
        else:
            lines.append(f"  remaining {format_duration(info['eta_s'])} of training once resumed ({pace})")
    lines.append(f"  loss: train {_loss(info['train_loss'])} · validation {_loss(info['val_loss'])}")
    ratio, wall = info["goodput_ratio"], info["wall_s"]
    lines.append(f"  goodput {f'{ratio:.1%}' if ratio is not None else '-'}"
                 + (f" of {format_duration(wall)} wall time" if wall is not None else ""))
    if info["alerts"]:
        lines.append(f"  alerts since the last start (newest first, {len(info['alerts'])} shown):")
        for e in info["alerts"]:
            when = time.strftime("%H:%M:%S", time.localtime(e["time"])) if finite(e.get("time")) else "-"
            detail = e.get("detail") or {}
            lines.append(f"    {when} step {e.get('step')} {e.get('action')} ({detail.get('severity', '?')}): "
                         f"{detail.get('message', '')}".rstrip())
    else:
        lines.append("  alerts since the last start: none")
    if info["events"]:
        lines += ["  recent events:", *base[cut:]]
    return lines


def json_safe(value: Any) -> Any:
    """NaN and infinities as null: `--json` output that strict JSON parsers accept."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
