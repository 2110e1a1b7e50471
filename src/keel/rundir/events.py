"""The run directory's logs: events.jsonl, metrics.jsonl and the per-rank messages, written so that
several processes (and a process killed mid-line) never corrupt them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keel.rundir.progress import Progress
from keel.rundir.quarantine import node_name


class JsonlSink:
    """One JSON object per line. Each record is a single write() on an O_APPEND descriptor, so lines
    from several processes never interleave."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, allow_nan=True) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventLog:
    """events.jsonl: `{"time", "step", "rank", "kind", "action", "detail"}` per decision or fault."""

    def __init__(self, path: Path, rank: int) -> None:
        self.sink, self.rank = JsonlSink(path), rank
        self.listeners: list[Callable[[dict], None]] = []  # the alert rules watch the events

    def emit(self, kind: str, step: int, action: str = "", **detail: Any) -> None:
        record = {"time": round(time.time(), 3), "step": step, "rank": self.rank, "kind": kind, "action": action,
                  "detail": detail}
        self.sink.write(record)
        for listener in list(self.listeners):
            listener(record)

    def subscribe(self, listener: Callable[[dict], None]) -> None:
        self.listeners.append(listener)

    def unsubscribe(self, listener: Callable[[dict], None]) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def close(self) -> None:
        self.sink.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file. A line that does not parse is skipped: a writer killed in the middle
    of a line (SIGKILL, a full disk) must not make the run unreadable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def host() -> str:
    return node_name()


class RunLog:
    """The run directory's outputs for one rank: events, metrics (rank 0 writes them) and messages."""

    def __init__(self, run_dir: Path, rank: int, layout: str = "") -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(run_dir / "events.jsonl", rank)
        self.metrics = JsonlSink(run_dir / "metrics.jsonl") if rank == 0 else None
        self.say = Progress(run_dir / "logs" / f"rank-{rank}.log", echo=rank == 0, layout=layout)

    def metric(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.close()
        if self.metrics is not None:
            self.metrics.close()
        self.say.close()
