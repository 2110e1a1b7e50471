"""A ring of in-memory snapshots of the train state, so that a rollback reads no storage.

Every `snapshot_interval` steps this rank copies its parameter shards, its optimizer state, the host
train state, the data cursor and its RNG streams into host buffers that are allocated once per slot
and reused (pinned, with non-blocking copies, on CUDA). Restoring copies them back in place. The ring
keeps the newest `count` snapshots, and besides them the one it is told to keep (the replica groups'
last verified state) until another is kept; a rollback further back falls back to a disk checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from keel.core.dtensor import local
from keel.core.state import rng_state, set_rng_state


def live_tensors(optimizers: list[torch.optim.Optimizer]) -> tuple[list[torch.Tensor], list[tuple[int, tuple]]]:
    """Every tensor the update changes, in a fixed order (each parameter, then its optimizer state),
    and for each parameter the names of the state entries it has (none before its first update)."""
    tensors: list[torch.Tensor] = []
    keys: list[tuple[int, tuple]] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                names = tuple(sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)))
                tensors += [local(p)] + [local(state[k]) for k in names]
                keys.append((len(keys), names))
    return tensors, keys


@dataclass
class Snapshot:
    step: int
    buffers: list[torch.Tensor]
    keys: list[tuple[int, tuple]]
    host: dict[str, Any] = field(default_factory=dict)  # train state, loader state, RNG


class SnapshotRing:
    def __init__(self, optimizers: list[torch.optim.Optimizer], count: int, pin_memory: bool) -> None:
        self.optimizers, self.count, self.pin_memory = optimizers, count, pin_memory
        self.snapshots: list[Snapshot] = []  # oldest first
        self.kept: int | None = None  # the step of the snapshot kept out of the rotation

    def take(self, step: int, host: dict[str, Any]) -> None:
        """Copy the live state into a slot: the snapshot of the same step, else the oldest one not kept once
        `count` of them are there, else a new one."""
        tensors, keys = live_tensors(self.optimizers)
        rotating = [s for s in self.snapshots if s.step != self.kept]
        same = [s for s in self.snapshots if s.step == step]
        slot = (same[0] if same else rotating[0] if len(rotating) >= self.count else Snapshot(step, [], keys))
        if slot in self.snapshots:
            self.snapshots.remove(slot)
        if [(b.shape, b.dtype) for b in slot.buffers] != [(t.shape, t.dtype) for t in tensors]:
            slot.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory) for t in tensors]
        for buffer, t in zip(slot.buffers, tensors, strict=True):
            buffer.copy_(t.detach(), non_blocking=self.pin_memory)
        slot.step, slot.keys = step, keys
        slot.host = copy.deepcopy({**host, "rng": rng_state()})
        self.snapshots = sorted([*self.snapshots, slot], key=lambda s: s.step)

    def keep(self, step: int) -> None:
        """Keep the snapshot of `step` out of the rotation until another is kept; the one kept before
        rotates again (dropped if the ring is full without it)."""
        if not self.has(step):
            raise ValueError(f"no snapshot of step {step} to keep (the ring holds {[s.step for s in self.snapshots]})")
        self.kept = step
        rotating = [s for s in self.snapshots if s.step != step]
        for dropped in rotating[:max(0, len(rotating) - self.count)]:
            self.snapshots.remove(dropped)

    def has(self, step: int) -> bool:
        return any(s.step == step for s in self.snapshots)

    def clear(self) -> None:
        self.snapshots, self.kept = [], None

    def forget_after(self, step: int) -> None:
        """The run went back to `step`: the snapshots of later steps are of abandoned steps. A kept one among
        them gives way to the newest left (an older state than a verified one was not corrupted either)."""
        self.snapshots = [s for s in self.snapshots if s.step <= step]
        if self.kept is not None and self.kept > step:
            self.kept = self.snapshots[-1].step if self.snapshots else None

    def newest(self, at_most: int) -> Snapshot | None:
        """The newest snapshot of a step <= `at_most`."""
        fitting = [s for s in self.snapshots if s.step <= at_most]
        return fitting[-1] if fitting else None

    def restore(self, snapshot: Snapshot) -> dict[str, Any]:
        """Put the snapshot's tensors and RNG back in place; returns its host state. Newer snapshots,
        of the abandoned steps, are dropped."""
        if self.pin_memory:
            torch.cuda.synchronize()  # the snapshot's non-blocking copies have landed
        tensors = self._tensors_shaped_like(snapshot)
        with torch.no_grad():
            for t, buffer in zip(tensors, snapshot.buffers, strict=True):
                t.copy_(buffer, non_blocking=self.pin_memory)
        set_rng_state(snapshot.host["rng"])
        self.forget_after(snapshot.step)
        return copy.deepcopy({k: v for k, v in snapshot.host.items() if k != "rng"})

    def _tensors_shaped_like(self, snapshot: Snapshot) -> list[torch.Tensor]:
        """The live tensors in the snapshot's order. A parameter that had not been updated at the
        snapshot loses its optimizer state, as it was then."""
        wanted = dict(snapshot.keys)
        index = 0
        out = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    names = wanted[index]
                    index += 1
                    state = optimizer.state.get(p, {})
                    if not names:
                        optimizer.state.pop(p, None)
                        out.append(local(p))
                        continue
                    out += [local(p)] + [local(state[k]) for k in names]
        return out
