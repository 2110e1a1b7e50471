"""Checkpoints of the whole train state: staged in host memory, written in the background, committed
atomically with a manifest of checksums, verified before they are trusted, pruned by policy.

One checkpoint, `step-NNNNNN/`:
  *.distcp, .metadata   model and optimizer (torch.distributed.checkpoint: any layout can load it)
  rng-rank-RRRRR.pt     each rank's RNG streams
  train_state.json      step, tokens seen, data cursor, callback state
  manifest.json         written last: every file with its size and checksum, step, layout, versions

The training loop waits only while the state is copied into reusable host buffers (pinned on CUDA).
A writer thread per rank then writes the copy with DCP over its own gloo group, checksums what this
rank wrote, and rank 0 writes the manifest, publishes the checkpoint, moves `latest` and prunes old
ones. At most one save is in flight: the next one first waits for it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import keel
from keel.checkpoint.identity import check_identity, recorded_identity, setting_changes
from keel.checkpoint.manifest import (
    CHECKSUM,
    FORMAT,
    MANIFEST,
    check_files,
    committed,
    manifest_json,
    read_manifest,
    step_name,
    step_of,
    uncommitted,
    verify,
)
from keel.checkpoint.staging import HostStager
from keel.checkpoint.storage import LATEST, Storage, locate
from keel.config import Config
from keel.errors import CheckpointError
from keel.monitor.sinks import EventLog
from keel.train.state import TrainState, rng_state, seed_everything, set_rng_state

TRAIN_STATE = "train_state.json"
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp|rng-rank-(\d+)\.pt")


def checkpoint_root(cfg: Config, run_dir: Path) -> Storage:
    return Storage(cfg.checkpoint.dir or run_dir / "checkpoints")


@dataclass
class SaveOutcome:
    """What became of one save; every rank receives the same one."""

    step: int
    path: str
    committed: bool
    error: str = ""
    blocking_s: float = 0.0  # the longest any rank was blocked staging
    write_s: float = 0.0  # staging done → committed, in the background
    bytes: int = 0
    pruned: list[str] = field(default_factory=list)
    waited_s: float = 0.0  # how long the loop waited for this save before starting the next
    train_s: float = 0.0  # rank 0's training time at the save, so that every rank derives the same interval


def _first_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(sorted({f"rank {r}: {_first_line(err)}" for r, (err, _) in e.failures.items()}))
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class CheckpointManager:
    def __init__(self, cfg: Config, run_dir: Path, layout: str, events: EventLog,
                 on_write: Callable[[int, str], None] | None = None, tokenizer: dict | None = None,
                 identity: dict | None = None, accepted: tuple[str, ...] = ()) -> None:
        """`tokenizer`: the corpus tokenizer's description, recorded in every checkpoint's manifest.
        `identity`: the run's identity (keel.checkpoint.identity), compared with a checkpoint's before it
        is loaded; `accepted`: the identity fields that may change on purpose at this resume."""
        self.cfg, self.policy, self.tokenizer = cfg, cfg.checkpoint, tokenizer
        self.identity, self.accepted = identity or {}, accepted
        self.identity_history: list[dict] = []  # identity changes accepted over the run's life
        self.storage = checkpoint_root(cfg, run_dir)
        self.layout, self.events, self.on_write = layout, events, on_write
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # The writer thread's collectives run beside the training loop's, so they get a group of their own.
        self.group = dist.new_group(backend="gloo")
        self.stager = HostStager(pin_memory=torch.cuda.is_available())
        self.pending: Future[SaveOutcome] | None = None
        if self.rank == 0:
            self._clean_leftovers()
        dist.barrier()

    # ------------------------------------------------------------------ saving

    def save(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: TrainState,
             wait: bool = False) -> list[SaveOutcome]:
        """Stage the state and write it in the background (or to the end, with `wait`). Returns the
        outcomes of the saves that finished meanwhile: the previous one, and this one with `wait`."""
        finished = [o for o in [self.finish()] if o is not None]
        started = time.perf_counter()
        staged = self.stager.stage(_state_dict(parts, optimizers))
        rng = io.BytesIO()
        torch.save(rng_state(), rng)
        train_state = json.dumps(state.to_dict(), indent=1).encode()
        blocking_s = time.perf_counter() - started
        self.pending = Future()
        args = (state.step, state.tokens_seen, staged, rng.getvalue(), train_state, blocking_s, state.train_seconds)
        # A daemon thread: if a peer dies mid-save, this process can still exit.
        threading.Thread(target=self._run, args=(self.pending, args), name="keel-checkpoint", daemon=True).start()
        if wait or not self.policy.async_save:
            finished.append(self.finish())
            finished[-1].waited_s = 0.0  # a synchronous save: the wait is the save itself, not a slow previous one
        return finished

    def done(self) -> bool:
        return self.pending is not None and self.pending.done()

    def finish(self) -> SaveOutcome | None:
        """Wait for the save in flight, if any, and return its outcome."""
        if self.pending is None:
            return None
        started = time.perf_counter()
        outcome = self.pending.result()
        outcome.waited_s = time.perf_counter() - started
        self.pending = None
        return outcome

    def _run(self, future: Future, args: tuple) -> None:
        with contextlib.suppress(OSError):  # where cores are shared, the training loop goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            future.set_result(self._write(*args))
        except BaseException as e:  # a bug: surfaces in the loop through finish()
            future.set_exception(e)

    def _write(self, step: int, tokens_seen: int, staged: dict, rng: bytes, train_state: bytes,
               blocking_s: float, train_s: float) -> SaveOutcome:
        started = time.perf_counter()
        name = step_name(step)
        staging = self.storage.staging_name(name)
        if self.rank == 0:
            self.storage.remove(staging)  # left by a crashed save of the same step
            self.storage.makedirs(staging)
        dist.barrier(group=self.group)
        error, files = "", {}
        try:
            dcp.save(staged, storage_writer=self.storage.writer(staging), process_group=self.group)
            self.storage.write_durably(f"{staging}/rng-rank-{self.rank:05d}.pt", rng)
            if self.rank == 0:
                self.storage.write_durably(f"{staging}/{TRAIN_STATE}", train_state)
            if self.on_write is not None:
                self.on_write(step, self.storage.path(staging))
            files = {f: {"size": size, CHECKSUM: self.storage.digest(f"{staging}/{f}")}
                     for f, size in self.storage.files(staging).items() if self._owner(f) == self.rank}
        except (Exception, CheckpointException) as e:  # disk full, a broken mount: reported, training goes on
            error = _first_line(e)
        reports: list = [None] * self.world_size
        dist.all_gather_object(reports, (error, files, blocking_s), group=self.group)
        outcome = SaveOutcome(step, self.storage.path(name), False, blocking_s=max(r[2] for r in reports),
                              train_s=train_s)
        if self.rank == 0:
            self._commit(outcome, staging, reports, tokens_seen, started)
        shared = [outcome]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        return shared[0]

    def _owner(self, fname: str) -> int:
        """The rank that checksums a file: the one that wrote it (rank 0 for shared files)."""
        m = _RANK_FILE.fullmatch(fname)
        return int(m.group(1) or m.group(2)) if m else 0

    def _commit(self, outcome: SaveOutcome, staging: str, reports: list, tokens_seen: int, started: float) -> None:
        errors = sorted({e for e, _, _ in reports if e})
        name = step_name(outcome.step)
        if not errors:
            files = {f: entry for _, mine, _ in reports for f, entry in mine.items()}
            outcome.bytes = sum(entry["size"] for entry in files.values())
            manifest = {"format": FORMAT, "checksum": CHECKSUM, "step": outcome.step, "tokens_seen": tokens_seen,
                        "layout": self.layout,
                        "world_size": self.world_size, "config_digest": self.cfg.digest(),
                        "model": asdict(self.cfg.model), "tokenizer": self.tokenizer,
                        "seed": self.cfg.train.seed, "identity": self.identity,
                        "identity_changes": self.identity_history, "config": asdict(self.cfg),
                        "permanent": bool(self.policy.keep_every and outcome.step % self.policy.keep_every == 0),
                        "keel_version": keel.__version__, "torch_version": torch.__version__,
                        "time": time.time(), "blocking_s": round(outcome.blocking_s, 4),
                        "write_s": round(time.perf_counter() - started, 3), "bytes": outcome.bytes,
                        "files": dict(sorted(files.items()))}
            try:
                self.storage.write_durably(f"{staging}/{MANIFEST}", manifest_json(manifest))
                self.storage.publish(staging, name)
                outcome.committed = True
            except Exception as e:
                errors = [_first_line(e)]
        if not errors:
            try:
                self.storage.set_latest(name)
                outcome.pruned = self._prune(name)
            except Exception as e:  # the checkpoint itself is committed
                self.events.emit("checkpoint", outcome.step, "warning", path=outcome.path, error=_first_line(e))
        outcome.write_s = round(time.perf_counter() - started, 3)
        if outcome.committed:
            self.events.emit("checkpoint", outcome.step, "committed", path=outcome.path, bytes=outcome.bytes,
                             blocking_s=round(outcome.blocking_s, 4), write_s=outcome.write_s, pruned=outcome.pruned)
            return
        outcome.error = "; ".join(errors)
        try:
            self.storage.remove(staging)
        except Exception as e:
            outcome.error += f"; the unfinished {staging} could not be removed ({_first_line(e)})"
        self.events.emit("checkpoint", outcome.step, "failed", path=outcome.path, error=outcome.error)
        self.events.emit("alert", outcome.step, "checkpoint_failed", severity="error",
                         message=f"checkpoint of step {outcome.step} failed: {outcome.error}; training continues, "
                                 f"the next save retries")

    # ------------------------------------------------------------------ retention

    def _prune(self, newest: str) -> list[str]:
        """Keep the newest `keep_last`, every `keep_every`-th step, and the one just committed; skip any
        that a process is reading. Checkpoints being written are never in the list (no manifest yet)."""
        names = committed(self.storage)
        keep = set(names[-self.policy.keep_last:]) | {newest}
        if self.policy.keep_every:
            keep |= {n for n in names if step_of(n) % self.policy.keep_every == 0}
        return [n for n in names if n not in keep and self.storage.remove_unless_read(n)]

    def retire_after(self, step: int, events: EventLog, now: int) -> list[str]:
        """Remove the committed checkpoints of steps after `step`: a rollback abandoned them (after a
        spike they lead back into the bad data, after silent corruption they may hold it). The save in
        flight must have been finished. Every rank calls this; rank 0 removes."""
        retired: list[str] = []
        if self.rank == 0:
            for name in committed(self.storage):
                if step_of(name) > step and self.storage.remove_unless_read(name):
                    retired.append(name)
            remaining = committed(self.storage)
            if retired and remaining:
                self.storage.set_latest(remaining[-1])
            elif retired:
                self.storage.remove(LATEST)
            if retired:
                events.emit("checkpoint", now, "retired", names=retired,
                            reason=f"newer than step {step}, the state the run went back to")
        dist.barrier()
        return retired

    def _clean_leftovers(self) -> None:
        for name in uncommitted(self.storage):
            self.storage.remove(name)
            self.events.emit("checkpoint", step_of(name.split(".")[0]) or 0, "cleaned",
                             path=self.storage.path(name), reason="left unfinished by an interrupted save")

    # ------------------------------------------------------------------ loading

    def restore(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], resume: str,
                say: Callable[[str], None]) -> tuple[TrainState, str] | None:
        """Load what `resume` asks for: `auto` the newest checkpoint that verifies and loads (older ones
        are tried in turn, each skip reported), `never` nothing, or the checkpoint at a path."""
        if resume == "never":
            return None
        if resume == "auto":
            storage, candidates = self.storage, committed(self.storage)[::-1]
        else:
            storage, name = locate(resume)
            candidates = [name]
        skipped = []
        for name in candidates:
            try:
                return self._load(storage, name, parts, optimizers), storage.path(name)
            except CheckpointError as e:
                if resume != "auto":
                    raise
                skipped.append(f"{name}: {e}")
                if self.rank == 0:
                    self.events.emit("checkpoint", step_of(name) or 0, "skipped", path=storage.path(name),
                                     reason=str(e))
                    self.events.emit("alert", step_of(name) or 0, "checkpoint_skipped", severity="warning",
                                     message=f"{name} cannot be resumed ({e}); trying the previous checkpoint")
                say(f"warning: skipping checkpoint {storage.path(name)}: {e}")
        if skipped:
            raise CheckpointError(f"no checkpoint in {storage} can be resumed ({'; '.join(skipped)}); resume one "
                                  f"explicitly with --resume PATH, or start over with --resume never")
        return None

    def _load(self, storage: Storage, name: str, parts: list[nn.Module],
              optimizers: list[torch.optim.Optimizer]) -> TrainState:
        path = storage.path(name)
        manifest = read_manifest(storage, name)
        if manifest is None:
            raise CheckpointError(f"{path!r} is not a committed keel checkpoint (no {MANIFEST}); pass a "
                                  f"checkpoints/step-NNNNNN directory")
        accepted: dict = {}
        if "unreadable" not in manifest:  # a ConfigError, not a CheckpointError: no fallback to an older one
            accepted = check_identity(recorded_identity(manifest), self.identity, int(manifest["step"]),
                                      self.accepted, path)
        checksums = self.policy.verify_on_resume
        with storage.reading(name):
            # DCP trusts .metadata, so it is checked first; each rank then checksums its share of the
            # other files while the state loads, and all ranks agree on the verdict.
            problems = self._agree(check_files(storage, name, manifest, [n for n in manifest.get("files", {})
                                                                         if n == ".metadata"], checksums))
            if problems:
                raise CheckpointError("; ".join(problems))
            others = sorted(n for n in manifest["files"] if n != ".metadata")[self.rank::self.world_size]
            with ThreadPoolExecutor(1, thread_name_prefix="keel-verify") as pool:
                checking = pool.submit(check_files, storage, name, manifest, others, checksums)
                state = _state_dict(parts, optimizers)
                load_error = ""
                try:
                    dcp.load(state, storage_reader=storage.reader(name))
                except CheckpointException as e:  # raised on every rank alike
                    load_error = (f"it does not fit this model and optimizer ({_first_line(e)}); resume with "
                                  f"the config it was saved with")
                problems = self._agree(checking.result())
            if problems or load_error:
                raise CheckpointError("; ".join(problems) or load_error)
            for part, optimizer in zip(parts, optimizers, strict=True):
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
                set_optimizer_state_dict(part, optimizer, state["optim"], options=_FLAT)
            train_state = TrainState.from_dict(json.loads(storage.read_bytes(f"{name}/{TRAIN_STATE}")))
            if manifest["layout"] == self.layout and manifest["world_size"] == self.world_size:
                set_rng_state(torch.load(io.BytesIO(storage.read_bytes(f"{name}/rng-rank-{self.rank:05d}.pt")),
                                         weights_only=False))
            else:  # another layout: each rank's streams are re-derived from (seed, step, rank)
                seed_everything(self.cfg.train.seed, self.rank, train_state.step)
        self._record_changes(manifest, accepted, train_state.step, path)
        return train_state

    def _record_changes(self, manifest: dict, accepted: dict, step: int, path: str) -> None:
        """What this resume changes: accepted identity changes join the run's history (written into every
        later manifest); every changed setting is an event."""
        self.identity_history = list(manifest.get("identity_changes") or []) + [
            {"step": step, "key": k, "old": old, "new": new} for k, (old, new) in accepted.items()]
        changed = setting_changes(manifest.get("config"), self.cfg)
        if self.rank == 0 and (changed or accepted):
            self.events.emit("resume", step, "config_changed", checkpoint=path, changes=changed,
                             identity_accepted=sorted(accepted))

    def _agree(self, problems: list[str]) -> list[str]:
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, problems)
        return sorted({p for mine in everyone for p in mine})

    def latest(self) -> str | None:
        name = self.storage.latest()
        return self.storage.path(name) if name else None


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


def check_resume(storage: Storage, resume: str) -> None:
    """What a start can check before any worker runs: `never` must not overwrite a checkpoint that
    verifies, and an explicit path must be a committed checkpoint."""
    if resume == "auto":
        return
    if resume == "never":
        for name in committed(storage)[::-1]:
            if not verify(storage, name):
                raise CheckpointError(f"--resume never: {storage} already holds checkpoints (latest verified: "
                                      f"{name}) that a fresh run would overwrite; use another --run-dir")
        return
    if read_manifest(*locate(resume)) is None:
        raise CheckpointError(f"--resume {resume!r} is not a committed keel checkpoint (a directory holding "
                              f"{MANIFEST}); pass a checkpoints/step-NNNNNN directory, auto or never")


def check_resume_identity(storage: Storage, resume: str, identity: dict, accepted: tuple[str, ...]) -> None:
    """Refuse, before any worker starts, a resume that would change the run's identity: compared with the
    checkpoint the workers will load (the newest whose files are all there, for `auto`)."""
    if resume == "never":
        return
    if resume == "auto":
        names = [n for n in committed(storage)[::-1] if not verify(storage, n, checksums=False)][:1]
    else:
        storage, name = locate(resume)
        names = [name]
    for name in names:
        manifest = read_manifest(storage, name)
        if manifest is not None and "unreadable" not in manifest:
            check_identity(recorded_identity(manifest), identity, int(manifest["step"]), accepted,
                           storage.path(name))
