"""`keel status RUN_DIR` in a few lines (or JSON): the state, step and last checkpoint that
keel.rundir.status reads, plus the ETA, the last losses, the goodput ratio and the alerts raised since
the run last started; for a run of replica groups, the run as a whole and one line per group. Also reads
the run directory's files for the HTML report."""

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


def is_run_dir(path: Path) -> bool:
    """A directory holding at least one of the files a keel train job writes."""
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


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
    resumes = [e for e in run.events if e.get("kind") == "resume" and isinstance(e.get("detail"), dict)]
    return {**info, "name": run.config.get("name") or run.summary.get("name") or run.path.name, "step": step,
            "total_steps": total, "step_s": step_s, "eta_s": eta_s,
            "train_loss": last_value(run.metrics, "train/loss"), "val_loss": last_value(run.metrics, "val/loss"),
            "tokens_seen": tokens["value"] if tokens else run.summary.get("tokens_seen"),
            "goodput_ratio": ratio, "wall_s": wall_seconds(run, info["since"]), "alerts": alerts,
            "last_restore": last_restore(resumes[-1], run.events) if resumes else None}


def last_restore(event: dict, events: list[dict]) -> dict:
    """Which tier and step the latest start restored, how long the load took, and the ranks restarted alone when
    the failure before it was one the launcher handled in-process (health.in_process_restart)."""
    detail = event["detail"]
    failures = [e for e in events if e.get("kind") == "failure" and e.get("time", 0) <= event.get("time", 0)]
    alone = failures[-1]["detail"].get("ranks") if failures and failures[-1].get("action") == "in_process" else None
    return {"step": event.get("step"), "tier": detail.get("tier") or "storage", "checkpoint": detail.get("checkpoint"),
            "load_s": detail.get("load_s"), "time": event.get("time"), "restarted_alone": alone}


def group_dirs(run_dir: Path) -> list[Path]:
    """The groups' own run directories (RUN_DIR/groups/G) of a run of replica groups, in group order; none
    for any other run directory."""
    root = run_dir / "groups"
    found = [p for p in root.iterdir() if p.name.isdigit() and p.is_dir()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name))


def quorum_events(events: list[dict], action: str) -> list[dict]:
    return [e for e in events if e.get("kind") == "quorum" and e.get("action") == action]


def group_summary(run: Run, info: dict, lost: dict[int, dict]) -> dict:
    """One replica group (`info`: its summary as a run): where its own run directory stands, its part in the
    quorum (heals and retries over every start of the group, the live groups at its last quorum), and why
    the run gave it up (`lost`: the launcher's `replica_group_lost` alerts by group), if it did."""
    quorums = [e for e in run.events if e.get("kind") == "quorum" and "participants" in (e.get("detail") or {})]
    heals = quorum_events(run.events, "heal")
    last_heal = {"time": heals[-1].get("time"), "step": heals[-1].get("step"),
                 "heal_s": heals[-1]["detail"].get("heal_s")} if heals else None
    return {"group": int(run.path.name), "run_dir": str(run.path), "state": info["state"], "step": info["step"],
            "since": info["since"], "reason": info["reason"],
            "participants": quorums[-1]["detail"]["participants"] if quorums else None,
            "heals": len(heals), "last_heal": last_heal, "retries": len(quorum_events(run.events, "retry")),
            "goodput_ratio": info["goodput_ratio"],
            "last_checkpoint": info["last_checkpoint"],
            "given_up": (lost.get(int(run.path.name)) or {}).get("detail", {}).get("message")}


def run_state(alive: bool, states: list[str]) -> str:
    """A run of replica groups runs while its launcher or any group does; once all have ended it finished
    if any group did (as the launcher's exit code says), else paused if any paused, else as its first group."""
    if alive or "running" in states:
        return "running"
    return next((s for s in ("finished", "paused") if s in states), states[0] if states else "not started")


def newest_checkpoint(paths: list[str | None]) -> str | None:
    """The newest of checkpoint paths named step-NNNNNN (zero-padded: longer names are later steps)."""
    names = [p for p in paths if p]
    return max(names, key=lambda p: (len(Path(p).name), Path(p).name)) if names else None


def replica_summary(run_dir: Path, dirs: list[Path], events: int = 5) -> dict:
    """The run as a whole (its furthest group's step, loss and ETA; the shared newest checkpoint; the
    goodput of all groups' time together), then one entry per group."""
    top = run_status(run_dir, events)  # the group launcher's lock and events
    runs = [load_run(d) for d in dirs]
    infos = [summarize(run, events=0) for run in runs]
    lost = {e["detail"]["group"]: {**e, "group": e["detail"]["group"]} for e in read_jsonl(run_dir / "events.jsonl")
            if e.get("kind") == "alert" and e.get("action") == "replica_group_lost"}
    groups = [group_summary(run, info, lost) for run, info in zip(runs, infos, strict=True)]
    lead = max(infos, key=lambda i: i["step"])
    buckets: dict[str, float] = {}
    for run in runs:
        for k, v in (run.goodput.get("buckets") or {}).items():
            buckets[k] = buckets.get(k, 0.0) + (v if finite(v) else 0.0)
    state = run_state(top["alive"], [g["state"] for g in groups])
    return {**lead, "run_dir": str(run_dir), "state": state, "alive": top["alive"],
            "since": max((g["since"] for g in groups if finite(g["since"])), default=None),
            "reason": next((g["reason"] for g in groups if g["state"] == state and state != "running"), ""),
            "last_checkpoint": newest_checkpoint([g["last_checkpoint"] for g in groups]),
            "eta_s": lead["eta_s"] if state != "finished" else None,
            "goodput_ratio": goodput_ratio({"buckets": buckets}),
            "alerts": by_time([*lost.values(), *tagged(groups, [i["alerts"] for i in infos])], newest_first=True)[:5],
            "events": by_time(top["events"] + tagged(groups, [r.events for r in runs]))[-events:]
            if events > 0 else [], "groups": groups}


def tagged(groups: list[dict], records: list[list[dict]]) -> list[dict]:
    """Each group's records with its group number."""
    return [{**r, "group": g["group"]} for g, rs in zip(groups, records, strict=True) for r in rs]


def by_time(records: list[dict], newest_first: bool = False) -> list[dict]:
    return sorted(records, key=lambda r: r["time"] if finite(r.get("time")) else 0.0, reverse=newest_first)


def summary(run_dir: Path, events: int = 5) -> dict:
    """What `keel status RUN_DIR` shows, JSON-serialisable (`--json`)."""
    dirs = group_dirs(run_dir) if run_dir.is_dir() else []
    return json_safe(replica_summary(run_dir, dirs, events) if dirs else summarize(load_run(run_dir), events))


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
    if (restore := info.get("last_restore")) is not None:
        took = f" in {restore['load_s']:.2f} s" if finite(restore.get("load_s")) else ""
        lines.append(f"  last restore: step {restore['step']} from the {restore['tier']} tier{took} at "
                     f"{_clock(restore.get('time'))} ({restore['checkpoint']})")
        if alone := restore.get("restarted_alone"):
            lines.append(f"    in-process: rank(s) {', '.join(map(str, alone))} restarted alone, the others kept their "
                         f"processes")
    lines.append(f"  loss: train {_loss(info['train_loss'])} · validation {_loss(info['val_loss'])}")
    ratio, wall = info["goodput_ratio"], info["wall_s"]
    lines.append(f"  goodput {f'{ratio:.1%}' if ratio is not None else '-'}"
                 + (f" of {format_duration(wall)} wall time" if wall is not None else ""))
    lines += group_lines(info.get("groups") or [])
    if info["alerts"]:
        lines.append(f"  alerts since the last start (newest first, {len(info['alerts'])} shown):")
        for e in info["alerts"]:
            detail = e.get("detail") or {}
            group = f"group {e['group']} " if "group" in e else ""
            lines.append(f"    {_clock(e.get('time'))} {group}step {e.get('step')} {e.get('action')} "
                         f"({detail.get('severity', '?')}): {detail.get('message', '')}".rstrip())
    else:
        lines.append("  alerts since the last start: none")
    if info["events"]:
        lines += ["  recent events:", *base[cut:]]
    return lines


def _clock(t: object) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if finite(t) else "-"


def group_lines(groups: list[dict]) -> list[str]:
    """One line per replica group: state, step, live groups at its last quorum, heals, retries, goodput."""
    lines = [f"  replica groups ({len(groups)}):"] if groups else []
    for g in groups:
        heal = g["last_heal"]
        healed = f", last {_clock(heal['time'])} at step {heal['step']} in {heal['heal_s']:.2f} s" \
            if heal and finite(heal.get("heal_s")) else ""
        ratio = g["goodput_ratio"]
        lines.append(f"    group {g['group']}: {g['state']} at step {g['step']} · "
                     f"{g['participants'] if g['participants'] is not None else '-'} live at its last quorum · "
                     f"{g['heals']} heal(s){healed} · {g['retries']} retr{'y' if g['retries'] == 1 else 'ies'} · "
                     f"goodput {f'{ratio:.1%}' if ratio is not None else '-'}")
        if g.get("given_up"):
            lines.append(f"      given up: {g['given_up']}")
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
