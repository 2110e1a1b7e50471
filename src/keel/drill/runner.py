"""Run a scenario for real and judge its recovery against a clean reference run of the same config."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.checkpoint.inspect import state_sha256
from keel.config import load_config
from keel.drill.procs import Launch
from keel.drill.scenarios import BITWISE, Scenario
from keel.monitor.goodput import ratio
from keel.monitor.sinks import read_jsonl

DEFAULT_CONFIG = Path("configs/tiny.toml")
# Events that happen in every run: left out of the story a drill tells.
ROUTINE = {("checkpoint", "interval"), ("preflight", "passed"), ("telemetry", "unavailable"),
           ("checkpoint", "committed"), ("checkpoint", "retired")}


class DrillError(RuntimeError):
    """The clean reference itself failed: nothing can be judged against it."""


@dataclass
class Drill:
    """Scenarios on one config and layout: `overrides` as for `keel train`, `nproc` processes, `steps` steps
    with a checkpoint every `interval`. Reference runs are cached under `workdir/references`."""

    workdir: Path
    overrides: list[str] = field(default_factory=list)
    config: Path | None = None
    nproc: int = 2
    steps: int = 40
    interval: int = 10
    timeout: float = 300.0
    say: Callable[[str], None] = lambda line: None

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config is None and (self.workdir / DEFAULT_CONFIG).is_file():
            self.config = self.workdir / DEFAULT_CONFIG  # what `keel train` would pick up there
        self.config = Path(self.config).resolve() if self.config is not None else None

    # ------------------------------------------------------------ launching

    def base(self, steps: int) -> list[str]:
        return [*self.overrides, f"train.steps={steps}", f"checkpoint.interval={self.interval}"]

    def train_args(self, run_dir: Path, overrides: list[str], max_restarts: int = 0) -> list[str]:
        config = ["--config", str(self.config)] if self.config is not None else []
        return ["train", "--nproc", str(self.nproc), "--run-dir", str(run_dir), "--quiet", *config, *overrides,
                "--max-restarts", str(max_restarts)]

    def launch(self, run_dir: Path, overrides: list[str], max_restarts: int = 0,
               outside: Any = None) -> dict[str, Any]:
        """One launch of `keel train`; with `outside`, its signal goes to the launcher once the run is there."""
        run_dir.mkdir(parents=True, exist_ok=True)
        sent: dict[str, Any] = {}
        with Launch(self.train_args(run_dir, overrides, max_restarts), self.workdir, run_dir / "drill.log") as job:
            if outside is not None:
                while job.proc.poll() is None and time.time() - job.started < self.timeout:
                    step = _status(run_dir).get("step", 0)
                    if step >= outside.at_step:
                        job.proc.send_signal(getattr(signal, outside.signal))
                        sent = {"time": time.time(), "step": step}
                        break
                    time.sleep(0.05)
            code = job.wait(self.timeout)
            leftovers = job.leftovers()
        return {"exit": code, "seconds": round(time.time() - job.started, 2), "outside": sent,
                "leftovers": leftovers}

    # ------------------------------------------------------------ the clean reference

    def reference_key(self, overrides: list[str]) -> str:
        cfg = load_config(self.config, overrides)
        key = {"config": cfg.digest(), "nproc": self.nproc}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def reference(self, extra: tuple[str, ...] = (), steps: int | None = None) -> Path:
        """The clean run of this config with `extra`, made once and reused while its key holds."""
        steps = steps or self.steps
        overrides = [*self.base(steps), *extra]
        key = self.reference_key(overrides)
        run_dir = self.workdir / "references" / key
        marker = run_dir / "drill-reference.json"
        if marker.is_file() and _final(run_dir, steps).is_dir():
            return run_dir
        shutil.rmtree(run_dir, ignore_errors=True)
        self.say(f"reference {key}: {' '.join(extra) or 'clean'}")
        done = self.launch(run_dir, overrides)
        if done["exit"] != 0 or not _final(run_dir, steps).is_dir():
            raise DrillError(f"the reference run {run_dir} failed (exit {done['exit']}); see {run_dir}/drill.log")
        marker.write_text(json.dumps({"key": key, "overrides": overrides, "nproc": self.nproc,
                                      "seconds": done["seconds"]}, indent=1) + "\n")
        return run_dir

    # ------------------------------------------------------------ one scenario

    def run(self, scenario: Scenario) -> dict[str, Any]:
        if scenario.requires:
            return {"scenario": scenario.name, "promise": scenario.promise, "promise_kept": None,
                    "detect_s": None, "recover_s": None, "steps_lost": None, "not_run": scenario.requires}
        steps = scenario.steps or self.steps
        extra = scenario.config + (scenario.reference_with if scenario.compare != BITWISE else ())
        ref_dir = self.reference(extra, steps)
        run_dir = self.workdir / "scenarios" / scenario.name
        shutil.rmtree(run_dir, ignore_errors=True)
        self.say(f"scenario {scenario.name}")
        inject = [f"drill.inject={json.dumps(list(scenario.inject))}"] if scenario.inject else []
        overrides = [*self.base(steps), *scenario.config, *scenario.tuning]
        launches = [self.launch(run_dir, [*overrides, *inject], scenario.max_restarts, scenario.outside)]
        if scenario.rerun:
            launches.append(self.launch(run_dir, overrides, scenario.max_restarts))
        return judge(scenario, run_dir, ref_dir, steps, launches)

    def run_all(self, scenarios: list[Scenario]) -> list[dict[str, Any]]:
        return [self.run(s) for s in scenarios]


# ---------------------------------------------------------------- judging


def judge(scenario: Scenario, run_dir: Path, ref_dir: Path, steps: int,
          launches: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare a faulted run with its reference: final state, losses, detection, recovery, goodput, events."""
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    broken: list[str] = []

    final, ref_final = _final(run_dir, steps), _final(ref_dir, steps)
    state_equal = final.is_dir() and state_sha256(final) == state_sha256(ref_final)
    if not final.is_dir():
        broken.append(f"no final checkpoint at step {steps}")
    elif not state_equal:
        broken.append("final state differs from the reference" if scenario.compare == BITWISE
                      else f"final state differs from the reference with {' '.join(scenario.reference_with)}")

    first_exit = launches[0]["exit"]
    if scenario.rerun and (first_exit == 0 if scenario.first_exit is None else first_exit != scenario.first_exit):
        broken.append(f"first launch exited {first_exit}, expected {scenario.first_exit or 'a failure'}")
    if launches[-1]["exit"] != 0:
        broken.append(f"the run ended with exit {launches[-1]['exit']}")
    if any(launch["leftovers"] for launch in launches):
        broken.append("processes outlived the launcher")

    fault_time, fault_step = _fault_point(scenario, launches[0], events)
    detected = _find(events, scenario.detect, from_step=fault_step - 1) if scenario.detect[0] else None
    if scenario.detect[0] and detected is None:
        broken.append(f"no {'/'.join(filter(None, scenario.detect))} event: the fault went undetected")
    recovered = None
    if detected is not None and scenario.recovered_by is not None:
        recovered = _find(events, scenario.recovered_by, after=detected["time"])
        if recovered is None:
            broken.append(f"no {'/'.join(filter(None, scenario.recovered_by))} event after the detection")

    ledger = _json(run_dir / "goodput.json")
    ref_ledger = _json(ref_dir / "goodput.json")
    recomputed = int(ledger.get("recomputed_steps", 0))
    skipped = sum(1 for e in events if e["kind"] == "guard" and e["action"] == "skip")
    losses, ref_losses = _losses(metrics), _losses(read_jsonl(ref_dir / "metrics.jsonl"))
    common = sorted(set(losses) & set(ref_losses))
    return {
        "scenario": scenario.name,
        "promise": scenario.promise,
        "promise_kept": not broken,
        "broken": broken,
        "compare": scenario.compare if scenario.compare == BITWISE else
        f"{scenario.compare}: {' '.join(scenario.reference_with)}",
        "state_equal": state_equal,
        "fault_step": fault_step,
        "detected_by": f"{detected['kind']}/{detected['action']}" if detected else None,
        # A crash is reported at the last step completed, one before the step the fault landed in.
        "detect_steps": max(0, detected["step"] - fault_step) if detected else None,
        "detect_s": round(detected["time"] - fault_time, 2) if detected and fault_time else None,
        "recover_s": (round(recovered["time"] - detected["time"], 2) if recovered else
                      0.0 if detected and scenario.recovered_by is None else None),
        "steps_lost": recomputed + skipped,
        "steps_recomputed": recomputed,
        "updates_skipped": skipped,
        "losses_equal": common == sorted(ref_losses) and all(losses[s] == ref_losses[s] for s in common),
        "loss_max_abs_diff": max((abs(losses[s] - ref_losses[s]) for s in common), default=None),
        "goodput": round(ratio(ledger["buckets"]), 4) if ledger.get("buckets") else None,
        "reference_goodput": round(ratio(ref_ledger["buckets"]), 4) if ref_ledger.get("buckets") else None,
        "goodput_buckets": ledger.get("buckets", {}),
        "launches": [{"exit": launch["exit"], "seconds": launch["seconds"]} for launch in launches],
        "events": story(events),
        "run_dir": str(run_dir),
        "reference_dir": str(ref_dir),
    }


def story(events: list[dict]) -> list[str]:
    """The run's non-routine events in order, `kind/action@step`, repeats from several ranks folded."""
    told: list[str] = []
    for e in events:
        if (e["kind"], e["action"]) in ROUTINE or e["kind"] == "telemetry":
            continue
        line = f"{e['kind']}/{e['action']}@{e['step']}" if e["action"] else f"{e['kind']}@{e['step']}"
        if not told or told[-1] != line:
            told.append(line)
    return told


def _fault_point(scenario: Scenario, first: dict[str, Any], events: list[dict]) -> tuple[float | None, int]:
    """When and in which step the fault landed: an action from outside is timed by the runner, an injected
    fault by the `drill/inject` event its injector wrote as it fired."""
    if first["outside"]:
        return first["outside"]["time"], first["outside"]["step"]
    fired = _find(events, ("drill", "inject"))
    return (fired["time"], fired["step"]) if fired else (None, scenario.fault_step)


def _find(events: list[dict], match: tuple[str, str], after: float | None = None, from_step: int = 0) -> dict | None:
    kind, action = match
    for e in events:
        if e["kind"] == kind and (not action or e["action"] == action) and e["step"] >= from_step and \
                (after is None or e["time"] >= after):
            return e
    return None


def _losses(metrics: list[dict]) -> dict[int, float]:
    """Loss per step, the last record of a step winning: the trajectory the run kept after any redo."""
    return {r["step"]: r["train/loss"] for r in metrics if "train/loss" in r}


def _final(run_dir: Path, steps: int) -> Path:
    return run_dir / "checkpoints" / f"step-{steps:06d}"


def _status(run_dir: Path) -> dict:
    return _json(run_dir / "status.json")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
