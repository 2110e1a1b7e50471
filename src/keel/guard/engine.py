"""The guards of a run decide: continue, skip, roll back, stop, quarantine (keel.train.rollback carries
out what they decide).

They are asked twice per step. `inspect` runs after the backward, on the step report: first whether the state
is as the last update wrote it (the at-rest check), then keel's own guards (each registered by its module of
keel.guard, see keel.guard.registry), users' guards (callbacks with an `inspect` method) and, when due, the step
replay (and, before a replayed step's update, its re-execution into scratch). `check` runs after the update:
whether a re-executed update wrote what it computed, the replica fingerprints when due, on the steps that computed the
instability signals the guards that read them (the spike guard: the attention logits), then the at-rest seal and
the in-memory snapshot when due. The strongest action wins. Every input to a decision is reduced or gathered over
all ranks, so every rank takes the same branch. Each decision is an event with its evidence and a counter in the
metrics.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from keel.config import GuardConfig
from keel.core.actions import CONTINUE, Action, stronger, strongest
from keel.core.guard import BuiltinGuard, Guard, SignalGuard
from keel.core.state import TrainState
from keel.core.sync import StepReport
from keel.errors import EXIT_QUARANTINE
from keel.guard.registry import build_guards
from keel.guard.sdc import SdcGuard
from keel.guard.snapshots import SnapshotRing
from keel.parallel.layout import Layout
from keel.rundir.events import EventLog

AT_REST = "sdc/changed_at_rest"  # the step sync's sum of the tensors changed since their seal


class Guards:
    def __init__(self, cfg: GuardConfig, deterministic: bool, layout: Layout, optimizers: list[torch.optim.Optimizer],
                 params: dict[torch.nn.Parameter, str], user_guards: Sequence[Guard], events: EventLog,
                 say: Callable[[str], None]) -> None:
        """`params`: the model's parameters and their names."""
        self.g, self.events = cfg, events
        self.rank0 = dist.get_rank() == 0
        on = self.g.enabled
        self.builtin: dict[str, BuiltinGuard] = build_guards(self.g) if on else {}
        self.guards: list[Guard] = [*self.builtin.values(), *user_guards]  # users' keep their state as callbacks
        self.sdc = SdcGuard(self.g, layout, optimizers, list(params), deterministic, params) if on else None
        if on and not deterministic:
            say("note: step replays are off: with train.deterministic = false a recomputed step may differ by rounding")
        self.ring = (SnapshotRing(optimizers, self.g.snapshots, pin_memory=torch.cuda.is_available())
                     if on and self.g.snapshot_interval else None)
        self.counts: Counter[str] = Counter()
        self.lr_scale, self.lr_scale_until = 1.0, 0
        self.rollback_steps: list[int] = []  # steps where data rollbacks happened, for escalation
        self.snapshot_s = 0.0

    def forget_histories(self) -> None:
        """The histories the guards judge by start afresh (they were gathered under another definition of the
        run: a resume that accepted a change)."""
        for guard in self.builtin.values():
            guard.load_state_dict({})

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
            self.sdc.seal(state.step, force=True)
        if self.ring is not None:
            self._snapshot(state)

    def inspect(self, state: TrainState, report: StepReport,
                recompute: Callable[[], tuple[torch.Tensor, list]]) -> Action:
        if self.sdc is not None and report.values.get(AT_REST, 0.0) > 0:
            changed = self.sdc.at_rest(report.step)
            self._record(changed, report.step)  # state corrupted at rest explains whatever else this step shows
            return self._exiting(changed)
        actions = [self._escalate(guard.inspect(report), report.step) for guard in self.guards]
        for action in actions:
            if action is not None and action.reason:
                self._record(action, report.step)
        if self.sdc is not None:
            self.sdc.record(report)
            fired = any(a is not None and a.kind != "continue" for a in actions)
            found: list[Action | None] = []
            self.sdc.update_due = False
            if self.sdc.wants_replay(report.step, fired):
                self.counts["sdc_replays"] += 1
                found.append(self.sdc.replay(report, recompute))
                self.sdc.update_due = found[-1] is None and self.g.sdc.update_replay  # and then its update
            if fired and self.sdc.group is not None:  # is the trouble in a corrupted replica, not in the data?
                self.counts["sdc_checks"] += 1
                found.append(self.sdc.check(report.step - 1))
            if any(found):  # corruption explains what the other guards saw: its response replaces theirs
                actions = found
                self.rollback_steps = [s for s in self.rollback_steps if s != report.step]
                for action in found:
                    if action is not None:
                        self._record(action, report.step)
        return self._exiting(strongest(actions))

    def before_update(self) -> None:
        """The optimizers are about to step: a replayed step's update is first re-executed into scratch."""
        if self.sdc is not None and self.sdc.update_due:
            self.sdc.update_due = False
            self.sdc.reexecute_update()

    def check(self, state: TrainState, save_due: bool, signals: dict[str, float] | None = None) -> Action:
        """After the update of `state.step`; `signals`: the instability signals when this step computed them."""
        if self.sdc is not None and (wrong := self.sdc.check_update(state.step)) is not None:
            self._record(wrong, state.step)
            return self._exiting(wrong)
        action = CONTINUE
        if self.sdc is not None and self.sdc.wants_check(state.step, save_due):
            self.counts["sdc_checks"] += 1
            action = self.sdc.check(state.step) or CONTINUE
            if action.reason:
                self._record(action, state.step)
        if action.kind == "continue" and signals:
            for guard in self.builtin.values():
                if isinstance(guard, SignalGuard):
                    found = self._escalate(guard.inspect_signals(state.step, signals), state.step)
                    if found is not None:
                        self._record(found, state.step)
                        action = stronger(action, found)
        if action.kind == "continue" and self.sdc is not None:
            self.sdc.seal(state.step)
        if action.kind == "continue" and self.ring is not None and state.step % self.g.snapshot_interval == 0:
            self._snapshot(state)
        return self._exiting(action)

    def _exiting(self, action: Action) -> Action:
        """A quarantine ends the run (exit 76, once recorded) when `guard.sdc.response` says so."""
        if action.kind == "quarantine" and action.ranks and self.g.sdc.response == "exit":
            return dataclasses.replace(action, exit_code=EXIT_QUARANTINE)
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

    # ------------------------------------------------------------ snapshots, events, metrics, state

    def rolled_back(self, saved: dict, step: int) -> None:
        """The run went back to `step`, whose guard state was `saved`: the histories go back with it."""
        for name, guard in self.builtin.items():
            guard.load_state_dict(saved.get("guards", {}).get(name, {}))
        if self.sdc is not None:
            self.sdc.rolled_back(step)
            self.sdc.seal(step, force=True)

    def resnapshot(self, state: TrainState) -> None:
        """Drop the in-memory snapshots and take one of the state now, kept as the verified one: replica groups
        do it when a group joins with a ring of its own, so that every group's rollback finds the same snapshots."""
        if self.sdc is not None:
            self.sdc.seal(state.step, force=True)
        if self.ring is not None:
            self.ring.clear()
            self.keep_verified(state)

    def keep_verified(self, state: TrainState) -> None:
        """The replica groups know the state now to be the same in every group (their fingerprints agreed, a
        group joined, the run started): its snapshot stays in memory until a newer one is verified, so that
        removing a corrupted group rolls the others back to it without reading storage."""
        if self.ring is not None:
            self._snapshot(state)
            self.ring.keep(state.step)

    def _snapshot(self, state: TrainState) -> None:
        assert self.ring is not None
        if self.ring.has(state.step):  # taken at this step already, as the verified state
            return
        started = time.perf_counter()
        self.ring.take(state.step, {"train": state.to_dict()})
        self.snapshot_s = time.perf_counter() - started

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
                        "guard/at_rest_s": self.sdc.at_rest_s, "guard/update_replay_s": self.sdc.update_s,
                        "guard/last_verified_step": self.sdc.last_verified})
        if self.ring is not None:
            out["guard/snapshot_s"] = self.snapshot_s
        return out

    def state_dict(self) -> dict:
        return {"guards": {name: g.state_dict() for name, g in self.builtin.items()},
                "sdc": self.sdc.state_dict() if self.sdc is not None else {},
                "counts": dict(self.counts), "lr_scale": self.lr_scale, "lr_scale_until": self.lr_scale_until,
                "rollback_steps": self.rollback_steps}

    def load_state_dict(self, state: dict) -> None:
        for name, g in self.builtin.items():
            if name in state.get("guards", {}):
                g.load_state_dict(state["guards"][name])
        if self.sdc is not None and state.get("sdc"):
            self.sdc.load_state_dict(state["sdc"])
        self.counts = Counter(state.get("counts", {}))
        self.lr_scale, self.lr_scale_until = state.get("lr_scale", 1.0), state.get("lr_scale_until", 0)
        self.rollback_steps = state.get("rollback_steps", [])
