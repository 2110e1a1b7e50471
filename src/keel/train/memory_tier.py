"""The memory tier's saves (keel.checkpoint.memory): every `checkpoint.memory_interval` steps the state is copied
into this node's shared memory, in the background as a storage save is. A save in flight is finished before
anything replaces the state it copies (a rollback, a pause, a stop), and after a rollback the copies of the
steps it abandoned are retired, so that no restart restores them."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from keel.checkpoint.manager import CheckpointManager, SaveOutcome
from keel.core.callbacks import Step
from keel.core.state import TrainState
from keel.monitor.run_monitor import RunMonitor
from keel.rundir.events import EventLog
from keel.train.components import Builtin, CheckpointWriter

ENDS_OR_REPLACES = ("pause", "rollback", "quarantine", "stop")  # actions after which the live state is not the next


class MemoryCheckpoints(Builtin):
    """Saves to the memory tier on its interval, at the steps the storage tier saves too: a restart then finds
    the newest step in memory and reads no storage."""

    priority = 58  # after the storage writer; its carry_out before the stop's and the recovery's

    def __init__(self, writer: CheckpointManager, interval: int, parts: list[nn.Module], optimizers: list[Optimizer],
                 monitor: RunMonitor, events: EventLog) -> None:
        self.writer, self.interval, self.parts, self.optimizers = writer, interval, parts, optimizers
        self.monitor, self.events = monitor, events
        self.rolled_back = False

    def on_step_end(self, step: Step) -> None:
        if step.save_waits or step.state.step % self.interval:  # the last step's or a pause's save: the job ends
            return
        for outcome in self.writer.save(self.parts, self.optimizers, step.state):
            self._published(outcome)

    def carry_out(self, step: Step) -> int | None:
        action = step.action
        if action.kind in ENDS_OR_REPLACES:
            self._finish()
            self.rolled_back = action.rolls_back
        if action.kind == "quarantine":  # a rank computed wrong: no copy since the last check is trusted
            self.writer.retire_after(-1, self.events, step.state.step)
        return None

    def before_step(self, state: TrainState) -> None:
        """The first step after a rollback: what the memory tier holds of the abandoned steps goes."""
        if self.rolled_back:
            self.rolled_back = False
            self.writer.retire_after(state.step, self.events, state.step)

    def on_end(self, state: TrainState) -> None:
        self._finish()

    def _finish(self) -> None:
        if (outcome := self.writer.finish()) is not None:
            self._published(outcome)

    def _published(self, outcome: SaveOutcome) -> None:
        """A finished save's figures (its failure, if it failed, is an event and an alert of the writer's)."""
        if outcome.committed:
            self.monitor.publish({"step": outcome.step, "checkpoint/memory_step": outcome.step,
                                  "checkpoint/memory_blocking_s": outcome.blocking_s,
                                  "checkpoint/memory_write_s": outcome.write_s,
                                  "checkpoint/memory_waited_s": outcome.waited_s})


def memory_checkpoints(storage_writer: CheckpointWriter) -> list[MemoryCheckpoints]:
    """The component, where the run has a memory tier: it saves the state the storage writer saves."""
    w, ckpt = storage_writer, storage_writer.ckpt
    if ckpt.manager.memory_writer is None:
        return []
    return [MemoryCheckpoints(ckpt.manager.memory_writer, ckpt.cfg.memory_interval, w.parts, w.optimizers,
                              ckpt.monitor, ckpt.events)]
