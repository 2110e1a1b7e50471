"""Distributed checkpoints of the whole train state, committed atomically.

Layout of one checkpoint, `checkpoints/step-NNNNNN/`:
  *.distcp, .metadata      model and optimizer (torch.distributed.checkpoint, any layout can load it)
  rng-rank-RRRRR.pt        each rank's RNG streams
  train_state.json         step, tokens seen, data cursor, callback state
  commit.json              written last: a checkpoint without it does not exist

Everything is written into `step-NNNNNN.tmp/`; the commit marker is written and the directory
renamed only after every rank has finished writing, so a crash at any moment leaves the previous
checkpoint intact and the unfinished one invisible.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import keel
from keel.errors import CheckpointError
from keel.train.state import TrainState, rng_state, set_rng_state

COMMIT = "commit.json"
TRAIN_STATE = "train_state.json"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_checkpoint(path: Path) -> bool:
    return (path / COMMIT).is_file() and (path / ".metadata").is_file() and (path / TRAIN_STATE).is_file()


def committed(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoints in `ckpt_dir`, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step-*") if p.is_dir() and p.name[5:].isdigit() and is_checkpoint(p)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def check_checkpoint(path: Path) -> Path:
    if not path.is_dir() or not is_checkpoint(path):
        raise CheckpointError(f"{str(path)!r} is not a committed keel checkpoint (a directory holding {COMMIT}, "
                              f".metadata and {TRAIN_STATE}); pass a checkpoints/step-NNNNNN directory")
    return path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    def __init__(self, run_dir: Path, config_digest: str) -> None:
        self.dir = run_dir / "checkpoints"
        self.config_digest = config_digest
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def latest(self) -> Path | None:
        found = committed(self.dir)
        return found[-1] if found else None

    def save(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: TrainState) -> Path:
        started = time.perf_counter()
        final = self.dir / step_dir_name(state.step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(_state_dict(parts, optimizers), checkpoint_id=tmp)
        rng_path = tmp / f"rng-rank-{self.rank:05d}.pt"
        torch.save(rng_state(), rng_path)
        _fsync(rng_path)
        dist.barrier()
        if self.rank == 0:
            _write_durably(tmp / TRAIN_STATE, json.dumps(state.to_dict(), indent=1))
            for f in tmp.iterdir():
                _fsync(f)
            commit = {"step": state.step, "tokens_seen": state.tokens_seen, "world_size": self.world_size,
                      "config_digest": self.config_digest, "keel_version": keel.__version__,
                      "torch_version": torch.__version__, "time": time.time(),
                      "save_seconds": round(time.perf_counter() - started, 3)}
            _write_durably(tmp / COMMIT, json.dumps(commit, indent=1))
            self._publish(tmp, final)
        dist.barrier()
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():  # the same step saved again after resuming from an older checkpoint
            replaced = final.with_name(final.name + ".replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
            tmp.rename(final)
            shutil.rmtree(replaced)
        else:
            tmp.rename(final)
        link = self.dir / (LATEST + ".tmp")
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        link.rename(self.dir / LATEST)
        _fsync(self.dir)

    def load(self, path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> TrainState:
        check_checkpoint(path)
        state = _state_dict(parts, optimizers)
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:  # raised on every rank alike
            causes = {f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                      for err, _ in e.failures.values()}
            raise CheckpointError(f"{str(path)!r} does not fit this model and optimizer ({'; '.join(sorted(causes))}); "
                                  f"resume with the config it was saved with") from None
        for part, optimizer in zip(parts, optimizers, strict=True):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, optimizer, state["optim"], options=_FLAT)
        commit = json.loads((path / COMMIT).read_text())
        rng_path = path / f"rng-rank-{self.rank:05d}.pt"
        if commit["world_size"] == self.world_size and rng_path.exists():
            set_rng_state(torch.load(rng_path, weights_only=False))
        return TrainState.from_dict(json.loads((path / TRAIN_STATE).read_text()))


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state_dict(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, dict]:
    """Model and optimizer state keyed by parameter name, whatever the layout: a pipeline rank's
    stages add up to their share of the names, and DCP reshards between layouts."""
    model_sd: dict = {}
    optim_sd: dict = {}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model_sd.update(get_model_state_dict(part))
        optim_sd.update(get_optimizer_state_dict(part, optimizer, options=_FLAT))
    return {"model": model_sd, "optim": optim_sd}


def load_full_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole and keyed by flat name (`model.…`, `optim.state.…`), whatever
    layout saved it. Needs no process group; meant for inspection and tests."""
    check_checkpoint(path)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        nested = torch.load(Path(tmp) / "state.pt", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", nested)
    return flat


def state_digests(path: Path) -> dict[str, str]:
    """sha256 of every model and optimizer tensor of a checkpoint, keyed by name."""
    return {name: hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
            for name, t in load_full_state(path).items()}


def state_sha256(path: Path) -> str:
    """One digest of all model and optimizer tensors: equal iff the states are bitwise equal."""
    return hashlib.sha256(json.dumps(sorted(state_digests(path).items())).encode()).hexdigest()


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """Which checkpoint a start loads: `auto` the run directory's latest (none on a fresh run),
    `never` none (refused when the run directory already holds checkpoints, which a fresh run would
    overwrite), or an explicit checkpoint directory."""
    ckpt_dir = run_dir / "checkpoints"
    if resume == "auto":
        found = committed(ckpt_dir)
        return found[-1] if found else None
    if resume == "never":
        found = committed(ckpt_dir)
        if found:
            raise CheckpointError(f"--resume never: {str(ckpt_dir)!r} already holds checkpoints (latest "
                                  f"{found[-1].name}) that a fresh run would overwrite; use another --run-dir")
        return None
    return check_checkpoint(Path(resume))
