"""Carrying out what the guards decided: roll back to an in-memory snapshot or a checkpoint, stop, or
quarantine a rank (keel.guard decides; this module acts). Every rank acts on the same action."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from torch import nn
from torch.optim import Optimizer

from keel.checkpoint.manager import CheckpointManager
from keel.checkpoint.manifest import checkpoint_step, committed
from keel.core.actions import Action
from keel.core.callbacks import Step
from keel.core.state import TrainState
from keel.data.loader import GlobalOrderLoader
from keel.errors import EXIT_GUARD_STOP, EXIT_QUARANTINE
from keel.guard.engine import Guards
from keel.monitor.run_monitor import RunMonitor
from keel.rundir.events import EventLog
from keel.rundir.quarantine import add_to_quarantine
from keel.train.components import Builtin, Checkpointing


class NothingToRollBackTo(Exception):
    """A rollback found no state at or before its target."""


@dataclasses.dataclass
class Recovery(Builtin):
    """Carries out a rollback, a stop or a quarantine once the step's hooks have run (after the save in flight
    has finished), and accounts its time to the goodput ledger."""

    priority = 45  # carry_out only: after the stop, which carries out a late pause
    guards: Guards
    manager: CheckpointManager
    loader: GlobalOrderLoader
    parts: list[nn.Module]
    optimizers: list[Optimizer]
    state: TrainState
    hosts: list[str]
    events: EventLog
    say: Callable[[str], None]
    run_dir: Path
    rank0: bool
    checkpointing: Checkpointing
    monitor: RunMonitor
    status: Callable[..., None]
    writer: Callable[[], bool] = lambda: True  # whether this rank's group writes (and retires) the checkpoints

    def on_checkpoint_loaded(self, state: TrainState, path: str) -> None:
        """A resume that changed what defines the run on purpose (`--accept-change`): the guards judge the steps
        after the change only, and no rollback goes behind it."""
        if state.step <= self.manager.defined_since:
            self.guards.forget_histories()

    def carry_out(self, step: Step) -> int | None:
        action = step.action
        if not action.carried_out:
            return None
        self.checkpointing.finish()
        self.monitor.ledger.spent("productive")
        code = self.act(action)
        code = code if action.exit_code is None else action.exit_code  # the code the asker gave wins
        self.monitor.ledger.charge("checkpoint_restore" if action.rolls_back else "guard_checks")
        if code is not None:
            self.status("stopped" if code in (EXIT_GUARD_STOP, EXIT_QUARANTINE) else "failed", reason=action.reason)
        return code

    def act(self, action: Action) -> int | None:
        """A rollback, stop or quarantine (skips are the loop's). Returns an exit code when the run ends."""
        state = self.state
        if action.kind == "quarantine" and action.ranks:
            self._quarantine(action, state.step)
            if self.guards.g.sdc.response == "exit":
                sdc = self.guards.sdc
                verified = sdc.last_verified if sdc is not None else state.step
                self.manager.retire_after(verified, self.events, state.step)
                self.say(f"error: rank(s) {', '.join(map(str, action.ranks))} computed wrong ({action.reason}); "
                         f"exiting with code {EXIT_QUARANTINE} so that the launcher restarts without their node")
                return EXIT_QUARANTINE
        if action.kind == "stop":
            if action.to_step is not None:  # the steps after it are abandoned: their checkpoints may hold the fault
                self.manager.retire_after(action.to_step, self.events, state.step, remove=self.writer())
            if action.exit_code is None:  # an asker that gives its own code has said why
                self.say(f"error: guard {action.guard} stopped the run at step {state.step}: {action.reason}. "
                         f"Details in events.jsonl; the newest checkpoint is {self.manager.latest()}")
            return EXIT_GUARD_STOP
        if action.rolls_back:
            try:
                self._roll_back(action)
            except NothingToRollBackTo as e:
                self.say(f"error: {e}")
                if self.rank0:
                    self.events.emit("guard", state.step, "stop", guard=action.guard, reason=str(e))
                return EXIT_GUARD_STOP
        return None

    def _roll_back(self, action: Action) -> None:
        state, guards, loader = self.state, self.guards, self.loader
        now, train_seconds, interruptions = state.step, state.train_seconds, state.interruptions
        target = max(0, action.to_step or 0)
        if action.verified_only and guards.sdc is not None:
            target = min(target, guards.sdc.last_verified)
        target = max(target, self.manager.defined_since)  # the states before a change belong to another run
        batch_now = loader.cursor // loader.global_batch - 1  # the batch of the step being undone
        snapshot = guards.ring.newest(target) if guards.ring is not None else None
        # The newest state at or before the target wins: a checkpoint newer than every snapshot in reach
        # (snapshots rarer than checkpoints) is read from storage rather than going back further.
        on_disk = max((s for s in map(checkpoint_step, committed(self.manager.storage)) if s <= target), default=-1)
        if snapshot is not None and guards.ring is not None and snapshot.step >= on_disk:
            record = guards.ring.restore(snapshot)["train"]
            source = f"the in-memory snapshot of step {snapshot.step}"
        else:
            record, source = self._from_disk(target)
        # The data cursor, the experts' selection biases and the guards' histories go back with the state (a spike
        # is judged against the steps before it); what counts rollbacks, suspects, restarts and time does not.
        state.load(record, only=("loader", "experts"))
        if guards.ring is not None:  # after a checkpoint's state, the snapshots of the steps abandoned go too
            guards.ring.forget_after(state.step)
        # A state of the step of a change holds histories gathered before it: they start afresh.
        guards.rolled_back(record.get("guards", {}) if state.step > self.manager.defined_since else {}, state.step)
        state.train_seconds, state.interruptions = train_seconds, interruptions
        retired = self.manager.retire_after(state.step, self.events, now, remove=self.writer())
        skipped: list[int] = []
        if action.skip_batches:
            first = loader.cursor // loader.global_batch
            skipped = [first, max(first + action.skip_batches, batch_now + 1)]
            loader.skip(*skipped)
        if action.lr_scale != 1.0 and action.lr_scale_steps:
            guards.lr_scale, guards.lr_scale_until = action.lr_scale, state.step + action.lr_scale_steps
        guards.counts["rollbacks"] += 1
        if self.rank0:
            self.events.emit("guard", now, "rolled_back", guard=action.guard, to_step=state.step,
                             source=source, skipped_batches=skipped, retired_checkpoints=retired,
                             lr_scale=guards.lr_scale if guards.lr_scale_until > state.step else 1.0)
        self.say(f"rolled back from step {now} to step {state.step} ({source})"
                 + (f", skipping global batches {skipped[0]}..{skipped[1] - 1}" if skipped else ""))

    def _from_disk(self, target: int) -> tuple[dict, str]:
        storage, ring = self.manager.storage, self.guards.ring
        names = [n for n in committed(storage) if checkpoint_step(n) <= target]
        if not names:
            raise NothingToRollBackTo(
                f"no state at or before step {target} to roll back to (the in-memory snapshots reach back to step "
                f"{ring.snapshots[0].step if ring and ring.snapshots else '-'}, no checkpoint is older); raise "
                f"guard.snapshots or lower guard.rollback_steps")
        restored = self.manager.restore(self.parts, self.optimizers, storage.path(names[-1]), self.say)
        assert restored is not None  # a path given: it loads or raises
        saved, path = restored
        return saved.record, f"checkpoint {path}"

    def _quarantine(self, action: Action, step: int) -> None:
        hosts = [self.hosts[r] for r in action.ranks]
        self.guards.counts["quarantines"] += 1
        if not self.rank0:
            return
        add_to_quarantine(self.run_dir, hosts, source=f"guard.{action.guard}", reason=action.reason, step=step,
                          ranks=list(action.ranks), evidence=action.evidence)
        self.events.emit("alert", step, "sdc_suspect", severity="critical",
                         message=f"rank(s) {', '.join(map(str, action.ranks))} on {', '.join(hosts)} "
                                 f"suspected of silent data corruption: {action.reason}")
