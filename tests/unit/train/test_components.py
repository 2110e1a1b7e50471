"""Each built-in component on its own: made from the collaborators of a Trainer built in this process (on
a one-process gloo group), its hooks driven with `Step`s, what it does checked."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from functools import partial

import torch

from keel.core.actions import CONTINUE, Action
from keel.core.callbacks import Callback, Hooks, Step
from keel.core.sync import StepSync
from keel.errors import EXIT_PAUSED
from keel.health.watchdog import PHASES, Watchdog
from keel.monitor.metrics import CommProfiler
from keel.rundir.events import read_jsonl
from keel.rundir.status import read_status
from keel.train.components import (
    CheckpointDecision,
    CheckpointWriter,
    GuardCheck,
    GuardInspection,
    Metering,
    PauseRequests,
)
from keel.train.stopping import Stopping
from keel.train.trainer import Trainer
from keel.train.watching import Evaluation, StepEnd, WatchdogPhases, WatchdogSections

Build = Callable[..., Trainer]


def made(trainer: Trainer, number: int, last: bool = False, sync: StepSync | None = None,
         action: Action = CONTINUE) -> Step:
    """Step `number` after its update: its report from a real reduction of `sync` (the trainer's)."""
    trainer.state.step = number
    report = (sync or trainer.sync).reduce(number, torch.tensor(3.0), torch.tensor(1.0), lambda: True)
    return Step(number, trainer.state, last=last, lr=1e-3, report=report, action=action)


def drive(hooks: Hooks, trainer: Trainer, steps: int) -> list[Step]:
    """Every step hook of `steps` steps, as the loop calls them (the last step is the last)."""
    done = []
    for number in range(1, steps + 1):
        step = Step(number, trainer.state, last=number == steps, lr=1e-3)
        hooks.notify("on_step_start", step)
        hooks.notify("on_batch", step)
        hooks.notify("on_backward", step, False)
        step.report = trainer.sync.reduce(number, torch.tensor(3.0), torch.tensor(1.0), lambda: False)
        hooks.ask("after_backward", step)
        trainer.state.step = number
        hooks.ask("on_step_end", step)
        done.append(step)
    return done


def part(trainer: Trainer, kind: type) -> Callback:
    (component,) = trainer.hooks.of_type(kind)
    return component


def test_metering_logs_the_step_and_its_learning_rate_and_counts_steps_since_the_log(build: Build) -> None:
    trainer = build()
    metering = Metering(trainer.monitor, trainer.meter, part(trainer, Metering).comm)
    hooks = Hooks()
    hooks.add(metering)
    steps = drive(hooks, trainer, 3)
    assert [s.metrics for s in steps] == [{"step": n, "optim/lr": 1e-3} for n in (1, 2, 3)]
    assert metering.since_log == 3 and trainer.monitor.step == 3 and metering.profiling is None
    assert trainer.meter.window()["time/step_s"] > 0


def test_a_step_runs_under_the_profiler_only_at_the_profile_interval(build: Build) -> None:
    trainer = build([], "monitor.profile_interval=0", "health.straggler.interval=1")
    hooks = Hooks()
    hooks.add(part(trainer, Metering))
    drive(hooks, trainer, 2)
    assert part(trainer, Metering).comm.last == {}, "profile_interval = 0: never, whatever else is due"
    profiled = Metering(trainer.monitor, trainer.meter, CommProfiler(2, "cpu"))
    hooks = Hooks()
    hooks.add(profiled)
    drive(hooks, trainer, 2)
    assert profiled.comm.last["time/comm_s"] >= 0


def test_guard_inspection_scales_the_lr_and_skips_a_nonfinite_step(build: Build) -> None:
    trainer = build()
    inspection = GuardInspection(trainer.guards, trainer.monitor, trainer.stepper, lambda step: None, StepSync(1))
    trainer.guards.lr_scale, trainer.guards.lr_scale_until = 0.5, 3
    scaled, after = Step(3, trainer.state, last=False, lr=1.0), Step(4, trainer.state, last=False, lr=1.0)
    trainer.state.step = 2
    inspection.on_step_start(scaled)
    trainer.state.step = 3
    inspection.on_step_start(after)
    assert (scaled.lr, after.lr) == (0.5, 1.0)
    assert inspection.after_backward(made(trainer, 4)) == CONTINUE
    # A real non-finite step: its replay (the numerics guard asks for one) is non-finite alike.
    with torch.no_grad():
        next(trainer.parts[0].parameters()).fill_(float("nan"))
    nonfinite = Step(5, trainer.state, last=False, micro_batches=trainer.loader.next())
    nonfinite.loss = trainer.stepper.forward_backward(nonfinite.micro_batches)
    nonfinite.report = trainer.sync.reduce(5, nonfinite.loss, trainer.stepper.grad_norm(),
                                           partial(trainer.stepper.nonfinite_here, nonfinite.loss))
    action = inspection.after_backward(nonfinite)
    assert action is not None and (action.kind, action.guard) == ("skip", "numerics")


def test_guard_check_snapshots_the_state_at_its_interval(build: Build) -> None:
    trainer = build([], "guard.snapshot_interval=2")
    check = GuardCheck(trainer.guards, trainer.monitor, part(trainer, GuardInspection), lambda step: {})
    ring = trainer.guards.ring
    assert ring is not None and ring.newest(10).step == 0  # the start's snapshot
    for number in (1, 2, 3):
        assert check.on_step_end(made(trainer, number)) is CONTINUE
    assert ring.newest(10).step == 2 and ring.newest(1).step == 0


def test_pause_requests_pause_every_rank_once_a_signal_arrived(build: Build) -> None:
    trainer = build()
    own, sync = part(trainer, PauseRequests), StepSync(1)
    pause = PauseRequests(trainer.requests, own.straggler, sync)
    assert pause.on_step_end(made(trainer, 1, sync=sync)) is None
    os.kill(os.getpid(), signal.SIGUSR1)  # a real signal: what `kill -USR1` sends
    action = pause.on_step_end(made(trainer, 2, sync=sync))
    assert action is not None and (action.kind, action.reason, pause.asked) == ("pause", "SIGUSR1", 1.0)


def test_checkpoint_decision_saves_by_step_at_the_last_and_before_a_pause(build: Build) -> None:
    trainer = build()
    sync = StepSync(1)
    decision = CheckpointDecision(trainer.checkpointing, sync)
    due = []
    for number, last, action in [(1, False, CONTINUE), (2, False, CONTINUE), (3, False, CONTINUE),
                                 (3, True, CONTINUE), (5, False, Action("pause"))]:
        step = made(trainer, number, last, sync, action=action)
        decision.on_step_end(step)
        due.append(step.save_due)
    assert due == [False, True, False, True, True]


def test_checkpoint_decision_saves_by_time(build: Build) -> None:
    trainer = build([], "checkpoint.policy=seconds", "checkpoint.every_seconds=0.2")
    sync = StepSync(1)
    decision = CheckpointDecision(trainer.checkpointing, sync)
    trainer.checkpointing.last_save = time.perf_counter()
    soon = made(trainer, 1, sync=sync)
    decision.on_step_end(soon)
    time.sleep(0.3)
    later = made(trainer, 2, sync=sync)
    decision.on_step_end(later)
    assert (soon.save_due, later.save_due) == (False, True)


def test_checkpoint_writer_writes_only_the_saves_decided(build: Build) -> None:
    trainer = build()
    writer = CheckpointWriter(trainer.checkpointing, trainer.parts, trainer.optimizers, trainer.watchdog)
    writer.on_start(trainer.state)
    writer.on_step_end(made(trainer, 1))
    assert trainer.manager.pending is None and trainer.manager.latest() is None
    due = made(trainer, 2, last=True)
    due.save_due = due.save_waits = True  # as the decision sets them for the last step
    writer.on_step_end(due)  # the last step's save is waited for
    assert trainer.manager.latest().endswith("step-000002") and trainer.checkpointing.final_saved
    assert trainer.state.train_seconds > 0 and trainer.watchdog.section_name == "idle"


def test_interval_metrics_reduce_and_log_every_k_steps_only(build: Build) -> None:
    trainer = build([], "monitor.interval=3")
    hooks = Hooks()
    hooks.add(part(trainer, Metering))
    hooks.add(trainer.metrics, every=trainer.cfg.monitor.interval)
    steps = drive(hooks, trainer, 4)
    logged = [s.number for s in steps if "train/loss" in s.metrics]
    assert logged == [3, 4] and trainer.metrics.train_loss == 3.0
    assert steps[2].metrics["train/tokens_seen"] == trainer.state.tokens_seen
    assert [r["step"] for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "train/loss" in r] == [3, 4]


def evaluated_steps(trainer: Trainer, interval: int, final: bool, steps: int = 5) -> list[tuple[int, float]]:
    evaluated: list[tuple[int, float]] = []
    evaluation = Evaluation(trainer.evaluation.evaluate, trainer.bpb, trainer.watchdog, trainer.monitor,
                            lambda hook, state, loss: evaluated.append((state.step, loss)), trainer.say,
                            interval, final)
    hooks = Hooks()
    hooks.add(evaluation, every=interval or steps)
    done = drive(hooks, trainer, steps)
    assert [s.number for s in done if "val/loss" in s.metrics] == [n for n, _ in evaluated]
    return evaluated


def test_evaluation_runs_every_k_steps_and_at_the_last(build: Build) -> None:
    evaluated = evaluated_steps(build(), 2, final=True)
    assert [n for n, _ in evaluated] == [2, 4, 5]
    assert all(loss == evaluated[0][1] > 0 for _, loss in evaluated), "no update between: the same loss"


def test_evaluation_without_final_runs_only_at_its_interval(build: Build) -> None:
    trainer = build()
    assert [n for n, _ in evaluated_steps(trainer, 2, final=False)] == [2, 4]
    assert evaluated_steps(trainer, 0, final=False) == []


def test_stopping_ends_a_paused_step_with_exit_75_but_not_the_last(build: Build) -> None:
    trainer = build()
    stopping = Stopping(part(trainer, PauseRequests), trainer.checkpointing, part(trainer, CheckpointWriter),
                        trainer.hosts, trainer.run_dir, trainer.status)
    paused = Action("pause", "health", "asked")
    assert stopping.on_step_end(made(trainer, 1)) is None
    assert stopping.on_step_end(made(trainer, 6, last=True, action=paused)) is None
    action = stopping.on_step_end(made(trainer, 2, action=paused))
    assert action is not None and (action.kind, action.exit_code) == ("pause", EXIT_PAUSED) and action.ends_step
    assert read_status(trainer.run_dir)["state"] == "paused"
    assert [e["step"] for e in read_jsonl(trainer.run_dir / "events.jsonl") if e["kind"] == "pause"] == [2]


def test_watchdog_sections_and_phases_follow_the_step(build: Build) -> None:
    trainer = build()
    watchdog: Watchdog = trainer.watchdog
    sections, phases = WatchdogSections(watchdog), WatchdogPhases(watchdog)
    step = made(trainer, 1)
    sections.on_step_start(step)
    assert (watchdog.section_name, watchdog.section_step, PHASES[watchdog.phase_index]) == ("step", 1, "data")
    seen = []
    for hook, args in [("on_batch", ()), ("on_backward", (False,)), ("on_backward", (True,)),
                       ("after_backward", ())]:
        getattr(phases, hook)(step, *args)
        seen.append(PHASES[watchdog.phase_index])
    assert seen == ["forward_backward", "reduce", "reduce", "update"]
    sections.on_step_end(step)
    assert watchdog.section_name == "idle" and watchdog.steps_seen == 1


def test_step_end_marks_the_first_step_of_a_start_once(build: Build) -> None:
    trainer = build()
    end = StepEnd(trainer.monitor, trainer.events.emit, rank0=True)
    for number in (1, 2):
        end.on_step_end(made(trainer, number))
    trainer.events.close()
    marks = [e["step"] for e in read_jsonl(trainer.run_dir / "events.jsonl") if e["kind"] == "step"]
    assert marks == [1]
