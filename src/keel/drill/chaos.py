"""Chaos mode: faults drawn at random from the catalog, all injected into one run, judged together.

`keel drill --chaos --mtbf 30s --duration 10m [--seed N]` draws fault arrivals with exponential
inter-arrival times (mean `mtbf`, seeded: the same seed draws the same faults) over `duration`, turns
each arrival into a step of the run with the clean reference's time per step, and gives each a kind
drawn uniformly. The run gets every injection at once (one `drill.inject` list: the fire-once counters
in the run directory keep each fault delivered once across restarts and relaunches), a restart budget
for all its crashes, and a SIGTERM to the launcher at each preemption step; it is relaunched after
each pause. Then the combined promise is judged: the final checkpoint equals, bit for bit, the clean
run of the same config and layout told to skip the updates of the steps that got a NaN; every fault
fired and was detected by the event its scenario names; nothing outlived the launcher; the last
launch exited 0.

The kinds, and why each keeps a promise that composes with the others:

- kill: SIGKILL of a rank mid-step; the launcher restarts the workers from the last checkpoint and
  the steps after it are made again, exactly.
- hang: a rank sleeps mid-step; the watchdog (FAST_WATCHDOG tuning) names it and the workers are
  restarted. Drawn no earlier than two steps after the watchdog's warm-up, so that even a start from
  step 0 has learned its step timeout when the hang comes.
- kill_during_save: SIGKILL during the background write of the checkpoint at the first checkpoint
  step at or after the drawn step (the fault's step); nothing committed is lost, the restart resumes
  from the previous checkpoint.
- nan_grads: a NaN in one rank's gradients; the update is skipped on every rank (reproducibly: a step
  made again meets it again). The reference is told to skip the same updates. Two NaNs are never
  drawn in adjacent steps: `guard.numerics.max_consecutive` skips in a row make the guard roll back
  instead, and a reproducible NaN would meet it again.
- bitflip_params, bitflip_optimizer: a flipped bit in one replica's parameters or Adam moment, in a
  layout with two replicas (REPLICATED); the flipped rank's at-rest check finds it before the next update
  (with that check off, the fingerprints, compared every checkpoint interval and before every save, find the
  replicas disagreeing); the run rolls back to the newest verified state. Each flip hits its own element, so
  that two flips never cancel.
- bitflip_grads: a flipped bit in one rank's gradients, caught by the step replay in its own step
  (the fault's step is a replay step: every `replay_every(interval)` steps) and rolled back.
- straggler: one rank made slower for a few steps; the straggler detector names it, the math is
  untouched.
- preemption: SIGTERM to the launcher once status.json shows the step reached; the job checkpoints,
  exits 75, and is relaunched with the same command. Every rank is slowed a little for the few steps
  after the preemption step (the math untouched), so that the pause lands within them whatever the
  latency of the signal.

Faults that would erase one another's evidence are not drawn together. A crash (a kill, a hang, the
steps until the next checkpoint in which a killed background write may land, a preemption and the
steps its pause may land in) never lands between a state bitflip and the fingerprint check that
catches it (a restart would resume from before the flip, unseen), nor inside a straggler's slow steps
(the detector needs consecutive slow gathers), nor at a hang (it would be found first), nor within the
steps after a preemption (the pause would not happen); stragglers do not overlap. A draw that finds no
step allowed for a fault leaves that fault out, and arrivals after the run's last step are not drawn.

Left out: the poisoned batch. Its promise is a run told to skip the global batches the spike guard
skipped, and which those are depends on the rollback target the guard picks (the newest snapshot far
enough back, `_poisoned` in keel.drill.scenarios): with other faults around, restarts and rollbacks
move the snapshots and checkpoints within reach, so the skipped range cannot be stated in advance
exactly. The spike guard's warm-up window is also longer than a short chaos run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import signal
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from keel.checkpoint.inspect import state_sha256
from keel.drill.procs import Launch
from keel.drill.runner import Drill, _final, _json, _status, story
from keel.drill.scenarios import FAST_WATCHDOG, REPLICATED, Outside
from keel.errors import EXIT_PAUSED
from keel.monitor.goodput import ratio
from keel.rundir.events import read_jsonl

KINDS = ("kill", "hang", "kill_during_save", "nan_grads", "bitflip_params", "bitflip_optimizer", "bitflip_grads",
         "straggler", "preemption")
DEFAULT = KINDS
CRASHES = ("kill", "hang", "kill_during_save")  # the launcher restarts the workers after each
NEEDS_REPLICAS = ("bitflip_params", "bitflip_optimizer")
RANK = 1  # the rank the injected faults land on

PROMISE = ("every fault is detected by its detector and recovered from; the final state equals, bit for bit, the "
           "clean run told to skip the updates of the steps that got a NaN")

# The event that counts as detection of each kind: (kind, actions); no actions: any action.
DETECT: dict[str, tuple[str, tuple[str, ...]]] = {
    "kill": ("failure", ()), "kill_during_save": ("failure", ()), "hang": ("hang", ()),
    "nan_grads": ("guard", ("skip",)), "bitflip_params": ("guard", ("rollback", "quarantine")),
    "bitflip_optimizer": ("guard", ("rollback", "quarantine")), "bitflip_grads": ("guard", ("quarantine",)),
    "straggler": ("straggler", ()), "preemption": ("pause", ()),
}
# The event that ends recovery, after the detection; None: recovery is the detection itself.
RECOVERED_BY: dict[str, tuple[str, str] | None] = {
    "kill": ("step", "first"), "kill_during_save": ("step", "first"), "hang": ("step", "first"),
    "nan_grads": None, "bitflip_params": ("guard", "rolled_back"), "bitflip_optimizer": ("guard", "rolled_back"),
    "bitflip_grads": ("guard", "rolled_back"), "straggler": None, "preemption": ("step", "first"),
}
EXACT_STEP = ("nan_grads", "bitflip_grads")  # detected in the step the fault landed in
# Detected whatever the step: a rollback between the signal and the pause moves the step the pause lands in.
ANY_STEP = ("preemption",)

WATCHDOG_WARMUP = int(dict(t.split("=") for t in FAST_WATCHDOG)["health.watchdog.warmup_steps"])
STRAGGLER_EVERY = 2  # steps between the straggler detector's gathers
SLOW_STEPS = 2 * STRAGGLER_EVERY + 1  # slow steps: at least two gathers in a row (the detector's patience)
SLOW_FACTOR = 4.0
PREEMPT_QUIET = 4  # steps after a preemption step in which the pause may land: no other crash there
PREEMPT_SLOW_S = 0.25  # added to each of those steps on every rank
POLL_S = 0.05
RELAUNCHES_AFTER_FAILURE = 2
SLACK_S = 0.01  # event times are rounded to milliseconds, and written by several processes


@dataclass(frozen=True)
class Fault:
    """One drawn fault: its `kind`, the `step` it lands in, and what it becomes: the `inject` spec for
    `drill.inject`, and for a preemption the `outside` action the runner takes (its `inject` then only
    slows the steps in which the pause may land)."""

    kind: str
    step: int
    inject: str = ""
    outside: Outside | None = None

    @property
    def spec(self) -> str:
        if self.outside is not None:
            return f"{self.outside.signal} to the launcher at step {self.outside.at_step}"
        return self.inject


def replay_every(interval: int) -> int:
    """Steps between step replays in a chaos run (a gradient bitflip lands on one of them)."""
    return max(2, interval // 2)


# ---------------------------------------------------------------- durations


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """`30s`, `10m`, `1h` or `90` (seconds) → seconds (positive; fractions allowed, e.g. `1.5h`)."""
    match = _DURATION.match(str(text))
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if not match or seconds <= 0:
        raise ValueError(f"duration {text!r}: expected a positive number of seconds with an optional unit, "
                         f"e.g. 30s, 10m, 1h or 90 (seconds)")
    return seconds


# ---------------------------------------------------------------- drawing faults


@dataclass(frozen=True)
class _Placement:
    kind: str
    step: int
    span: tuple[int, int] | None  # steps a crash (or a pause) may take the run down in
    watch: tuple[int, int] | None  # steps in which no crash may land, or the fault's evidence is lost


class _Rules:
    """Where each kind may land in a run of `steps` steps with a checkpoint every `interval`."""

    def __init__(self, steps: int, interval: int) -> None:
        self.steps, self.interval, self.replay = steps, interval, replay_every(interval)

    def first(self, kind: str) -> int:
        return {"hang": WATCHDOG_WARMUP + 2, "kill_during_save": self.interval,
                "bitflip_grads": self.replay}.get(kind, 2)

    def last(self, kind: str) -> int:
        if kind == "straggler":
            return self.steps - SLOW_STEPS - 1
        if kind == "preemption":
            return self.steps - PREEMPT_QUIET - 2  # the pause must land before the last step
        return self.steps - 1

    def align(self, kind: str, step: int) -> int:
        """The first step at or after `step` this kind can land in."""
        every = {"kill_during_save": self.interval, "bitflip_grads": self.replay}.get(kind, 1)
        return -(-step // every) * every

    def next(self, kind: str, step: int) -> int:
        return self.align(kind, step + 1)

    def check_after(self, step: int) -> int:
        """The fingerprint check that sees a state flipped after the update of `step`."""
        return min(self.steps, (step // self.interval + 1) * self.interval)

    def place(self, kind: str, step: int) -> _Placement:
        span = watch = None
        if kind == "kill":
            span = (step, step)
        elif kind == "hang":
            span = watch = (step, step)  # another crash while it hangs would be found before the hang
        elif kind == "kill_during_save":
            # The write runs in the background until the next save at the latest (the fingerprint check
            # before the save comes first). A pause at its checkpoint step would save there, and be killed.
            span, watch = (step + 1, step + self.interval - 1), (step, step)
        elif kind == "preemption":
            span = watch = (step, step + PREEMPT_QUIET)
        elif kind in NEEDS_REPLICAS:
            watch = (step + 1, self.check_after(step))
        elif kind == "straggler":
            watch = (step, step + SLOW_STEPS - 1)
        return _Placement(kind, step, span, watch)

    def allowed(self, new: _Placement, placed: Iterable[_Placement]) -> bool:
        for old in placed:
            if old.step == new.step or _meets(new.span, old.watch) or _meets(old.span, new.watch):
                return False
            if new.kind == old.kind == "nan_grads" and abs(new.step - old.step) < 2:
                return False
            if new.kind == old.kind == "straggler" and abs(new.step - old.step) < SLOW_STEPS + STRAGGLER_EVERY + 1:
                return False  # the next one starts a streak of its own, after a gather that found none
        return True


def _meets(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def draw(seed: int, mtbf_s: float, duration_s: float, step_s: float, steps: int, interval: int,
         kinds: Sequence[str] = DEFAULT) -> list[Fault]:
    """The faults of a chaos run, in step order. Arrivals are the cumulative sums of exponential(`mtbf_s`)
    draws of a generator seeded with `seed`, up to `duration_s`; each becomes step time / `step_s` (at
    least 2, at most `steps` - 1), and gets a kind drawn uniformly from `kinds`. A fault moves to the next
    step its kind allows (a checkpoint step for kill_during_save, a replay step for bitflip_grads, no step
    already taken, none where it and another fault would erase each other's evidence); one for which no
    step is left is not drawn."""
    kinds = _check_kinds(kinds)
    if mtbf_s <= 0 or duration_s <= 0 or step_s <= 0:
        raise ValueError(f"mtbf {mtbf_s}, duration {duration_s} and step time {step_s}: all must be positive")
    rules = _Rules(steps, interval)
    rng = np.random.default_rng(seed)
    placed: list[_Placement] = []
    at = 0.0
    while True:
        at += float(rng.exponential(mtbf_s))
        if at > duration_s:
            break
        kind = kinds[int(rng.integers(len(kinds)))]
        step = rules.align(kind, max(2, rules.first(kind), min(int(at / step_s), steps - 1)))
        while step <= rules.last(kind) and not rules.allowed(rules.place(kind, step), placed):
            step = rules.next(kind, step)
        if step <= rules.last(kind):
            placed.append(rules.place(kind, step))
    placed.sort(key=lambda p: p.step)
    return [_fault(p.kind, p.step, n) for n, p in enumerate(placed)]


def _fault(kind: str, step: int, n: int) -> Fault:
    """Fault number `n` of the run (its own tensor element, for bitflips) as its injection and, for a
    preemption, the action from outside."""
    at = f"step={step},rank={RANK}"
    inject = {
        "kill": f"kill:{at}",
        "hang": f"hang:{at}",
        "kill_during_save": f"sigkill_during_checkpoint_write:{at},times=1",
        "nan_grads": f"nan_grads:{at}",
        "bitflip_params": f"bitflip:{at},target=params,tensor=3,element={5 + n},bit=22",
        "bitflip_optimizer": f"bitflip:{at},target=exp_avg,tensor=2,element={n},bit=30",
        "bitflip_grads": f"bitflip:{at},target=grads,tensor=3,element={5 + n},bit=3",
        "straggler": f"slow:rank={RANK},factor={SLOW_FACTOR:g},from_step={step},steps={SLOW_STEPS}",
        "preemption": f"slow:rank=-1,seconds={PREEMPT_SLOW_S:g},from_step={step + 1},steps={PREEMPT_QUIET}",
    }.get(kind, "")
    return Fault(kind, step, inject, Outside("SIGTERM", at_step=step) if kind == "preemption" else None)


def _check_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"chaos kinds {', '.join(unknown) or '(none)'}: expected some of {', '.join(KINDS)}")
    return kinds


# ---------------------------------------------------------------- the settings of a chaos run


def layout(drill: Drill, kinds: Iterable[str]) -> tuple[str, ...]:
    """The overrides that shape the math for `kinds`, for the reference too: two replicas when a state
    bitflip may be drawn (its fingerprints compare replicas)."""
    if not set(kinds) & set(NEEDS_REPLICAS):
        return ()
    if drill.nproc == 2:
        return REPLICATED
    if drill.nproc % 2:
        raise ValueError(f"{', '.join(NEEDS_REPLICAS)} need two replicas: --nproc {drill.nproc} is odd")
    return ("parallel.dp_replicate=2", f"parallel.dp_shard={drill.nproc // 2}")


def tuning(faults: Iterable[Fault], interval: int) -> tuple[str, ...]:
    """Overrides that make the detectors act within a short run without changing the math: the faulted
    run alone gets them."""
    kinds = [f.kind for f in faults]
    out: list[str] = []
    crashes = sum(k in CRASHES for k in kinds)
    if crashes:  # restarts that resume before the step already reached are the faults' doing, not a loop
        out.append(f"health.no_progress_restarts={crashes + 2}")
    if "hang" in kinds:
        out += FAST_WATCHDOG
    if set(kinds) & set(NEEDS_REPLICAS):
        out.append(f"guard.sdc.fingerprint_interval={interval}")
    if "bitflip_grads" in kinds:
        out.append(f"guard.sdc.replay_interval={replay_every(interval)}")
    if "straggler" in kinds:
        out.append(f"health.straggler.interval={STRAGGLER_EVERY}")
    return tuple(out)


def skipped_steps(faults: Iterable[Fault]) -> list[int]:
    return sorted(f.step for f in faults if f.kind == "nan_grads")


def reference_with(faults: Iterable[Fault]) -> tuple[str, ...]:
    """The overrides that tell the clean run to skip what the guards skip: the updates of the NaN steps."""
    skips = [f"skip_update:step={s}" for s in skipped_steps(faults)]
    return (f"drill.inject={json.dumps(skips)}",) if skips else ()


def step_seconds(ref_dir: Path, steps: int) -> float:
    """Seconds of training per step of a clean run (its checkpoints and evaluations included), from its
    summary, else the median of its measured step times."""
    seconds = _json(ref_dir / "summary.json").get("train_seconds")
    if seconds:
        return float(seconds) / steps
    times = [r["time/step_s"] for r in read_jsonl(ref_dir / "metrics.jsonl") if "time/step_s" in r]
    if not times:
        raise ValueError(f"no step times in {ref_dir}: cannot turn seconds into steps")
    return statistics.median(times)


def _overrides(drill: Drill, steps: int, extra: Iterable[str]) -> list[str]:
    """The command's overrides, in the order the drill's reference runs use."""
    return [*drill.base(steps), *extra, *drill.overrides]


# ---------------------------------------------------------------- running


def run_chaos(drill: Drill, seed: int, mtbf_s: float, duration_s: float, kinds: Sequence[str] = DEFAULT,
              step_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Draw the faults of `seed` and run them on `drill`'s config, `drill.steps` steps with a checkpoint
    every `drill.interval`; returns the result in the scorecard's shape. `step_s`: the seconds per step
    that turn arrival times into steps (default: measured from the clean reference run). `timeout`: the
    wall-clock bound of the whole faulted run (default: from the drill's timeout and the faults drawn)."""
    kinds = _check_kinds(kinds)
    config = layout(drill, kinds)
    measured = step_s is None
    if step_s is None:
        step_s = step_seconds(drill.reference(config, drill.steps), drill.steps)
    faults = draw(seed, mtbf_s, duration_s, step_s, drill.steps, drill.interval, kinds)
    drill.say(f"chaos seed {seed}: {len(faults)} faults: " + ", ".join(f"{f.kind}@{f.step}" for f in faults))
    result = run_faults(drill, faults, config=config, name=f"chaos-{seed}", timeout=timeout)
    return {**result, "seed": seed, "mtbf_s": mtbf_s, "duration_s": duration_s,
            "step_s": round(step_s, 4), "step_s_measured": measured,
            "kinds": dict(sorted(Counter(f.kind for f in faults).items()))}


def run_faults(drill: Drill, faults: Sequence[Fault], config: Sequence[str] = (), extra_tuning: Sequence[str] = (),
               name: str = "chaos", timeout: float | None = None) -> dict[str, Any]:
    """Run `faults` together in one run under `config` (which the reference shares) and the detectors'
    tuning, then `extra_tuning` (the faulted run only), and judge it against the reference told to skip
    the NaN steps."""
    steps = drill.steps
    ref_dir = drill.reference((*config, *reference_with(faults)), steps)
    run_dir = drill.workdir / "chaos" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "chaos.json").write_text(json.dumps([dataclasses.asdict(f) for f in faults], indent=1) + "\n")
    injected = [f.inject for f in faults if f.inject]
    overrides = _overrides(drill, steps, (*config, *tuning(faults, drill.interval), *extra_tuning))
    if injected:
        overrides.append(f"drill.inject={json.dumps(injected)}")
    crashes = sum(f.kind in CRASHES for f in faults)
    if timeout is None:
        timeout = drill.timeout + 30.0 * (crashes + sum(f.outside is not None for f in faults))
    drill.say(f"chaos run {name}: {len(faults)} faults, up to {crashes + 2} restarts per launch")
    launches, sent = _run(drill, run_dir, overrides, faults, crashes + 2, timeout)
    return judge_chaos(faults, run_dir, ref_dir, steps, launches, sent)


def _run(drill: Drill, run_dir: Path, overrides: list[str], faults: Sequence[Fault], max_restarts: int,
         timeout: float) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    """Launch until the run finishes: SIGTERM to the launcher at each preemption step (one per launch),
    a relaunch after each pause, and after a failure a few times; all within `timeout` seconds. Returns
    the launches and, by fault index, when and at which step each preemption was sent."""
    preemptions = {i: f.outside for i, f in enumerate(faults) if f.outside is not None}
    sent: dict[int, dict[str, Any]] = {}
    launches: list[dict[str, Any]] = []
    deadline = time.time() + timeout
    failures = 0
    while time.time() < deadline and len(launches) <= len(preemptions) + RELAUNCHES_AFTER_FAILURE:
        signalled: dict[str, Any] = {}
        with Launch(drill.train_args(run_dir, overrides, max_restarts), drill.workdir, run_dir / "drill.log") as job:
            while job.proc.poll() is None and time.time() < deadline:
                due = next((i for i in preemptions if i not in sent), None)
                if due is not None and not signalled:
                    status = _status(run_dir)
                    if status.get("state") == "running" and status.get("step", 0) >= faults[due].step:
                        job.proc.send_signal(getattr(signal, preemptions[due].signal))
                        signalled = sent[due] = {"time": time.time(), "step": status.get("step", 0)}
                time.sleep(POLL_S)
            code = job.wait(deadline - job.started)
            leftovers = job.leftovers()
        launches.append({"exit": code, "seconds": round(time.time() - job.started, 2), "outside": signalled,
                         "leftovers": leftovers, "started": job.started})
        drill.say(f"launch {len(launches)} exited {code}")
        if code in (0, None):
            break
        if code != EXIT_PAUSED:
            failures += 1
            if failures > RELAUNCHES_AFTER_FAILURE:
                break
    return launches, sent


# ---------------------------------------------------------------- judging


def judge_chaos(faults: Sequence[Fault], run_dir: Path, ref_dir: Path, steps: int, launches: list[dict[str, Any]],
                sent: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The combined promise: the final state equals the reference (told to skip the NaN steps) bit for bit,
    every fault fired and was detected by its event (and recovered from), the updates skipped are those of
    the NaN steps, nothing outlived a launcher, the last launch exited 0."""
    events = sorted(read_jsonl(run_dir / "events.jsonl"), key=lambda e: e["time"])
    broken: list[str] = []

    final, ref_final = _final(run_dir, steps), _final(ref_dir, steps)
    state_equal = final.is_dir() and ref_final.is_dir() and state_sha256(final) == state_sha256(ref_final)
    compare = f"reference_with: {' '.join(reference_with(faults))}" if skipped_steps(faults) else "bitwise"
    if not final.is_dir():
        broken.append(f"no final checkpoint at step {steps}")
    elif not state_equal:
        broken.append("final state differs from the reference" + (f" ({compare})" if skipped_steps(faults) else ""))
    if not launches or launches[-1]["exit"] != 0:
        broken.append(f"the run ended with exit {launches[-1]['exit'] if launches else None}")
    if any(launch["leftovers"] for launch in launches):
        broken.append("processes outlived the launcher")

    results = [_judge_fault(i, fault, events, sent.get(i)) for i, fault in enumerate(faults)]
    broken += _faults_broken(results)

    kept_skips = _kept_skips(events)
    if final.is_dir() and kept_skips != skipped_steps(faults):
        broken.append(f"updates skipped at steps {kept_skips or 'none'}, the NaNs drawn at "
                      f"{skipped_steps(faults) or 'none'}")

    ledger, ref_ledger = _json(run_dir / "goodput.json"), _json(ref_dir / "goodput.json")
    recomputed = int(ledger.get("recomputed_steps", 0))
    detected = [r for r in results if r["detected_by"]]
    return {
        "scenario": "chaos",
        "promise": PROMISE,
        "promise_kept": not broken,
        "broken": broken,
        "compare": compare,
        "state_equal": state_equal,
        "detected_by": f"{len(detected)} of {len(results)} faults",
        "detect_steps": None,
        "detect_s": _mean(r["detect_s"] for r in results),
        "recover_s": _mean(r["recover_s"] for r in results),
        "steps_lost": recomputed + len(kept_skips),
        "steps_recomputed": recomputed,
        "updates_skipped": len(kept_skips),
        "goodput": round(ratio(ledger["buckets"]), 4) if ledger.get("buckets") else None,
        "reference_goodput": round(ratio(ref_ledger["buckets"]), 4) if ref_ledger.get("buckets") else None,
        "goodput_buckets": ledger.get("buckets", {}),
        "faults": results,
        "launches": [{"exit": launch["exit"], "seconds": launch["seconds"]} for launch in launches],
        "events": story(events),
        "run_dir": str(run_dir),
        "reference_dir": str(ref_dir),
    }


def _faults_broken(results: list[dict[str, Any]]) -> list[str]:
    """For each fault judged, whether it failed to fire, to be detected or to be recovered from."""
    broken = []
    for r in results:
        what = f"{r['kind']} at step {r['step']}"
        if not r["fired"]:
            broken.append(f"{what} never fired")
        elif r["detected_by"] is None:
            broken.append(f"{what} went undetected (no {r['expected']} event)")
        elif r["recover_s"] is None:
            broken.append(f"{what}: no {'/'.join(RECOVERED_BY[r['kind']] or ())} event after its detection")
    return broken


def _judge_fault(index: int, fault: Fault, events: list[dict], signalled: dict[str, Any] | None) -> dict[str, Any]:
    kind, actions = DETECT[fault.kind]
    if fault.outside is not None:
        fired_at, fired_step = (signalled["time"], signalled["step"]) if signalled else (None, None)
    else:
        fired = next((e for e in events if e["kind"] == "drill" and e["action"] == "inject"
                      and e["detail"].get("fault") == fault.inject), None)
        fired_at, fired_step = (fired["time"], fired["step"]) if fired else (None, None)
    detected = None
    if fired_at is not None:
        detected = next((e for e in events if e["kind"] == kind and (not actions or e["action"] in actions)
                         and e["time"] >= fired_at - SLACK_S and _names_rank(e, RANK) and _at_step(fault, e)),
                        None)
    until = RECOVERED_BY[fault.kind]
    recover_s = None
    if detected is not None and until is None:
        recover_s = 0.0
    elif detected is not None and until is not None:
        recovered = next((e for e in events if e["kind"] == until[0] and e["action"] == until[1]
                          and e["time"] >= detected["time"]), None)
        recover_s = round(recovered["time"] - detected["time"], 2) if recovered else None
    return {
        "index": index, "kind": fault.kind, "step": fault.step, "spec": fault.spec,
        "fired": fired_at is not None, "fired_at_step": fired_step,
        "expected": f"{kind}/{'|'.join(actions)}" if actions else kind,
        "detected_by": f"{detected['kind']}/{detected['action']}" if detected else None,
        "detected_at_step": detected["step"] if detected else None,
        "detect_s": round(max(0.0, detected["time"] - fired_at), 2) if detected else None,
        "recover_s": recover_s,
    }


def _at_step(fault: Fault, event: dict) -> bool:
    """Whether `event` is at a step where `fault`'s detection can be (a crash is reported at the last step
    completed, one before the step it landed in)."""
    if fault.kind in ANY_STEP:
        return True
    return event["step"] == fault.step if fault.kind in EXACT_STEP else event["step"] >= fault.step - 1


def _names_rank(event: dict, rank: int) -> bool:
    """Whether a detector's event names `rank` where it names one (a straggler, the stuck ranks of a hang):
    a rank slowed by the load of the machine is not the fault injected."""
    detail = event.get("detail", {})
    if event["kind"] == "straggler":
        return detail.get("rank") == rank
    if event["kind"] == "hang" and detail.get("stuck_ranks") is not None:
        return rank in detail["stuck_ranks"]
    return True


def _kept_skips(events: list[dict]) -> list[int]:
    """The steps whose skipped update the final trajectory kept: skips undone by a later rollback, or by a
    start from an earlier checkpoint (or from scratch), are made again (and skipped again, or not)."""
    skipped: set[int] = set()
    before_start: set[int] = set()
    for e in events:
        if e["kind"] == "guard" and e["action"] == "skip":
            skipped.add(e["step"])
        elif e["kind"] == "guard" and e["action"] == "rolled_back":
            skipped = {s for s in skipped if s <= e["detail"].get("to_step", e["step"])}
        elif e["kind"] == "start" and e.get("rank") == 0:  # a start from scratch, unless a resume follows
            before_start, skipped = skipped, set()
        elif e["kind"] == "resume":
            skipped |= {s for s in before_start if s <= e["step"]}
    return sorted(skipped)


def _mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None and math.isfinite(v)]
    return round(statistics.fmean(known), 2) if known else None
