"""The guards of a run and what their decisions do: skip, roll back, stop, quarantine.

The loop asks twice per step. `inspect` runs after the backward, on the step report: the numerics and
spike guards, users' guards (callbacks with an `inspect` method) and, when due, the step replay. `check`
runs after the update: the replica fingerprints when due, then the in-memory snapshot when due. The
strongest action wins. Every input to a decision is reduced or gathered over all ranks, so every rank
takes the same branch. Each decision is an event with its evidence and a counter in the metrics.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from keel.checkpoint.manager import CheckpointManager
from keel.checkpoint.manifest import committed, step_of
from keel.config import Config
from keel.core.actions import CONTINUE, Action, strongest
from keel.core.state import TrainState
from keel.core.sync import StepReport
from keel.data.loader import GlobalOrderLoader
from keel.errors import EXIT_GUARD_STOP, EXIT_QUARANTINE
from keel.guard.numerics import NumericsGuard
from keel.guard.sdc import SdcGuard
from keel.guard.snapshots import SnapshotRing
from keel.guard.spike import SpikeGuard
from keel.parallel.mesh import Mesh
from keel.rundir.events import EventLog, host
from keel.rundir.quarantine import add_to_quarantine


class GuardStop(Exception):
    """A guard stopped the run, or a rollback found no state to go back to."""


class Guards:
    def __init__(self, cfg: Config, mesh: Mesh, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer],
                 params: list[torch.nn.Parameter], loader: GlobalOrderLoader, manager: CheckpointManager,
                 user_guards: list[Any], events: EventLog, say: Callable[[str], None], run_dir: Path) -> None:
        self.cfg, self.g = cfg, cfg.guard
        self.parts, self.optimizers, self.loader, self.manager = parts, optimizers, loader, manager
        self.events, self.say, self.run_dir = events, say, run_dir
        self.rank0 = dist.get_rank() == 0
        on = self.g.enabled
        self.builtin: list[NumericsGuard | SpikeGuard] = [NumericsGuard(self.g), SpikeGuard(self.g)] if on else []
        self.guards: list[Any] = [*self.builtin, *user_guards]  # users' guards keep their state as callbacks
        self.sdc = SdcGuard(self.g, mesh, optimizers, params, cfg.train.deterministic) if on else None
        if on and not cfg.train.deterministic:
            say("note: step replays are off: with train.deterministic = false a recomputed step may differ by rounding")
        self.ring = (SnapshotRing(optimizers, self.g.snapshots, pin_memory=torch.cuda.is_available())
                     if on and self.g.snapshot_interval else None)
        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, host())
        self.hosts: list[str] = hosts
        self.counts: Counter[str] = Counter()
        self.lr_scale, self.lr_scale_until = 1.0, 0
        self.rollback_steps: list[int] = []  # steps where data rollbacks happened, for escalation
        self.snapshot_s = 0.0

    @property
    def reporting(self) -> bool:
        """Whether every step needs the report (otherwise only logged steps reduce one)."""
        return bool(self.guards)

    def lr_factor(self, step: int) -> float:
        return self.lr_scale if step < self.lr_scale_until else 1.0

    # ------------------------------------------------------------ the two questions of a step

    def begin(self, state: TrainState) -> None:
        """At the start (fresh or resumed): the state is trusted, and the first snapshot is taken."""
        if self.sdc is not None:
            self.sdc.last_verified = max(self.sdc.last_verified, state.step)
        if self.ring is not None:
            self._snapshot(state)

    def inspect(self, state: TrainState, report: StepReport,
                recompute: Callable[[], tuple[torch.Tensor, list]]) -> Action:
        actions = [self._escalate(guard.inspect(report), report.step) for guard in self.guards]
        for action in actions:
            if action is not None and action.reason:
                self._record(action, report.step)
        if self.sdc is not None:
            self.sdc.record(report)
            fired = any(a is not None and a.kind != "continue" for a in actions)
            found: list[Action | None] = []
            if self.sdc.wants_replay(report.step, fired):
                self.counts["sdc_replays"] += 1
                found.append(self.sdc.replay(report, recompute))
            if fired and self.sdc.group is not None:  # is the trouble in a corrupted replica, not in the data?
                self.counts["sdc_checks"] += 1
                found.append(self.sdc.check(report.step - 1))
            if any(found):  # corruption explains what the other guards saw: its response replaces theirs
                actions = found
                self.rollback_steps = [s for s in self.rollback_steps if s != report.step]
                for action in found:
                    if action is not None:
                        self._record(action, report.step)
        return strongest(actions)

    def check(self, state: TrainState, save_due: bool) -> Action:
        """After the update of `state.step`."""
        action = CONTINUE
        if self.sdc is not None and self.sdc.wants_check(state.step, save_due):
            self.counts["sdc_checks"] += 1
            action = self.sdc.check(state.step) or CONTINUE
            if action.reason:
                self._record(action, state.step)
        if action is CONTINUE and self.ring is not None and state.step % self.g.snapshot_interval == 0:
            self._snapshot(state)
        return action

    def _escalate(self, action: Action | None, step: int) -> Action | None:
        """A data rollback at the place of an earlier one doubles the skip; too many stop the run."""
        if action is None or action.kind != "rollback" or not action.skip_batches:
            return action
        recent = [s for s in self.rollback_steps if step - s <= self.g.spike.window]
        if len(recent) >= self.g.max_rollbacks:
            return Action("stop", action.guard, f"{len(recent)} rollbacks within {self.g.spike.window} steps (at "
                          f"steps {', '.join(map(str, recent))}) did not clear it: {action.reason}",
                          {**action.evidence, "rollbacks_at": recent})
        self.rollback_steps.append(step)
        return dataclasses.replace(action, skip_batches=action.skip_batches * 2 ** len(recent),
                                   evidence={**action.evidence, "repeat": len(recent)})

    # ------------------------------------------------------------ doing what was decided

    def apply(self, action: Action, state: TrainState) -> tuple[TrainState, int | None]:
        """Carry out a rollback, stop or quarantine (skips are the loop's). Returns the state to go on
        from, and an exit code when the run must end."""
        if action.kind == "quarantine" and action.ranks:
            self._quarantine(action, state.step)
            if self.g.sdc.response == "exit":
                verified = self.sdc.last_verified if self.sdc is not None else state.step
                self.manager.retire_after(verified, self.events, state.step)
                self.say(f"error: rank(s) {', '.join(map(str, action.ranks))} computed wrong ({action.reason}); "
                         f"exiting with code {EXIT_QUARANTINE} so that the launcher restarts without their node")
                return state, EXIT_QUARANTINE
        if action.kind == "stop":
            self.say(f"error: guard {action.guard} stopped the run at step {state.step}: {action.reason}. "
                     f"Details in events.jsonl; the newest checkpoint is {self.manager.latest()}")
            return state, EXIT_GUARD_STOP
        if action.rolls_back:
            try:
                state = self._roll_back(action, state)
            except GuardStop as e:
                self.say(f"error: {e}")
                if self.rank0:
                    self.events.emit("guard", state.step, "stop", guard=action.guard, reason=str(e))
                return state, EXIT_GUARD_STOP
        return state, None

    def _roll_back(self, action: Action, state: TrainState) -> TrainState:
        target = max(0, action.to_step)
        if action.verified_only and self.sdc is not None:
            target = min(target, self.sdc.last_verified)
        batch_now = self.loader.cursor // self.loader.global_batch - 1  # the batch of the step being undone
        snapshot = self.ring.newest(target) if self.ring is not None else None
        # The newest state at or before the target wins: a checkpoint newer than every snapshot in reach
        # (snapshots rarer than checkpoints) is read from storage rather than going back further.
        on_disk = max((step_of(n) for n in committed(self.manager.storage) if step_of(n) <= target), default=-1)
        if snapshot is not None and snapshot.step >= on_disk:
            saved = self.ring.restore(snapshot)
            restored = TrainState.from_dict(saved["train"])
            self.loader.load_state_dict(saved["loader"], allow_corpus_change=True)
            source = f"the in-memory snapshot of step {snapshot.step}"
        else:
            restored, source = self._from_disk(target)
        # The guards' histories go back with the state (a spike is judged against the steps before it);
        # what counts rollbacks and suspects does not.
        for guard in self.builtin:
            guard.load_state_dict(restored.guards.get("guards", {}).get(guard.name, {}))
        if self.sdc is not None:
            self.sdc.rolled_back(restored.step)
        retired = self.manager.retire_after(restored.step, self.events, state.step)
        skipped: list[int] = []
        if action.skip_batches:
            first = self.loader.cursor // self.loader.global_batch
            skipped = [first, max(first + action.skip_batches, batch_now + 1)]
            self.loader.skip(*skipped)
        if action.lr_scale != 1.0 and action.lr_scale_steps:
            self.lr_scale, self.lr_scale_until = action.lr_scale, restored.step + action.lr_scale_steps
        restored.train_seconds, restored.interruptions = state.train_seconds, state.interruptions
        self.counts["rollbacks"] += 1
        if self.rank0:
            self.events.emit("guard", state.step, "rolled_back", guard=action.guard, to_step=restored.step,
                             source=source, skipped_batches=skipped, retired_checkpoints=retired,
                             lr_scale=self.lr_scale if self.lr_scale_until > restored.step else 1.0)
        self.say(f"rolled back from step {state.step} to step {restored.step} ({source})"
                 + (f", skipping global batches {skipped[0]}..{skipped[1] - 1}" if skipped else ""))
        return restored

    def _from_disk(self, target: int) -> tuple[TrainState, str]:
        storage = self.manager.storage
        names = [n for n in committed(storage) if step_of(n) <= target]
        if not names:
            raise GuardStop(f"no state at or before step {target} to roll back to (the in-memory snapshots reach "
                            f"back to step {self.ring.snapshots[0].step if self.ring and self.ring.snapshots else '-'}"
                            f", no checkpoint is older); raise guard.snapshots or lower guard.rollback_steps")
        restored, path = self.manager.restore(self.parts, self.optimizers, storage.path(names[-1]), self.say)
        self.loader.load_state_dict(restored.loader, allow_corpus_change=True)
        return restored, f"checkpoint {path}"

    def _snapshot(self, state: TrainState) -> None:
        started = time.perf_counter()
        state.guards = self.state_dict()
        self.ring.take(state.step, {"train": state.to_dict(), "loader": self.loader.state_dict()})
        self.snapshot_s = time.perf_counter() - started

    def _quarantine(self, action: Action, step: int) -> None:
        hosts = [self.hosts[r] for r in action.ranks]
        self.counts["quarantines"] += 1
        if not self.rank0:
            return
        add_to_quarantine(self.run_dir, hosts, source=f"guard.{action.guard}", reason=action.reason, step=step,
                          ranks=list(action.ranks), evidence=action.evidence)
        self.events.emit("alert", step, "sdc_suspect", severity="critical",
                         message=f"rank(s) {', '.join(map(str, action.ranks))} on {', '.join(hosts)} "
                                 f"suspected of silent data corruption: {action.reason}")

    def _record(self, action: Action, step: int) -> None:
        self.counts[f"{action.guard}_{action.kind}"] += 1
        if self.rank0:
            named = {"ranks": list(action.ranks)} if action.kind == "quarantine" else {}
            self.events.emit("guard", step, action.kind, guard=action.guard, reason=action.reason,
                             **{**action.evidence, **named})

    # ------------------------------------------------------------ metrics and state

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"guard/{name}_total": n for name, n in sorted(self.counts.items())}
        if self.sdc is not None:
            out.update({"guard/fingerprint_s": self.sdc.check_s, "guard/replay_s": self.sdc.replay_s,
                        "guard/last_verified_step": self.sdc.last_verified})
        if self.ring is not None:
            out["guard/snapshot_s"] = self.snapshot_s
        return out

    def state_dict(self) -> dict:
        return {"guards": {g.name: g.state_dict() for g in self.builtin},
                "sdc": self.sdc.state_dict() if self.sdc is not None else {},
                "counts": dict(self.counts), "lr_scale": self.lr_scale, "lr_scale_until": self.lr_scale_until,
                "rollback_steps": self.rollback_steps}

    def load_state_dict(self, state: dict) -> None:
        for g in self.builtin:
            if g.name in state.get("guards", {}):
                g.load_state_dict(state["guards"][g.name])
        if self.sdc is not None and state.get("sdc"):
            self.sdc.load_state_dict(state["sdc"])
        self.counts = Counter(state.get("counts", {}))
        self.lr_scale, self.lr_scale_until = state.get("lr_scale", 1.0), state.get("lr_scale_until", 0)
        self.rollback_steps = state.get("rollback_steps", [])
