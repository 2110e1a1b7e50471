"""The goodput ledger: every second of a run's wall time, across all its starts, in exactly one bucket.

The ledger keeps a mark, the instant up to which time is accounted. `charge(bucket)` gives the time
since the mark to a bucket and moves the mark to now, so consecutive charges cover the wall time
without gaps or overlaps by construction. Rank 0 persists it to RUN_DIR/goodput.json (an atomic
rewrite) every `monitor.interval` steps, at checkpoints and at exit; the file is never rolled back
with a checkpoint, since the time a rollback or a restart loses is exactly what it records.

Between two starts the ledger cannot run. The next start charges that gap: to `paused` when the last
start closed the ledger (a pause, a stop, a finished run later extended), to `failed_down` when it did
not (a crash: from the last update, at most one interval before the failure, to the new start).
A step whose number is at most the highest step ever reached (`high_water`) is recomputed after a
restart or a rollback: its whole time is `wasted`. The highest step is also kept, step by step, in a
file of its own (a few bytes rewritten in place), so that a crash between two flushes does not forget
the steps it will make again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

LEDGER = "goodput.json"
HIGH_WATER = ".goodput-high-water"
BUCKETS = ("productive", "startup", "checkpoint_blocking", "checkpoint_restore", "wasted", "data_wait",
           "guard_checks", "evaluation", "paused", "failed_down", "replica_quorum", "replica_cover")
BUCKET_HELP = {
    "productive": "training steps done for the first time",
    "startup": "process start, initialisation and preflight until the first step; the exit after the last",
    "checkpoint_blocking": "training blocked by checkpoint saves",
    "checkpoint_restore": "loading a checkpoint at a start (from storage or the memory tier: goodput.json's "
                          "restore_s_by_tier), or an in-memory snapshot at a rollback",
    "wasted": "steps recomputed after a restart or a rollback",
    "data_wait": "waiting for the data loader",
    "guard_checks": "numerical and replica checks of the guards",
    "evaluation": "validation passes",
    "paused": "between a pause (or stop) and the next start",
    "failed_down": "between the last sign of life before a crash and the next start",
    "replica_quorum": "replica groups: waiting for the step's quorum (a lost group's heartbeat timeout included) "
                      "and receiving a live group's state when healing",
    "replica_cover": "replica groups: the survivors' extra micro-batches, the share of the missing groups",
}
MAX_HISTORY = 2000
MAX_RESTORES = 100  # the restores listed (their time by tier is kept in full)


def new_ledger(started: float) -> dict:
    return {"version": 1, "started": started, "updated": started, "open": False, "ended": "", "attempts": 0,
            "high_water": 0, "recomputed_steps": 0, "buckets": dict.fromkeys(BUCKETS, 0.0), "history": []}


def read_ledger(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / LEDGER).read_text())
    except (OSError, ValueError):
        return None


def _read_high_water(run_dir: Path) -> int:
    try:
        return int((run_dir / HIGH_WATER).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def write_ledger(run_dir: Path, ledger: dict) -> None:
    tmp = run_dir / f".{LEDGER}.tmp"
    tmp.write_text(json.dumps(ledger) + "\n")
    os.replace(tmp, run_dir / LEDGER)


def ratio(buckets: dict[str, float]) -> float:
    total = sum(buckets.values())
    return buckets["productive"] / total if total > 0 else 0.0


class GoodputLedger:
    """One start's view of the ledger. Every rank keeps one (cheap), rank 0 writes it."""

    def __init__(self, run_dir: Path, started: float, write: bool) -> None:
        self.run_dir, self.write = run_dir, write
        self.data = read_ledger(run_dir) or new_ledger(started)
        self.data["high_water"] = max(self.data["high_water"], _read_high_water(run_dir))
        self._high_water_fd = os.open(run_dir / HIGH_WATER, os.O_WRONLY | os.O_CREAT, 0o644) if write else -1
        self.buckets: dict[str, float] = {b: self.data["buckets"].get(b, 0.0) for b in BUCKETS}
        self.mark = self.data["updated"]
        if self.data["attempts"]:  # the gap since the previous start stopped accounting
            self.charge("failed_down" if self.data["open"] else "paused", max(started, self.mark))
        self.recomputing = False
        self.mark = max(started, self.mark)  # never count a second twice, whatever the clocks say
        self.data["attempts"] += 1
        self.data["open"] = True
        self._interval_from = dict(self.buckets)

    def charge(self, bucket: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.buckets[bucket] += max(0.0, now - self.mark)
        self.mark = max(self.mark, now)

    def begin_step(self, step: int) -> None:
        """Step `step` begins; it is recomputed (after a restart or a rollback) when the run got past it before."""
        self.recomputing = step <= self.data["high_water"]

    def spent(self, bucket: str) -> None:
        """Charge the time since the mark to `bucket`, or to `wasted` for all of a recomputed step's time."""
        self.charge("wasted" if self.recomputing else bucket)

    def move(self, seconds: float, source: str, to: str) -> None:
        """Reassign `seconds` already charged to `source` (at most all of it) to `to`."""
        seconds = min(max(0.0, seconds), self.buckets[source])
        self.buckets[source] -= seconds
        self.buckets[to] += seconds

    def restored(self, step: int, tier: str, seconds: float) -> None:
        """A start restored `step` from a checkpoint of `tier` ("storage" or "memory") in `seconds`, all of it
        charged to `checkpoint_restore`: kept by tier, and the latest few restores listed."""
        by_tier = self.data.setdefault("restore_s_by_tier", {})
        by_tier[tier] = round(by_tier.get(tier, 0.0) + seconds, 6)
        self.data["restores"] = [*self.data.get("restores", []),
                                 {"time": round(time.time(), 3), "step": step, "tier": tier,
                                  "seconds": round(seconds, 6)}][-MAX_RESTORES:]

    def step_done(self, step: int) -> None:
        if step <= self.data["high_water"]:
            self.data["recomputed_steps"] += 1
        elif self._high_water_fd >= 0:
            os.pwrite(self._high_water_fd, f"{step:>12}\n".encode(), 0)  # fixed width: never a torn number
        self.data["high_water"] = max(self.data["high_water"], step)

    def ratio(self) -> float:
        return ratio(self.buckets)

    def interval_ratio(self) -> float:
        """Goodput of the time since the previous call."""
        delta = {b: self.buckets[b] - self._interval_from[b] for b in BUCKETS}
        self._interval_from = dict(self.buckets)
        return ratio(delta)

    def metrics(self) -> dict[str, float]:
        return {"goodput/ratio": self.ratio(), "goodput/interval_ratio": self.interval_ratio(),
                **{f"goodput/{b}_s": s for b, s in self.buckets.items()}}

    def flush(self, step: int) -> None:
        """Persist what is accounted so far (up to the mark)."""
        if not self.write:
            return
        self.data["buckets"] = {b: round(s, 6) for b, s in self.buckets.items()}
        self.data["updated"] = self.mark
        history = self.data["history"]
        history.append({"time": round(self.mark, 3), "step": step, "buckets": self.data["buckets"]})
        if len(history) > MAX_HISTORY:  # thin the older half: the shape of the curve stays
            half = len(history) // 2
            self.data["history"] = history[:half:2] + history[half:]
        write_ledger(self.run_dir, self.data)

    def close(self, step: int, ended: str) -> None:
        """The start ends cleanly: the time since the last charge is the exit's."""
        self.charge("startup")
        self.data["open"] = False
        self.data["ended"] = ended
        self.flush(step)
        if self._high_water_fd >= 0:
            os.close(self._high_water_fd)
            self._high_water_fd = -1


def account_exit(run_dir: Path, now: float | None = None) -> None:
    """Called by the launcher once its workers have exited: the time from the workers' last update to
    now (their exit, the agent's shutdown) is the exit's when they closed the ledger, down time when
    they crashed (the next start goes on from here)."""
    data = read_ledger(run_dir)
    if data is None:
        return
    now = time.time() if now is None else now
    bucket = "failed_down" if data["open"] else "startup"
    data["buckets"][bucket] += max(0.0, now - data["updated"])
    data["updated"] = max(now, data["updated"])
    write_ledger(run_dir, data)
