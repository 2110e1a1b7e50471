"""keel's own guards register by their module of keel.guard: a guard added as one new module file is built
from the GuardConfig (or declines to be), asked by the guards every step beside the numerics and spike guards
and users' guards, and its state travels with the guards' state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from keel.config import GuardConfig
from keel.core.actions import Action
from keel.core.state import TrainState
from keel.core.sync import StepReport
from keel.guard.engine import Guards
from keel.guard.numerics import NumericsGuard
from keel.guard.registry import GUARDS, build_guards
from keel.guard.spike import SpikeGuard
from keel.parallel.degrees import Degrees
from keel.parallel.layout import Layout
from keel.rundir.events import EventLog, read_jsonl
from tests.package_files import added_module

# A guard as its own module of keel.guard would be: made by a function that declines where the config
# skips no data (a ceiling on the loss that answers with a data rollback has nothing to ask then).
LOSS_CEILING = """
    from keel.config import GuardConfig
    from keel.core.actions import Action
    from keel.core.sync import StepReport
    from keel.guard.registry import guard

    CEILING = 10.0


    class LossCeiling:
        name = "loss_ceiling"

        def __init__(self, skip: int) -> None:
            self.skip, self.seen = skip, []

        def inspect(self, report: StepReport) -> Action | None:
            self.seen.append(report.step)
            if report.loss <= CEILING:
                return None
            return Action("rollback", self.name, f"loss {report.loss} above {CEILING}", {"loss": report.loss},
                          to_step=report.step - 1, skip_batches=self.skip)

        def state_dict(self) -> dict:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict) -> None:
            self.seen = state.get("seen", [])


    @guard("loss_ceiling")
    def make(cfg: GuardConfig) -> LossCeiling | None:
        return LossCeiling(cfg.skip_batches) if cfg.skip_batches else None
"""


class SkipStepTwo:
    """A user's guard: a callback with an `inspect` method."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def inspect(self, report: StepReport) -> Action | None:
        self.seen.append(report.step)
        return Action("skip", "mine", "step two") if report.step == 2 else None


def report(step: int, loss: float = 3.0) -> StepReport:
    return StepReport(step=step, loss=loss, grad_norm=1.0, local_loss=loss, nonfinite_ranks=[])


@pytest.fixture
def layout(group: None) -> Layout:
    return Layout.build("cpu", Degrees(dp_replicate=1, dp_shard=1, tp=1))


@pytest.fixture
def loss_ceiling(tmp_path: Path) -> Iterator[str]:
    with added_module("keel.guard", "loss_ceiling", LOSS_CEILING, tmp_path / "added", GUARDS) as module:
        yield module


def guards(cfg: GuardConfig, layout: Layout, run_dir: Path, users: list | None = None) -> Guards:
    cfg.snapshot_interval = 0  # no snapshots: these guards hold no parameters
    return Guards(cfg, False, layout, [], [], users or [], EventLog(run_dir / "events.jsonl", 0), lambda _: None)


def no_recompute() -> tuple[torch.Tensor, list]:
    raise AssertionError("no step is replayed here")


def test_keels_guards_register_by_their_modules() -> None:
    built = build_guards(GuardConfig())
    assert list(built) == ["numerics", "spike"]
    assert isinstance(built["numerics"], NumericsGuard) and isinstance(built["spike"], SpikeGuard)


def test_a_new_guard_registers_by_its_file_alone_and_is_asked_every_step(loss_ceiling: str, layout: Layout,
                                                                           tmp_path: Path) -> None:
    mine = SkipStepTwo()
    engine = guards(GuardConfig(skip_batches=5), layout, tmp_path, [mine])
    assert list(engine.builtin) == ["loss_ceiling", "numerics", "spike"]
    state = TrainState()
    assert engine.inspect(state, report(1), no_recompute).kind == "continue"
    assert engine.inspect(state, report(2), no_recompute).kind == "skip", "users' guards are asked too"
    action = engine.inspect(state, report(3, loss=50.0), no_recompute)
    assert (action.kind, action.guard, action.to_step, action.skip_batches) == ("rollback", "loss_ceiling", 2, 5)
    assert engine.builtin["loss_ceiling"].state_dict() == {"seen": [1, 2, 3]} and mine.seen == [1, 2, 3]
    decided = [r["detail"] for r in read_jsonl(tmp_path / "events.jsonl") if r["kind"] == "guard"]
    assert [(d["guard"], d["loss"]) for d in decided if d["guard"] == "loss_ceiling"] == [("loss_ceiling", 50.0)]
    assert engine.metrics()["guard/loss_ceiling_rollback_total"] == 1


def test_a_new_guards_state_is_saved_and_restored_with_the_guards(loss_ceiling: str, layout: Layout,
                                                                  tmp_path: Path) -> None:
    first = guards(GuardConfig(), layout, tmp_path)
    for step in (1, 2):
        first.inspect(TrainState(), report(step), no_recompute)
    saved = first.state_dict()
    assert saved["guards"]["loss_ceiling"] == {"seen": [1, 2]}
    again = guards(GuardConfig(), layout, tmp_path)
    again.load_state_dict(saved)
    assert again.builtin["loss_ceiling"].state_dict() == {"seen": [1, 2]}


def test_a_guard_declines_a_config_it_has_nothing_to_do_in(loss_ceiling: str, layout: Layout, tmp_path: Path) -> None:
    assert "loss_ceiling" not in build_guards(GuardConfig(skip_batches=0))
    assert guards(GuardConfig(enabled=False), layout, tmp_path).builtin == {}, "guard.enabled = false: none is built"
