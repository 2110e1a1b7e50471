"""Failures and checkpoints at scale: job MTBF, save cost, the Young/Daly interval and a Monte Carlo of the run.

Failure rate. The default comes from Llama 3 405B pre-training ("The Llama 3 Herd of Models", arXiv 2407.21783,
§3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100 GPUs. Counting every cause (GPU, HBM, network,
host, software) against the GPUs, one device sees an interruption every 16,384 × 54 × 24 h / 419 ≈ 50,677
device-hours. A job on n devices fails n times as often: M = 50,677 h / n (3.09 h on 16,384 GPUs, 49.5 h on
1,024). An extra per-node term (host, NIC, power) can be added when a source separates it; the Llama 3 figure
already includes it. 78% of their unexpected interruptions were confirmed or suspected hardware: those need the
node swapped for a spare, or repaired when no spare is free.

Checkpoint size: fp32 master weights + Adam m + v = 12 bytes/param, + 2 if the bf16 weights are saved too
(ZeRO, arXiv 1910.02054: 16 bytes/param of model state, 2 of which are gradients that are not saved), + the
loader and RNG state of each rank. A synchronous save blocks for size / aggregate storage bandwidth; an async
save blocks only for the copy of each device's shard to host memory and writes it in the background.

First-order waste (fraction of wall time not spent on useful training), with δ the blocking cost of one save,
τ the compute between saves, R the down time per failure and M the job MTBF:
    waste ≈ δ/τ + (τ/2 + R)/M
(saves cost δ every τ; a failure loses half an interval of work on average plus R). Young (1974) minimised it:
τ = √(2δM); Daly (2006) added higher-order terms (keel.checkpoint.interval.daly_interval). An async save adds
the write time w to the expected loss, since a failure during the write loses that save too: + w/M. With one
host buffer, a save waits for the previous write when τ < w. `expected_goodput` is the complete exponential
model (valid when the waste is large, where the first-order form is not).

The simulator draws failure times on the wall clock, independent of the policy (exponential, or Weibull with a
shape: Schroeder and Gibson, DSN 2006, found a decreasing hazard, shape < 1, in HPC systems), and replays each
trial: compute and saves from the last restore, the failure, detection, the wait for a node (a spare from a
finite pool, each failed node back after a repair time; without a free spare, the repair itself), restart, and
restore from disk or from peers' host memory; the work since the last committed save is lost. A failure during
a recovery overlaps with it. All trials advance together, one failure per numpy step.

How a failure shows sets how long it takes to find (FailureMix, Recovery): a crash is noticed within
detect_s, a hang only when a collective times out (hang_detect_s), a silent corruption when a check finds it
(silent_detect_s: keel's guard latency in the planner); a share of failures waits for a person's triage
(triage_s). R above holds the mean of these. Loss-spike rollbacks are not failures: each redoes rollback_s of
compute, FailureMix.rollbacks_per_day of them a day; the models add that share of the compute to the lost work.
keel.plan.failure_rates holds the published rates and shares, and the runs that check them.

Two tiers. A memory checkpoint (keel.checkpoint.memory) is a copy of each device's shard in its node's host memory,
replicated to a buddy node in the background over the scale-out network; a storage checkpoint is the usual one.
The memory tier covers a share p_m of the failures (FailureModel.memory_coverage): a process or GPU failure
(the node's memory survives the restart) and the loss of one node (its replacement pulls the shards from the
buddy). A failure that takes a node together with its buddy, or the whole job, falls back to storage. Each tier
gets its own Young/Daly interval against the failures it serves, δ_m and δ_s the blocking cost of one save:
    τ_m = √(2·δ_m·M / p_m)        τ_s = √(2·δ_s·M / (1 − p_m))
(Daly's higher-order form at M / p_m and M / (1 − p_m)), and the first-order waste is
    δ_m/τ_m + δ_s/τ_s + [p_m·(τ_m/2 + R_m) + (1 − p_m)·(τ_s/2 + R_s)] / M
whose minimum over τ_m and τ_s is the pair above. keel's memory tier also saves at the storage tier's steps,
so the storage interval is planned as a whole number of memory intervals (the nearest to τ_s).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from keel.checkpoint.interval import daly_interval
from keel.checkpoint.memory import BYTES_PER_PARAMETER
from keel.errors import KeelError

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS = 419  # unexpected ones; 47 more were planned (arXiv 2407.21783 §3.3.4)
LLAMA3_HARDWARE_FRACTION = 0.78  # share of unexpected interruptions confirmed or suspected hardware (same source)
LLAMA3_SWITCH_INTERRUPTIONS = 35  # of the 419: network switch or cable (same source, Table 5)
# p_m: the share of failures a memory tier replicated to a buddy node restores (FailureModel.memory_coverage).
DEFAULT_MEMORY_COVERAGE = 1 - LLAMA3_SWITCH_INTERRUPTIONS / LLAMA3_INTERRUPTIONS  # ≈ 0.916
DEFAULT_DEVICE_MTBF_H = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS  # ≈ 50,677 device-hours


@dataclass(frozen=True)
class FailureMix:
    """How the interruptions show, each as a share of them, and the loss-spike rollbacks beside them. All 0 here
    (every failure a crash, found at once); keel.plan.failure_rates holds the published figures the planner
    uses. Each share is charged its own detection time (Recovery): a hang waits for a collective's timeout, a
    silent corruption for the check that finds it, and a failure a person must triage for that person."""

    hang: float = 0.0  # found only when a collective times out
    silent: float = 0.0  # silent data corruption: found by a check, its latency the detection time
    manual: float = 0.0  # needs a person to diagnose it before the restart (on top of its detection)
    rollbacks_per_day: float = 0.0  # loss spikes rolled back per day of compute: not failures, work redone

    def __post_init__(self) -> None:
        for name in ("hang", "silent", "manual"):
            if not 0 <= getattr(self, name) <= 1:
                raise KeelError(f"failure mix: {name} {getattr(self, name)} must be a share in [0, 1]")
        if self.hang + self.silent > 1:
            raise KeelError(f"failure mix: hang {self.hang} + silent {self.silent} exceed every failure (1)")
        if not 0 <= self.rollbacks_per_day < math.inf:
            raise KeelError(f"failure mix: rollbacks_per_day {self.rollbacks_per_day} must be >= 0 and finite")


@dataclass(frozen=True)
class FailureModel:
    device_mtbf_h: float = DEFAULT_DEVICE_MTBF_H  # hours of one device per job interruption it causes
    node_mtbf_h: float = math.inf  # extra failures per node (host, NIC, power), when not already counted above
    devices_per_node: int = 8
    dist: str = "exponential"  # exponential | weibull: inter-arrival times of the job's failures
    shape: float = 1.0  # Weibull shape: < 1 failures come in bursts (decreasing hazard), 1 is exponential
    hardware_fraction: float = LLAMA3_HARDWARE_FRACTION  # failures that need the node replaced
    # p_m, the failures the memory tier restores. Of the categories above, software failures (1 −
    # hardware_fraction) leave every node's memory and hardware failures of one node leave the buddy's copy:
    # both are covered. Not covered: failures that take several nodes at once, a node with its buddy. Llama 3
    # names one such category, network switch or cable (35 of 419): a switch cuts off every node behind it, the
    # buddy too when it shares the switch, so all 35 count as uncovered. That is conservative where buddies sit
    # behind different switches; a buddy's own failure during a node's recovery is rarer still and left out.
    memory_coverage: float = DEFAULT_MEMORY_COVERAGE
    mix: FailureMix = FailureMix()  # frozen: one shared default is safe

    def __post_init__(self) -> None:
        if self.dist not in ("exponential", "weibull"):
            raise KeelError(f"failure distribution {self.dist!r}: use exponential or weibull")
        if self.device_mtbf_h <= 0 or self.shape <= 0 or not 0 <= self.hardware_fraction <= 1:
            raise KeelError("failure model: device_mtbf_h and shape must be > 0, hardware_fraction in [0, 1]")
        if not 0 <= self.memory_coverage <= 1:
            raise KeelError(f"memory_coverage {self.memory_coverage}: the share of failures the memory tier "
                            f"restores must be in [0, 1]")

    def job_mtbf_s(self, devices: int) -> float:
        """Mean time between the job's failures: the per-device (and per-node) rates add up."""
        nodes = math.ceil(devices / self.devices_per_node)
        rate_per_h = devices / self.device_mtbf_h + nodes / self.node_mtbf_h
        return 3600.0 / rate_per_h


def checkpoint_bytes(n_params: float, ranks: int, *, bf16_weights: bool = True,
                     extra_per_rank: float = 2**20) -> float:
    """Bytes of one restartable checkpoint: 12/param (fp32 master, Adam m and v), + 2/param for the bf16
    weights when saved, + loader position and RNG states of each rank (~5 KB of RNG; 1 MiB is a generous bound)."""
    return n_params * (BYTES_PER_PARAMETER + (2 if bf16_weights else 0)) + ranks * extra_per_rank


@dataclass(frozen=True)
class Storage:
    write_bw: float = 2e12  # bytes/s aggregate; Llama 3's 2 TB/s sustained (arXiv 2407.21783 §3.3.4)
    read_bw: float = 0.0  # bytes/s aggregate for a restore; 0: same as write_bw
    # Device → host copy per device. PCIe Gen5 x16 is 64 GB/s one way (reference table); 8 GPUs share a host's
    # memory and sockets, so assume 25 GB/s.
    host_copy_bw: float = 25e9
    # In-memory/peer restore: a replacement pulls its shard from a peer's host memory over the scale-out link,
    # 400 Gb/s NDR per GPU = 50 GB/s (reference table, DGX H100).
    peer_bw: float = 50e9
    save_overhead_s: float = 1.0  # per save: planning collective, barrier, manifest commit (assumption)
    # Per memory save beyond the copy: a node-local commit, no storage round trip. keel's loop waited 0.02 s a
    # memory save on 2 processes (docs/benchmarks.md); 0.1 s allows for thousands of ranks (assumption).
    memory_overhead_s: float = 0.1


@dataclass(frozen=True)
class Recovery:
    detect_s: float = 120.0  # heartbeat/watchdog notices the failure (PyTorch's NCCL default timeout is 600 s)
    restart_s: float = 300.0  # reschedule, start every rank, NCCL init, warm-up (assumption: minutes at scale)
    repair_s: float = 4 * 3600.0  # a failed node back in service: drain, diagnose, swap a part, burn-in (assumption)
    hang_detect_s: float = 600.0  # a hang found by the collective's timeout (PyTorch's NCCL default: 10 min)
    silent_detect_s: float = 3600.0  # a silent corruption found (the planner puts keel's guard latency here)
    triage_s: float = 0.0  # a person's diagnosis of a failure automation cannot handle
    rollback_s: float = 0.0  # compute redone per loss-spike rollback

    def detection_s(self, mix: FailureMix) -> float:
        """The mean time from a failure to its restart's start: detection by how it shows, and the share
        a person triages. The simulator charges every failure this mean."""
        crash = 1.0 - mix.hang - mix.silent
        return (crash * self.detect_s + mix.hang * self.hang_detect_s + mix.silent * self.silent_detect_s
                + mix.manual * self.triage_s)


@dataclass(frozen=True)
class Run:
    work_s: float  # compute time the token budget needs, without saves or failures
    devices: int
    ckpt_bytes: float
    failures: FailureModel = field(default_factory=FailureModel)
    storage: Storage = field(default_factory=Storage)
    recovery: Recovery = field(default_factory=Recovery)

    def __post_init__(self) -> None:
        if self.work_s <= 0 or self.devices < 1 or self.ckpt_bytes < 0:
            raise KeelError("run: work_s must be > 0, devices >= 1 and ckpt_bytes >= 0")

    @property
    def mtbf_s(self) -> float:
        return self.failures.job_mtbf_s(self.devices)


@dataclass(frozen=True)
class Policy:
    name: str = "async, optimal interval, disk restore, spares"
    async_save: bool = True
    interval_s: float | None = None  # compute seconds between (storage) saves; None: the Young/Daly optimum
    restore: str = "disk"  # disk | memory (peers' host memory): where every restore reads, with one tier
    spare_nodes: int = 8  # hot spares; a failed node is repaired in repair_s and becomes a spare again
    memory_tier: bool = False  # also save to host memory (two tiers); storage then serves what memory cannot
    memory_interval_s: float | None = None  # compute seconds between memory saves; None: the Young/Daly optimum

    def __post_init__(self) -> None:
        if self.restore not in ("disk", "memory"):
            raise KeelError(f"restore {self.restore!r}: use disk or memory")
        if self.spare_nodes < 0:
            raise KeelError(f"spare_nodes {self.spare_nodes}: must be >= 0")
        for name in ("interval_s", "memory_interval_s"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise KeelError(f"{name} {value}: a checkpoint interval must be > 0 s and finite")
        if self.memory_tier and self.restore == "memory":
            raise KeelError("memory_tier with restore='memory': with two tiers, restore names the storage "
                            "tier's source; use restore='disk'")
        if self.memory_interval_s is not None and not self.memory_tier:
            raise KeelError(f"memory_interval_s {self.memory_interval_s} without memory_tier: set "
                            f"memory_tier=True or leave the memory interval out")


@dataclass(frozen=True)
class Schedule:
    """What a policy does on a run: interval τ, blocking per save (with any wait for the previous write),
    the period τ + blocking, the lag from a save's end of blocking to its commit, and the restore time."""

    tau: float
    blocking: float
    period: float
    lag: float  # the background write of an async save; 0 when sync
    restore_s: float


def save_times(run: Run, async_save: bool) -> tuple[float, float]:
    """(blocking_s, write_s) of one save. Sync: the copy to host and the write are pipelined, training waits
    for both. Async: training waits for the copy only; the write runs in the background."""
    st = run.storage
    write = run.ckpt_bytes / st.write_bw
    copy = run.ckpt_bytes / run.devices / st.host_copy_bw
    if async_save:
        return copy + st.save_overhead_s, write
    return max(write, copy) + st.save_overhead_s, 0.0


def restore_time(run: Run, restore: str) -> float:
    st = run.storage
    if restore == "memory":
        return run.ckpt_bytes / run.devices / st.peer_bw
    return run.ckpt_bytes / (st.read_bw or st.write_bw)


def young_daly(run: Run, async_save: bool = True) -> float:
    """Optimal compute time between saves (Daly 2006). Async: no shorter than the background write, or each
    save would wait for the previous one."""
    blocking, write = save_times(run, async_save)
    return max(daly_interval(blocking, run.mtbf_s), write)


def memory_save_times(run: Run) -> tuple[float, float]:
    """(blocking_s, replicate_s) of one memory save. Training waits for the copy of each device's shard to host
    memory and a node-local commit; the replica then goes to the buddy node in the background over the
    scale-out network, each device sending its shard at peer_bw (all of the checkpoint's bytes cross the
    network once per save: the traffic `replication` states)."""
    st = run.storage
    shard = run.ckpt_bytes / run.devices
    return shard / st.host_copy_bw + st.memory_overhead_s, shard / st.peer_bw


def _tier_interval(delta_s: float, mtbf_s: float, share: float, floor_s: float) -> float:
    """Young/Daly against the failures one tier serves, M / share apart; never (inf) when it serves none. No
    shorter than `floor_s`, the background part a save must finish before the next one."""
    if share <= 0:
        return math.inf
    return max(daly_interval(delta_s, mtbf_s / share), floor_s)


def young_daly_tiers(run: Run, async_save: bool = True) -> tuple[float, float]:
    """(τ_m, τ_s): each tier's own Young/Daly interval, τ_m at M / p_m and τ_s at M / (1 − p_m) (the module
    docstring), before the storage interval is rounded to whole memory intervals."""
    p = run.failures.memory_coverage
    m_block, replicate = memory_save_times(run)
    s_block, write = save_times(run, async_save)
    return (_tier_interval(m_block, run.mtbf_s, p, replicate),
            _tier_interval(s_block, run.mtbf_s, 1 - p, write))


@dataclass(frozen=True)
class Tiers:
    """A two-tier policy on a run: the memory tier's schedule (its lag is the replication to the buddy, its
    restore a pull from the buddy's memory), the storage tier's (τ = every × τ_m; its period is `every` memory
    periods and its own save) and p_m, the share of failures restored from memory."""

    memory: Schedule
    storage: Schedule
    every: int
    coverage: float


def _storage_every(tau_s: float, tau_m: float, work_s: float) -> int:
    """Memory intervals per storage interval: the nearest whole number; one beyond the run's end when storage
    would serve no failure (p_m = 1) or its interval outlasts the run."""
    if tau_s >= work_s:
        return max(1, math.ceil(work_s / tau_m))
    return max(1, round(tau_s / tau_m))


def tiers(run: Run, policy: Policy) -> Tiers | None:
    """The two tiers' schedules, or None for one tier. With an optimal memory interval and p_m = 0 the optimum
    is never to save to memory: storage only, None too. A memory interval longer than the storage one is cut
    to it (the memory tier saves at every storage save anyway)."""
    if not policy.memory_tier:
        return None
    optimal_m, optimal_s = young_daly_tiers(run, policy.async_save)
    if policy.memory_interval_s is None and math.isinf(optimal_m):
        return None
    tau_s = optimal_s if policy.interval_s is None else policy.interval_s
    tau_m = min(optimal_m if policy.memory_interval_s is None else policy.memory_interval_s, tau_s)
    every = _storage_every(tau_s, tau_m, run.work_s)
    m_block, replicate = memory_save_times(run)
    m_block += max(0.0, replicate - tau_m)  # one replica in flight: a save waits for the previous one
    memory = Schedule(tau_m, m_block, tau_m + m_block, replicate, restore_time(run, "memory"))
    s_block, write = save_times(run, policy.async_save)
    s_block += max(0.0, write - every * tau_m)
    storage = Schedule(every * tau_m, s_block, every * memory.period + s_block, write,
                       restore_time(run, policy.restore))
    return Tiers(memory, storage, every, run.failures.memory_coverage)


def schedule(run: Run, policy: Policy) -> Schedule:
    """The storage tier's schedule (the only tier's, with one)."""
    if (two := tiers(run, policy)) is not None:
        return two.storage
    blocking, write = save_times(run, policy.async_save)
    tau = policy.interval_s if policy.interval_s is not None else young_daly(run, policy.async_save)
    if tau <= 0:
        raise KeelError(f"checkpoint interval {tau} s: must be > 0")
    if policy.async_save:  # one host buffer: a save waits until the previous write is done
        blocking += max(0.0, write - tau)
    return Schedule(tau, blocking, tau + blocking, write, restore_time(run, policy.restore))


def save_share(run: Run, policy: Policy) -> float:
    """Seconds blocked in saves per second of compute: δ/τ, and δ_m/τ_m + δ_s/τ_s with two tiers."""
    s = schedule(run, policy)
    two = tiers(run, policy)
    return s.blocking / s.tau + (two.memory.blocking / two.memory.tau if two else 0.0)


def _recovery_s(run: Run, policy: Policy, restore_s: float) -> float:
    """Detect, restart, restore, + the repair wait of hardware failures without a spare (a free spare is
    assumed when there are any; the simulator models the pool running dry)."""
    rec = run.recovery
    wait = 0.0 if policy.spare_nodes > 0 else run.failures.hardware_fraction * rec.repair_s
    return rec.detection_s(run.failures.mix) + rec.restart_s + restore_s + wait


def down_time(run: Run, policy: Policy) -> float:
    """Mean down time per failure R; with two tiers, p_m of the failures restore from memory, the rest from
    storage."""
    if (two := tiers(run, policy)) is None:
        return _recovery_s(run, policy, restore_time(run, policy.restore))
    p = two.coverage
    return p * _recovery_s(run, policy, two.memory.restore_s) + (1 - p) * _recovery_s(run, policy,
                                                                                      two.storage.restore_s)


def rollback_share(run: Run) -> float:
    """Compute redone in loss-spike rollbacks per second of compute (FailureMix.rollbacks_per_day)."""
    return run.failures.mix.rollbacks_per_day * run.recovery.rollback_s / 86400


def first_order_waste(delta_s: float, tau_s: float, restart_s: float, mtbf_s: float) -> float:
    """Young's first-order waste fraction δ/τ + (τ/2 + R)/M (see the module docstring)."""
    return delta_s / tau_s + (tau_s / 2 + restart_s) / mtbf_s


def two_tier_waste(memory: tuple[float, float, float], storage: tuple[float, float, float], coverage: float,
                   mtbf_s: float) -> float:
    """The first-order waste of two tiers, each given as (δ, τ, R):
    δ_m/τ_m + δ_s/τ_s + [p_m·(τ_m/2 + R_m) + (1 − p_m)·(τ_s/2 + R_s)] / M (the module docstring)."""
    (delta_m, tau_m, restart_m), (delta_s, tau_s, restart_s) = memory, storage
    lost = coverage * (tau_m / 2 + restart_m) + (1 - coverage) * (tau_s / 2 + restart_s)
    return delta_m / tau_m + delta_s / tau_s + lost / mtbf_s


def effective_ratio(run: Run, policy: Policy) -> float:
    """Expected effective training time ratio (goodput), first order: 1 − waste, with the commit lags."""
    s = schedule(run, policy)
    if (two := tiers(run, policy)) is None:
        waste = first_order_waste(s.blocking, s.tau, down_time(run, policy) + s.lag, run.mtbf_s)
    else:
        m = two.memory
        waste = two_tier_waste((m.blocking, m.tau, _recovery_s(run, policy, m.restore_s) + m.lag),
                               (s.blocking, s.tau, _recovery_s(run, policy, s.restore_s) + s.lag),
                               two.coverage, run.mtbf_s)
    return max(0.0, 1.0 - waste - rollback_share(run))


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-trial outcomes (arrays of length trials). wall = work + checkpoint + lost + down, exactly."""

    policy: Policy
    schedule: Schedule  # the storage tier's (the only tier's, with one)
    work_s: float
    wall_s: np.ndarray
    interruptions: np.ndarray
    checkpoint_s: np.ndarray  # blocked in saves (copy, write when sync, wait for the previous write)
    lost_s: np.ndarray  # compute redone after failures
    down_s: np.ndarray  # detection, wait for a node, restart, restore
    elapsed_s: float  # the simulator's own run time
    storage_restores: np.ndarray  # the interruptions restored from storage (all of them, with one tier)
    tiers: Tiers | None = None

    @property
    def goodput(self) -> np.ndarray:
        return self.work_s / self.wall_s

    @property
    def trials(self) -> int:
        return len(self.wall_s)

    @property
    def lost_per_failure_s(self) -> float:
        """Compute redone per interruption, over every trial."""
        return float(self.lost_s.sum() / max(int(self.interruptions.sum()), 1))

    def stats(self, name: str) -> dict[str, float]:
        values = np.asarray(getattr(self, name), dtype=float)
        p10, p50, p90 = np.percentile(values, [10, 50, 90])
        return {"p10": float(p10), "p50": float(p50), "p90": float(p90), "mean": float(values.mean())}

    def row(self) -> dict:
        memory = self.tiers.memory if self.tiers else None
        return {"policy": self.policy.name, "interval_s": self.schedule.tau, "blocking_s": self.schedule.blocking,
                "restore_s": self.schedule.restore_s, "wall_days": {k: v / 86400 for k, v in
                                                                     self.stats("wall_s").items()},
                "goodput": self.stats("goodput"), "interruptions": self.stats("interruptions"),
                "memory_interval_s": memory.tau if memory else None,
                "memory_blocking_s": memory.blocking if memory else None,
                "lost_per_failure_s": self.lost_per_failure_s,
                "restored_from_storage": float(self.storage_restores.sum() / max(self.interruptions.sum(), 1))}


def _inter_arrivals(rng: np.random.Generator, fm: FailureModel, mtbf_s: float, n: int) -> np.ndarray:
    if fm.dist == "weibull":  # scale so that the mean is the MTBF
        return mtbf_s / math.gamma(1 + 1 / fm.shape) * rng.weibull(fm.shape, n)
    return rng.exponential(mtbf_s, n)


def expected_goodput(run: Run, policy: Policy) -> float:
    """Expected goodput with exponential failures that also strike during recovery: Daly (2006)'s complete
    model, with the async commit lag and random recovery times. An up time commits τ per period P = τ + δ that
    ends (plus the lag) before the failure. Overlapping recoveries merge like the busy period of an M/G/∞ queue:
    a down stretch lasts M(e^{R/M} − 1) on average, R the mean down time per failure, so
        goodput = τ·e^{−lag/M} / (M·(e^{P/M} − 1)·e^{R/M})
    Valid at any waste level (the first-order form is not); a free spare is assumed when there are any. Two
    tiers: `_two_tier_goodput`."""
    if (two := tiers(run, policy)) is not None:
        return _two_tier_goodput(run, policy, two) / (1 + rollback_share(run))
    s = schedule(run, policy)
    m = run.mtbf_s
    commits = math.exp(-min(s.lag / m, 500)) / math.expm1(min(s.period / m, 500))
    return s.tau * commits / (m * math.exp(min(down_time(run, policy) / m, 500))) / (1 + rollback_share(run))


def _daly_wall(length_s: float, mtbf_s: float, down_s: float, lag_s: float) -> float:
    """Expected wall time to get through `length_s` of up time that each failure (MTBF `mtbf_s`) sends back to
    its start after `down_s`, the result committing `lag_s` after the end: Daly's M·(e^{L/M} − 1)·e^{(R+lag)/M},
    L itself without failures."""
    if math.isinf(mtbf_s):
        return length_s
    return mtbf_s * math.expm1(min(length_s / mtbf_s, 500)) * math.exp(min((down_s + lag_s) / mtbf_s, 500))


def _two_tier_goodput(run: Run, policy: Policy, two: Tiers) -> float:
    """Daly's model nested: the failures memory covers (M / p_m apart) send a memory period back to its start,
    which makes a storage period of `every` memory periods and the storage save last `segment` on average; the
    failures it does not cover (M / (1 − p_m) apart) send that whole storage period back."""
    m, s, p = two.memory, two.storage, two.coverage
    covered = run.mtbf_s / p if p > 0 else math.inf
    uncovered = run.mtbf_s / (1 - p) if p < 1 else math.inf
    down_m, down_s = _recovery_s(run, policy, m.restore_s), _recovery_s(run, policy, s.restore_s)
    segment = ((two.every - 1) * _daly_wall(m.period, covered, down_m, m.lag)
               + _daly_wall(m.period + s.blocking, covered, down_m, m.lag))
    return s.tau / _daly_wall(segment, uncovered, down_s, s.lag)


class _Replay:
    """The trials' state while the simulator replays them, one failure per numpy step. Every trial draws every
    time, finished or not, so that the streams stay aligned across policies (common random numbers)."""

    def __init__(self, run: Run, policy: Policy, seed: int, trials: int, max_failures: int) -> None:
        self.run, self.trials, self.max_failures = run, trials, max_failures
        # Failure times, hardware or not, memory covers it or not: a stream each, so that policies with or
        # without the memory tier meet the same failures.
        self.fail_rng, self.kind_rng, self.cover_rng = (
            np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(3))
        self.busy = np.zeros((trials, policy.spare_nodes))  # when each spare slot is next free
        self.rows = np.arange(trials)
        self.done = np.zeros(trials, dtype=bool)
        self.resume = np.zeros(trials)  # wall time the job is up again
        self.last_fail = np.zeros(trials)
        self.wall, self.blocked, self.lost = np.zeros(trials), np.zeros(trials), np.zeros(trials)
        self.count = np.zeros(trials, dtype=np.int64)
        self.from_storage = np.zeros(trials, dtype=np.int64)

    def draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next failure of every trial: when, whether it is hardware, and the up time before it."""
        fail_at = self.last_fail + _inter_arrivals(self.fail_rng, self.run.failures, self.run.mtbf_s, self.trials)
        hardware = self.kind_rng.random(self.trials) < self.run.failures.hardware_fraction
        return fail_at, hardware, np.maximum(fail_at - self.resume, 0.0)

    def finish(self, need: np.ndarray, up: np.ndarray, blocking: np.ndarray) -> bool:
        """Trials whose rest of the run (`need`, of which `blocking` in saves) fits in the up time end there;
        True when all have."""
        finish = ~self.done & (need <= up)
        self.wall[finish] = self.resume[finish] + need[finish]
        self.blocked[finish] += blocking[finish]
        self.done |= finish
        return bool(self.done.all())

    def fail(self, fail_at: np.ndarray, hardware: np.ndarray, lost: np.ndarray, blocked: np.ndarray,
             down: np.ndarray | float, from_storage: np.ndarray | bool) -> None:
        """The unfinished trials fail: the work and saves of the up time, the wait for a node, and the
        recovery, which a failure during an earlier one overlaps with (up once both are recovered)."""
        hit = ~self.done
        self.blocked[hit] += blocked[hit]
        self.lost[hit] += lost[hit]
        self.count[hit] += 1
        self.from_storage[hit] += np.broadcast_to(from_storage, hit.shape)[hit]
        wait = _node_wait(self.busy, self.rows, hardware, hit, fail_at, self.run.recovery.repair_s)
        self.resume = np.where(hit, np.maximum(self.resume, fail_at + wait + down), self.resume)
        self.last_fail = fail_at


def _one_tier(r: _Replay, s: Schedule) -> None:
    """Saves every τ of compute from the last restore; a failure loses the compute since the last committed one."""
    rec, work = r.run.recovery, r.run.work_s
    committed = np.zeros(r.trials)
    fixed_down = rec.detection_s(r.run.failures.mix) + rec.restart_s + s.restore_s
    for _ in range(r.max_failures):
        fail_at, hardware, up = r.draw()
        remaining = work - committed
        saves_left = np.maximum(np.ceil(remaining / s.tau) - 1, 0)  # no save after the last step
        if r.finish(remaining + saves_left * s.blocking, up, saves_left * s.blocking):
            return
        saves = np.floor(np.maximum(up - s.lag, 0.0) / s.period)  # saves committed before the failure
        periods = np.floor(up / s.period)
        in_saves = periods * s.blocking + np.clip(up - periods * s.period - s.tau, 0.0, s.blocking)
        committed[~r.done] += saves[~r.done] * s.tau
        r.fail(fail_at, hardware, up - in_saves - saves * s.tau, in_saves, fixed_down, True)
    _exhausted(r)


def _storage_saves(pos: np.ndarray, n: np.ndarray, every: int) -> np.ndarray:
    """Storage saves among the n memory intervals after position `pos` (both counted in memory intervals
    from the run's start): one at each multiple of `every`."""
    return np.floor((pos + n) / every) - np.floor(pos / every)


def _wall_of(pos: np.ndarray, n: np.ndarray, two: Tiers) -> np.ndarray:
    """Up time to compute n memory intervals from `pos`, with the saves after each."""
    return n * two.memory.period + _storage_saves(pos, n, two.every) * two.storage.blocking


def _intervals_done(pos: np.ndarray, up: np.ndarray, two: Tiers) -> np.ndarray:
    """The memory intervals, saves after them included, done in `up` seconds from `pos`: the largest n with
    _wall_of(pos, n) <= up (0 when up < 0). The first storage save follows d = every − pos mod every
    intervals, then one every `every`: a cycle of every memory periods and a storage save."""
    period, every, s_block = two.memory.period, two.every, two.storage.blocking
    up = np.maximum(up, 0.0)
    d = every - np.mod(pos, every)
    first = d * period + s_block
    rest = np.maximum(up - first, 0.0)
    cycle = every * period + s_block
    cycles = np.floor(rest / cycle)
    after = d + cycles * every + np.minimum(np.floor((rest - cycles * cycle) / period), every - 1)
    return np.where(up < first, np.minimum(np.floor(up / period), d - 1), after)


def _two_tiers(r: _Replay, two: Tiers) -> None:
    """Memory saves every τ_m of compute, storage saves at every `every`-th of them, both on the run's own grid
    (positions count memory intervals from the start). A failure memory covers (probability p_m) restarts from
    the newest committed save of either tier; one it does not, from the newest storage save, and the memory
    copies beyond it are gone."""
    m, s, rec, work = two.memory, two.storage, r.run.recovery, r.run.work_s
    detect = rec.detection_s(r.run.failures.mix)
    down_m, down_s = (detect + rec.restart_s + restore for restore in (m.restore_s, s.restore_s))
    pos = np.zeros(r.trials)  # where the current up time started
    stored = np.zeros(r.trials)  # the newest committed storage save
    for _ in range(r.max_failures):
        fail_at, hardware, up = r.draw()
        covered = r.cover_rng.random(r.trials) < two.coverage
        remaining = work - pos * m.tau
        left = np.maximum(np.ceil(remaining / m.tau) - 1, 0)  # memory saves before the end
        blocking = left * m.blocking + _storage_saves(pos, left, two.every) * s.blocking
        if r.finish(remaining + blocking, up, blocking):
            return
        n = _intervals_done(pos, up, two)
        compute = n * m.tau + np.clip(up - _wall_of(pos, n, two), 0.0, m.tau)
        memory = pos + _intervals_done(pos, up - m.lag, two)
        new = _storage_saves(pos, _intervals_done(pos, up - s.lag, two), two.every)
        stored = np.where(new > 0, (np.floor(pos / two.every) + new) * two.every, stored)
        restored = np.where(covered, np.maximum(memory, stored), stored)
        r.fail(fail_at, hardware, compute - (restored - pos) * m.tau, up - compute,
               np.where(covered, down_m, down_s), ~covered)
        pos = np.where(r.done, pos, restored)
    _exhausted(r)


def _exhausted(r: _Replay) -> None:
    raise KeelError(f"the run did not finish within {r.max_failures} failures in some trials "
                    f"(job MTBF {r.run.mtbf_s / 3600:.2f} h): shorten recovery or add spares")


def simulate(run: Run, policy: Policy | None = None, seed: int = 0, trials: int = 2000,
             max_failures: int | None = None) -> SimResult:
    """Monte Carlo of the whole run. The failure times depend on the seed and the failure model only, so
    policies simulated with the same seed meet the same failures (common random numbers); so do the draws of
    which failures the memory tier covers, for policies with it."""
    policy = policy or Policy()
    started = time.perf_counter()
    s, two = schedule(run, policy), tiers(run, policy)
    rate = expected_goodput(run, policy)
    if rate < 1e-4:
        raise KeelError(f"the run cannot make progress: job MTBF {run.mtbf_s / 3600:.2f} h against "
                        f"{down_time(run, policy) / 3600:.2f} h down per failure and a {s.tau:.0f} s interval")
    if max_failures is None:  # three times the expected count: far in the tail, bounded when progress is slow
        max_failures = 1000 + int(3 * run.work_s / (run.mtbf_s * rate))
    # Loss-spike rollbacks redo compute: the replay computes that much more, and it counts as lost work
    redone = run.work_s * rollback_share(run)
    r = _Replay(replace(run, work_s=run.work_s + redone), policy, seed, trials, max_failures)
    if two is None:
        _one_tier(r, s)
    else:
        _two_tiers(r, two)
    r.lost += redone
    # What is left of the wall time; a trial without failures leaves a rounding error of either sign, not time
    down = np.maximum(r.wall - run.work_s - r.blocked - r.lost, 0.0)
    return SimResult(policy, s, run.work_s, r.wall, r.count, r.blocked, r.lost, down, time.perf_counter() - started,
                     r.from_storage, two)


def _node_wait(busy: np.ndarray, rows: np.ndarray, hardware: np.ndarray, hit: np.ndarray, fail_at: np.ndarray,
               repair_s: float) -> np.ndarray:
    """Each trial's wait for a healthy node after a failure at `fail_at`: a hardware failure takes the first
    free spare (`busy`: when each is next free) or waits for the earliest one back from repair, and the failed
    node goes to repair in its place; without spares it waits for its own repair."""
    if not busy.shape[1]:
        return np.where(hardware, repair_s, 0.0)
    slot = busy.argmin(axis=1)
    wait = np.where(hardware, np.maximum(busy[rows, slot] - fail_at, 0.0), 0.0)
    busy[rows, slot] = np.where(hardware & hit, fail_at + repair_s, busy[rows, slot])
    return wait


def replication(run: Run, two: Tiers) -> dict[str, float]:
    """What the memory tier's copies to buddy nodes cost the scale-out network: bytes each device sends per
    save, the seconds that takes at peer_bw (in the background) and the share of the link's time it holds on
    average. Contention with the training's own inter-node traffic is not modelled beyond this share."""
    per_device = run.ckpt_bytes / run.devices
    seconds = per_device / run.storage.peer_bw
    return {"bytes_per_device": per_device, "seconds": seconds, "link_share": seconds / two.memory.period}


def compare_policies(run: Run, seed: int = 0, trials: int = 2000, base: Policy | None = None,
                     fixed_interval_s: float = 3600.0) -> list[SimResult]:
    """The base policy and one change at a time: sync saves, a fixed interval, restore from peers' memory
    (or from disk when the base uses memory), no spare nodes, and the memory tier added (or, when the base has
    it, storage only). Same seed, so the same failures for each."""
    base = base or Policy()
    one_tier = replace(base, memory_tier=False, memory_interval_s=None)
    variants = [
        base,
        replace(base, name="sync saves" if base.async_save else "async saves", async_save=not base.async_save),
        replace(base, name=f"fixed interval {fixed_interval_s / 60:.0f} min", interval_s=fixed_interval_s)
        if base.interval_s is None else replace(base, name="optimal interval", interval_s=None),
        replace(one_tier, name="in-memory/peer restore" if base.restore == "disk" else "disk restore",
                restore="memory" if base.restore == "disk" else "disk"),
        replace(base, name="no spare nodes" if base.spare_nodes else "8 spare nodes",
                spare_nodes=0 if base.spare_nodes else 8),
        replace(one_tier, name="storage only", interval_s=None) if base.memory_tier else
        replace(base, name="memory + storage tiers", restore="disk", memory_tier=True, interval_s=None,
                memory_interval_s=None),
    ]
    return [simulate(run, policy, seed, trials) for policy in variants]
