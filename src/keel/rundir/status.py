"""status.json: where a run stands (running, paused, finished, stopped, failed), written by rank 0, and
`keel status`, which reads it together with the run lock, the checkpoints and the last events."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from keel.errors import KeelError
from keel.rundir.events import read_jsonl
from keel.rundir.lock import LOCK

STATUS = "status.json"
STATES = ("running", "paused", "finished", "stopped", "failed")


def write_status(run_dir: Path, state: str, step: int, **detail: Any) -> None:
    """Atomically: a reader never sees half a file. `checkpoint` is the newest committed one."""
    record = {"state": state, "step": step, "time": round(time.time(), 3), **detail}
    tmp = run_dir / f".{STATUS}.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, run_dir / STATUS)


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return {}


def job_alive(run_dir: Path) -> bool:
    """Whether a keel job holds the run directory's lock (the kernel drops it when the holder dies)."""
    for path in run_dir.glob(LOCK + "*"):  # .lock, or .lock.NODE per node of an elastic job
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a lock taken here
    return False


def run_status(run_dir: Path, events: int = 5) -> dict:
    """What `keel status` shows. A run whose status says running but whose job is gone died without a
    word (SIGKILL, power, OOM killer): that is a failure."""
    if not run_dir.is_dir():
        raise KeelError(f"run directory {str(run_dir)!r} does not exist; pass the --run-dir of a keel train job "
                        f"(default runs/<config name>)")
    status = read_status(run_dir)
    alive = job_alive(run_dir)
    state = status.get("state", "not started")
    if alive and state not in ("running",):
        state = "running"  # starting up, or resuming, before rank 0 has said so
    elif not alive and state == "running":
        state = "failed"
        status["reason"] = "the job ended without writing its status (killed or crashed); rerun to resume"
    return {"run_dir": str(run_dir), "state": state, "step": status.get("step", 0), "alive": alive,
            "since": status.get("time"), "reason": status.get("reason", ""),
            "last_checkpoint": status.get("checkpoint"),
            "events": read_jsonl(run_dir / "events.jsonl")[-events:] if events > 0 else []}


def status_lines(info: dict) -> list[str]:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"])) if info["since"] else "-"
    lines = [f"{info['run_dir']}: {info['state']} at step {info['step']} (as of {since})"]
    if info["reason"]:
        lines.append(f"  reason: {info['reason']}")
    lines.append(f"  last checkpoint: {info['last_checkpoint'] or 'none'}")
    for e in info["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
        detail = readable(e.get("detail", {}))
        group = f"group {e['group']} " if "group" in e else ""  # one of a run's replica groups
        lines.append(f"  {when} {group}step {e['step']} rank {e['rank']} {e['kind']} {e['action']} {detail}".rstrip())
    return lines


DETAIL_CHARS = 160  # an event's detail on one console line
STAMP_FLOOR = 1.5e9  # a float above this in an event's detail is a time stamp (seconds since 1970; 2017 on)


def _value(value: object) -> str:
    if isinstance(value, list) and value and all(isinstance(v, dict) and "ok" in v for v in value):
        failed = [str(v.get("name", "?")) for v in value if not v["ok"]]  # preflight's checks
        return f"{len(value) - len(failed)}/{len(value)} passed" + (f" (failed: {', '.join(failed)})" if failed else "")
    if isinstance(value, float):
        return time.strftime("%H:%M:%S", time.localtime(value)) if value > STAMP_FLOOR else f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def readable(detail: dict) -> str:
    """An event's detail as `key=value` pairs a person reads: checks counted, time stamps as local times,
    numbers to four figures, long values cut, the whole line kept short."""
    text = ", ".join(f"{k}={_value(v)}" for k, v in detail.items())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."
