"""The order a run's components run in is their own declaration (`priority`), not a list's: every built-in
component declares a distinct place, a built run runs them in that order with a configured callback after the
step's components and before the watchdog's phases and the end mark, whatever order they were registered in."""

from __future__ import annotations

from collections.abc import Callable

from keel.config import CallbackSpec
from keel.core.callbacks import Callback, Hooks
from keel.monitor.trackers import Trackers
from keel.train.components import (
    CheckpointDecision,
    CheckpointWriter,
    GuardCheck,
    GuardInspection,
    IntervalMetrics,
    Metering,
    PauseRequests,
)
from keel.train.downstream import DownstreamEvaluation
from keel.train.memory_tier import MemoryCheckpoints
from keel.train.replicas import ReplicaGroups
from keel.train.rollback import Recovery
from keel.train.signals import InstabilitySignals
from keel.train.stopping import Stopping
from keel.train.trainer import Trainer
from keel.train.watching import Evaluation, StepEnd, WatchdogPhases, WatchdogSections

ORDER = ["Metering", "InstabilitySignals", "ReplicaGroups", "GuardInspection", "PauseRequests", "CheckpointDecision",
         "IntervalMetrics", "WatchdogSections", "Evaluation", "DownstreamEvaluation", "GuardCheck", "CheckpointWriter",
         "MemoryCheckpoints", "Stopping", "Recovery", "Trackers", "Recorder", "WatchdogPhases", "StepEnd"]
BUILTIN = [Metering, InstabilitySignals, ReplicaGroups, GuardInspection, PauseRequests, CheckpointDecision,
           IntervalMetrics, WatchdogSections, Evaluation, DownstreamEvaluation, GuardCheck, CheckpointWriter,
           MemoryCheckpoints, Stopping, Recovery, Trackers, WatchdogPhases, StepEnd]


class Recorder(Callback):
    """A configured callback: priority 0."""


class Second(Recorder):
    """Another, configured after it."""


def test_every_built_in_component_declares_a_place_of_its_own() -> None:
    assert len({cls.priority for cls in BUILTIN}) == len(BUILTIN)
    hooks = Hooks()
    for component in [Recorder(), *(object.__new__(cls) for cls in reversed(BUILTIN))]:  # registered backwards
        hooks.add(component)
    assert [type(cb).__name__ for cb in hooks.callbacks] == ORDER


def test_a_built_run_runs_its_components_in_the_declared_order(build: Callable[..., Trainer]) -> None:
    trainer = build([CallbackSpec(path=f"{__name__}:Recorder"), CallbackSpec(path=f"{__name__}:Second")])
    names = [type(cb).__name__ for cb in trainer.hooks.callbacks]
    # This run has no replica groups, downstream tasks, trackers or memory tier; its two configured callbacks keep
    # their order.
    expected = [name for name in ORDER
                if name not in ("ReplicaGroups", "DownstreamEvaluation", "Trackers", "MemoryCheckpoints")]
    at = expected.index("Recorder") + 1
    assert names == [*expected[:at], "Second", *expected[at:]]
