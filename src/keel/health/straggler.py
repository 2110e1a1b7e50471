"""Stragglers: a rank whose compute is persistently slower than the others'.

Every `interval` steps each rank's own time is compared: its forward, backward and their hooks, from
its batch to the step's first reduction (the gradient norm), timed on the host once the device has
finished them (one device synchronisation on those steps only). The ranks that wait for a slow peer
wait in that reduction, after their own time has been taken, so the slow rank has the longest. The
times are gathered with one all-reduce and each is compared with the lower median (for two ranks,
the faster one). A rank slower by `factor` in `patience` gathers in a row is reported once (an event
and an alert with rank, host and ratio); with `action = quarantine` its node is also listed in
quarantine.json, and the run checkpoints and exits 76 so that the agents restart it without that node.

The measure costs no profiler, and sees what the others wait for at the step's reduction. A rank slow
at each layer makes its peers wait inside FSDP's own gathers of that layer too, where each rank's
time holds the others' waits: such a rank is seen by the share of its slowness that reaches the
reduction, and the profiled steps' `time/comm_s` (`monitor.profile_interval`) tell the rest.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import StragglerConfig
from keel.rundir.events import EventLog
from keel.rundir.quarantine import add_to_quarantine


class StragglerDetector:
    def __init__(self, cfg: StragglerConfig, rank: int, world: int, hosts: list[str], events: EventLog,
                 say: Callable[[str], None], run_dir: Path, device: torch.device) -> None:
        self.cfg, self.rank, self.world, self.hosts = cfg, rank, world, hosts
        self.events, self.say, self.run_dir, self.device = events, say, run_dir, device
        self.slow_streak = [0] * world
        self.reported: set[int] = set()
        self.last: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return bool(self.cfg.interval) and self.world > 1 and step % self.cfg.interval == 0

    def settle(self) -> None:
        """On a due step, after the backward: wait for the device's work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def observe(self, step: int, compute_s: float) -> bool:
        """Every rank, on a due step, with its own time. Returns whether the run must leave out a
        straggler's node now (the same answer on every rank)."""
        times = torch.zeros(self.world, dtype=torch.float64, device=self.device)
        times[self.rank] = compute_s
        dist.all_reduce(times)
        values = times.tolist()
        reference = statistics.median_low(values)
        ratios = [t / max(reference, 1e-9) for t in values]
        self.last = {"health/compute_s_max_rank": max(values), "health/compute_s_median_rank": reference,
                     "health/slowest_rank_ratio": max(ratios)}
        leave = False
        for r, ratio in enumerate(ratios):
            self.slow_streak[r] = self.slow_streak[r] + 1 if ratio > self.cfg.factor else 0
            if self.slow_streak[r] >= self.cfg.patience and r not in self.reported:
                self.reported.add(r)
                leave |= self._report(step, r, ratio, values)
            elif self.slow_streak[r] == 0:
                self.reported.discard(r)  # recovered: a new streak is reported again
        return leave

    def _report(self, step: int, rank: int, ratio: float, values: list[float]) -> bool:
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        message = (f"rank {rank} on {host} is a straggler: its compute takes {ratio:.2f}× the median rank's "
                   f"({values[rank]:.3f} s vs {statistics.median_low(values):.3f} s) for {self.cfg.patience} "
                   f"checks in a row")
        quarantine = self.cfg.action == "quarantine"
        if self.rank == 0:
            evidence = {"rank": rank, "host": host, "ratio": round(ratio, 3),
                        "compute_s": [round(v, 4) for v in values], "patience": self.cfg.patience}
            self.events.emit("straggler", step, "quarantine" if quarantine else "log", **evidence)
            self.events.emit("alert", step, "straggler", severity="warning", message=message)
            if quarantine:
                add_to_quarantine(self.run_dir, [host], source="straggler", reason=message, step=step, ranks=[rank])
        self.say(f"warning: {message}" + ("; its node is quarantined" if quarantine else ""))
        return quarantine
