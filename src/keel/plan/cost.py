"""What a run costs: accelerator-hours and money, split into productive training, checkpointing and failures.

The whole allocation is billed for the whole wall time (a reserved cluster keeps its GPUs while the job waits
or restarts), and hot spare nodes are billed too. Each device-second of the run is one of:
  productive    the compute the token budget needs, done once;
  checkpointing training blocked in saves (copy to host, synchronous write, wait for the previous write);
  failures      work lost since the last committed checkpoint, down time (detection, wait for a node,
                restart, restore), and the spare nodes kept for failures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from keel.errors import KeelError
from keel.plan.failures import Policy, Run, SimResult, down_time, expected_goodput, save_share, simulate

# USD per accelerator-hour. Assumption dated 2024-12: DeepSeek-V3's rental price for its H800s, $2/GPU-hour
# (arXiv 2412.19437, 2,788k H800-hours = $5.576M). H100 SXM on-demand list prices of specialised clouds were
# about $2-4/GPU-hour in 2025-2026 and hyperscalers' higher; pass the price of the actual contract.
DEFAULT_PRICE_PER_HOUR = 2.0


@dataclass(frozen=True)
class Cost:
    price_per_hour: float
    productive_h: float  # accelerator-hours
    checkpoint_h: float
    lost_h: float
    down_h: float
    spares_h: float

    @property
    def failures_h(self) -> float:
        return self.lost_h + self.down_h + self.spares_h

    @property
    def gpu_hours(self) -> float:
        return self.productive_h + self.checkpoint_h + self.failures_h

    @property
    def money(self) -> float:
        return self.gpu_hours * self.price_per_hour

    def parts(self) -> dict[str, dict[str, float]]:
        """Hours, money and share of the total for each part, failures broken down."""
        hours = {"productive": self.productive_h, "checkpointing": self.checkpoint_h, "failures": self.failures_h,
                 "failures.lost_work": self.lost_h, "failures.down_time": self.down_h,
                 "failures.spares": self.spares_h}
        total = self.gpu_hours or 1.0
        return {name: {"gpu_hours": h, "money": h * self.price_per_hour, "share": h / total}
                for name, h in hours.items()}


def cost(devices: int, work_s: float, checkpoint_s: float = 0.0, lost_s: float = 0.0, down_s: float = 0.0, *,
         spare_devices: int = 0, price_per_hour: float = DEFAULT_PRICE_PER_HOUR) -> Cost:
    """Cost of a run whose wall time is work + checkpoint + lost + down seconds on `devices` accelerators,
    with `spare_devices` billed alongside for the whole wall time."""
    if price_per_hour < 0 or min(work_s, checkpoint_s, lost_s, down_s) < 0:
        raise KeelError("price and times must be >= 0")
    wall_h = (work_s + checkpoint_s + lost_s + down_s) / 3600
    return Cost(price_per_hour, devices * work_s / 3600, devices * checkpoint_s / 3600, devices * lost_s / 3600,
                devices * down_s / 3600, spare_devices * wall_h)


def _spare_devices(run: Run, policy: Policy) -> int:
    return policy.spare_nodes * run.failures.devices_per_node


def expected_cost(run: Run, policy: Policy, price_per_hour: float = DEFAULT_PRICE_PER_HOUR) -> Cost:
    """Analytic prediction: wall = work / expected goodput (Daly's complete exponential model); saves every τ
    cost their blocking time; the rest is failures, split into down time (failures × R, at most the rest) and
    lost work."""
    goodput = expected_goodput(run, policy)
    if goodput <= 0:
        raise KeelError("the run cannot finish: its expected goodput is 0")
    wall = run.work_s / goodput
    checkpoint = run.work_s * save_share(run, policy)
    failures = max(wall - run.work_s - checkpoint, 0.0)
    down = min(wall / run.mtbf_s * down_time(run, policy), failures)
    return cost(run.devices, run.work_s, checkpoint, failures - down, down,
                spare_devices=_spare_devices(run, policy), price_per_hour=price_per_hour)


def cost_of(result: SimResult, run: Run, price_per_hour: float = DEFAULT_PRICE_PER_HOUR) -> Cost:
    """Mean cost over the simulator's trials (the parts' means add up to the mean wall time)."""
    return cost(run.devices, result.work_s, float(result.checkpoint_s.mean()), float(result.lost_s.mean()),
                float(result.down_s.mean()), spare_devices=_spare_devices(run, result.policy),
                price_per_hour=price_per_hour)


def money_percentiles(result: SimResult, run: Run, price_per_hour: float = DEFAULT_PRICE_PER_HOUR) -> dict:
    """P10/P50/P90 and mean of the whole run's money over the trials."""
    devices = run.devices + _spare_devices(run, result.policy)
    money = devices * result.wall_s / 3600 * price_per_hour
    p10, p50, p90 = np.percentile(money, [10, 50, 90])
    return {"p10": float(p10), "p50": float(p50), "p90": float(p90), "mean": float(money.mean())}


SPARE_OPTIONS = (0, 1, 2, 4, 8, 16, 32, 64)  # hot spare nodes `--spares auto` compares (up to the job's nodes)
SPARE_TRIALS = 500  # Monte Carlo trials per option


def best_spares(run: Run, base: Policy, price_per_hour: float, seed: int, trials: int) -> tuple[int, list[dict]]:
    """The number of hot spare nodes that makes the run cheapest (then shortest), over SPARE_OPTIONS, each
    simulated on the same failures; with each option's mean cost and wall time. A spare pays for itself when
    the waits for repairs it saves cost more than keeping it for the whole run."""
    nodes = math.ceil(run.devices / run.failures.devices_per_node)
    rows = []
    for spares in sorted({n for n in SPARE_OPTIONS if n <= nodes}):
        try:
            result = simulate(run, replace(base, spare_nodes=spares), seed, min(trials, SPARE_TRIALS))
        except KeelError:  # the run cannot finish with so few spares
            continue
        rows.append({"spares": spares, "money": cost_of(result, run, price_per_hour).money,
                     "wall_days": float(result.wall_s.mean()) / 86400})
    if not rows:
        raise KeelError("the run cannot finish whatever the number of spare nodes: shorten recovery (--detect-s, "
                        "--restart-s, --repair-h) or use fewer accelerators")
    best = min(rows, key=lambda r: (round(r["money"], 2), r["wall_days"], r["spares"]))
    return int(best["spares"]), rows
