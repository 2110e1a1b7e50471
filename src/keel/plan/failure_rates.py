"""How often accelerators interrupt a training job, by generation; how the interruptions show; and the published
runs both rest on, each forecast again by the planner's failure model.

A run's rate is its unexpected interruptions per accelerator-day of wall time. A generation's rate is the
geometric midpoint of the extremes its runs give, the one value within the smallest factor of each (as
keel.plan.throughput fits the compute efficiency); an accelerator of no listed generation takes the midpoint
over every run. The runs of one generation still differ by up to 3.4×: the cluster matters as much as the chip
(a young cloud cluster, OPT-175B's, against mature fleets), so a team that knows its own cluster's rate passes
it (`mtbf_hours`).

How a failure shows (the mix) decides how long it takes to find: a crash at once, a hang at a collective's
timeout, a silent corruption at the latency of the check that finds it, and a share of failures only after a
person's diagnosis. The shares are the published ones below, from the only sources that count them.

`forecast` predicts each published run from its generation's rate and the run's own published operational
figures (its checkpoints, detection, restart and triage times where stated, the planner's defaults where not),
never from its own interruption count; docs/planning.md sets the forecasts beside what each run reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from keel.config import Config
from keel.core.accelerators import by_key
from keel.plan.failures import (
    FailureMix,
    FailureModel,
    Policy,
    Recovery,
    Run,
    Storage,
    checkpoint_bytes,
    simulate,
)

# Llama 3 405B's 419 unexpected interruptions by root cause (arXiv 2407.21783, Table 5; the counts sum to 419,
# the printed 30.1% for "faulty GPU" does not match its 148): silent data corruption 6; significant manual
# intervention "only three times" (§3.3.4).
LLAMA3_UNEXPECTED, LLAMA3_SDC, LLAMA3_MANUAL = 419, 6, 3
# ByteRobust's fleet, 3 months of 778,135 training jobs (arXiv 2509.16293, Table 1): 5,506 job hangs of 55,365
# incidents. Its share of failures that show as hangs, whatever their cause (a dead GPU often hangs its peers).
BYTEROBUST_HANGS, BYTEROBUST_INCIDENTS = 5506, 55365
# A person's diagnosis where automation fails: ByteRobust's manual diagnosis took over 1.5 h for a hang after a
# CUDA error and over 8 h for a silent corruption (§2.2): their geometric midpoint, about 3.5 h.
TRIAGE_H = math.sqrt(1.5 * 8)
# A failure found and fixed by hand, without on-call automation: BLOOM-176B's hangs cost 18, 6 and 11 h
# (bigscience train/tr11-176B-ml/chronicles.md, 2022-04-30, 05-09, 05-18): their geometric midpoint, 10.4 h.
BY_HAND_H = math.sqrt(6 * 18)

# PaLM 540B restarted about 100 steps before each of its ~20 loss spikes (arXiv 2204.02311 §5.1).
PALM_ROLLBACK_STEPS = 100

PUBLISHED_MIX = FailureMix(hang=BYTEROBUST_HANGS / BYTEROBUST_INCIDENTS, silent=LLAMA3_SDC / LLAMA3_UNEXPECTED,
                           manual=LLAMA3_MANUAL / LLAMA3_UNEXPECTED)


@dataclass(frozen=True)
class PublishedRun:
    """A training run that published its interruptions, and what the forecast needs of it (None: the
    planner's default). `at_least`: the source says "over" the count (or the goodput)."""

    name: str
    generation: str  # `Accelerator.generation`
    devices: int
    days: float  # wall-clock days the count covers
    interruptions: float  # unexpected ones
    source: str
    params: float  # parameters: the checkpoint's size
    goodput: float | None = None  # effective training time as published (None: not published)
    at_least: bool = False
    goodput_at_least: bool = False
    blocking_s: float | None = None  # one save's blocking time
    sync: bool = False  # training waits for the whole write
    interval_s: float | None = None  # between saves; None: the Young/Daly optimum
    detect_s: float | None = None
    restart_s: float | None = None
    manual: float | None = None  # share of failures a person diagnoses
    triage_h: float | None = None
    spare_nodes: int = 8
    notes: str = ""

    @property
    def rate(self) -> float:
        """Unexpected interruptions per accelerator-day."""
        return self.interruptions / (self.devices * self.days)


RUNS = (
    PublishedRun("Llama 3 405B", "hopper", 16384, 54, 419, "arXiv 2407.21783 §3.3.4, Table 5", 405e9,
                 goodput=0.90, goodput_at_least=True,
                 notes="checkpoints to 2 TB/s storage; no detection, restart or interval published"),
    PublishedRun("ByteRobust dense 70B+", "hopper", 9600, 90, 175, "arXiv 2509.16293 §8.1, Tables 4, 6-8", 70e9,
                 goodput=0.97, blocking_s=0.04, detect_s=30, restart_s=768, manual=12 / 175, triage_h=4289 / 3600,
                 notes="175 incidents (128 evict and restart, 20 hot updates, 15 over-evictions, 12 rollbacks); "
                       "every-step checkpoints blocking 0.01-0.04 s; detection 2-30 s; a requeue 768 s at 1,024 "
                       "machines; a NaN rollback 4,289 s on average"),
    PublishedRun("ByteRobust MoE 200B+", "hopper", 9600, 30, 125, "arXiv 2509.16293 §8.1, Table 4", 200e9,
                 notes="125 incidents; its effective time is only drawn (Fig. 10), not stated"),
    PublishedRun("OPT-175B", "ampere", 992, 56, 90, "arXiv 2205.01068 §2.5; metaseq projects/OPT/chronicles",
                 175e9, goodput=33 / 56, manual=35 / 105, triage_h=BY_HAND_H, detect_s=900,
                 notes="~90 restarts of the 12.xx runs, Nov 11 2021 - Jan 6 2022; at least 35 manual and 70+ "
                       "automatic hardware restarts; goodput derived: 33 days of compute at the achieved rate "
                       "in 56; hangs found by hand"),
    PublishedRun("BLOOM-176B", "ampere", 384, 102, 1.5 * 102 / 7, "bigscience tr11-176B-ml chronicles; HF blog",
                 176e9, goodput=0.87, blocking_s=40, sync=True, interval_s=3 * 3600, manual=6 / 22,
                 triage_h=BY_HAND_H, spare_nodes=4,
                 notes="1-2 GPU failures a week (1.5 taken) over epoch 1, 2022-03-18 to 06-28; 3 hangs and "
                       "several 5-10 h stops found by hand (6 of ~22 taken); goodput derived: 85,376 - 12,695 "
                       "iterations at 105 s in 102 days"),
    PublishedRun("MegaScale 175B", "ampere", 10000, 21, 100, "arXiv 2402.15627 §6.2-6.3, §3.5, §4.4", 175e9,
                 goodput=0.90, at_least=True, goodput_at_least=True, detect_s=600, restart_s=30, manual=0.1,
                 notes="over 100 restarts in 'several weeks' (3 taken) on over 10,000 GPUs; detection and "
                       "diagnosis under 10 min; over 90% of faults handled automatically; initialisation under "
                       "30 s"),
)


def _midpoint(rates: list[float]) -> float:
    return math.sqrt(min(rates) * max(rates))


def generation_rate(generation: str) -> float:
    """Unexpected interruptions per accelerator-day of a generation's published runs (every run's for another)."""
    rates = [r.rate for r in RUNS if r.generation == generation] or [r.rate for r in RUNS]
    return _midpoint(rates)


def device_mtbf_hours(hardware_key: str) -> float:
    """Hours of one accelerator per job interruption it causes, from its generation's published runs."""
    return 24.0 / generation_rate(by_key(hardware_key).generation)


def forecast(run: PublishedRun, own_rate: bool = False, trials: int = 500, seed: int = 0) -> dict[str, float]:
    """The failure model's interruptions and goodput for a published run, from its generation's rate (or, with
    `own_rate`, the run's own count: what the goodput terms alone give) and its own operational figures: the
    run's days of compute meet failures for as long as they take."""
    rate = run.rate if own_rate else generation_rate(run.generation)
    mix = PUBLISHED_MIX if run.manual is None else replace(PUBLISHED_MIX, manual=run.manual)
    ckpt = checkpoint_bytes(run.params, run.devices)
    storage = Storage()
    if run.blocking_s is not None:  # the published blocking: the whole write when sync, the copy when async
        storage = Storage(write_bw=ckpt / run.blocking_s, save_overhead_s=0.0) if run.sync else \
            Storage(host_copy_bw=math.inf, save_overhead_s=run.blocking_s)
    given = {"detect_s": run.detect_s, "restart_s": run.restart_s}
    recovery = replace(Recovery(triage_s=(TRIAGE_H if run.triage_h is None else run.triage_h) * 3600),
                       **{name: value for name, value in given.items() if value is not None})
    model = Run(run.days * 86400, run.devices, ckpt, FailureModel(device_mtbf_h=24.0 / rate, mix=mix), storage,
                recovery)
    result = simulate(model, Policy(async_save=not run.sync, interval_s=run.interval_s,
                                    spare_nodes=run.spare_nodes), seed=seed, trials=trials)
    return {"interruptions": rate * run.devices * run.days, "goodput": float(result.stats("goodput")["p50"]),
            "rate_per_1000_device_days": rate * 1000}


def failures_source(hardware_key: str) -> str:
    """Where the default rate of `hardware_key` comes from, in a few words."""
    generation = by_key(hardware_key).generation
    runs = [r.name for r in RUNS if r.generation == generation]
    return f"{generation.title()}'s published runs ({', '.join(runs)})" if runs else \
        "the midpoint of every published run (none of this generation)"


def guard_latencies(cfg: Config, step_s: float) -> tuple[float, float]:
    """keel's own detection of a silent corruption and cost of a loss-spike rollback, in seconds at `step_s`:
    a corrupted gradient is found by the next replay (half the replay interval on average, and the step itself);
    a spike rolls back at least `guard.rollback_steps` to a snapshot taken every `guard.snapshot_interval`
    (half of one more on average). Without the guards: an hour to find a corruption (an assumption) and
    PaLM 540B's rollbacks of about 100 steps (arXiv 2204.02311 §5.1)."""
    guard = cfg.guard
    silent = (guard.sdc.replay_interval / 2 + 1) * step_s if guard.enabled and guard.sdc.replay_interval else 3600.0
    redone = guard.rollback_steps + guard.snapshot_interval / 2 if guard.enabled and guard.snapshot_interval \
        else PALM_ROLLBACK_STEPS
    return silent, redone * step_s
