"""The memory tier: checkpoints every `checkpoint.memory_interval` steps held in host memory that outlives the
workers. They live in a directory on the node's shared-memory filesystem (/dev/shm, a RAM filesystem), which the
launcher creates before its first worker starts and removes when the job ends: workers it restarts after a
failure find them there and restore the newest checkpoint of either tier, one from memory reading nothing from
the checkpoint storage. They are written, checked and committed as storage checkpoints are
(keel.checkpoint.manager: the same checksums and manifest), their tensors in the tier's own format
(keel.checkpoint.flat), two kept, so that a failure while one is written leaves the one before whole. On one node
the node's memory is the only copy: it covers the loss of processes, not of the node. On several, each node's
copy also holds its buddy's files (keel.checkpoint.spread), and the copies cover the loss of a node. Torch-free:
the launcher imports it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from keel.checkpoint.manifest import committed
from keel.checkpoint.storage import Storage, size_text
from keel.config import Config
from keel.config.schema import CheckpointConfig
from keel.core import generations
from keel.errors import ConfigError
from keel.rundir.quarantine import node_name

MEMORY_DIR_ENV = "KEEL_MEMORY_DIR"  # set by the launcher for its workers: where this node's memory tier is
SHARED_MEMORY = Path("/dev/shm")
KEPT = 2  # the newest, and the one before it while the newest is written
# Bytes a parameter costs in a checkpoint: fp32 weights and AdamW's two fp32 moments.
BYTES_PER_PARAMETER = 12


def memory_root(memory_dir: str, run_dir: Path, node: str = "") -> Path:
    """This run's memory tier on this node: `checkpoint.memory_dir`, or a directory in /dev/shm named after the
    run directory and the node (two runs, or two nodes of a job on one machine, never share one)."""
    if memory_dir:
        return Path(memory_dir)
    digest = hashlib.sha256(f"{run_dir.absolute()}\0{node}".encode()).hexdigest()[:16]
    return SHARED_MEMORY / f"keel-memory-{digest}"


def state_bytes(cfg: Config, nproc: int) -> int:
    """What one memory checkpoint of this node's `nproc` ranks holds, about: the parameters and AdamW's moments
    of the whole model, divided among the data-parallel ranks that shard them (a whole copy on each replica)."""
    from keel.model.flops import param_count

    copies = max(1, cfg.parallel.dp_replicate) if nproc > 1 else 1
    return param_count(cfg.model) * BYTES_PER_PARAMETER * copies


def check_fits(cfg: Config, root: Path, nproc: int) -> None:
    """Before any worker starts: the node's shared memory holds the tier's checkpoints and the one being written."""
    need = (KEPT + 1) * state_bytes(cfg, nproc)
    probe = root if root.exists() else root.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as e:
        raise ConfigError(f"checkpoint.memory_dir {str(root)!r} cannot be used ({e.strerror}); expected a "
                          f"directory on a RAM filesystem such as /dev/shm") from None
    if free < need:
        raise ConfigError(f"checkpoint.memory_interval = {cfg.checkpoint.memory_interval}: the memory tier needs "
                          f"{size_text(need)} ({KEPT} checkpoints and one being written) in {probe}, which has "
                          f"{size_text(free)} free; lower the model or the data-parallel replicas, grow /dev/shm, "
                          f"or set checkpoint.memory_interval = 0")


def check_memory_tier(cfg: Config, restarts: int) -> None:
    """Before anything starts: a memory tier is only of use to workers a launcher restarts, and replica groups heal
    from a live group instead."""
    interval = cfg.checkpoint.memory_interval
    if not interval:
        return
    if cfg.fault_tolerance.replica_groups > 1:
        raise ConfigError(f"checkpoint.memory_interval = {interval} with fault_tolerance.replica_groups = "
                          f"{cfg.fault_tolerance.replica_groups}: replica groups heal from a live group instead; set "
                          f"checkpoint.memory_interval = 0")
    if restarts == 0:
        raise ConfigError(f"checkpoint.memory_interval = {interval}: the memory tier serves workers the launcher "
                          f"restarts after a failure, and none are (--max-restarts 0); pass --max-restarts N or set "
                          f"health.max_restarts, or set checkpoint.memory_interval = 0")


@contextlib.contextmanager
def held_in_memory(cfg: Config, run_dir: Path, nproc: int) -> Iterator[Path | None]:
    """The launcher's part: create this node's memory tier (checked to fit), tell the workers where it is, and
    remove it when the job ends, however it ends. A tier left by a launcher that was killed is taken over as it
    is: its checkpoints are checked like any before one is restored."""
    if not cfg.checkpoint.memory_interval:
        yield None
        return
    root = memory_root(cfg.checkpoint.memory_dir, run_dir, node_name())
    check_fits(cfg, root, nproc)
    root.mkdir(parents=True, exist_ok=True)
    os.environ[MEMORY_DIR_ENV] = str(root)
    try:
        yield root
    finally:
        os.environ.pop(MEMORY_DIR_ENV, None)
        shutil.rmtree(root, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class MemoryTier:
    """A worker's memory tier: where its launcher holds it, and the storage policy as it applies there: two kept,
    none permanent, always written in the background, and a failed copy never stops the run (the storage tier
    is still there)."""

    storage: Storage
    policy: CheckpointConfig


def memory_tier(cfg: Config) -> MemoryTier | None:
    """In a worker: the memory tier its launcher holds (none when the tier is off, or no launcher started this
    process: without one, no worker is restarted to restore from it)."""
    root = os.environ.get(MEMORY_DIR_ENV)
    if not cfg.checkpoint.memory_interval or not root:
        return None
    policy = dataclasses.replace(cfg.checkpoint, keep_last=KEPT, keep_every=0, async_save=True,
                                 on_storage_error="continue")
    return MemoryTier(Storage(root), policy)


def resume_on_restart(cfg: Config, storage: Storage, resume: str) -> str:
    """What a restarted worker resumes: one the agent restarted, or one started or kept to rejoin a replaced peer
    (keel.core.generations), continues from this run's own latest checkpoint of either tier, where there is one,
    whatever the command first said (a fresh start, a checkpoint to start from)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or generations.joined() > 0
    if restarted and (committed(storage) or (memory := memory_tier(cfg)) is not None and committed(memory.storage)):
        return "auto"
    return resume
