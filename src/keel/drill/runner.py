"""Run a scenario for real and judge its recovery against a clean reference run of the same config."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keel.checkpoint.inspect import load_full_state, state_sha256
from keel.checkpoint.manifest import MANIFEST, step_of
from keel.checkpoint.memory import memory_root
from keel.checkpoint.storage import LATEST
from keel.config import load_config
from keel.core.net import free_port
from keel.drill import network
from keel.drill.netns import unavailable
from keel.drill.procs import Launch, kill_tagged
from keel.drill.scenarios import (
    BITWISE,
    CLOSE,
    CLOSE_RTOL,
    CORRUPT_LATEST,
    LIGHTHOUSE,
    LOSE_MANIFEST,
    REPLICA_ATOL,
    Outside,
    Scenario,
)
from keel.errors import KeelError
from keel.monitor.goodput import ratio
from keel.rundir.events import read_jsonl

DEFAULT_CONFIG = Path("configs/tiny.toml")
# Events that happen in every run: left out of the story a drill tells.
ROUTINE = {("checkpoint", "interval"), ("preflight", "passed"), ("telemetry", "unavailable"),
           ("checkpoint", "committed"), ("checkpoint", "retired")}
# Set by the drill itself, for the reference and the faulted run alike.
OWN_KEYS = ("train.steps", "checkpoint.interval", "checkpoint.dir", "drill.inject")
# Settings that decide only when a detector looks, never what a run computes (the scenarios' tuning is made
# of them): clean runs that differ in them alone are the same reference.
LOOK_ONLY = (("guard", "sdc", "replay_interval"), ("guard", "sdc", "fingerprint_interval"),
             ("guard", "sdc", "at_rest_interval"), ("guard", "sdc", "at_rest_moments_every"), ("health", "watchdog"))




JOINED_STEPS = 4  # steps every node of a job makes together before one is lost


class DrillError(RuntimeError):
    """The clean reference itself failed: nothing can be judged against it."""


@dataclass
class Drill:
    """Scenarios on one config and layout, `nproc` processes, `steps` steps with a checkpoint every `interval`.

    `shape` overrides come first (a suite's model and batch), then the drill's own settings, the scenario's,
    and last the user's `overrides` as for `keel train`: they apply to the reference and the faulted run
    alike. Reference runs are cached under `workdir/references`."""

    workdir: Path
    overrides: list[str] = field(default_factory=list)
    config: Path | None = None
    nproc: int = 2
    steps: int = 40
    interval: int = 10
    timeout: float = 300.0
    say: Callable[[str], None] = lambda line: None
    shape: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config is None and (self.workdir / DEFAULT_CONFIG).is_file():
            self.config = self.workdir / DEFAULT_CONFIG  # what `keel train` would pick up there
        self.config = Path(self.config).resolve() if self.config is not None else None
        for override in self.overrides:
            if override.partition("=")[0].strip() in OWN_KEYS:
                raise KeelError(f"{override!r}: the drill sets {', '.join(OWN_KEYS)} itself (use --steps and "
                                f"--interval for the run's length and checkpoint interval)")
        if self.interval < 2 or self.steps < 3 * self.interval:
            raise KeelError(f"--steps {self.steps} --interval {self.interval}: a drill needs an interval of at "
                            f"least 2 and at least three checkpoints in the run (steps >= 3 x interval)")
        load_config(self.config, self.base(self.steps))  # a bad override fails here, before any run

    # ------------------------------------------------------------ launching

    def base(self, steps: int) -> list[str]:
        return [*self.shape, f"train.steps={steps}", f"checkpoint.interval={self.interval}"]

    def procs(self, nproc: int = 0, groups: int = 1) -> int:
        """Processes of a launch (of each replica group): `nproc` when a scenario's layout names it, else the
        drill's own, or one per replica group."""
        return nproc or (1 if groups > 1 else self.nproc)

    def train_args(self, run_dir: Path, overrides: list[str], max_restarts: int = 0, nproc: int | None = None,
                   more: tuple[str, ...] = (), groups: int = 1) -> list[str]:
        config = ["--config", str(self.config)] if self.config is not None else []
        if groups > 1:
            more = (*more, "--replica-groups", str(groups))
        return ["train", "--nproc", str(self.procs(nproc or 0, groups)), "--run-dir", str(run_dir), "--quiet",
                *config, *overrides, "--max-restarts", str(max_restarts), *more]

    def group_args(self, run_dir: Path, overrides: list[str], scenario: Scenario, group: int,
                   lighthouse: str) -> list[str]:
        """The command of one replica group of a run on several nodes, as each group's node runs it."""
        return self.train_args(run_dir / "groups" / str(group), [
            *overrides, f"fault_tolerance.replica_groups={scenario.groups}", f"fault_tolerance.lighthouse={lighthouse}",
            f"checkpoint.dir={run_dir / 'checkpoints'}"], scenario.max_restarts, 1)

    def launch(self, run_dir: Path, overrides: list[str], max_restarts: int = 0,
               outside: Any = None, groups: int = 1, nproc: int = 0) -> dict[str, Any]:
        """One launch of `keel train`; with `outside`, its signal goes to the launcher (or the lighthouse) once
        the run (its first replica group) is there."""
        run_dir.mkdir(parents=True, exist_ok=True)
        sent: dict[str, Any] = {}
        args = self.train_args(run_dir, overrides, max_restarts, nproc, groups=groups)
        watched = run_dir / "groups" / "0" if groups > 1 else run_dir
        with Launch(args, self.workdir, run_dir / "drill.log") as job:
            if outside is not None:
                while job.proc.poll() is None and time.time() - job.started < self.timeout:
                    step = _status(watched).get("step", 0)
                    if _workers_started(run_dir, job.started, self.procs(nproc)) if outside.while_starting else \
                            step >= outside.at_step:
                        pid = lighthouse_pid(run_dir) if outside.target == LIGHTHOUSE else job.proc.pid
                        os.kill(pid, getattr(signal, outside.signal))
                        sent = {"time": time.time(), "step": step, "target": outside.target, "pid": pid}
                        break
                    time.sleep(0.05)
            code = job.wait(self.timeout)
            leftovers = job.leftovers()
        return {"exit": code, "seconds": round(time.time() - job.started, 2), "outside": sent,
                "leftovers": leftovers, "started": job.started}

    # ------------------------------------------------------------ the clean reference

    def reference_key(self, overrides: list[str], groups: int = 1, nproc: int = 0) -> str:
        cfg = load_config(self.config, overrides)
        for *path, name in LOOK_ONLY:
            section = functools.reduce(getattr, path, cfg)
            setattr(section, name, getattr(type(section)(), name))
        key = {"config": cfg.digest(), "nproc": self.procs(nproc, groups)}
        if groups > 1:
            key["replica_groups"] = groups
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def reference(self, extra: tuple[str, ...] = (), steps: int | None = None, groups: int = 1,
                  nproc: int = 0) -> Path:
        """The clean run of this config with `extra` (as `groups` replica groups when > 1, on `nproc` processes
        each when given), made once and reused while its key holds."""
        steps = steps or self.steps
        overrides = [*self.base(steps), *extra, *self.overrides]
        key = self.reference_key(overrides, groups, nproc)
        run_dir = self.workdir / "references" / key
        marker = run_dir / "drill-reference.json"
        if marker.is_file() and _final(run_dir, steps).is_dir():
            return run_dir
        shutil.rmtree(run_dir, ignore_errors=True)
        self.say(f"reference {key}: {' '.join(extra) or 'clean'}{f', {groups} replica groups' if groups > 1 else ''}")
        done = self.launch(run_dir, overrides, groups=groups, nproc=nproc)
        if done["exit"] != 0 or not _final(run_dir, steps).is_dir():
            raise DrillError(f"the reference run {run_dir} failed (exit {done['exit']}); see {run_dir}/drill.log")
        marker.write_text(json.dumps({"key": key, "overrides": overrides, "nproc": self.procs(nproc, groups),
                                      "groups": groups, "seconds": done["seconds"]}, indent=1) + "\n")
        return run_dir

    # ------------------------------------------------------------ one scenario

    def run(self, scenario: Scenario) -> dict[str, Any]:
        if scenario.nodes > 1 and self.procs(scenario.nproc) % scenario.nodes:
            return not_run(scenario, f"{scenario.nodes} nodes need --nproc divisible by {scenario.nodes}")
        if scenario.network and (why := unavailable()):
            return not_run(scenario, why)
        steps = scenario.steps or self.steps
        extra = scenario.config + (scenario.reference_with if scenario.compare == "reference_with" else ())
        ref_dir = self.reference(extra, steps, scenario.groups, scenario.nproc)
        run_dir = self.workdir / "scenarios" / scenario.name
        _unmount(run_dir / "volume")
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        self.say(f"scenario {scenario.name}")
        overrides = [*self.base(steps), *scenario.config, *scenario.tuning, *self.overrides]
        volume = run_dir / "volume"
        if scenario.volume:
            if (why := _mount_small_volume(volume, ref_dir, steps, self.interval)) is not None:
                return not_run(scenario, why)
            overrides.append(f"checkpoint.dir={volume / 'checkpoints'}")
        try:
            inject = [spec.format(volume=volume) for spec in scenario.inject]
            faulted = [*overrides, f"drill.inject={json.dumps(inject)}"] if inject else overrides
            launches = [self.first_launch(run_dir, faulted, scenario)]
            if scenario.between == CORRUPT_LATEST:
                launches[0]["outside"] = corrupt_latest(run_dir / "checkpoints")
            elif scenario.between == LOSE_MANIFEST:
                launches[0]["outside"] = lose_latest_manifest(run_dir / "checkpoints")
            if scenario.rerun:
                launches.append(self.launch(run_dir, overrides, scenario.max_restarts, nproc=scenario.nproc))
        finally:
            if scenario.volume:
                _keep_and_unmount(volume, run_dir / "checkpoints")
        if scenario.groups > 1:
            return judge_replicas(scenario, run_dir, ref_dir, steps, launches)
        return judge(scenario, run_dir, ref_dir, steps, launches)

    def first_launch(self, run_dir: Path, faulted: list[str], scenario: Scenario) -> dict[str, Any]:
        """The scenario's job with its fault: on nodes of their own network (replica groups or an elastic job),
        on several launchers of this machine, or one launch."""
        if scenario.network and scenario.groups > 1:
            return network.launch_groups(scenario, run_dir, functools.partial(self.group_args, run_dir, faulted,
                                                                              scenario), self.workdir, self.timeout)
        if scenario.network:
            per_node = self.procs(scenario.nproc) // scenario.nodes
            return network.launch_nodes(scenario, run_dir, functools.partial(
                self.train_args, run_dir, faulted, scenario.max_restarts, per_node), per_node, self.workdir,
                self.timeout)
        if scenario.nodes > 1:
            return self.launch_nodes(run_dir, faulted, scenario)
        return self.launch(run_dir, faulted, scenario.max_restarts, scenario.outside, scenario.groups, scenario.nproc)

    def launch_nodes(self, run_dir: Path, overrides: list[str], scenario: Scenario) -> dict[str, Any]:
        """An elastic job of `scenario.nodes` launchers on this machine (node-0 hosts the rendezvous); at step
        `lose_node_at` the last `lose_nodes` nodes' launchers and workers are SIGKILLed together, as machines that
        die, and their memory tiers go with them."""
        run_dir.mkdir(parents=True, exist_ok=True)
        # A job that loses no node waits for all of them: a node joining late pauses the job for the new world
        # and checkpoints it to storage, at a step that would race the scenario's fault.
        least = 1 if scenario.lose_node_at else scenario.nodes
        more = ("--nnodes", f"{least}:{scenario.nodes}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
        args = self.train_args(run_dir, overrides, scenario.max_restarts, self.nproc // scenario.nodes, more)
        jobs = []
        sent: dict[str, Any] = {}
        try:
            # Each node its own loopback address, the first node's the endpoint's: it alone hosts the rendezvous
            # store, which the others wait for, so all start together and meet in the first round. A node
            # started later could join after a job that may start without it had made every step.
            for n in range(scenario.nodes):
                jobs.append(Launch([*args, "--local-addr", f"127.0.0.{n + 1}"], self.workdir,
                                   run_dir / f"drill-node-{n}.log", env={"KEEL_NODE": f"node-{n}"}))
            first, lost = jobs[0], jobs[-scenario.lose_nodes:]
            joined = None  # the step at which every node was in the job (the last may join late)
            while first.proc.poll() is None and time.time() - first.started < self.timeout:
                step = _status(run_dir).get("step", 0)
                if joined is None and network.newest_world(run_dir) == self.nproc:
                    joined = step
                # A few steps on every node first: what the job then holds (a memory copy on each) is theirs.
                if scenario.lose_node_at and not sent and joined is not None and \
                        step >= max(scenario.lose_node_at, joined + JOINED_STEPS):
                    names = [f"node-{n}" for n in range(scenario.nodes - len(lost), scenario.nodes)]
                    for job, name in zip(lost, names, strict=True):
                        kill_tagged(job.tag)
                        shutil.rmtree(memory_root("", run_dir, name), ignore_errors=True)
                    sent = {"time": time.time(), "step": step, "node": ", ".join(names)}
                time.sleep(0.05)
            code = first.wait(self.timeout)
            leftovers = [pid for job in jobs for pid in job.leftovers()]
        finally:
            for job in jobs:
                job.__exit__()
        return {"exit": code, "seconds": round(time.time() - jobs[0].started, 2), "outside": sent,
                "leftovers": leftovers, "started": jobs[0].started}

    # ------------------------------------------------------------ a plain restart, for comparison

    def baseline(self, steps: int | None = None) -> dict[str, Any]:
        """What a plain restart from a checkpoint costs on this config and layout: a fresh launch resuming from
        the clean run's checkpoint at `steps - interval`, timed from the launch to its first step made.
        Measured once per clean reference and kept beside it, as the step time read from that run is."""
        steps = steps or self.steps
        ref_dir = self.reference((), steps)
        measured = ref_dir / "drill-baseline.json"
        if measured.is_file():
            return json.loads(measured.read_text())
        run_dir = self.workdir / "baseline"
        shutil.rmtree(run_dir, ignore_errors=True)
        start = steps - self.interval
        if not (ref_dir / "checkpoints" / f"step-{start:06d}" / MANIFEST).is_file():
            return {"restart_s": None, "from_step": start, "step_s": None,
                    "why": f"the clean run kept no checkpoint at step {start} (checkpoint.keep_last)"}
        shutil.copytree(ref_dir / "checkpoints", run_dir / "checkpoints", symlinks=True,
                        ignore=lambda d, names: [n for n in names if (step_of(n) or 0) > start or n == LATEST])
        self.say("baseline: a plain restart from a checkpoint")
        # Its status logged every step, so that the SIGTERM lands in its first steps: a SIGTERM that finds
        # the run already finished (the next log at its last step) waits out torchrun's 120 s grace period.
        launched = self.launch(run_dir, [*self.base(steps), *self.overrides, "monitor.interval=1"],
                               outside=Outside("SIGTERM", start + 1))
        events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
        first = _find(events, ("step", "first"))
        step_s = statistics.median(r["time/step_s"] for r in read_jsonl(ref_dir / "metrics.jsonl")
                                   if "time/step_s" in r)
        result = {"restart_s": round(first["time"] - launched["started"], 2) if first else None,
                  "from_step": start, "step_s": round(step_s, 4), "run_dir": str(run_dir)}
        if first:
            _write_json(measured, result)
        return result

    def run_all(self, scenarios: list[Scenario]) -> list[dict[str, Any]]:
        return [self.run(s) for s in scenarios]

    def save(self, results: list[dict[str, Any]], baseline: dict[str, Any] | None, **about: Any) -> Path:
        """drill.json in the work directory (the scorecard `keel report` shows), and each scenario's own result
        beside its run."""
        record = {"time": time.time(), "config": str(self.config or ""), "nproc": self.nproc, "steps": self.steps,
                  "interval": self.interval, "overrides": self.overrides, "shape": self.shape, **about,
                  "baseline": baseline, "results": results}
        for r in results:
            if r.get("run_dir") and Path(r["run_dir"]).is_dir():
                _write_json(Path(r["run_dir"]) / "drill.json", {**record, "results": [r]})
        return _write_json(self.workdir / "drill.json", record)


def with_baseline(results: list[dict[str, Any]], baseline: dict[str, Any], interval: int) -> list[dict[str, Any]]:
    """Beside each recovery, what a plain restart from the last checkpoint would have cost at the same fault:
    the steps made since that checkpoint, made again, and the restart time plus theirs."""
    for r in results:
        if r.get("steps_made") is None or baseline.get("restart_s") is None:
            continue
        made = r["steps_made"]
        lost = made - made // interval * interval
        r["restart_steps_lost"] = lost
        r["restart_s"] = round(baseline["restart_s"] + lost * baseline["step_s"], 2)
    return results


def not_run(scenario: Scenario, why: str) -> dict[str, Any]:
    return {"scenario": scenario.name, "promise": scenario.promise, "promise_kept": None, "detect_s": None,
            "recover_s": None, "steps_lost": None, "not_run": why}


# ---------------------------------------------------------------- actions from outside


def _newest_committed(checkpoints: Path) -> tuple[int, Path]:
    steps = sorted((step, d) for d in checkpoints.iterdir() if (step := step_of(d.name)) and (d / MANIFEST).exists())
    if not steps:
        raise DrillError(f"no committed checkpoint in {checkpoints} to damage")
    return steps[-1]


def corrupt_latest(checkpoints: Path) -> dict[str, Any]:
    """Flip one byte in the middle of the largest data file of the newest committed checkpoint, as a bad
    disk or a torn copy would; returns when and at which step."""
    step, newest = _newest_committed(checkpoints)
    victim = max((f for f in newest.iterdir() if f.is_file() and f.name != MANIFEST), key=lambda f: f.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return {"time": time.time(), "step": step, "corrupted": str(victim)}


def lose_latest_manifest(checkpoints: Path) -> dict[str, Any]:
    """Delete the manifest of the newest committed checkpoint, as a careless copy or a cleanup script would;
    its other files stay, and must stay."""
    step, newest = _newest_committed(checkpoints)
    (newest / MANIFEST).unlink()
    return {"time": time.time(), "step": step, "lost": str(newest / MANIFEST)}


def _workers_started(run_dir: Path, since: float, nproc: int) -> bool:
    """Every worker of the launch started at `since` has written its start event (before its first step)."""
    path = run_dir / "events.jsonl"
    starts = [e for e in read_jsonl(path) if e["kind"] == "start" and e["time"] >= since] if path.exists() else []
    return len(starts) >= nproc


def _mount_small_volume(volume: Path, ref_dir: Path, steps: int, interval: int) -> str | None:
    """Mount a tmpfs at `volume` with room for the checkpoints a run keeps and one more (sized from the clean
    run's), so that filling it makes a save meet a real ENOSPC. Returns why it could not, or None."""
    ckpt = ref_dir / "checkpoints" / f"step-{steps:06d}"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    keep = min(3, steps // interval)  # checkpoint.keep_last's default; every checkpoint of a shorter run
    mib = ((keep + 2) * size >> 20) + 4
    volume.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(volume)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        return f"a small volume for the checkpoints could not be mounted here (needs root): {done.stderr.strip()}"
    return None


def _keep_and_unmount(volume: Path, checkpoints: Path) -> None:
    """Copy what the run saved on the small volume into the run directory, then unmount it."""
    if (volume / "checkpoints").is_dir():
        shutil.copytree(volume / "checkpoints", checkpoints, dirs_exist_ok=True)
    _unmount(volume)


def _unmount(volume: Path) -> None:
    if volume.is_mount():
        subprocess.run(["umount", "-l", str(volume)], check=False, capture_output=True)


# ---------------------------------------------------------------- judging


def judge(scenario: Scenario, run_dir: Path, ref_dir: Path, steps: int,
          launches: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare a faulted run with its reference: final state, losses, detection, recovery, goodput, events."""
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    final, ref_final = _final(run_dir, steps), _final(ref_dir, steps)
    state_equal = final.is_dir() and state_sha256(final) == state_sha256(ref_final)
    losses, ref_losses = _losses(metrics), _losses(read_jsonl(ref_dir / "metrics.jsonl"))
    common = sorted(set(losses) & set(ref_losses))
    broken = _outcome_broken(scenario, run_dir, ref_dir, steps, final.is_dir(), state_equal, losses, ref_losses)
    broken += _launches_broken(scenario, launches)
    fault_time, fault_step = _fault_point(scenario, launches[0], events)
    detected, recover_s, missed = _detection(scenario, events, fault_time, fault_step)
    broken += missed

    ledger = _json(run_dir / "goodput.json")
    ref_ledger = _json(ref_dir / "goodput.json")
    recomputed = int(ledger.get("recomputed_steps", 0))
    skipped = sum(1 for e in events if e["kind"] == "guard" and e["action"] == "skip")
    return {
        "scenario": scenario.name,
        "promise": scenario.promise,
        "promise_kept": not broken,
        "broken": broken,
        "compare": f"{scenario.compare}: {' '.join(scenario.reference_with)}" if scenario.reference_with else
        scenario.compare,
        "state_equal": state_equal,
        "fault_step": fault_step,
        # Steps complete when the fault landed: one before the step an injected fault hit.
        "steps_made": fault_step if launches[0]["outside"] else fault_step - 1,
        "detected_by": f"{detected['kind']}/{detected['action']}" if detected else None,
        # A crash is reported at the last step completed, one before the step the fault landed in.
        "detect_steps": max(0, detected["step"] - fault_step) if detected else None,
        "detect_s": round(detected["time"] - fault_time, 2) if detected and fault_time else None,
        "recover_s": recover_s,
        "steps_lost": recomputed + skipped,
        "steps_recomputed": recomputed,
        "updates_skipped": skipped,
        "losses_equal": common == sorted(ref_losses) and all(losses[s] == ref_losses[s] for s in common),
        "loss_max_abs_diff": max((abs(losses[s] - ref_losses[s]) for s in common), default=None),
        "goodput": round(ratio(ledger["buckets"]), 4) if ledger.get("buckets") else None,
        "reference_goodput": round(ratio(ref_ledger["buckets"]), 4) if ref_ledger.get("buckets") else None,
        "goodput_buckets": ledger.get("buckets", {}),
        "launches": [{k: launch[k] for k in ("exit", "victim_exit", "seconds") if k in launch} for launch in launches],
        "events": story(events),
        "run_dir": str(run_dir),
        "reference_dir": str(ref_dir),
    }


def judge_replicas(scenario: Scenario, run_dir: Path, ref_dir: Path, steps: int,
                   launches: list[dict[str, Any]]) -> dict[str, Any]:
    """A replica-group run against the fault-free replica-group run, as the survivor (group 0) lived it:
    detection is its quorum without the lost group, recovery the last heal of the lost one after it."""
    events = replica_events(run_dir)
    survivor, ref_survivor = run_dir / "groups" / "0", ref_dir / "groups" / "0"
    outcome = replica_outcome(run_dir, ref_dir, steps)
    broken = outcome.pop("broken") + _launches_broken(scenario, launches)
    # Each rank of a group writes its own start: a group of several processes started once has one per rank.
    starts = max(Counter(e["rank"] for e in events if e["kind"] == "start" and e["group"] == 0).values(), default=0)
    if scenario.survivor and starts != 1:
        broken.append(f"the surviving group started {starts} times: it must never restart")
    fault_time, fault_step = _replica_fault_point(launches[0], events)
    detected = _find(events, scenario.detect, after=fault_time) if fault_time is not None else None
    detected_by = scenario.detect
    if detected is None and fault_time is not None and scenario.recovered_by:
        # The lost group was back, restarted and healing, before a quorum left it out: the survivors never had
        # to go on without it, and its heal is what saw and repaired the loss.
        detected, detected_by = _find(events, scenario.recovered_by, after=fault_time), scenario.recovered_by
    if fault_time is None:
        broken.append("the fault was never delivered")
    elif detected is None:
        broken.append(f"no {'/'.join(map(str, scenario.detect))} event: the survivors never went on without it, "
                      f"and the lost group never healed")
    heals = [e for e in events if detected and scenario.recovered_by and _matches(e, scenario.recovered_by)
             and e["time"] >= detected["time"]]
    if detected and scenario.recovered_by and not heals:
        broken.append(f"no {'/'.join(map(str, scenario.recovered_by))} event after the detection: never healed")
    recover_s = (round(heals[-1]["time"] - detected["time"], 2) if heals and detected else None) \
        if scenario.recovered_by else 0.0 if detected else None
    ledger, ref_ledger = _json(survivor / "goodput.json"), _json(ref_survivor / "goodput.json")
    recomputed = int(ledger.get("recomputed_steps", 0))
    if recomputed and scenario.survivor:
        broken.append(f"the surviving group made {recomputed} committed steps again")
    step_s = [r["time/step_s"] for r in read_jsonl(survivor / "metrics.jsonl") if "time/step_s" in r]
    return {
        "scenario": scenario.name, "promise": scenario.promise, "promise_kept": not broken, "broken": broken,
        "compare": f"{scenario.compare} (atol {REPLICA_ATOL:g})", **outcome, "groups": scenario.groups,
        "fault_step": fault_step, "steps_made": fault_step if launches[0]["outside"] else fault_step - 1,
        "detected_by": "/".join(map(str, detected_by[:2])) if detected else None,
        "detect_steps": max(0, detected["step"] - fault_step) if detected else None,
        "detect_s": round(detected["time"] - fault_time, 2) if detected and fault_time else None,
        "recover_s": recover_s, "heals": len(heals),
        "steps_lost": recomputed, "steps_recomputed": recomputed, "updates_skipped": 0,
        "steps_retried": sum(1 for e in events if _matches(e, ("quorum", "retry", {"group": 0}))),
        "survivor_max_step_s": round(max(step_s), 2) if step_s else None,
        "survivor_median_step_s": round(statistics.median(step_s), 2) if step_s else None,
        "goodput": round(ratio(ledger["buckets"]), 4) if ledger.get("buckets") else None,
        "reference_goodput": round(ratio(ref_ledger["buckets"]), 4) if ref_ledger.get("buckets") else None,
        "goodput_buckets": ledger.get("buckets", {}),
        "launches": [{"exit": launch["exit"], "seconds": launch["seconds"]} for launch in launches],
        "events": story(events), "run_dir": str(run_dir), "reference_dir": str(ref_dir),
    }


def replica_outcome(run_dir: Path, ref_dir: Path, steps: int) -> dict[str, Any]:
    """The final parameters, every loss and the tokens seen of the run's first group against the reference's."""
    final, ref_final = _final(run_dir, steps), _final(ref_dir, steps)
    if not final.is_dir():
        return {"broken": [f"no final checkpoint at step {steps}"], "state_equal": False}
    mine, ref = load_full_state(final), load_full_state(ref_final)
    params = sorted(k for k in ref if k.startswith("model."))
    param_diff = max(((mine[k] - ref[k]).abs().max().item() if k in mine else float("inf")) for k in params)
    losses = _losses(read_jsonl(run_dir / "groups" / "0" / "metrics.jsonl"))
    ref_losses = _losses(read_jsonl(ref_dir / "groups" / "0" / "metrics.jsonl"))
    loss_diff = max((abs(losses[s] - ref_losses[s]) if s in losses else float("inf") for s in ref_losses),
                    default=None)
    tokens = _json(run_dir / "groups" / "0" / "summary.json").get("tokens_seen")
    ref_tokens = _json(ref_dir / "groups" / "0" / "summary.json").get("tokens_seen")
    broken = []
    if param_diff > REPLICA_ATOL:
        broken.append(f"final parameters differ from the reference by {param_diff:.3g} > {REPLICA_ATOL:g}")
    if loss_diff is None or loss_diff > REPLICA_ATOL:
        broken.append(f"losses differ from the reference by {loss_diff} > {REPLICA_ATOL:g} (or a step is missing)")
    if tokens != ref_tokens:
        broken.append(f"{tokens} tokens seen, the reference {ref_tokens}: not the same global batches")
    return {"broken": broken, "state_equal": all(torch.equal(mine[k], ref[k]) for k in ref if k in mine),
            "param_max_abs_diff": param_diff, "loss_max_abs_diff": loss_diff, "losses_equal": losses == ref_losses,
            "tokens_seen": tokens}


def replica_events(run_dir: Path) -> list[dict]:
    """The launcher's events and every group's, each marked with its group (None: the launcher's), by time."""
    events = [{**e, "group": None} for e in read_jsonl(run_dir / "events.jsonl")]
    for path in sorted((run_dir / "groups").glob("*/events.jsonl")):
        events += [{**e, "group": int(path.parent.name)} for e in read_jsonl(path)]
    return sorted(events, key=lambda e: e["time"])


def _replica_fault_point(first: dict[str, Any], events: list[dict]) -> tuple[float | None, int]:
    """When and where the fault landed: an injected fault's first `drill/inject` event, the pace left out."""
    if first["outside"]:
        return first["outside"]["time"], first["outside"]["step"]
    fired = next((e for e in events if _matches(e, ("drill", "inject"))
                  and not e["detail"].get("fault", "").startswith("slow:")), None)
    return (fired["time"], fired["step"]) if fired else (None, 0)


def lighthouse_pid(run_dir: Path) -> int:
    """The process of the lighthouse `keel train --replica-groups` started (or last started again)."""
    ours = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "lighthouse" and e["detail"].get("pid")]
    if not ours:
        raise DrillError(f"{run_dir / 'events.jsonl'} names no lighthouse process")
    return int(ours[-1]["detail"]["pid"])


def _outcome_broken(scenario: Scenario, run_dir: Path, ref_dir: Path, steps: int, final_exists: bool,
                    state_equal: bool, losses: dict[int, float], ref_losses: dict[int, float]) -> list[str]:
    """How the run's final state or losses break the promise, compared with the reference as the scenario says."""
    if not final_exists:
        return [f"no final checkpoint at step {steps}"]
    if scenario.compare == CLOSE:
        broken = []
        tokens, ref_tokens = _json(run_dir / "summary.json").get("tokens_seen"), \
            _json(ref_dir / "summary.json").get("tokens_seen")
        common = sorted(set(losses) & set(ref_losses))
        far = [s for s in common if abs(losses[s] - ref_losses[s]) > CLOSE_RTOL * abs(ref_losses[s])]
        if tokens != ref_tokens:
            broken.append(f"{tokens} tokens seen, the reference {ref_tokens}: not the same global batches")
        if common != sorted(ref_losses) or far:
            broken.append(f"losses differ from the reference by more than {CLOSE_RTOL:g} (relative) at steps "
                          f"{far[:5] or sorted(set(ref_losses) - set(losses))[:5]}")
        return broken
    if not state_equal:
        return ["final state differs from the reference" if scenario.compare == BITWISE
                else f"final state differs from the reference with {' '.join(scenario.reference_with)}"]
    return []


def _launches_broken(scenario: Scenario, launches: list[dict[str, Any]]) -> list[str]:
    """How the launches' exits, or processes left behind, break the promise."""
    broken = []
    first_exit = launches[0]["exit"]
    if scenario.rerun and (first_exit == 0 if scenario.first_exit is None else first_exit != scenario.first_exit):
        broken.append(f"first launch exited {first_exit}, expected {scenario.first_exit or 'a failure'}")
    if launches[-1]["exit"] != 0:
        broken.append(f"the run ended with exit {launches[-1]['exit']}")
    if launches[-1].get("victim_exit", scenario.victim_exit) != scenario.victim_exit:
        broken.append(f"the node hit ended with exit {launches[-1]['victim_exit']}, expected {scenario.victim_exit}")
    if any(launch["leftovers"] for launch in launches):
        broken.append("processes outlived the launcher")
    return broken


def _detection(scenario: Scenario, events: list[dict], fault_time: float | None,
               fault_step: int) -> tuple[dict | None, float | None, list[str]]:
    """The event that detected the fault, the seconds from it to the recovery, and what went missing."""
    missed = [] if fault_time is not None else ["the fault was never delivered"]
    # The detector's event comes after the fault. A launcher's event carries the step its run last
    # reported (status.json), which may be some steps before the fault: time orders them, not steps.
    detected = (_find(events, scenario.detect, after=fault_time) if fault_time is not None else
                _find(events, scenario.detect, from_step=fault_step - 1)) if scenario.detect[0] else None
    if scenario.detect[0] and detected is None:
        missed.append(f"no {'/'.join(str(x) for x in scenario.detect[:2] if x)} event: the fault went undetected")
    if detected is None:
        return None, None, missed
    if scenario.recovered_by is None:
        return detected, 0.0, missed
    recovered = _find(events, scenario.recovered_by, after=detected["time"])
    if recovered is None:
        missed.append(f"no {'/'.join(filter(None, scenario.recovered_by))} event after the detection")
        return detected, None, missed
    return detected, round(recovered["time"] - detected["time"], 2), missed


def story(events: list[dict]) -> list[str]:
    """The run's non-routine events in order, `kind/action@step`, repeats from several ranks folded."""
    told: list[str] = []
    for e in events:
        if (e["kind"], e["action"]) in ROUTINE or e["kind"] == "telemetry":
            continue
        line = f"{e['kind']}/{e['action']}@{e['step']}" if e["action"] else f"{e['kind']}@{e['step']}"
        if e.get("group") is not None:  # a replica group's own event
            line = f"[{e['group']}] {line}"
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


def _matches(e: dict, match: tuple) -> bool:
    """`match` is (kind, action[, detail]): "" matches any action, and the event's detail holds `detail`."""
    kind, action, *detail = match
    return e["kind"] == kind and (not action or e["action"] == action) and \
        all(e["detail"].get(k) == v for k, v in (detail[0] if detail else {}).items())


def _find(events: list[dict], match: tuple, after: float | None = None, from_step: int = 0) -> dict | None:
    for e in events:
        if _matches(e, match) and e["step"] >= from_step and (after is None or e["time"] >= after):
            return e
    return None


def _losses(metrics: list[dict]) -> dict[int, float]:
    """Loss per step, the last record of a step winning: the trajectory the run kept after any redo."""
    return {r["step"]: r["train/loss"] for r in metrics if "train/loss" in r}


def _final(run_dir: Path, steps: int) -> Path:
    return run_dir / "checkpoints" / f"step-{steps:06d}"


def _status(run_dir: Path) -> dict:
    return _json(run_dir / "status.json")


def _write_json(path: Path, record: dict) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
