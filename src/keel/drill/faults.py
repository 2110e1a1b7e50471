"""Fault injectors: callbacks that deliver a real fault to a real process at a chosen point."""

from __future__ import annotations

import errno
import fnmatch
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from keel.checkpoint.manifest import step_name
from keel.checkpoint.memory import MEMORY_DIR_ENV
from keel.config import CallbackSpec
from keel.core.callbacks import Build, Callback, Step
from keel.core.replica import PARTICIPANTS, ROOT_ENV, replica_group
from keel.core.state import TrainState
from keel.errors import ConfigError
from keel.rundir.events import EventLog, read_jsonl


class Injector(Callback):
    """A fault that says when it lands: a `drill/inject` event in the run's events (the drill dates its
    detection from it), and a count of its deliveries kept in the run directory, so that a fault limited to
    some number of deliveries stays delivered across restarts of the workers and relaunches of the job."""

    spec = ""
    events: EventLog | None = None
    counter: Path | None = None
    announced = False

    def attach(self, spec: str, index: int, run_dir: Path) -> None:
        """Tie the injector to the run's events and directory (`drill.inject`'s `index`-th entry)."""
        self.spec, self.run_dir = spec, run_dir
        self.counter = run_dir / "drill" / f"{index}-{spec.partition(':')[0]}.delivered"

    def delivered(self) -> int:
        """How often this fault was delivered in the run (in this process when not attached to one)."""
        if self.counter is None:
            return int(self.__dict__.get("_delivered", 0))
        try:
            return len(self.counter.read_text().split())
        except OSError:
            return 0

    def fire(self, step: int, **detail: Any) -> None:
        """Record one delivery, durably, before delivering it: a fault that kills the process leaves its trace."""
        if self.counter is None:
            self.__dict__["_delivered"] = self.delivered() + 1
        else:
            self.counter.parent.mkdir(parents=True, exist_ok=True)
            with open(self.counter, "a") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
        self.announce(step, **detail)

    def announce(self, step: int, **detail: Any) -> None:
        if self.counter is None:
            return
        if self.events is None:  # opened when first needed: preflight's probe runs before the loop is built
            self.events = EventLog(self.run_dir / "events.jsonl", dist.get_rank())
        self.events.emit("drill", step, "inject", fault=self.spec, **detail)


class SigkillAfterCheckpoint(Injector):
    """SIGKILL this process, if it is `rank`, once the checkpoint of `step` is committed."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_checkpoint_saved(self, state: TrainState, path: str) -> None:
        if path.rstrip("/").endswith(step_name(self.step)) and dist.get_rank() == self.rank:
            self.fire(self.step)
            os.kill(os.getpid(), signal.SIGKILL)


class SigkillDuringCheckpointWrite(Injector):
    """SIGKILL this process, if it is `rank`, in the middle of the background write of `step`'s
    checkpoint (`tier` storage) or memory copy (`tier` memory): its files are written, the copy to its buddy
    node and the commit have not happened. At most `times` times in the run (0: every time the write
    happens), so that with `times` set a restarted run gets past it."""

    def __init__(self, step: int, rank: int = 1, times: int = 0, tier: str = "storage") -> None:
        if tier not in ("storage", "memory"):
            raise ValueError(f"tier {tier!r}: expected storage or memory")
        self.step, self.rank, self.times, self.tier = step, rank, times, tier

    def on_checkpoint_write(self, step: int, staging_path: str) -> None:
        memory = os.environ.get(MEMORY_DIR_ENV)
        tier = "memory" if memory and Path(staging_path).is_relative_to(memory) else "storage"
        if (step == self.step and tier == self.tier and dist.get_rank() == self.rank
                and (not self.times or self.delivered() < self.times)):
            self.fire(step)
            os.kill(os.getpid(), signal.SIGKILL)


class FillDiskBeforeCheckpoint(Injector):
    """Fill the volume under `path` with a file before the save of `step`, so that the save meets a
    real ENOSPC; the file is removed once that save has failed, so the next save can succeed."""

    def __init__(self, path: str, step: int) -> None:
        self.filler, self.step = Path(path) / "filler", step

    def on_step_end(self, step: Step) -> None:
        state = step.state
        if state.step == self.step - 1 and dist.get_rank() == 0:
            self.fire(self.step)
            with open(self.filler, "wb") as f:
                block = b"\0" * (1 << 20)
                try:
                    while True:
                        f.write(block)
                        f.flush()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise

    def on_checkpoint_failed(self, state: TrainState, step: int, error: str) -> None:
        if step == self.step and dist.get_rank() == 0:
            self.filler.unlink(missing_ok=True)


class ReadOnlyBeforeCheckpoint(Injector):
    """Remount the volume at `path` read-only before the save of `step`, as a storage fault or a fenced
    NFS export does, and read-write again once that save has failed. Needs root."""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_step_end(self, step: Step) -> None:
        state = step.state
        if state.step == self.step - 1 and dist.get_rank() == 0:
            self.fire(self.step)
            subprocess.run(["mount", "-o", "remount,ro", self.path], check=True, capture_output=True)

    def on_checkpoint_failed(self, state: TrainState, step: int, error: str) -> None:
        if step == self.step and dist.get_rank() == 0:
            subprocess.run(["mount", "-o", "remount,rw", self.path], check=True, capture_output=True)


# ---------------------------------------------------------------- faults of processes and machines


def attempt() -> int:
    """Which start of the worker group this is (0 first; torchrun counts its restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class _InStep(Injector):
    """A fault delivered inside step `step` on `rank`, after the backward, at most `times` times in the run
    (so that a restarted run gets past it, or meets it again)."""

    def __init__(self, step: int, rank: int = 1, times: int = 1, group: int = -1) -> None:
        self.step, self.rank, self.times, self.group = step, rank, times, group

    def on_backward(self, step: Step, replaying: bool) -> None:
        if not replaying and self.due(step):
            self.fire(self.step, attempt=attempt())
            self.deliver()

    def due(self, step: Step) -> bool:
        """Step `step` on rank `rank` (-1: every rank) of replica group `group` (-1: any group)."""
        return (step.number == self.step and self.rank in (-1, dist.get_rank())
                and self.group in (-1, replica_group())
                and self.delivered() < self.times)

    def deliver(self) -> None:
        raise NotImplementedError


class KillInStep(_InStep):
    """SIGKILL this rank in the middle of a step. `down_s`: the killed processes' restart holds back that many
    seconds before it builds anything (a replica group then rejoins only after the live ones went on without
    it, as a replaced node would; restarted workers are otherwise back within about a second)."""

    def __init__(self, step: int, rank: int = 1, times: int = 1, group: int = -1, down_s: float = 0.0) -> None:
        super().__init__(step, rank, times, group)
        self.down_s = down_s

    def attach(self, spec: str, index: int, run_dir: Path) -> None:
        super().attach(spec, index, run_dir)
        restarted_after_a_kill = 0 < attempt() <= self.delivered()
        if (self.down_s and restarted_after_a_kill and self.rank in (-1, dist.get_rank())
                and self.group in (-1, replica_group())):
            time.sleep(self.down_s)

    def deliver(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class KillInReduce(_InStep):
    """Stall this rank before its forward pass for `seconds`, long enough for the other replica groups to
    be waiting for it inside the gradient all-reduce, then SIGKILL it: the group dies mid-collective, as
    its peers see it."""

    def __init__(self, step: int, rank: int = -1, times: int = 1, group: int = 1, seconds: float = 3.0) -> None:
        super().__init__(step, rank, times, group)
        self.seconds = seconds

    def on_batch(self, step: Step) -> None:
        if self.due(step):
            self.fire(self.step, attempt=attempt())
            time.sleep(self.seconds)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_backward(self, step: Step, replaying: bool) -> None:
        pass


class KillRejoined(_InStep):
    """SIGKILL `rank` (-1: every rank) of replica group `group` in the first step it makes after a restart,
    once it has rejoined the live groups: a group that fails again as soon as it healed."""

    def __init__(self, rank: int = -1, times: int = 1, group: int = 1) -> None:
        super().__init__(0, rank, times, group)
        self.made = 0

    def due(self, step: Step) -> bool:
        self.made += 1
        self.step = step.number  # the inject event names the step it lands in
        return (attempt() > 0 and self.made == 1 and self.rank in (-1, dist.get_rank())
                and self.group in (-1, replica_group()) and self.delivered() < self.times)

    def deliver(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_lighthouse(after_s: float = 0.0) -> None:
    """SIGKILL the lighthouse `keel train --replica-groups` started (the last one it names in its events), now
    or `after_s` seconds from now from a process of its own (this one may be gone by then)."""
    root = Path(os.environ.get(ROOT_ENV, "."))
    pids = [e["detail"]["pid"] for e in read_jsonl(root / "events.jsonl")
            if e.get("kind") == "lighthouse" and (e.get("detail") or {}).get("pid")]
    if not pids:
        return
    if after_s <= 0:
        os.kill(int(pids[-1]), signal.SIGKILL)
        return
    subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep({after_s}); os.kill({int(pids[-1])}, 9)"],
                     start_new_session=True)


class _AtReplicaMoment(Injector):
    """A fault delivered in replica group `group` at a moment of its part in the quorum (keel.train.replicas'
    DRILL_HOOKS: `join`, `serve`, `heal`) of a step from `from_step` on, at most `times` times in the run."""

    moment = ""

    def __init__(self, group: int = 1, times: int = 1, from_step: int = 0) -> None:
        self.group, self.times, self.from_step = group, times, from_step

    def attach(self, spec: str, index: int, run_dir: Path) -> None:
        super().attach(spec, index, run_dir)
        from keel.train.replicas import DRILL_HOOKS  # hooked before the group joins (before `on_build`)

        if self.group == replica_group():
            DRILL_HOOKS.append(self._hook)

    def _hook(self, moment: str, step: int) -> None:
        if moment == self.moment and step >= self.from_step and self.due() and self.delivered() < self.times:
            self.fire(step, attempt=attempt())
            self.deliver()

    def due(self) -> bool:
        return True

    def deliver(self) -> None:
        raise NotImplementedError


class KillJoining(_AtReplicaMoment):
    """SIGKILL a restarted worker of replica group `group` `after_s` seconds after it began joining the live
    groups (its first quorum, or its heal); with `lighthouse_after_s`, the lighthouse that much later."""

    moment = "join"

    def __init__(self, group: int = 1, times: int = 1, after_s: float = 0.2, lighthouse_after_s: float = 0.0,
                 from_step: int = 0) -> None:
        super().__init__(group, times, from_step)
        self.after_s, self.lighthouse_after_s = after_s, lighthouse_after_s

    def due(self) -> bool:
        return attempt() > 0

    def deliver(self) -> None:
        def kill() -> None:
            if self.lighthouse_after_s > 0:
                kill_lighthouse(self.lighthouse_after_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(self.after_s, kill).start()


class KillHealing(_AtReplicaMoment):
    """SIGKILL replica group `group`'s worker as it heals: the live state received, not yet applied."""

    moment = "heal"

    def deliver(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class KillLighthouseServing(_AtReplicaMoment):
    """SIGKILL the lighthouse as replica group `group` hands its state to a healing peer (the transfer then
    runs without a lighthouse)."""

    moment = "serve"

    def deliver(self) -> None:
        kill_lighthouse()


class HangInStep(_InStep):
    """This rank sleeps forever in the middle of a step; the others wait for it in the next collective.
    `busy`: it spins forever in C holding the GIL instead (as a long C call can), so that no thread of it
    runs Python: it neither beats nor answers an alarm, though its process runs."""

    def __init__(self, step: int, rank: int = 1, times: int = 1, group: int = -1, busy: bool = False) -> None:
        super().__init__(step, rank, times, group)
        self.busy = busy

    def deliver(self) -> None:
        if self.busy:
            sum(itertools.repeat(0))  # one C call that never returns: the GIL is never let go
        while True:
            time.sleep(3600)


class SignalInStep(_InStep):
    """Send `signal` (SIGTERM, SIGUSR1) to this rank's own process in the middle of a step."""

    def __init__(self, step: int, rank: int = 1, times: int = 1, signal: str = "SIGTERM", group: int = -1) -> None:
        super().__init__(step, rank, times, group)
        self.signal = signal

    def deliver(self) -> None:
        os.kill(os.getpid(), getattr(signal, self.signal))


class SlowRank(Injector):
    """Make `rank` (-1: every rank) slower from step `from_step` on, for `steps` steps (0: to the end): after
    its backward it sleeps for `seconds`, or else for (factor − 1) × the time the step took it so far (outside
    any collective). `while_missing`: only in the steps made while fewer replica groups are in the quorum
    than this process has seen in one (the live groups wait for a lost one to come back and heal, and go at
    their own pace once it has)."""

    def __init__(self, rank: int = 1, factor: float = 3.0, from_step: int = 1, seconds: float = 0.0,
                 steps: int = 0, while_missing: bool = False) -> None:
        self.rank, self.factor, self.from_step, self.seconds, self.steps = rank, factor, from_step, seconds, steps
        self.while_missing, self.most_groups = while_missing, 0
        self.started = 0.0

    def _paced(self, step: Step) -> bool:
        if not self.while_missing:
            return True
        live = step.metrics.get(PARTICIPANTS, 0)
        self.most_groups = max(self.most_groups, live)
        return live < self.most_groups

    def on_batch(self, step: Step) -> None:
        self.started = time.perf_counter()

    def on_backward(self, step: Step, replaying: bool) -> None:
        n = step.number
        if (not replaying and n >= self.from_step and self.rank in (-1, dist.get_rank())
                and (not self.steps or n < self.from_step + self.steps) and self._paced(step)):
            if not self.announced and dist.get_rank() == max(self.rank, 0):
                self.announced = True
                self.announce(n, attempt=attempt())
            time.sleep(self.seconds or (self.factor - 1) * (time.perf_counter() - self.started))


class SlowCollective(Injector):
    """Delay `rank`'s entry into every collective (FSDP's gathers and reductions, all-reduces, broadcasts) by
    `seconds` from step `from_step` on, for `steps` steps (0: to the end): a slow link, as the other ranks see
    it, waiting inside the collective. The data moved is untouched."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
             "reduce_scatter_tensor", "all_gather", "broadcast")

    def __init__(self, rank: int = 1, seconds: float = 0.05, from_step: int = 1, steps: int = 0) -> None:
        self.rank, self.seconds, self.from_step, self.steps = rank, seconds, from_step, steps
        self.step = 0

    def on_build(self, build: Build) -> None:
        if dist.get_rank() != self.rank:
            return
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._delayed(getattr(dist, name)))

    def _delayed(self, collective: Any) -> Any:
        def delayed(*args: Any, **kwargs: Any) -> Any:
            if self.from_step <= self.step and (not self.steps or self.step < self.from_step + self.steps):
                if not self.announced:
                    self.announced = True
                    self.announce(self.step, collective=collective.__name__)
                time.sleep(self.seconds)
            return collective(*args, **kwargs)
        return delayed

    def on_batch(self, step: Step) -> None:
        self.step = step.number

    def on_step_end(self, step: Step) -> None:
        self.step = 0  # checkpoints, evaluation and the guards' collectives between steps go at full speed


class WrongAllReduce(Injector):
    """`rank` adds a wrong value to its part of preflight's all-reduce probe, as a rank with a faulty
    link or device would."""

    def __init__(self, rank: int = 1) -> None:
        self.rank = rank

    def corrupt_probe(self, tensor: torch.Tensor) -> None:
        if dist.get_rank() == self.rank:
            self.fire(0)
            tensor.add_(1.0)


# ---------------------------------------------------------------- faults in the math


class NanInGradients(Injector):
    """Put a NaN in one gradient element of `rank` during step `step`. By default the NaN is
    reproducible (a replay of the step meets it again), as a numerical overflow would be; with
    `transient` it is not, as a hardware fault would not be."""

    def __init__(self, step: int, rank: int = 1, transient: bool = False) -> None:
        self.step, self.rank, self.transient = step, rank, transient
        self.params: list = []

    def on_build(self, build: Build) -> None:
        parts = build.parts
        self.params = [p for part in parts for p in part.parameters()]

    def on_backward(self, step: Step, replaying: bool) -> None:
        if step.number == self.step and dist.get_rank() == self.rank and not (replaying and self.transient):
            from keel.core.dtensor import local  # DTensor only where a fault fires: the launcher checks these specs

            self.fire(self.step, replaying=replaying)
            grad = next(p.grad for p in self.params if p.grad is not None)
            with torch.no_grad():
                local(grad).view(-1)[0] = float("nan")


class PoisonedBatch(Injector):
    """Replace the tokens of global batches `batch` .. `batch + count - 1` (batch b is the one step
    b + 1 reads when nothing is skipped) with uniform random ones, on `rank` or (-1) on every rank,
    i.e. the whole global batch. The data is poisoned whichever step reads it, the way a corrupt shard
    or a bad mixture would be."""

    def __init__(self, batch: int, count: int = 1, rank: int = -1, vocab: int = 256, seed: int = 0) -> None:
        self.batch, self.count, self.rank, self.vocab, self.seed = batch, count, rank, vocab, seed

    def on_batch(self, step: Step) -> None:
        state, micro_batches, batch = step.state, step.micro_batches, step.batch
        if not self.batch <= batch < self.batch + self.count or self.rank not in (-1, dist.get_rank()):
            return
        if dist.get_rank() == max(self.rank, 0):
            self.fire(state.step + 1, batch=batch)
        generator = torch.Generator().manual_seed(self.seed + batch * 1000 + dist.get_rank())
        for inputs, targets in micro_batches:
            # inputs and targets are views of one token block: (tokens[:-1], tokens[1:])
            tokens = torch.randint(0, self.vocab, (inputs.shape[0], inputs.shape[1] + 1), generator=generator)
            inputs.copy_(tokens[:, :-1])
            targets.copy_(tokens[:, 1:])


BIT_FLIP_TARGETS = ("params", "grads", "exp_avg", "exp_avg_sq", "update")


class BitFlip(Injector):
    """Flip bit `bit` (0 = lowest mantissa bit; 31 = sign of a float32) of element `element` of tensor
    `tensor` of `rank`'s `target`: its parameters or optimizer moments after step `step`'s update, or
    its gradients of step `step` before the update (once: a replay computes them right), or (`update`) the
    parameter as the optimizer writes it, inside step `step`'s update: what an update computed wrong leaves.
    With `name`, a glob over parameter names (`layers.1.moe.experts.w2`, `*.experts.*`), `tensor` counts only the
    parameters it matches; the element is one of this rank's own shard of the parameter."""

    def __init__(self, step: int, rank: int = 1, target: str = "params", tensor: int = 0, element: int = 0,
                 bit: int = 20, group: int = -1, name: str = "") -> None:
        if target not in BIT_FLIP_TARGETS:
            raise ValueError(f"bitflip target {target!r}: expected one of {', '.join(BIT_FLIP_TARGETS)}")
        self.step, self.rank, self.target = step, rank, target
        self.tensor, self.element, self.bit, self.group, self.name = tensor, element, bit, group, name
        self.params: list = []
        self.names: list[str] = []
        self.optimizers: list = []
        self.making = 0  # the step being made

    def on_build(self, build: Build) -> None:
        from keel.model.init import canonical_name  # the names without activation checkpointing's or compile's

        named = [(canonical_name(n), p) for part in build.parts for n, p in part.named_parameters()]
        chosen = [(n, p) for n, p in named if not self.name or fnmatch.fnmatchcase(n, self.name)]
        if build.rank == self.rank and not chosen:
            kinds = dict.fromkeys(re.sub(r"^layers\.\d+\.", "layers.*.", n) for n, _ in named)
            raise ConfigError(f"bitflip name={self.name!r}: no parameter of rank {self.rank} matches it; expected a "
                              f"glob over its parameters' names: {', '.join(kinds)}")
        if build.rank == self.rank and len(chosen) <= self.tensor:
            what = f"parameters named {self.name!r}" if self.name else "parameters"
            raise ConfigError(f"bitflip tensor={self.tensor}: rank {self.rank} holds {len(chosen)} {what}; expected "
                              f"a tensor between 0 and {len(chosen) - 1}")
        self.names, self.params = [n for n, _ in chosen], [p for _, p in chosen]
        self.optimizers = build.optimizers
        if self.target == "update" and build.rank == self.rank:
            param = self.params[self.tensor]
            next(o for o in self.optimizers if any(param is p for g in o.param_groups for p in g["params"])
                 ).register_step_post_hook(lambda optimizer, args, kwargs: self._in_update())

    def _in_update(self) -> None:
        if self._mine(self.making):
            self.fire(self.step, target=self.target, param=self.names[self.tensor])
            self._flip(self.params[self.tensor])

    def _flip(self, t: torch.Tensor) -> None:
        from keel.core.dtensor import local

        flat = local(t).detach().view(-1)
        bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        with torch.no_grad():
            bits[self.element % bits.numel()] ^= torch.tensor(1, dtype=bits.dtype) << self.bit

    def _mine(self, step: int) -> bool:
        """Once in the run: a restart that makes the step again makes it right."""
        return (dist.get_rank() == self.rank and step == self.step and self.delivered() == 0
                and self.group in (-1, replica_group()))

    def on_backward(self, step: Step, replaying: bool) -> None:
        self.making = step.number
        if self.target == "grads" and not replaying and self._mine(step.number):
            self.fire(self.step, target=self.target, param=self.names[self.tensor])
            self._flip(self.params[self.tensor].grad)

    def on_step_end(self, step: Step) -> None:
        state = step.state
        if self.target in ("grads", "update") or not self._mine(state.step):
            return
        self.fire(self.step, target=self.target, param=self.names[self.tensor])
        if self.target == "params":
            self._flip(self.params[self.tensor])
        else:
            param = self.params[self.tensor]
            optimizer = next(o for o in self.optimizers if param in o.state)
            self._flip(optimizer.state[param][self.target])


class SkipUpdateAt(Injector):
    """A guard that drops the update of step `step`: the clean reference for a skipped step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def inspect(self, report: Any) -> Any:
        from keel.core.actions import Action

        return Action("skip", "drill", f"told to skip step {self.step}") if report.step == self.step else None


INJECTORS = {"nan_grads": NanInGradients, "poison_batch": PoisonedBatch, "bitflip": BitFlip,
             "skip_update": SkipUpdateAt, "sigkill_after_checkpoint": SigkillAfterCheckpoint,
             "sigkill_during_checkpoint_write": SigkillDuringCheckpointWrite,
             "fill_disk_before_checkpoint": FillDiskBeforeCheckpoint,
             "read_only_before_checkpoint": ReadOnlyBeforeCheckpoint, "kill": KillInStep,
             "kill_in_reduce": KillInReduce, "kill_rejoined": KillRejoined, "kill_joining": KillJoining,
             "kill_healing": KillHealing, "kill_lighthouse_serving": KillLighthouseServing, "hang": HangInStep,
             "signal": SignalInStep, "slow": SlowRank, "slow_collective": SlowCollective,
             "wrong_allreduce": WrongAllReduce}


def parse_injection(spec: str) -> Injector:
    """`KIND:key=value,...` → the injector, e.g. `bitflip:step=40,rank=1,target=params,bit=30`."""
    kind, _, args = spec.partition(":")
    if kind not in INJECTORS:
        raise ConfigError(f"drill.inject {spec!r}: unknown fault {kind!r}; expected one of {', '.join(INJECTORS)}")
    kwargs: dict[str, Any] = {}
    for item in filter(None, args.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"drill.inject {spec!r}: expected key=value, not {item!r}")
        try:
            kwargs[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            kwargs[key.strip()] = raw
    try:
        return INJECTORS[kind](**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"drill.inject {spec!r}: {e}") from None


def inject(spec: str, index: int, run_dir: str) -> Injector:
    """The injector of `drill.inject`'s `index`-th entry, as a `[[callbacks]]` entry makes it."""
    injector = parse_injection(spec)
    injector.attach(spec, index, Path(run_dir))
    return injector


def as_callbacks(specs: list[str], run_dir: Path) -> list[CallbackSpec]:
    """`drill.inject`'s entries as ordinary `[[callbacks]]` entries (checked first: a bad one is a config error)."""
    check_injections(specs)
    return [CallbackSpec(path="keel.drill.faults:inject", args={"spec": spec, "index": i, "run_dir": str(run_dir)})
            for i, spec in enumerate(specs)]


def check_injections(specs: list[str]) -> None:
    """Every `drill.inject` entry names a known fault with arguments that fit, before a worker starts."""
    for spec in specs:
        parse_injection(spec)
