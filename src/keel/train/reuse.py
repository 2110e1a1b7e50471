"""What the elastic agent's restart of a job reuses from the start before it: the results of probes that
measure the machines rather than the run (preflight, the measured matmul peak), kept in the run
directory's probes.json under what they depend on.

A result is reused only by a worker group of the same job (the same `keel train` launcher on every node,
KEEL_LAUNCHED_AT), on the same hosts in the same rank order, within REUSE_MAX_AGE_S of its measurement,
and when every setting it depends on is unchanged; anything else measures again. Rank 0 reads and writes
the file and broadcasts what it found, so that every rank takes the same branch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from keel.monitor.mfu import measure_peak_flops
from keel.rundir.events import host

PROBES = "probes.json"
REUSE_MAX_AGE_S = 3600.0  # machines drift (disks fill, GPUs heat): an hour-old result is measured again


def job_key(world_size: int) -> list | None:
    """This job's worker group as every rank sees it: (host, the launcher's start) by rank; None outside a
    `keel train` launcher (no restart to reuse anything for). Every rank calls it together."""
    mine = [host(), os.environ.get("KEEL_LAUNCHED_AT")]
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    return None if any(launched is None for _, launched in every) else every


def reused(run_dir: Path, name: str, depends: dict | None) -> dict | None:
    """The entry kept under `name` ({"time", "depends", "value"}) when it was measured for the same
    `depends` (None: never reuse), else None. Every rank calls it together and receives the same answer."""
    found: list = [None]
    if dist.get_rank() == 0 and depends is not None:
        entry = _read(run_dir).get(name) or {}
        if entry.get("depends") == json.loads(json.dumps(depends)) and \
                time.time() - entry.get("time", 0) < REUSE_MAX_AGE_S:
            found = [entry]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def remember(run_dir: Path, name: str, depends: dict | None, value: Any) -> None:
    """Keep `value` under `name` for the next start of this job (rank 0 writes)."""
    if dist.get_rank() != 0 or depends is None or not run_dir.is_dir():
        return
    kept = _read(run_dir)
    kept[name] = {"time": time.time(), "depends": depends, "value": value}
    tmp = run_dir / f".{PROBES}.{os.getpid()}.tmp"  # replica groups share the run directory
    tmp.write_text(json.dumps(kept))
    os.replace(tmp, run_dir / PROBES)


def _read(run_dir: Path) -> dict:
    try:
        kept = json.loads((run_dir / PROBES).read_text())
    except (OSError, ValueError):  # none yet, or damaged: measure again
        return {}
    return kept if isinstance(kept, dict) else {}


def measured_peak(run_dir: Path, job: list | None, device: torch.device, dtype: torch.dtype) -> float:
    """The matmul peak of these processes, measured once per job: a restart on the same hosts reuses it."""
    depends = None if job is None else {"job": job, "device": str(device), "dtype": str(dtype)}
    if (kept := reused(run_dir, "peak_flops", depends)) is not None:
        return float(kept["value"])
    peak = measure_peak_flops(device, dtype)
    remember(run_dir, "peak_flops", depends, peak)
    return peak
