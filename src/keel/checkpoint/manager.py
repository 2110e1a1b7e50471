"""Checkpoints of the whole train state: staged in host memory, written in the background, committed
atomically with a manifest of checksums, verified before they are trusted, pruned by policy.

One checkpoint, `step-NNNNNN/`:
  *.distcp, .metadata   model and optimizer (torch.distributed.checkpoint: any layout can load it)
  rng-rank-RRRRR.pt     each rank's RNG streams
  train_state.json      step, tokens seen, data cursor, callback state
  manifest.json         written last: every file with its size and checksum, step, layout, versions

A save copies the state into reusable host buffers (pinned on CUDA) while the next step's forward and backward
run; the loop waits only at the fence before the next optimizer update, for whatever of the copy is left
(keel.checkpoint.staging). A writer thread per rank then writes the copy with DCP over its own gloo group (the
memory tier: each rank's shards in the tier's own format, keel.checkpoint.flat), checksums what this rank wrote,
and rank 0 writes the manifest, publishes the checkpoint, moves `latest` and prunes old ones. At most one save is
in flight: the next one first waits for it.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import io
import json
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
from torch.distributed.tensor import DTensor

import keel
from keel.checkpoint import flat, owner, spread, verifying
from keel.checkpoint.digesting import DigestingWriter
from keel.checkpoint.identity import check_continuation, setting_changes
from keel.checkpoint.manifest import (
    CHECKSUM,
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    aside_name,
    checkpoint_step,
    checkpoints,
    manifest_json,
    read_manifest,
    step_name,
    step_of,
    uncommitted,
    verify,
    writer_rank,
)
from keel.checkpoint.memory import MemoryTier
from keel.checkpoint.resume import checkpoint_root
from keel.checkpoint.spread import Nodes
from keel.checkpoint.staging import HostStager, Staging
from keel.checkpoint.storage import LATEST, Storage, locate, size_text, volume_error
from keel.config import Config
from keel.core.process import in_background
from keel.core.state import TrainState, rng_state, seed_everything, set_rng_state
from keel.errors import CheckpointError
from keel.model.init import canonical_name
from keel.rundir.events import EventLog

TRAIN_STATE = "train_state.json"


@dataclass
class SaveOutcome:
    """What became of one save; every rank receives the same one."""

    step: int
    path: str
    committed: bool
    error: str = ""
    blocking_s: float = 0.0  # the longest any rank's loop was blocked by the save: starting it, and at the fence
    write_s: float = 0.0  # staging done → committed, in the background
    bytes: int = 0
    pruned: list[str] = field(default_factory=list)
    waited_s: float = 0.0  # how long the loop waited for this save before starting the next
    train_s: float = 0.0  # rank 0's training time at the save, so that every rank derives the same interval
    volume_error: str = ""  # ENOSPC, EROFS, ...: the volume refused the save (checkpoint.on_storage_error applies)


# A rank's failed save: what it said, the volume's errno behind it (if any), the path and the free bytes then.
Failure = tuple[str, int | None, str, int | None]


def _failure(e: BaseException, storage: Storage, share: int) -> Failure:
    err = volume_error(e)
    free = storage.free_bytes()
    if err is None and free is not None and free < share:  # torch's zip writer hides the ENOSPC of a full volume
        return _first_line(e), errno.ENOSPC, storage.path(), free
    return _first_line(e), err.errno if err else None, (err.filename or "") if err else "", free


def _nbytes(value: object) -> int:
    """Bytes this rank writes for one staged entry (a DTensor: its local shard)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.numel() * local.element_size() if isinstance(local, torch.Tensor) else 0


def _first_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(sorted({f"rank {r}: {_first_line(err)}" for r, (err, _) in e.failures.items()}))
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class CheckpointManager:
    def __init__(self, cfg: Config, run_dir: Path, layout: str, events: EventLog,
                 on_write: Callable[[int, str], None] | None = None, tokenizer: dict | None = None,
                 identity: dict | None = None, accepted: tuple[str, ...] = (), memory: MemoryTier | None = None,
                 tier: MemoryTier | None = None) -> None:
        """`tokenizer`: the corpus tokenizer's description, recorded in every checkpoint's manifest.
        `identity`: the run's identity (keel.checkpoint.identity), compared with a checkpoint's before it
        is loaded; `accepted`: the identity fields that may change on purpose at this resume. `memory`: the
        memory tier (keel.checkpoint.memory), whose checkpoints a resume also considers and `memory_writer`
        writes. `tier`: this manager is that writer (the tier's root and policy; its events are `memory` ones)."""
        self.cfg, self.policy, self.tokenizer = cfg, cfg.checkpoint if tier is None else tier.policy, tokenizer
        self.identity, self.accepted = identity or {}, accepted
        self.identity_history: list[dict] = []  # identity changes accepted over the run's life
        self.storage = checkpoint_root(cfg, run_dir) if tier is None else tier.storage
        self.kind = "checkpoint" if tier is None else "memory"  # the kind of its events
        self.memory = memory.storage if memory is not None else None  # a resume's second tier
        self.restored_tier = ""  # the tier of the checkpoint `restore` loaded: "storage" or "memory"
        self.layout, self.events, self.on_write = layout, events, on_write
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.nodes = Nodes.here()
        # A memory tier on several nodes is spread over them (keel.checkpoint.spread): each node's leader keeps
        # its node's copy, as rank 0 keeps the storage tier's.
        self.spread = tier is not None and self.nodes.count > 1
        self.leader = self.nodes.leader if tier is not None else self.rank == 0
        self.inventories: list = []  # with a memory tier spread over nodes: what each node holds, at a restore
        # The writer thread's collectives run beside the training loop's, so they get a group of their own.
        self.group = dist.new_group(backend="gloo")
        self.stager = HostStager(pin_memory=torch.cuda.is_available())
        self.staging: Staging | None = None  # the copy of the save in flight, until the loop passes its fence
        self.fenced: set[int] = set()  # the optimizers whose updates wait for the copy
        self.closing = False  # the save in flight is the last step's or a pause's
        self.pending: Future[SaveOutcome] | None = None
        self.last_bytes = 0  # the size of the last save, what the next one needs free
        self.verdicts: dict[str, list[str]] = {}  # checkpoints verified by this process: name -> problems
        self.prefetched: verifying.Verification | None = None  # checks started before the load (`prefetch`)
        self.run = str(run_dir.absolute())
        self.claim: owner.Claim | None = None  # rank 0's claim on the staging name of the save in flight
        if self.leader:
            self._clean_leftovers()
        dist.barrier()
        self.memory_writer = None if memory is None else CheckpointManager(
            cfg, run_dir, layout, events, on_write=on_write, tokenizer=tokenizer, identity=identity, tier=memory)

    # ------------------------------------------------------------------ saving

    def reserve(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Allocate the host buffers of the first save now, in the background, beside the rest of the start."""
        self.stager.reserve(_state_templates(parts, optimizers))

    def save(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: TrainState,
             wait: bool = False) -> list[SaveOutcome]:
        """Start copying the state to the host and write it in the background (or to the end, with
        `wait`). Returns the outcomes of the saves that finished meanwhile: the previous one, and this one
        with `wait`. Until the copy is done, the next optimizer update waits for it (the fence)."""
        finished = [o for o in [self.finish()] if o is not None]
        self.closing = wait  # the last step's or a pause's save: no later save of this run retries it
        started = time.perf_counter()
        for optimizer in optimizers:
            if id(optimizer) not in self.fenced:
                optimizer.register_step_pre_hook(lambda *_: self.fence())
                self.fenced.add(id(optimizer))
        staging = self.staging = self.stager.start(_state_dict(parts, optimizers))
        rng = io.BytesIO()
        torch.save(rng_state(), rng)
        train_state = json.dumps(state.to_dict(), indent=1).encode()
        blocking_s = time.perf_counter() - started
        args = (state.step, state.tokens_seen, staging, rng.getvalue(), train_state, blocking_s, state.train_seconds)
        # A daemon thread: if a peer dies mid-save, this process can still exit.
        pending = self.pending = in_background(lambda: self._write_claimed(*args), "keel-checkpoint")
        if wait or not self.policy.async_save:
            finished.append(self._wait(pending))
            finished[-1].waited_s = 0.0  # a synchronous save: the wait is the save itself, not a slow previous one
        return finished

    def fence(self) -> None:
        """Wait until the save in flight has copied the live state: called before anything changes it (every
        optimizer update, through a step pre-hook; a heal from a peer; a rollback, through `finish`)."""
        if self.staging is not None:
            self.staging.fence()
            self.staging = None

    def done(self) -> bool:
        return self.pending is not None and self.pending.done()

    def finish(self) -> SaveOutcome | None:
        """Wait for the save in flight, if any, and return its outcome."""
        return None if self.pending is None else self._wait(self.pending)

    def _wait(self, pending: Future[SaveOutcome]) -> SaveOutcome:
        self.fence()
        started = time.perf_counter()
        outcome = pending.result()
        outcome.waited_s = time.perf_counter() - started
        self.pending = None
        return outcome

    def _write_claimed(self, step: int, tokens_seen: int, copied: Staging, rng: bytes, train_state: bytes,
                       blocking_s: float, train_s: float) -> SaveOutcome:
        """The writer thread's work (an exception, a bug, surfaces in the loop through `finish`). Rank 0
        claims the save's staging name before anything is written there and holds the claim until the save
        is committed or removed, so that no start takes it from under a live writer (keel.checkpoint.owner)."""
        with contextlib.suppress(OSError):  # where cores are shared, the training loop goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        staging = self.storage.staging_name(step_name(step))
        refused: Failure | None = None
        if self.leader:
            try:
                self.claim = owner.claim(self.storage, staging, self.run)
                self.storage.makedirs(staging)
            except (OSError, CheckpointError) as e:
                refused = _failure(e, self.storage, 0)
        outcome = None
        try:
            outcome = self._write(step, tokens_seen, copied, rng, train_state, blocking_s, train_s, refused)
            return outcome
        finally:
            if self.claim is not None:  # a save that raised (a peer lost mid-save) leaves its writer's record
                self.claim.release(done=outcome is not None and (outcome.committed or not self.storage.exists(staging)))
                self.claim = None

    def _write(self, step: int, tokens_seen: int, copied: Staging, rng: bytes, train_state: bytes,
               blocking_s: float, train_s: float, ready: Failure | None) -> SaveOutcome:
        """Write the save (rank 0's claim on it is `ready` unless it failed) and commit it."""
        copied.wait_copied()
        started, staged = time.perf_counter(), copied.state
        name = step_name(step)
        staging = self.storage.staging_name(name)
        share = len(rng) + len(train_state) + sum(_nbytes(t) for group in staged.values() for t in group.values())
        plans: list = [None] * self.world_size
        dist.all_gather_object(plans, (share, ready, self.storage.free_bytes()), group=self.group)
        need = self.last_bytes or sum(p[0] for p in plans)
        failure, free = next((p[1] for p in plans if p[1] is not None), None), plans[0][2]
        if failure is None and free is not None and free < need:  # it cannot fit: write nothing
            failure = (f"{size_text(free)} free", errno.ENOSPC, self.storage.path(staging), free)
        files = {}
        if failure is None:
            try:
                taken = self._write_state(staging, staged)
                self.storage.write_durably(f"{staging}/rng-rank-{self.rank:05d}.pt", rng)
                if self.rank == 0:
                    self.storage.write_durably(f"{staging}/{TRAIN_STATE}", train_state)
                if self.on_write is not None:
                    self.on_write(step, self.storage.path(staging))
                files = {f: {"size": size, CHECKSUM: self._checksum(staging, f, size, taken)}
                         for f, size in self.storage.files(staging).items() if writer_rank(f) == self.rank}
            except (Exception, CheckpointException) as e:  # disk full, a broken mount: reported, training goes on
                failure = _failure(e, self.storage, share)
        copied.fenced.wait()  # the loop's wait at the fence is part of what the save cost it
        reports: list = [None] * self.world_size
        dist.all_gather_object(reports, (failure, files, blocking_s + copied.fence_s), group=self.group)
        held = self._replicate(staging, reports)
        outcome = SaveOutcome(step, self.storage.path(name), False, blocking_s=max(r[2] for r in reports),
                              train_s=train_s)
        manifest = self._commit(outcome, staging, reports, tokens_seen, started, need, held) if self.rank == 0 \
            else None
        shared: list[Any] = [outcome, manifest]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        outcome, manifest = shared
        if self.spread and self.leader and self.rank != 0:
            self._commit_here(staging, manifest, held)
        if outcome.committed:
            self.last_bytes = outcome.bytes
        return outcome

    def _write_state(self, staging: str, staged: dict[str, dict]) -> dict[str, tuple[int, str]]:
        """Write the model and optimizer state: DCP's files to storage, the memory tier's own format to memory
        (keel.checkpoint.flat). Returns the files whose checksums were taken as they were written, with their
        sizes."""
        if self.kind == "memory":
            return flat.save(self.storage, staging, staged, self.rank)
        writer = self.storage.writer(staging)
        dcp.save(staged, storage_writer=writer, process_group=self.group)
        return writer.digests if isinstance(writer, DigestingWriter) else {}

    def _replicate(self, staging: str, reports: list) -> dict[int, list[str]]:
        """With a tier spread over nodes, a save every rank wrote: its files copied to its buddy's node, and what
        each node then holds. A rank whose copy failed makes it a failure of the save (`reports` amended)."""
        if not self.spread or any(r[0] for r in reports):
            return {}
        mine = spread.replicate(self.storage, staging, self.nodes, self.group)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        for rank, (_, error) in enumerate(everyone):
            if error:
                reports[rank] = ((error, None, self.storage.path(staging), None), *reports[rank][1:])
        return spread.held_by_node([files for files, _ in everyone], self.nodes)

    def _commit_here(self, staging: str, manifest: dict | None, held: dict[int, list[str]]) -> None:
        """Another node's leader: its copy of the save rank 0 committed (`manifest`), or removed if it was not."""
        name = step_name(manifest["step"]) if manifest else ""
        try:
            if manifest is None:
                self.storage.remove(staging)
                return
            self.storage.write_durably(f"{staging}/{MANIFEST}", spread.node_manifest(manifest,
                                                                                  held[self.nodes.node(self.rank)]))
            self.storage.publish(staging, name)
            self.verdicts[name] = []
            self.storage.set_latest(name)
            self._prune(name)
        except OSError as e:  # this node's copy is short; the others still hold its files
            self.events.emit(self.kind, manifest["step"] if manifest else 0, "warning",
                             path=self.storage.path(name or staging), error=_first_line(e))

    def _checksum(self, staging: str, fname: str, size: int, taken: dict[str, tuple[int, str]]) -> str:
        """A checksum taken as the file was written stands while the file has the size it was written with;
        any other file is read back."""
        written = taken.get(fname)
        return written[1] if written is not None and written[0] == size else self.storage.digest(f"{staging}/{fname}")

    def _commit(self, outcome: SaveOutcome, staging: str, reports: list, tokens_seen: int, started: float,
                need: int, held: dict[int, list[str]]) -> dict | None:
        """Rank 0: commit the save every rank reported on (`held`: with a tier spread over nodes, the files each
        node holds). Returns its manifest when committed."""
        failures = [f for f, _, _ in reports if f is not None]
        errors = [self._explain(failures, need)] if failures else []
        name = step_name(outcome.step)
        files = {f: entry for _, mine, _ in reports for f, entry in mine.items()}
        here = set(held[0]) if self.spread else None  # the files on this node: the others check their own
        dcp_files, missing = self._dcp_files(staging, files, here) if not errors else ([], [])
        if missing:  # nothing that DCP could not load is ever committed
            errors = [(f"the save is incomplete, not committed: {'; '.join(missing)}", "")]
        if not errors:
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
                        "files": dict(sorted(files.items())), "dcp_files": dcp_files}
            try:
                self.storage.write_durably(f"{staging}/{MANIFEST}", spread.node_manifest(manifest, held[0])
                                           if self.spread else manifest_json(manifest))
                self.storage.publish(staging, name)
                outcome.committed = True
                self.verdicts[name] = []  # its checksums were just taken from the files written
            except Exception as e:
                errors = [self._explain([_failure(e, self.storage, need)], need)]
        outcome.write_s = round(time.perf_counter() - started, 3)  # committed: retention is not part of the write
        if not errors:
            try:
                self.storage.set_latest(name)
                outcome.pruned = self._prune(name)
            except Exception as e:  # the checkpoint itself is committed
                self.events.emit(self.kind, outcome.step, "warning", path=outcome.path, error=_first_line(e))
        if outcome.committed:
            self.events.emit(self.kind, outcome.step, "committed", path=outcome.path, bytes=outcome.bytes,
                             blocking_s=round(outcome.blocking_s, 4), write_s=outcome.write_s, pruned=outcome.pruned,
                             **({"nodes": len(held)} if self.spread else {}))
            return manifest
        outcome.error, outcome.volume_error = errors[0]
        try:
            if self.claim is not None:  # what another writer holds is not this save's to remove
                self.storage.remove(staging)
        except Exception as e:
            outcome.error += f"; the unfinished {staging} could not be removed ({_first_line(e)})"
        stops = outcome.volume_error and self.policy.on_storage_error == "stop"
        then = ('the run stops (checkpoint.on_storage_error = "stop")' if stops else
                "the run stops at this step without it" if self.closing else
                "training continues, the next save retries")
        self.events.emit(self.kind, outcome.step, "failed", path=outcome.path, error=outcome.error,
                         volume_error=outcome.volume_error)
        self.events.emit("alert", outcome.step, "checkpoint_failed", severity="error",
                         message=f"checkpoint of step {outcome.step} failed: {outcome.error}; {then}")
        return None

    def _dcp_files(self, staging: str, files: dict[str, dict], here: set[str] | None = None
                   ) -> tuple[list[str], list[str]]:
        """The files DCP needs to load this save (its `.metadata` and every data file that `.metadata` points
        into; in the memory tier's format every rank's data and index), and what is wrong with them: not listed
        by the rank that wrote them, shorter than `.metadata` says, or no longer in the directory with the size
        listed (whatever removed them)."""
        if self.kind == "memory":
            needed = [f for rank in range(self.world_size) for f in flat.names(rank)]
            missing = [f"{f} is missing" for f in needed if f not in files]
        else:
            needed, missing = self._dcp_data_files(staging, files)
        present = self.storage.files(staging)
        missing += [f"{f} is missing" if f not in present else f"{f} has {present[f]} bytes, {entry['size']} written"
                    for f, entry in sorted(files.items()) if present.get(f) != entry["size"] and
                    (here is None or f in here)]
        return needed, missing

    def _dcp_data_files(self, staging: str, files: dict[str, dict]) -> tuple[list[str], list[str]]:
        """`.metadata` and the data files it points into, and what is wrong with them (`_dcp_files`)."""
        if DCP_METADATA not in files:
            return [], [f"{DCP_METADATA} is missing"]
        try:
            metadata = self.storage.reader(staging).read_metadata()
        except Exception as e:
            return [], [f"{DCP_METADATA} is unreadable ({_first_line(e)})"]
        ends: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        missing = [] if ends else [f"{DCP_METADATA} names no data file"]
        for fname, end in sorted(ends.items()):
            if fname not in files:
                missing.append(f"{fname} is missing")
            elif files[fname]["size"] < end:
                missing.append(f"{fname} has {files[fname]['size']} bytes, {DCP_METADATA} needs {end}")
        return [DCP_METADATA, *sorted(ends)], missing

    def _explain(self, failures: list[Failure], need: int) -> tuple[str, str]:
        """One line for the failed save, and the volume's errno name when the volume refused it."""
        volume = next(((code, path, free) for _, code, path, free in failures if code is not None), None)
        if volume is None:
            return "; ".join(sorted({text for text, *_ in failures})), ""
        code, path, free = volume
        have = f", {size_text(free)} ({free} bytes) free" if free is not None else ""
        return (f"{os.strerror(code)} ({errno.errorcode[code]}) on {path or self.storage.path()}: the checkpoint "
                f"needs {size_text(need)} ({need} bytes){have}"), errno.errorcode[code]

    # ------------------------------------------------------------------ retention

    def _prune(self, newest: str) -> list[str]:
        """Keep the newest `keep_last` checkpoints that verify, every `keep_every`-th step, and the one
        just committed; skip any that a process is reading. Only a checkpoint that verifies is removed:
        one that does not is set aside. Checkpoints being written are never in the list (`.tmp`)."""
        kept, pruned = 0, []
        for name in checkpoints(self.storage)[::-1]:
            if name == newest or (self.policy.keep_every and checkpoint_step(name) % self.policy.keep_every == 0):
                kept += name == newest
            elif self._verify(name):
                self._set_aside(name, self._verify(name)[0], checkpoint_step(newest))
            elif kept < self.policy.keep_last:
                kept += 1
            elif self.storage.remove_unless_read(name):
                pruned.append(name)
        return pruned

    def _verify(self, name: str) -> list[str]:
        """What is wrong with a checkpoint of this root: its manifest and file sizes every time (cheap),
        its checksums once per process (a save's own are taken as it is written)."""
        if problems := verify(self.storage, name, checksums=False):
            return problems
        if name not in self.verdicts:
            self.verdicts[name] = verify(self.storage, name)
        return self.verdicts[name]

    def _set_aside(self, name: str, problem: str, now: int) -> None:
        """Keep a checkpoint that does not verify where nothing resumes from it or removes it (a copy in the memory
        tier is removed: it is no evidence worth the memory, and the storage tier keeps its own)."""
        if self.kind == "memory":
            self.storage.remove(name)
            self.verdicts.pop(name, None)
            self.events.emit(self.kind, now, "removed", path=self.storage.path(name), reason=problem)
            return
        aside = aside_name(name, problem)
        taken = set(self.storage.names())
        aside = next(a for a in (aside, *(f"{aside}-{i}" for i in range(2, 1000))) if a not in taken)
        self.storage.rename(name, aside)
        self.verdicts.pop(name, None)
        self.events.emit(self.kind, now, "set_aside", path=self.storage.path(name),
                         moved_to=self.storage.path(aside), reason=problem)
        self.events.emit("alert", now, "checkpoint_set_aside", severity="warning",
                         message=f"{name} does not verify ({problem}); kept as {aside}, never resumed or removed")

    def retire_after(self, step: int, events: EventLog, now: int, remove: bool = True) -> list[str]:
        """Remove the checkpoints of steps after `step`: a rollback abandoned them (after a spike they
        lead back into the bad data, after silent corruption they may hold it). Those that do not
        verify are set aside instead, and the checkpoints up to `step` are left alone, so the newest
        verified one the run went back to stays. The save in flight must have been finished. Every
        rank calls this; rank 0 removes (each node's leader, from a tier spread over nodes), unless `remove` is
        False: another replica group writes the run's checkpoints."""
        retired: list[str] = []
        if self.leader and remove:
            for name in checkpoints(self.storage):
                if checkpoint_step(name) <= step:
                    continue
                if self._verify(name):
                    self._set_aside(name, self._verify(name)[0], now)
                elif self.storage.remove_unless_read(name):
                    retired.append(name)
            if retired:
                self._move_latest(next((n for n in checkpoints(self.storage)[::-1] if not self._verify(n)), None),
                                  now)
                if self.rank == 0:
                    events.emit(self.kind, now, "retired", names=retired,
                                reason=f"newer than step {step}, the state the run went back to")
        dist.barrier()
        return retired

    def _move_latest(self, name: str | None, step: int) -> None:
        """Point `latest` at checkpoint `name` (None: remove it). `latest` is a convenience, since resuming
        needs only the checkpoint, so a failure is a warning."""
        try:
            if name is None:
                self.storage.remove(LATEST)
            else:
                self.storage.set_latest(name)
        except OSError as e:
            self.events.emit(self.kind, step, "warning", path=self.storage.path(name or LATEST),
                             error=f"latest could not be moved to it: {_first_line(e)}")

    def _clean_leftovers(self) -> None:
        """Remove what interrupted saves left, where their writers are proven gone (keel.checkpoint.owner):
        their `.tmp` directories, and the old copy of a step that was saved again (put back when the
        interruption came before the new copy was in place). What a live writer holds is left alone, and
        what cannot be removed is reported and left: a start never fails on another process's save."""
        for name in self.storage.names():
            final = name.removesuffix(".replaced")
            if name.endswith(".replaced") and step_of(final) is not None:
                self._settle_replaced(name, final)
        for name in uncommitted(self.storage):
            step = step_of(name.split(".")[0]) or 0
            try:
                removed, why = owner.remove_if_abandoned(self.storage, name)
            except OSError as e:  # a writer came back to it meanwhile, or the volume refused
                removed, why = False, f"it could not be removed ({_first_line(e)})"
            if removed:
                self.events.emit(self.kind, step, "cleaned", path=self.storage.path(name),
                                 reason=f"left unfinished by an interrupted save: {why}")
            elif why:
                self.events.emit(self.kind, step, "left", path=self.storage.path(name), reason=why)

    def _settle_replaced(self, name: str, final: str) -> None:
        """The old copy of a step saved again: removed once the new one is in place, put back otherwise;
        left while the save of that step is in flight (its writer swaps the two)."""
        try:
            with owner.unclaimed(self.storage, self.storage.staging_name(final)) as free:
                if not free:
                    return
                if self.storage.exists(final):
                    self.storage.remove(name)
                else:
                    self.storage.rename(name, final)
        except OSError as e:
            self.events.emit(self.kind, checkpoint_step(final), "left", path=self.storage.path(name),
                             reason=f"it could not be settled ({_first_line(e)})")

    # ------------------------------------------------------------------ loading

    def restore(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], resume: str,
                say: Callable[[str], None]) -> tuple[TrainState, str] | None:
        """Load what `resume` asks for: `auto` the newest checkpoint that verifies and loads, `never`
        nothing, or the checkpoint at a path. With `auto`, newer checkpoints that fail are set aside
        (each reported) once an older one has loaded; when none loads, nothing is changed and the
        error lists them all. `never` sets aside those that do not verify, so the new run's saves
        never replace them."""
        if resume == "never":
            self._set_aside_unverified()
            return None
        if resume != "auto":
            storage, name = locate(resume)
            loaded = self._load(storage, name, parts, optimizers)
            self.restored_tier = "storage"
            return loaded, storage.path(name)
        return self._restore_newest(parts, optimizers, say)

    def _set_aside_unverified(self) -> None:
        """Every rank calls this; rank 0 sets aside the checkpoints that do not verify."""
        if self.rank == 0:
            for name in checkpoints(self.storage):
                if self._verify(name):
                    self._set_aside(name, self._verify(name)[0], 0)
        dist.barrier()

    def _restore_newest(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                        say: Callable[[str], None]) -> tuple[TrainState, str] | None:
        failed: list[tuple[Storage, str, str]] = []
        for storage, name in self._candidates():
            try:
                pulled = 0
                if storage is self.memory and self.inventories:  # spread over nodes: each node's copy made whole
                    pulled = spread.complete(storage, name, self.inventories, self.nodes, self.group)
                state = self._load(storage, name, parts, optimizers)
            except CheckpointError as e:
                failed.append((storage, name, str(e)))
                continue
            self.restored_tier = "storage" if storage is self.storage else "memory"
            if storage is self.storage:
                self.verdicts[name] = []
            elif self.rank == 0:  # the storage tier was not read
                self.events.emit("memory", checkpoint_step(name), "restored", path=storage.path(name),
                                 newest_in_storage=next(iter(checkpoints(self.storage)[::-1]), None),
                                 **({"nodes": self.nodes.count, "from_peers_bytes": pulled} if self.inventories
                                    else {}))
            for tier, bad, why in failed:
                say(f"warning: skipping checkpoint {tier.path(bad)}: {why}")
                if self.rank == 0:
                    self.events.emit("checkpoint" if tier is self.storage else "memory", checkpoint_step(bad),
                                     "skipped", path=tier.path(bad), reason=why)
                    if tier is self.storage:
                        self._set_aside(bad, why, checkpoint_step(bad))
                if tier is not self.storage and self.nodes.leader:  # a copy in memory is not evidence worth
                    tier.remove(bad)  # keeping (the storage tier has its own): each node removes its own
            if self.rank == 0 and any(tier is self.storage for tier, _, _ in failed):
                newest = name if storage is self.storage else next(iter(checkpoints(self.storage)[::-1]), None)
                self._move_latest(newest, checkpoint_step(name))
            return state, storage.path(name)
        if failed:
            raise CheckpointError(f"no checkpoint in {self.storage} can be resumed, nothing was changed: "
                                  f"{'; '.join(f'{tier.path(n)}: {why}' for tier, n, why in failed)}; resume one "
                                  f"explicitly with --resume PATH, or start over with --resume never (which sets "
                                  f"them aside)", every_rank=True)
        return None

    def _listing(self) -> list[tuple[int, str]]:
        """This process's view of the checkpoints `auto` tries, newest first, as (tier, name), tier 0 the storage
        and 1 the memory tier: at the same step the memory tier's, which reads no storage."""
        tiers = [self.storage] if self.memory is None else [self.storage, self.memory]
        found = sorted(((checkpoint_step(n), t, n) for t, tier in enumerate(tiers) for n in checkpoints(tier)),
                       reverse=True)
        return [(t, n) for _, t, n in found]

    def _candidates(self) -> list[tuple[Storage, str]]:
        """The checkpoints `auto` tries, in order: rank 0's list of the storage tier's, and with a memory tier
        the steps the nodes hold whole between them (keel.checkpoint.spread; a node's copy may hold only its
        own ranks' files and its buddy's), each node's copy made whole before it is loaded."""
        listing = self._listing()
        if self.memory is not None:
            shared = [listing]
            dist.broadcast_object_list(shared, src=0)
            listing = shared[0]
            self.inventories = spread.inventory(self.memory, self.nodes, self.group)
            whole = [(checkpoint_step(n), 1, n) for n in spread.restorable(self.inventories)]
            stored = [(checkpoint_step(n), 0, n) for t, n in listing if t == 0]
            listing = [(t, n) for _, t, n in sorted([*stored, *whole], reverse=True)]
        return [(self._tier(t), n) for t, n in listing]

    def _tier(self, index: int) -> Storage:
        """The tier `_listing` numbers `index`."""
        return self.memory if index == 1 and self.memory is not None else self.storage

    def _load(self, storage: Storage, name: str, parts: list[nn.Module],
              optimizers: list[torch.optim.Optimizer]) -> TrainState:
        path = storage.path(name)
        manifest = read_manifest(storage, name)
        if manifest is None:
            raise CheckpointError(verify(storage, name)[0] if storage is self.storage else
                                  f"{path!r} is not a committed keel checkpoint (no {MANIFEST}); pass a "
                                  f"checkpoints/step-NNNNNN directory")
        accepted: dict = {}
        if "unreadable" not in manifest:  # a ConfigError, not a CheckpointError: no fallback to an older one
            accepted = check_continuation(manifest, self.cfg, self.identity, self.accepted, path)
        with storage.reading(name):
            # DCP trusts .metadata, so it is checked first; each rank's share of the other files is checked
            # meanwhile (started before the model was built, when this is the checkpoint `prefetch` named),
            # and all ranks agree on the verdict.
            checks = self._verification(storage, name, manifest)
            problems = self._agree(checks.metadata.result())
            if problems:
                raise CheckpointError("; ".join(problems))
            state = _state_dict(parts, optimizers)
            load_error = own_error = ""
            try:
                if flat.is_flat(manifest["files"]):
                    self._load_flat(storage, name, manifest, state)
                else:
                    dcp.load(state, storage_reader=storage.reader(name))
            except CheckpointException as e:  # raised on every rank alike
                load_error = (f"it does not fit this model and optimizer ({_first_line(e)}); resume with "
                              f"the config it was saved with")
            except CheckpointError as e:  # in a rank's own share: every rank hears of it
                own_error = str(e)
            problems = self._agree([*checks.rest.result(), *([own_error] if own_error else [])])
            if problems or load_error:
                raise CheckpointError("; ".join(problems) or load_error)
            for part, optimizer in zip(parts, optimizers, strict=True):
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
                # The state dict also holds each group's settings (weight decay, betas, eps) as they were
                # saved; the config may change them at a resume, so the optimizer keeps those it was built with.
                settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                set_optimizer_state_dict(part, optimizer, state["optim"], options=_FLAT)
                for group, configured in zip(optimizer.param_groups, settings, strict=True):
                    group.update(configured)
            train_state = TrainState.from_dict(json.loads(storage.read_bytes(f"{name}/{TRAIN_STATE}")))
            if manifest["layout"] == self.layout and manifest["world_size"] == self.world_size:
                set_rng_state(torch.load(io.BytesIO(storage.read_bytes(f"{name}/rng-rank-{self.rank:05d}.pt")),
                                         weights_only=False))
            else:  # another layout: each rank's streams are re-derived from (seed, step, rank)
                seed_everything(self.cfg.train.seed, self.rank, train_state.step)
        self._record_changes(manifest, accepted, train_state.step, path)
        return train_state

    def _load_flat(self, storage: Storage, name: str, manifest: dict, state: dict[str, dict]) -> None:
        """This rank's share of a memory checkpoint (keel.checkpoint.flat), from the shards of every process that
        wrote it which overlap this rank's."""
        try:
            flat.load(storage, name, state, self.rank, int(manifest["world_size"]))
        except CheckpointError as e:
            raise CheckpointError(f"it does not fit this model and optimizer: {e}") from None
        except (OSError, ValueError, KeyError, IndexError, pickle.UnpicklingError) as e:  # a file lost or cut short
            raise CheckpointError(f"its files cannot be read ({_first_line(e)})") from None

    @property
    def defined_since(self) -> int:
        """The step of the newest accepted change of what defines the run (0: none): the states before it were
        trained under another definition, so rollbacks do not go behind it and the guards judge only after it."""
        return max((change["step"] for change in self.identity_history), default=0)

    def _record_changes(self, manifest: dict, accepted: dict, step: int, path: str) -> None:
        """What this resume changes: accepted identity changes join the run's history (written into every
        later manifest); every changed setting is an event."""
        self.identity_history = list(manifest.get("identity_changes") or []) + [
            {"step": step, "key": k, "old": old, "new": new} for k, (old, new) in accepted.items()]
        changed = setting_changes(manifest.get("config"), self.cfg)
        if self.rank == 0 and (changed or accepted):
            self.events.emit("config", step, "changed", checkpoint=path, changes=changed,
                             identity_accepted=sorted(accepted))

    def prefetch(self, resume: str) -> None:
        """Start checking the files of the checkpoint that `restore(resume)` will try first, so that the
        checks run while the model is built and the load finds them done (and the files it reads in the
        page cache). Nothing is trusted before `restore`: it checks the identity, takes these verdicts only
        for the same manifest, and falls back to older checkpoints as before."""
        if resume == "never":
            return
        if resume == "auto":
            listing = self._listing()
            # On several nodes a memory tier's newest copy may be a peer's: this node's view says nothing of
            # whether the storage tier will be read at all.
            if not listing or (listing[0][0] == 0 and self.memory is not None and self.nodes.count > 1):
                return
            tier, name = listing[0]
            storage = self._tier(tier)
        else:
            storage, name = locate(resume)
        manifest = read_manifest(storage, name)
        if manifest is not None and "unreadable" not in manifest:
            self.prefetched = verifying.start(storage, name, manifest, self.rank, self.world_size,
                                              self.policy.verify_on_resume)

    def _verification(self, storage: Storage, name: str, manifest: dict) -> verifying.Verification:
        """The checks `prefetch` started for this very checkpoint, or new ones when it was saved again or a file
        of it was written since."""
        kept, self.prefetched = self.prefetched, None
        if kept is not None and kept.path == storage.path(name) and kept.manifest == manifest and kept.unchanged():
            return kept
        return verifying.start(storage, name, manifest, self.rank, self.world_size, self.policy.verify_on_resume)

    def _agree(self, problems: list[str]) -> list[str]:
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, problems)
        return sorted({p for mine in everyone for p in mine})

    def latest(self) -> str | None:
        name = self.storage.latest()
        return self.storage.path(name) if name else None


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _state_templates(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Tensors shaped like every tensor a save stages, known before the optimizer has any state: the model's
    state dict, and for each parameter the state its optimizer's class keeps, found by stepping a
    throwaway optimizer of that class on a throwaway parameter (the real one is not touched: a step
    would change its state)."""
    templates = [t for part in parts for t in _model_state(part).values() if isinstance(t, torch.Tensor)]
    for optimizer in optimizers:
        probe = torch.zeros(2, 3, requires_grad=True)
        try:
            takes = inspect.signature(type(optimizer)).parameters
            trial = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in takes})
            probe.grad = torch.zeros_like(probe)
            trial.step()
        except Exception:  # an optimizer that cannot be probed: its buffers are allocated at the first save
            continue
        kept = [v for v in trial.state[probe].values() if isinstance(v, torch.Tensor)]
        for group in optimizer.param_groups:
            for p in group["params"]:
                templates += [p if v.shape == probe.shape else v for v in kept]
    return templates


def _model_state(part: nn.Module) -> dict[str, object]:
    """The part's model state dict with a tied parameter under its first name only: the output projection
    that is the embedding would otherwise be staged and written twice (1 GB more for a 128k vocabulary at
    width 2048). Loading the one name fills both, since they are one tensor; a checkpoint that holds both
    names (as keel wrote them before) still loads, its second copy unread. The aliases come from the
    module's structure, the same on every rank of a stage, not from which tensors happen to share memory."""
    first: dict[int, str] = {}
    aliases = {canonical_name(name) for name, p in part.named_parameters(remove_duplicate=False)
               if first.setdefault(id(p), name) != name}
    return {key: value for key, value in get_model_state_dict(part).items() if key not in aliases}


def _state_dict(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, dict]:
    """Model and optimizer state keyed by parameter name, whatever the layout: a pipeline rank's
    stages add up to their share of the names, and DCP reshards between layouts."""
    model_sd: dict = {}
    optim_sd: dict = {}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model_sd.update(_model_state(part))
        optim_sd.update(get_optimizer_state_dict(part, optimizer, options=_FLAT))
    return {"model": model_sd, "optim": optim_sd}
