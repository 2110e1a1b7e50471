"""The built-in features of a training run, each a component on the callback contract with one job.

Each declares where its hooks run among the others (`priority`, higher first: keel.core.callbacks), so that
the order is the components' own and not a list's; tests/unit/train/test_component_order.py pins the
resulting order of a built run's components.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist

from keel.checkpoint.interval import IntervalPolicy
from keel.checkpoint.manager import CheckpointManager, SaveOutcome
from keel.config import CheckpointConfig
from keel.core.actions import Action
from keel.core.callbacks import Callback, Step
from keel.core.state import TrainState
from keel.core.sync import StepSync
from keel.data.loader import GlobalOrderLoader
from keel.data.tokenizer import bits_per_byte
from keel.errors import StorageError
from keel.guard.engine import AT_REST, Guards
from keel.health.signals import StopRequests
from keel.health.straggler import StragglerDetector
from keel.health.watchdog import Watchdog
from keel.monitor.metrics import CommProfiler, MemoryMeter, StepMeter
from keel.monitor.run_monitor import RunMonitor
from keel.rundir.events import EventLog
from keel.rundir.progress import Progress
from keel.train.optim import update_norm_sq
from keel.train.step import Stepper

OVERDUE_FLOOR_S = 60.0


class Builtin(Callback):
    builtin = True  # saved under its own name in the train state, not with the configured callbacks


class Metering(Builtin):
    """Every step: the data wait, the goodput ledger's step marks, the communication profile, throughput."""
    priority = 170  # first: the step's clock and ledger marks

    def __init__(self, monitor: RunMonitor, meter: StepMeter, comm: CommProfiler) -> None:
        self.monitor, self.meter, self.comm = monitor, meter, comm
        self.profiling: AbstractContextManager | None = None
        self.since_log = 0  # steps made since the last logged one

    def on_step_start(self, step: Step) -> None:
        self._stop_profile()  # a step abandoned by a rollback left it open
        self.monitor.ledger.begin_step(step.number)
        self.monitor.ledger.spent("productive")

    def on_batch(self, step: Step) -> None:
        self.monitor.ledger.spent("data_wait")
        self.monitor.registry.add("time/data_s", step.data_s)
        self.meter.add_data_wait(step.data_s)
        self.profiling = self.comm.profile(step.number)
        self.profiling.__enter__()

    def after_backward(self, step: Step) -> None:
        self.monitor.registry.add("time/forward_backward_s", step.compute_s)

    def on_step_end(self, step: Step) -> None:
        self._stop_profile()
        self.monitor.registry.add("time/optimizer_s", step.update_s)
        self.meter.step_done()
        self.monitor.step_done(step.state.step)
        self.since_log += 1
        step.metrics.update({"step": step.state.step, "optim/lr": step.lr})

    def _stop_profile(self) -> None:
        if self.profiling is not None:
            self.profiling.__exit__(None, None, None)
            self.profiling = None


class GuardInspection(Builtin):
    """After the backward: the guards' verdict on the step report (and the learning-rate scale they set)."""
    priority = 140  # after the signals it may read, before anything acts on the step

    def __init__(self, guards: Guards, monitor: RunMonitor, stepper: Stepper,
                 replayed: Callable[[Step], None], sync: StepSync) -> None:
        self.guards, self.monitor, self.stepper, self.replayed = guards, monitor, stepper, replayed
        self.seconds = 0.0
        self.number = 0  # the step being made
        stepper.before_step = guards.before_update
        if (sdc := guards.sdc) is not None and sdc.at_rest_interval:  # the state checked where it rests
            sync.contribute_on_device(AT_REST, lambda device: sdc.changed_at_rest(self.number, device))

    def on_step_start(self, step: Step) -> None:
        self.number = step.number
        step.lr *= self.guards.lr_factor(step.state.step)

    def after_backward(self, step: Step) -> Action | None:
        assert step.report is not None
        with self.monitor.phase("guard_checks") as inspecting:
            action = None
            if self.guards.reporting:
                replay = partial(self.stepper.recompute, step.micro_batches, partial(self.replayed, step))
                action = self.guards.inspect(step.state, step.report, replay)
        self.seconds = inspecting.seconds
        return action


class GuardCheck(Builtin):
    """After the update: the replica fingerprints, the instability signals of this step (`signals(step)`, empty
    when it computed none) and the in-memory snapshot, when due."""
    priority = 70  # after evaluation, before the writer: fingerprints before a save

    def __init__(self, guards: Guards, monitor: RunMonitor, inspection: GuardInspection,
                 signals: Callable[[int], dict[str, float]]) -> None:
        self.guards, self.monitor, self.inspection, self.signals = guards, monitor, inspection, signals

    def on_step_end(self, step: Step) -> Action | None:
        with self.monitor.phase("guard_checks") as checking:
            # replica fingerprints before the state is saved or snapshotted
            action = self.guards.check(step.state, step.save_due, self.signals(step.number))
        self.monitor.registry.add("time/guard_s", self.inspection.seconds + checking.seconds)
        return action


class PauseRequests(Builtin):
    """A pause asked on any rank (a signal, `keel pause`), or a straggler's node to leave: every rank
    pauses at the same step, after its checkpoint."""
    priority = 130  # before the checkpoint decision, which saves before a pause

    def __init__(self, requests: StopRequests, straggler: StragglerDetector, sync: StepSync) -> None:
        self.requests, self.straggler = requests, straggler
        self.asked, self.leave = 0.0, False
        sync.contribute("pause/asked", lambda: float(requests.pending()))

    def on_backward(self, step: Step, replaying: bool) -> None:
        if not replaying and self.straggler.due(step.number):
            self.straggler.settle()  # the step's own time is the device's, not the host's queueing

    def on_step_end(self, step: Step) -> Action | None:
        assert step.report is not None
        number = step.state.step
        self.leave = self.straggler.due(number) and self.straggler.observe(number, step.own_s)
        self.asked = step.report.values["pause/asked"]
        if self.asked > 0 or self.leave:  # every rank sees the same sum: all stop at this step
            return Action("pause", "health", self.requests.reason() or "asked on another rank")
        return None


@dataclass
class Checkpointing:
    """What the checkpoint decision and the writer share: the manager, the interval policy, the save
    bookkeeping."""

    cfg: CheckpointConfig
    manager: CheckpointManager
    policy: IntervalPolicy
    monitor: RunMonitor
    events: EventLog
    say: Progress
    state: TrainState
    notify: Callable[..., None]  # the hooks' on_checkpoint_saved / on_checkpoint_failed
    status: Callable[..., None]
    rank0: bool
    writer: Callable[[], bool] = lambda: True  # whether this rank's group writes the run's checkpoints
    last_save: float = 0.0
    final_saved: bool = True
    volume_refused: bool = False  # the last save failed because the volume refused it (ENOSPC, EROFS, ...)

    def after_save(self, outcome: SaveOutcome, final: bool = False) -> None:
        """Every rank handles the same outcome at the same step; `final`: the last step's save, which no later
        save retries."""
        state = self.state
        self.final_saved, self.volume_refused = outcome.committed, bool(outcome.volume_error)
        if outcome.committed:
            self.monitor.checkpoint_committed()
            self.say(f"checkpoint {outcome.path} committed: {outcome.bytes / 2**20:.1f} MiB, training blocked "
                     f"{outcome.blocking_s:.3f} s, written in the background in {outcome.write_s:.2f} s")
            self.notify("on_checkpoint_saved", state, outcome.path)
            self.status("running")
        elif outcome.volume_error and self.cfg.on_storage_error == "stop":
            self.status("stopped", reason=outcome.error)
            raise StorageError(f"the checkpoint of step {outcome.step} failed: {outcome.error}; stopped "
                               f"(checkpoint.on_storage_error = \"stop\"), the newest checkpoint is "
                               f"{self.manager.latest()}", every_rank=True)
        else:
            then = "" if final else "; training continues, the next save retries"
            self.say(f"warning: the checkpoint of step {outcome.step} failed ({outcome.error}){then}")
            self.notify("on_checkpoint_failed", state, outcome.step, outcome.error)
        if self.rank0 and outcome.waited_s > 0.01:
            self.events.emit("checkpoint", state.step, "waited", waited_s=round(outcome.waited_s, 3),
                             reason=f"the save of step {outcome.step} was still being written")
        self.monitor.publish({"step": state.step, "checkpoint/blocking_s": outcome.blocking_s,
                              "checkpoint/write_s": outcome.write_s, "checkpoint/waited_s": outcome.waited_s})
        decision = self.policy.update(outcome.blocking_s, outcome.train_s, state.interruptions)
        if decision and self.rank0:
            self.events.emit("checkpoint", state.step, "interval", **decision)
            self.say(f"checkpoint interval (Young/Daly): every {decision['interval_s']:.1f} s of training for a "
                     f"blocking cost of {decision['delta_s']:.3f} s and a mean time between failures of "
                     f"{decision['mtbf_s']:.0f} s")

    def finish(self) -> None:
        """Wait for the save in flight, if any, and handle its outcome."""
        outcome = self.manager.finish()
        if outcome is not None:
            self.after_save(outcome)

    def seconds_since_save(self, report_values: dict[str, float]) -> float:
        return report_values["checkpoint/since_save_s"] / dist.get_world_size()


class CheckpointDecision(Builtin):
    """Each step: a background save that finished everywhere is handled, and the step's checkpoint decided, for
    the writer, the guards and the stop to read from the step: whether it saves (every `checkpoint.interval` steps
    or seconds, at the last step, before a pause) and whether the save is written to the end before the step
    ends (the last step, before a pause)."""
    priority = 120  # before the metrics and the guards' check, which read save_due

    def __init__(self, ckpt: Checkpointing, sync: StepSync) -> None:
        self.ckpt = ckpt
        sync.contribute("checkpoint/done", lambda: float(ckpt.manager.done()))
        sync.contribute("checkpoint/since_save_s", lambda: time.perf_counter() - ckpt.last_save)

    def on_step_end(self, step: Step) -> None:
        assert step.report is not None
        values, policy = step.report.values, self.ckpt.policy
        if values["checkpoint/done"] == dist.get_world_size():
            self.ckpt.after_save(self.ckpt.manager.finish())  # type: ignore[arg-type]
        ending = step.last or step.action.kind == "pause"
        step.save_due = self.ckpt.writer() and (ending or policy.due_by_step(step.state.step) or
                                                policy.due_by_time(self.ckpt.seconds_since_save(values)))
        step.save_waits = step.save_due and ending


class CheckpointWriter(Builtin):
    """Writes the checkpoint the decision asked for (synchronously at the last step and before a pause)."""
    priority = 60

    def __init__(self, ckpt: Checkpointing, parts: list, optimizers: list, watchdog: Watchdog) -> None:
        self.ckpt, self.parts, self.optimizers, self.watchdog = ckpt, parts, optimizers, watchdog
        self.started = time.perf_counter()

        self.saved_step = -1  # the step of the last save started

    def on_start(self, state: TrainState) -> None:
        self.started = self.ckpt.last_save = time.perf_counter()

    def on_step_end(self, step: Step) -> None:
        seconds = self.save(step, wait=step.save_waits) if step.save_due else 0.0
        self.ckpt.monitor.registry.add("time/checkpoint_s", seconds)  # a step's mean share

    def save(self, step: Step, wait: bool) -> float:
        """Save the state of `step` (to the end, with `wait`); returns the seconds training was blocked."""
        ckpt, state = self.ckpt, step.state
        state.train_seconds += time.perf_counter() - self.started
        self.started = time.perf_counter()
        self.watchdog.begin("checkpoint", state.step)
        with ckpt.monitor.phase("checkpoint_blocking", whole_step=False) as saving:
            for outcome in ckpt.manager.save(self.parts, self.optimizers, state, wait=wait):
                ckpt.after_save(outcome, final=step.last and outcome.step == state.step)
        self.watchdog.end()
        self.saved_step, ckpt.last_save = state.step, time.perf_counter()
        ckpt.monitor.ledger.flush(state.step)
        return saving.seconds


class IntervalMetrics(Builtin):
    """Every `monitor.interval` steps (registered with that frequency): the interval's one reduction of
    every metric, published to the sinks, the alert rules and the console."""
    priority = 110

    def __init__(self, steps: int, monitor: RunMonitor, metering: Metering, loader: GlobalOrderLoader,
                 optimizers: list, pp: int, ckpt: Checkpointing, sources: list[Callable[[], dict[str, float]]],
                 train_text: tuple[int, int], status: Callable[..., None], memory: MemoryMeter) -> None:
        self.steps, self.monitor, self.metering, self.loader = steps, monitor, metering, loader
        self.optimizers, self.pp = optimizers, pp
        self.train_loss = float("nan")
        self.ckpt, self.sources, self.train_text, self.status, self.memory = ckpt, sources, train_text, status, memory

    def on_step_end(self, step: Step) -> None:
        assert step.report is not None
        state, report, registry = step.state, step.report, self.monitor.registry
        registry.add("optim/update_norm_sq", update_norm_sq(self.optimizers, self.pp) * step.updated,
                     reduce="sum")
        peak, above_runtime = self.memory.peaks()
        registry.add("memory/peak_bytes_max_rank", peak, reduce="max")
        registry.add("memory/above_runtime_bytes_max_rank", above_runtime, reduce="max")
        reduced = registry.reduce()  # the interval's one reduction of every metric
        report.update_norm = reduced.pop("optim/update_norm_sq") ** 0.5
        step.metrics.update({"train/loss": report.loss, "train/bpb": bits_per_byte(report.loss, *self.train_text),
                             **{f"data/tokens/{name}": n for name, n in self.loader.tokens_by_source().items()},
                             "optim/grad_norm": report.grad_norm, "optim/update_norm": report.update_norm,
                             "train/tokens_seen": state.tokens_seen, **self.metering.meter.window(), **reduced,
                             **{k: v for source in self.sources for k, v in source().items()}})
        # The seconds between checkpoints the overdue alert expects: a few seconds of jitter (an eval, a
        # rollback) is no overdue checkpoint, so never less than OVERDUE_FLOOR_S.
        policy = self.ckpt.policy
        expected_s = max(OVERDUE_FLOOR_S, policy.every_s if policy.every_s < float("inf") else
                         self.ckpt.cfg.interval * step.metrics["time/step_s"])
        self.monitor.interval(step.metrics, self.metering.since_log, self.ckpt.seconds_since_save(report.values),
                              expected_s)
        self.metering.since_log = 0
        self.train_loss = report.loss
        self.monitor.log.say.step(state.step, self.steps, step.metrics)
        self.status("running")
