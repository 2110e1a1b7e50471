"""Experiment trackers (MLflow, Weights & Biases: their clients are keel.monitor.tracking's) as a monitor
component: rank 0 hands every metrics record, event and checkpoint to one background thread per tracker,
which owns the tracker's client.

Training never waits for a tracker: records go into a bounded queue, and a record that finds the queue full
is dropped and counted, as are those that come while a tracker rests after a failed request (the thread
says how many, at most once a minute, and at the end); what was dropped is not sent later. A tracker that
cannot be reached costs the loop one `put_nowait` per record. A key for the tracker's run is kept in
RUN_DIR/trackers.json before the run is started, its id as soon as it exists, so that a resumed run, after
any kind of stop, continues the same tracker run, and the last step the tracker received: a restart first
sends the records of metrics.jsonl after it (what a SIGKILL caught in the queue, or the whole history where
a tracker is enabled on a run that has one), so that the tracker's run holds what metrics.jsonl holds.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keel.config import Config, TrackerQueueConfig
from keel.core.callbacks import Callback
from keel.core.state import TrainState
from keel.monitor.run_monitor import RunMonitor, replica_group
from keel.monitor.tracking.registry import Backend, enabled_trackers, make_backend
from keel.rundir.events import EventLog, read_jsonl

TRACKERS = "trackers.json"
METRICS = "metrics.jsonl"
REPORT_EVERY_S = 60.0  # the thread's warnings about a tracker in trouble, at most this often
REOPEN_EVERY_S = 30.0  # a tracker that could not be opened is tried again this often
RETRY_AFTER_S = 10.0  # a tracker whose request failed is left alone this long
SAVE_EVERY_S = 5.0  # the last step a tracker received, kept in RUN_DIR/trackers.json this often


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record (booleans and text are not series), its `step` and `time` left out."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool)}


def cause(e: Exception) -> str:
    """A tracker client's exception in one short line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def ids_of(saved: dict) -> dict:
    """What identifies a tracker run in its entry of trackers.json (the tracker's own ids)."""
    return {k: v for k, v in saved.items() if k not in ("sent_step", "key")}


def read_saved(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / TRACKERS).read_text())
    except (OSError, ValueError):
        return {}


def save_ids(run_dir: Path, name: str, ids: dict) -> None:
    """Atomically, beside the other trackers' ids."""
    kept = read_saved(run_dir)
    kept[name] = ids
    tmp = run_dir / f".{TRACKERS}.{os.getpid()}.{name}.tmp"
    tmp.write_text(json.dumps(kept, indent=1) + "\n")
    os.replace(tmp, run_dir / TRACKERS)


class TrackerChannel:
    """One tracker (`name`: its registered name) behind a bounded queue and its own thread."""

    def __init__(self, name: str, backend: Backend, cfg: Config, run_dir: Path, qc: TrackerQueueConfig,
                 warn: Callable[[str, dict], None], start_step: int) -> None:
        self.name, self.backend, self.cfg, self.run_dir, self.warn = name, backend, cfg, run_dir, warn
        # metrics.jsonl's records up to the step this start resumes from are sent from the file (those after it
        # are redone, and come through the queue)
        self.start_step = start_step
        self.ids: dict = {}
        self.sent_step, self._saved_at = -1, 0.0
        self.queue: queue.Queue[tuple[str, tuple] | None] = queue.Queue(qc.queue)
        self.dropped = self.failed = self._reported = 0
        self._last_report = 0.0
        self.opened = False
        self._next_open = self._rest_until = 0.0
        self.error = ""
        self.thread = threading.Thread(target=self._run, name=f"keel-{name}", daemon=True)
        self.thread.start()

    def put(self, method: str, *args: Any) -> None:
        """From any thread, never blocking: a full queue drops the record and counts it."""
        try:
            self.queue.put_nowait((method, args))
        except queue.Full:
            self.dropped += 1

    def close(self, ended: str, timeout_s: float) -> None:
        """Send what is held (for at most `timeout_s`), end the tracker's run as `ended`, and say what was lost."""
        deadline = time.monotonic() + timeout_s
        for item in (("close", (ended,)), None):  # the end of the tracker's run waits its turn, not dropped
            try:
                self.queue.put(item, timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Full:
                break
        self.thread.join(max(deadline - time.monotonic(), 0.0))
        if self.thread.is_alive():
            self.dropped += self.queue.qsize()
            self.error = self.error or f"still sending after monitor.trackers.close_timeout_s = {timeout_s:g} s"
        self._report(final=True)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            method, args = item
            # After a failure the tracker rests for RETRY_AFTER_S (what comes meanwhile is dropped), so that a
            # dead server costs one request's timeout per rest, not a backlog; its run's end is always tried.
            if not self._open() or (method != "close" and time.monotonic() < self._rest_until):
                self.dropped += 1
            else:
                try:
                    getattr(self.backend, method)(*args)
                    if method == "metrics":
                        self._sent(args[0])
                except Exception as e:  # the tracker's own failure (a server down, a refused value): counted
                    self.failed += 1
                    self.error = cause(e)
                    self._rest_until = time.monotonic() + RETRY_AFTER_S
            self._report()
        if self.opened:
            self._sent(self.sent_step, force=True)

    def _open(self) -> bool:
        """The tracker's run, opened (or continued) on first use; retried every REOPEN_EVERY_S."""
        if self.opened or time.monotonic() < self._next_open:
            return self.opened
        entry = read_saved(self.run_dir).get(self.name, {})
        try:
            if not (key := entry.get("key")):  # kept before the tracker's run is started: see Backend.open
                key = uuid.uuid4().hex
                save_ids(self.run_dir, self.name, entry := {**entry, "key": key})
            opened = self.backend.open(ids_of(entry) or None, key)
            self.sent_step = int(entry.get("sent_step", -1)) if opened == ids_of(entry) else -1
            self.ids = {**opened, "key": key}
            save_ids(self.run_dir, self.name, {**self.ids, "sent_step": self.sent_step})
            self.backend.config(self.cfg)
            self._backfill()
            self.opened = True
        except Exception as e:
            self._next_open = time.monotonic() + REOPEN_EVERY_S
            self.failed += 1
            self.error = f"cannot open a run: {cause(e)}"
        return self.opened

    def _backfill(self) -> None:
        """The records of metrics.jsonl after the last step the tracker received, up to this start's step."""
        after = self.sent_step  # a step redone after a resume is in the file twice: both are sent, in order
        for record in read_jsonl(self.run_dir / METRICS):
            if after < record.get("step", -1) <= self.start_step and (values := numeric(record)):
                self.backend.metrics(record["step"], values, record.get("time", time.time()))
                self.sent_step = max(self.sent_step, record["step"])
        self._sent(self.sent_step, force=True)

    def _sent(self, step: int, force: bool = False) -> None:
        """`step`'s metrics reached the tracker: kept for the next start (at most every SAVE_EVERY_S)."""
        self.sent_step = max(self.sent_step, step)
        if force or time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._saved_at = time.monotonic()
            save_ids(self.run_dir, self.name, {**self.ids, "sent_step": self.sent_step})

    def _report(self, final: bool = False) -> None:
        lost = self.dropped + self.failed
        if lost == self._reported or not (final or time.monotonic() - self._last_report >= REPORT_EVERY_S):
            return
        self._last_report, self._reported = time.monotonic(), lost
        self.warn(f"{self.name}: {self.dropped} records dropped, {self.failed} refused"
                  f"{f' (last error: {self.error})' if self.error else ''}; training goes on",
                  {"tracker": self.name, "dropped": self.dropped, "failed": self.failed,
                   "error": self.error})


class Trackers(Callback):
    """On rank 0: the enabled trackers, fed every metrics record (a sink of the RunMonitor), every event
    of this rank, and each committed checkpoint's path; closed with the monitor."""
    priority = 40
    builtin = True

    def __init__(self, cfg: Config, run_dir: Path, emit: Callable[..., None], say: Callable[[str], None]) -> None:
        self.cfg, self.run_dir, self.emit, self.say, self.step = cfg, run_dir, emit, say, 0
        self.channels: list[TrackerChannel] = []
        self.early: list[tuple[str, tuple]] | None = []  # the events before the start (the resume among them)

    def on_start(self, state: TrainState) -> None:
        """The trackers start once the step this start resumes from is known."""
        self.step, cfg = state.step, self.cfg
        self.channels = [TrackerChannel(name, make_backend(name, cfg, self.run_dir), cfg, self.run_dir,
                                        cfg.monitor.trackers, self._warn, state.step) for name in enabled_trackers(cfg)]
        early, self.early = self.early or [], None
        for method, args in early:
            self._put(method, *args)

    def _warn(self, text: str, detail: dict) -> None:
        self.emit("tracker", self.step, "degraded", **detail)
        self.say(f"warning: tracker {text}")

    def _put(self, method: str, *args: Any) -> None:
        if self.early is not None:
            self.early.append((method, args))
        for channel in self.channels:
            channel.put(method, *args)

    def write(self, record: dict[str, Any]) -> None:
        """A metrics record (RunMonitor sink)."""
        self.step = int(record["step"])
        if values := numeric(record):
            self._put("metrics", self.step, values, record.get("time", time.time()))

    def on_event(self, record: dict) -> None:
        """An event of this rank (EventLog listener); the trackers' own warnings are not sent to them."""
        if record["kind"] == "tracker":
            return
        detail = ", ".join(f"{k}={v}" for k, v in record["detail"].items())
        self._put("event", int(record["step"]), record["kind"], f"step {record['step']}: {record['action']}"
                  f"{f' ({detail})' if detail else ''}")

    def on_checkpoint_saved(self, state: TrainState, path: str) -> None:
        self._put("link", "checkpoint", str(path))

    def close(self, ended: str | None) -> None:
        """The run ends (`ended`: finished, paused, stopped; None: it failed)."""
        for channel in self.channels:
            channel.close(ended or "failed", self.cfg.monitor.trackers.close_timeout_s)
        self.channels = []


def attach_report(cfg: Config, run_dir: Path, report: Path) -> list[str]:
    """After the job: the run's report, added to each tracker run it logged to (the ids in RUN_DIR/trackers.json).
    Returns what could not be attached, one line per tracker."""
    problems = []
    saved = read_saved(run_dir)
    for name in enabled_trackers(cfg):
        if name not in saved:
            continue
        try:
            backend = make_backend(name, cfg, run_dir)
            backend.open(ids_of(saved[name]), saved[name].get("key", ""))
            backend.artifact(report)
            backend.close("finished")
        except Exception as e:
            problems.append(f"{name}: the report was not attached ({cause(e)})")
    return problems


def run_trackers(cfg: Config, run_dir: Path, monitor: RunMonitor, events: EventLog, say: Callable[[str], None],
                 rank0: bool) -> list[Trackers]:
    """The experiment trackers of a run, fed from rank 0 (of the first replica group: one tracker run per run):
    a sink of the monitor and a subscriber of the events; none when no tracker is enabled."""
    if not (rank0 and enabled_trackers(cfg) and replica_group() in (None, "0")):
        return []
    trackers = Trackers(cfg, run_dir, events.emit, say)
    monitor.sinks.append(trackers)
    events.subscribe(trackers.on_event)
    return [trackers]
