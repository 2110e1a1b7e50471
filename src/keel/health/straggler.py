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

A slow link is no rank's compute: every rank waits for it alike. On the same steps, in a job of three
nodes or more, the nodes' first ranks pass a probe round a ring (each to the next node, all at once),
each timing the probe it receives: the link into it. A node whose links both ways (into it, and into
the next node, which it sends) take `factor` times the median node's is slow, and reported as a rank
is. Two nodes share one cable's two ways, and cannot say whose end is slow.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import StragglerConfig
from keel.rundir.events import EventLog
from keel.rundir.quarantine import add_to_quarantine

# A probe a few milliseconds late is a busy host's jitter, not a slow link: a node is named only when its probes
# are this much slower than the median node's as well (a 4 MiB probe: links under about 1.6 Gbit/s).
LINK_MARGIN_S = 0.02
PROBE_ROUNDS = 2  # the probe goes round the ring this many times, each link's fastest counted


def slow_nodes(links: list[float], factor: float, margin_s: float = LINK_MARGIN_S) -> list[tuple[int, float]]:
    """The nodes of a ring whose links both ways are `factor` times slower than the median node's, and
    `margin_s` slower at least, with that ratio. `links[k]`: the time of the probe into node k (from node
    k − 1); node k sends into k + 1. Fewer than three nodes name none."""
    n = len(links)
    if n < 3:
        return []
    scores = [min(links[k], links[(k + 1) % n]) for k in range(n)]  # slow only if both of its ways are
    reference = max(statistics.median_low(scores), 1e-6)
    return [(k, score / reference) for k, score in enumerate(scores)
            if score / reference > factor and score - reference > margin_s]


class StragglerDetector:
    def __init__(self, cfg: StragglerConfig, rank: int, world: int, hosts: list[str], events: EventLog,
                 say: Callable[[str], None], run_dir: Path, device: torch.device) -> None:
        self.cfg, self.rank, self.world, self.hosts = cfg, rank, world, hosts
        self.events, self.say, self.run_dir, self.device = events, say, run_dir, device
        self.slow_streak = [0] * world
        self.reported: set[int] = set()
        self.last: dict[str, float] = {}
        # Each node's first rank, in rank order: the ring the link probe goes round.
        self.leaders = sorted({hosts.index(h) for h in hosts}) if cfg.link_probe_mib and len(hosts) == world else []
        self.leaders = self.leaders if len(self.leaders) >= 3 else []
        self.link_streak = [0] * len(self.leaders)
        self.links_reported: set[int] = set()

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
        return self._judge_links(step) or leave

    def _probe(self) -> float:
        """This node's first rank: send the probe to the next node's, receive the previous one's; the seconds
        until it was received (the ranks left the all-reduce before it together)."""
        i, n = self.leaders.index(self.rank), len(self.leaders)
        size = self.cfg.link_probe_mib << 20
        out = torch.ones(size, dtype=torch.uint8, device=self.device)
        into = torch.empty(size, dtype=torch.uint8, device=self.device)
        fastest = float("inf")
        for _ in range(PROBE_ROUNDS):
            started = time.perf_counter()
            sent, got = dist.isend(out, self.leaders[(i + 1) % n]), dist.irecv(into, self.leaders[(i - 1) % n])
            assert sent is not None and got is not None  # the default group holds every rank
            got.wait()
            fastest = min(fastest, time.perf_counter() - started)
            sent.wait()
        return fastest

    def _judge_links(self, step: int) -> bool:
        """After the gather of compute times, in a job of three nodes or more: the link probe, its times
        gathered (a second all-reduce), and the slow nodes reported."""
        if not self.leaders:
            return False
        links_t = torch.zeros(len(self.leaders), dtype=torch.float64, device=self.device)
        if self.rank in self.leaders:
            links_t[self.leaders.index(self.rank)] = self._probe()
        dist.all_reduce(links_t)
        links = links_t.tolist()
        slow = dict(slow_nodes(links, self.cfg.factor))
        self.last.update({"health/link_s_max_node": max(links), "health/link_s_median_node":
                          statistics.median_low(links), "health/slowest_link_ratio": max(slow.values(), default=1.0)})
        leave = False
        for k in range(len(links)):
            self.link_streak[k] = self.link_streak[k] + 1 if k in slow else 0
            if self.link_streak[k] >= self.cfg.patience and k not in self.links_reported:
                self.links_reported.add(k)
                into, out = links[k], links[(k + 1) % len(links)]
                host = self.hosts[self.leaders[k]]
                message = (f"node {host} has a slow link: a {self.cfg.link_probe_mib} MiB probe takes {into:.3f} s "
                           f"into it and {out:.3f} s out of it, {slow[k]:.0f}× the median node's "
                           f"({min(into, out) / slow[k]:.4f} s), for {self.cfg.patience} checks in a row")
                leave |= self._announce(step, message, {"node": host, "ratio": round(slow[k], 3), "link": True,
                                                        "link_s": [round(v, 4) for v in links]}, host, None)
            elif self.link_streak[k] == 0:
                self.links_reported.discard(k)
        return leave

    def _report(self, step: int, rank: int, ratio: float, values: list[float]) -> bool:
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        message = (f"rank {rank} on {host} is a straggler: its compute takes {ratio:.2f}× the median rank's "
                   f"({values[rank]:.3f} s vs {statistics.median_low(values):.3f} s) for {self.cfg.patience} "
                   f"checks in a row")
        return self._announce(step, message, {"rank": rank, "host": host, "ratio": round(ratio, 3),
                                              "compute_s": [round(v, 4) for v in values]}, host, rank)

    def _announce(self, step: int, message: str, evidence: dict, host: str, rank: int | None) -> bool:
        """The event, alert and warning of a straggler (a rank or a node's link); with `action = quarantine`
        its node listed in quarantine.json. Whether the run must leave the node out now."""
        quarantine = self.cfg.action == "quarantine"
        if self.rank == 0:
            self.events.emit("straggler", step, "quarantine" if quarantine else "log", **evidence,
                             patience=self.cfg.patience)
            self.events.emit("alert", step, "straggler", severity="warning", message=message)
            if quarantine:
                add_to_quarantine(self.run_dir, [host], source="straggler", reason=message, step=step,
                                  **({} if rank is None else {"ranks": [rank]}))
        self.say(f"warning: {message}" + ("; its node is quarantined" if quarantine else ""))
        return quarantine
