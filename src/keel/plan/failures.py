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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from keel.checkpoint.interval import daly_interval
from keel.errors import KeelError

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS = 419  # unexpected ones; 47 more were planned (arXiv 2407.21783 §3.3.4)
LLAMA3_HARDWARE_FRACTION = 0.78  # share of unexpected interruptions confirmed or suspected hardware (same source)
DEFAULT_DEVICE_MTBF_H = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS  # ≈ 50,677 device-hours


@dataclass(frozen=True)
class FailureModel:
    device_mtbf_h: float = DEFAULT_DEVICE_MTBF_H  # hours of one device per job interruption it causes
    node_mtbf_h: float = math.inf  # extra failures per node (host, NIC, power), when not already counted above
    devices_per_node: int = 8
    dist: str = "exponential"  # exponential | weibull: inter-arrival times of the job's failures
    shape: float = 1.0  # Weibull shape: < 1 failures come in bursts (decreasing hazard), 1 is exponential
    hardware_fraction: float = LLAMA3_HARDWARE_FRACTION  # failures that need the node replaced

    def __post_init__(self) -> None:
        if self.dist not in ("exponential", "weibull"):
            raise KeelError(f"failure distribution {self.dist!r}: use exponential or weibull")
        if self.device_mtbf_h <= 0 or self.shape <= 0 or not 0 <= self.hardware_fraction <= 1:
            raise KeelError("failure model: device_mtbf_h and shape must be > 0, hardware_fraction in [0, 1]")

    def job_mtbf_s(self, devices: int) -> float:
        """Mean time between the job's failures: the per-device (and per-node) rates add up."""
        nodes = math.ceil(devices / self.devices_per_node)
        rate_per_h = devices / self.device_mtbf_h + nodes / self.node_mtbf_h
        return 3600.0 / rate_per_h


def checkpoint_bytes(n_params: float, ranks: int, *, bf16_weights: bool = True,
                     extra_per_rank: float = 2**20) -> float:
    """Bytes of one restartable checkpoint: 12/param (fp32 master, Adam m and v), + 2/param for the bf16
    weights when saved, + loader position and RNG states of each rank (~5 KB of RNG; 1 MiB is a generous bound)."""
    return n_params * (12 + (2 if bf16_weights else 0)) + ranks * extra_per_rank


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


@dataclass(frozen=True)
class Recovery:
    detect_s: float = 120.0  # heartbeat/watchdog notices the failure (PyTorch's NCCL default timeout is 600 s)
    restart_s: float = 300.0  # reschedule, start every rank, NCCL init, warm-up (assumption: minutes at scale)
    repair_s: float = 4 * 3600.0  # a failed node back in service: drain, diagnose, swap a part, burn-in (assumption)


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
    interval_s: float | None = None  # compute seconds between saves; None: the Young/Daly optimum
    restore: str = "disk"  # disk | memory (peers' host memory)
    spare_nodes: int = 8  # hot spares; a failed node is repaired in repair_s and becomes a spare again

    def __post_init__(self) -> None:
        if self.restore not in ("disk", "memory"):
            raise KeelError(f"restore {self.restore!r}: use disk or memory")
        if self.spare_nodes < 0:
            raise KeelError(f"spare_nodes {self.spare_nodes}: must be >= 0")


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


def schedule(run: Run, policy: Policy) -> Schedule:
    blocking, write = save_times(run, policy.async_save)
    tau = policy.interval_s if policy.interval_s is not None else young_daly(run, policy.async_save)
    if tau <= 0:
        raise KeelError(f"checkpoint interval {tau} s: must be > 0")
    if policy.async_save:  # one host buffer: a save waits until the previous write is done
        blocking += max(0.0, write - tau)
    return Schedule(tau, blocking, tau + blocking, write, restore_time(run, policy.restore))


def down_time(run: Run, policy: Policy) -> float:
    """Mean down time per failure R: detect, restart, restore, + the repair wait of hardware failures without
    a spare (a free spare is assumed when there are any; the simulator models the pool running dry)."""
    rec = run.recovery
    wait = 0.0 if policy.spare_nodes > 0 else run.failures.hardware_fraction * rec.repair_s
    return rec.detect_s + rec.restart_s + restore_time(run, policy.restore) + wait


def first_order_waste(delta_s: float, tau_s: float, restart_s: float, mtbf_s: float) -> float:
    """Young's first-order waste fraction δ/τ + (τ/2 + R)/M (see the module docstring)."""
    return delta_s / tau_s + (tau_s / 2 + restart_s) / mtbf_s


def effective_ratio(run: Run, policy: Policy) -> float:
    """Expected effective training time ratio (goodput), first order: 1 − waste, with the async commit lag."""
    s = schedule(run, policy)
    waste = first_order_waste(s.blocking, s.tau, down_time(run, policy) + s.lag, run.mtbf_s)
    return max(0.0, 1.0 - waste)


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-trial outcomes (arrays of length trials). wall = work + checkpoint + lost + down, exactly."""

    policy: Policy
    schedule: Schedule
    work_s: float
    wall_s: np.ndarray
    interruptions: np.ndarray
    checkpoint_s: np.ndarray  # blocked in saves (copy, write when sync, wait for the previous write)
    lost_s: np.ndarray  # compute redone after failures
    down_s: np.ndarray  # detection, wait for a node, restart, restore
    elapsed_s: float  # the simulator's own run time

    @property
    def goodput(self) -> np.ndarray:
        return self.work_s / self.wall_s

    @property
    def trials(self) -> int:
        return len(self.wall_s)

    def stats(self, name: str) -> dict[str, float]:
        values = np.asarray(getattr(self, name), dtype=float)
        p10, p50, p90 = np.percentile(values, [10, 50, 90])
        return {"p10": float(p10), "p50": float(p50), "p90": float(p90), "mean": float(values.mean())}

    def row(self) -> dict:
        return {"policy": self.policy.name, "interval_s": self.schedule.tau, "blocking_s": self.schedule.blocking,
                "restore_s": self.schedule.restore_s, "wall_days": {k: v / 86400 for k, v in
                                                                     self.stats("wall_s").items()},
                "goodput": self.stats("goodput"), "interruptions": self.stats("interruptions")}


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
    Valid at any waste level (the first-order form is not); a free spare is assumed when there are any."""
    s = schedule(run, policy)
    m = run.mtbf_s
    commits = math.exp(-min(s.lag / m, 500)) / math.expm1(min(s.period / m, 500))
    return s.tau * commits / (m * math.exp(min(down_time(run, policy) / m, 500)))


def simulate(run: Run, policy: Policy | None = None, seed: int = 0, trials: int = 2000,
             max_failures: int | None = None) -> SimResult:
    """Monte Carlo of the whole run. The failure times depend on the seed and the failure model only, so
    policies simulated with the same seed meet the same failures (common random numbers)."""
    policy = policy or Policy()
    started = time.perf_counter()
    s = schedule(run, policy)
    rec, fm, mtbf = run.recovery, run.failures, run.mtbf_s
    rate = expected_goodput(run, policy)
    if rate < 1e-4:
        raise KeelError(f"the run cannot make progress: job MTBF {mtbf / 3600:.2f} h against "
                        f"{down_time(run, policy) / 3600:.2f} h down per failure and a {s.tau:.0f} s interval")
    if max_failures is None:  # three times the expected count: far in the tail, bounded when progress is slow
        max_failures = 1000 + int(3 * run.work_s / (mtbf * rate))
    fail_rng, kind_rng = (np.random.default_rng(child) for child in np.random.SeedSequence(seed).spawn(2))
    busy = np.zeros((trials, policy.spare_nodes))  # when each spare slot is next free
    rows = np.arange(trials)
    done = np.zeros(trials, dtype=bool)
    committed = np.zeros(trials)
    resume = np.zeros(trials)  # wall time the job is up again
    last_fail = np.zeros(trials)
    wall, blocked, lost = np.zeros(trials), np.zeros(trials), np.zeros(trials)
    count = np.zeros(trials, dtype=np.int64)
    fixed_down = rec.detect_s + rec.restart_s + s.restore_s
    for _ in range(max_failures):
        # Every trial draws every time, finished or not, so that the streams stay aligned across policies.
        fail_at = last_fail + _inter_arrivals(fail_rng, fm, mtbf, trials)
        hardware = kind_rng.random(trials) < fm.hardware_fraction
        up = np.maximum(fail_at - resume, 0.0)
        remaining = run.work_s - committed
        saves_left = np.maximum(np.ceil(remaining / s.tau) - 1, 0)  # no save after the last step
        need = remaining + saves_left * s.blocking
        finish = ~done & (need <= up)
        wall[finish] = resume[finish] + need[finish]
        blocked[finish] += saves_left[finish] * s.blocking
        done |= finish
        if done.all():
            break
        hit = ~done
        saves = np.floor(np.maximum(up - s.lag, 0.0) / s.period)  # saves committed before the failure
        periods = np.floor(up / s.period)
        in_saves = periods * s.blocking + np.clip(up - periods * s.period - s.tau, 0.0, s.blocking)
        committed[hit] += saves[hit] * s.tau
        blocked[hit] += in_saves[hit]
        lost[hit] += (up - in_saves - saves * s.tau)[hit]
        count[hit] += 1
        wait = _node_wait(busy, rows, hardware, hit, fail_at, rec.repair_s)
        # A failure during recovery overlaps with it: the job is up once both are recovered.
        resume = np.where(hit, np.maximum(resume, fail_at + wait + fixed_down), resume)
        last_fail = fail_at
    else:
        raise KeelError(f"the run did not finish within {max_failures} failures in some trials "
                        f"(job MTBF {mtbf / 3600:.2f} h): shorten recovery or add spares")
    work = run.work_s
    down = wall - work - blocked - lost
    return SimResult(policy, s, work, wall, count, blocked, lost, down, time.perf_counter() - started)


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


def compare_policies(run: Run, seed: int = 0, trials: int = 2000, base: Policy | None = None,
                     fixed_interval_s: float = 3600.0) -> list[SimResult]:
    """The base policy and one change at a time: sync saves, a fixed interval, restore from peers' memory
    (or from disk when the base uses memory), no spare nodes. Same seed, so the same failures for each."""
    base = base or Policy()
    variants = [
        base,
        replace(base, name="sync saves" if base.async_save else "async saves", async_save=not base.async_save),
        replace(base, name=f"fixed interval {fixed_interval_s / 60:.0f} min", interval_s=fixed_interval_s)
        if base.interval_s is None else replace(base, name="optimal interval", interval_s=None),
        replace(base, name="in-memory/peer restore" if base.restore == "disk" else "disk restore",
                restore="memory" if base.restore == "disk" else "disk"),
        replace(base, name="no spare nodes" if base.spare_nodes else "8 spare nodes",
                spare_nodes=0 if base.spare_nodes else 8),
    ]
    return [simulate(run, policy, seed, trials) for policy in variants]
