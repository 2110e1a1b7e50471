"""Running a sweep: each point a real `keel train` in its own run directory under the sweep directory, as many
at once as there are slots. A point is done when its run finished its steps, or when a guard stopped it (it
diverged; a rerun would meet the same). Rerunning the sweep starts only the other points, and `keel train`
resumes a killed one from its latest checkpoint. The points die with the sweep (the kernel's parent-death
signal), and a SIGTERM or SIGINT pauses them all (each checkpoints) before the sweep exits."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keel.config import Config, to_toml
from keel.errors import EXIT_GUARD_STOP, EXIT_PAUSED, ConfigError
from keel.health.lifeline import kill_when_parent_dies
from keel.model.flops import param_count
from keel.report.svg import finite
from keel.rundir.events import read_jsonl
from keel.rundir.lock import HELD_ENV, WORKERS_ENV
from keel.rundir.status import read_status
from keel.sweep.analysis import AXES
from keel.sweep.grid import Axis, Point

SPEC = "sweep_spec.json"
OUTCOMES = "outcomes.json"
SIGNALS = ("signals/attn_logit_max", "signals/log_z_max")


@dataclass
class Sweep:
    """A sweep directory: its definition (kept in sweep_spec.json; a rerun must ask for the same), its points and
    their configs."""

    root: Path
    config: str | None
    overrides: list[str]
    axes: list[Axis]
    steps: int
    base: Config
    points: list[Point]
    configs: list[Config]
    outcomes: dict[str, int] = field(default_factory=dict)

    def spec(self) -> dict:
        return {"grid": [[a.key, list(a.values)] for a in self.axes], "steps": self.steps,
                "overrides": self.overrides, "config": self.config, "base config": to_toml(self.base)}

    def run_dir(self, point: Point) -> Path:
        return self.root / "points" / point.name

    def check_spec(self) -> None:
        """A sweep directory holds one sweep: a rerun with another grid, config or step count would mix points of
        two sweeps in one result."""
        path = self.root / SPEC
        if not path.exists():
            return
        held = json.loads(path.read_text())
        for key, value in self.spec().items():
            if held.get(key) != value:
                raise ConfigError(f"sweep directory {str(self.root)!r} holds a sweep with another {key}; rerun it "
                                  f"with the same arguments to finish it, or pass another --out")

    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / SPEC).write_text(json.dumps(self.spec(), indent=1) + "\n")
        (self.root / "logs").mkdir(exist_ok=True)
        try:
            self.outcomes = json.loads((self.root / OUTCOMES).read_text())
        except (OSError, ValueError):
            self.outcomes = {}

    def record_outcome(self, point: Point, code: int) -> None:
        self.outcomes[point.name] = code
        tmp = self.root / f".{OUTCOMES}.tmp"
        tmp.write_text(json.dumps(self.outcomes, indent=1) + "\n")
        os.replace(tmp, self.root / OUTCOMES)

    def done(self, point: Point, status: dict | None = None) -> bool:
        """Whether the point needs no more training (`status`: its status.json, when already read)."""
        status = read_status(self.run_dir(point)) if status is None else status
        finished = status.get("state") == "finished" and status.get("step") == self.steps
        return finished or self.outcomes.get(point.name) == EXIT_GUARD_STOP


def _command(sweep: Sweep, point: Point) -> list[str]:
    config = ["--config", sweep.config] if sweep.config else []
    return [sys.executable, "-m", "keel", "train", *config, "--run-dir", str(sweep.run_dir(point)), "--quiet",
            *sweep.overrides, *point.overrides, f"train.steps={sweep.steps}"]


def _environment(threads: int, device: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (HELD_ENV, WORKERS_ENV)}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


@dataclass
class Slots:
    """Where the points run: `count` at once, each on `threads` CPU threads, or each on one of `devices`."""

    count: int
    threads: int
    devices: list[str] | None = None


def run_points(sweep: Sweep, slots: Slots, say: Callable[[str], None]) -> int:
    """Run every point not yet done; 0 when all are done, EXIT_PAUSED when a signal paused them, 1 when a point
    failed (its log named)."""
    pending = [p for p in sweep.points if not sweep.done(p)]
    skipped = len(sweep.points) - len(pending)
    say(f"sweep of {len(sweep.points)} points: {skipped} done already, {len(pending)} to run, {slots.count} at once")
    stop: list[int] = []
    running: dict[int, tuple[Point, subprocess.Popen, float]] = {}  # slot -> point

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(signum)
        for _, proc, _ in running.values():
            proc.send_signal(signal.SIGTERM)  # each point pauses: it checkpoints and exits

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    failed: list[str] = []
    try:
        while pending or running:
            for slot in range(slots.count):
                if slot not in running and pending and not stop:
                    point = pending.pop(0)
                    running[slot] = (point, _start(sweep, point, slots, slot), time.monotonic())
            time.sleep(0.2)
            for slot, (point, proc, started) in list(running.items()):
                if (code := proc.poll()) is None:
                    continue
                del running[slot]
                _finished(sweep, point, code, time.monotonic() - started, failed, say)
            if stop and not running:
                break
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop:
        say(f"sweep paused by signal {stop[0]}; run the same command again to finish its points")
        return EXIT_PAUSED
    return 1 if failed else 0


def _start(sweep: Sweep, point: Point, slots: Slots, slot: int) -> subprocess.Popen:
    log = (sweep.root / "logs" / f"{point.name}.log").open("ab")
    device = slots.devices[slot] if slots.devices else None
    try:
        return subprocess.Popen(_command(sweep, point), env=_environment(slots.threads, device), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=kill_when_parent_dies)
    finally:
        log.close()  # the child holds its own descriptor


def _finished(sweep: Sweep, point: Point, code: int, seconds: float, failed: list[str],
              say: Callable[[str], None]) -> None:
    if code != EXIT_PAUSED:
        sweep.record_outcome(point, code)
    summary = point_result(sweep, point)
    what = ", ".join(point.overrides)
    if code == 0 or code == EXIT_GUARD_STOP:
        loss = "diverged" if summary["diverged"] else f"loss {summary['loss']:.4f}"
        say(f"  {what}: {loss} ({seconds:.0f} s)")
    elif code != EXIT_PAUSED:
        failed.append(point.name)
        say(f"  {what}: failed with exit code {code}; see {sweep.root / 'logs' / (point.name + '.log')}")


def point_result(sweep: Sweep, point: Point) -> dict:
    """What sweep.json says of a point, from its run directory alone (so a point resumed after a kill reads the
    same as one that ran straight through): nothing timed, no absolute path."""
    cfg = sweep.configs[point.index]
    run_dir = sweep.run_dir(point)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    status = read_status(run_dir)
    done = sweep.done(point, status)
    losses = [r["train/loss"] for r in metrics if "train/loss" in r]
    train, val = (float(v) if finite(v := summary.get(k)) else None for k in ("train_loss", "val_loss"))
    loss = val if val is not None else train
    initial = math.log(cfg.model.vocab_size)  # the loss of a uniform prediction, where a model starts
    diverged = done and (sweep.outcomes.get(point.name) == EXIT_GUARD_STOP or loss is None or loss >= initial
                         or not all(math.isfinite(v) for v in losses))
    signals = {key.removeprefix("signals/"): max(vals) for key in SIGNALS
               if (vals := [r[key] for r in metrics if finite(r.get(key))])}
    group = ", ".join(f"{k}={v}" for k, v in point.settings if k not in AXES)
    return {"name": point.name, "settings": dict(point.settings), "group": group, "width": cfg.model.dim,
            "lr": cfg.optim.lr, "params": param_count(cfg.model), "parametrization": cfg.model.parametrization,
            "base_dim": cfg.model.base_dim, "n_layers": cfg.model.n_layers, "warmup_steps": cfg.optim.warmup_steps,
            "tokens": sweep.steps * cfg.train.global_batch * cfg.train.seq_len, "initial_loss": initial, "done": done,
            "step": summary.get("step", 0) if done else status.get("step", 0),
            "train_loss": train, "val_loss": val, "loss": loss, "diverged": diverged, "signals": signals,
            "guard_events": sum(1 for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "guard")}


def results(sweep: Sweep, series: Callable[[list[dict]], list[dict]]) -> dict:
    """sweep.json: the definition, every point and, over the finished ones, the series."""
    points = [point_result(sweep, p) for p in sweep.points]
    finished = [p for p in points if p["done"]]
    return {"config": sweep.config, "overrides": sweep.overrides, "steps": sweep.steps,
            "grid": {a.key: list(a.values) for a in sweep.axes}, "metric": _metric(finished),
            "complete": len(finished) == len(points), "points": points, "series": series(finished)}


def _metric(points: Sequence[dict]) -> str:
    return "val_loss" if points and all(p["val_loss"] is not None for p in points if not p["diverged"]) \
        else "train_loss"
