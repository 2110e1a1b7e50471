"""The training loop of one worker process: `Trainer.build` sets the run up, `Trainer.fit` is the loop,
`Trainer.close` releases what was built. Every feature attaches as a component (keel.train.components);
`keel.train.worker.train` is the process around it."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from keel.checkpoint.interval import IntervalPolicy
from keel.config import CallbackSpec, Config, check_vocab_size, to_toml
from keel.core.callbacks import Build, Callback, Hooks, Step
from keel.core.state import NamedState, Stateful, TrainState, seed_everything
from keel.core.sync import StepSync
from keel.data.shards import open_corpus
from keel.data.tokenizer import bits_per_byte
from keel.guard.engine import Guards
from keel.health.signals import StopRequests
from keel.health.straggler import StragglerDetector
from keel.health.watchdog import Watchdog
from keel.model.flops import flops_per_token, param_count
from keel.model.llama import width_ratio
from keel.monitor.metrics import CommProfiler, MemoryMeter, StepMeter
from keel.monitor.mfu import resolve_peak_flops
from keel.monitor.run_monitor import RunMonitor
from keel.monitor.trackers import run_trackers
from keel.parallel.layout import Layout
from keel.parallel.mesh import Dist
from keel.rundir.events import RunLog, host
from keel.rundir.status import write_status
from keel.train import components, setup
from keel.train.callbacks import load_callbacks
from keel.train.downstream import downstream_evaluation
from keel.train.experts import expert_balance
from keel.train.memory_tier import memory_checkpoints
from keel.train.optim import build_optimizer, lr_at
from keel.train.replicas import ReplicaGroups
from keel.train.reuse import job_key, measured_peak
from keel.train.rollback import Recovery
from keel.train.signals import InstabilitySignals
from keel.train.stopping import (
    Stopping,
    already_finished,
    finished,
    paused_before_training,
    rendezvous_timeout,
    stop_agreed,
)
from keel.train.watching import Evaluation, StepEnd, WatchdogPhases, WatchdogSections

if TYPE_CHECKING:
    from keel.parallel.pipeline import Pipeline


class Trainer:
    """One worker's part of the run."""

    def __init__(self, cfg: Config, run_dir: Path, ctx: Dist, layout: Layout, log: RunLog, requests: StopRequests,
                 watchdog: Watchdog, monitor: RunMonitor) -> None:
        self.cfg, self.run_dir, self.ctx, self.layout, self.log = cfg, run_dir, ctx, layout, log
        self.requests, self.watchdog, self.monitor = requests, watchdog, monitor
        self.events, self.say, self.rank0 = log.events, log.say, ctx.rank == 0
        self.state, self.hooks = TrainState(), Hooks()

    def build(self, resume: str, accepted: tuple[str, ...], callbacks: list[CallbackSpec],
              times: dict[str, Any]) -> int | None:
        """Everything before the first step. Returns an exit code when the run ends before it."""
        cfg, ctx = self.cfg, self.ctx
        if stop_agreed(self.requests, ctx.device):  # asked to stop while starting: nothing to save yet
            return paused_before_training(self.requests, self.run_dir, self.events, self.say, self.rank0)
        corpus = open_corpus(cfg.data.dir, cfg.data.verify_checksums)
        check_vocab_size(cfg, corpus.vocab_size)
        users = load_callbacks(callbacks)
        self.manager = setup.checkpoint_manager(cfg, self.run_dir, self.layout, self.events, self.hooks, corpus,
                                                accepted)
        if cfg.fault_tolerance.replica_groups == 1:  # replica groups mostly heal from a live peer instead
            self.manager.prefetch(resume)  # the checkpoint's checks run while the model is built
        self.job = job_key(ctx.world_size)
        if (code := setup.preflight(cfg, self.run_dir, ctx, users, self.events, self.say, self.job)) is not None:
            return code
        seed_everything(cfg.train.seed, ctx.rank)
        self.memory = MemoryMeter(ctx.device)  # before the model: what the runtime holds
        self._build_model()
        self.manager.reserve(self.parts, self.optimizers)  # the first save's buffers, beside the rest of the start
        self.corpus, self.data = corpus, setup.build_data(cfg, self.layout, corpus, accepted)
        setup.mask_documents(cfg, self.parts, corpus)
        self.loader, self.loader_state = self.data.loader, self.data.loader_state
        # Step replays compare a rank's own gradients, which the replica groups' average replaces.
        replays = cfg.train.deterministic and cfg.fault_tolerance.replica_groups == 1
        self.guards = Guards(cfg.guard, replays, self.layout, self.optimizers, self.stepper.names,
                             [cb for cb in users if hasattr(cb, "inspect")], self.events, self.say)
        self.hosts = setup.gather_hosts(ctx.world_size)
        self._attach(users)
        self.events.emit("start", 0, pid=os.getpid(), host=host(), world_size=ctx.world_size, device=str(ctx.device),
                         config_digest=cfg.digest(), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                         **times)
        if self.rank0:
            self.events.emit("attention", 0, **self.attention)
        # A group that joins live peers further on receives their state instead of reading storage.
        healed = self.replicas is not None and self.replicas.join()
        if (code := self._resume(resume, accepted, restore=not healed)) is not None:
            return code
        self._announce()
        self.hooks.notify("on_build", Build(self.parts, self.optimizers, ctx.rank, ctx.world_size, self.run_dir,
                                            self.events.emit, self.say))
        self.hooks.notify("on_start", self.state)
        self.guards.begin(self.state)
        self.monitor.begin(self.guards.metrics())
        self.monitor.ledger.charge("startup")
        self.meter.restart()
        return None

    def _build_model(self) -> None:
        cfg, layout = self.cfg, self.layout
        self.dtype = setup.precision_dtype(cfg, self.ctx.device)
        self.attention = setup.attention_kernel(cfg, layout, self.ctx.device, self.dtype)  # refused now if unrunnable
        autocast = self.dtype if self.dtype != torch.float32 else None
        objective = layout.objective(cfg.train)
        parts, stages = setup.build_model_parts(cfg, layout, self.dtype)
        self.parts: list[nn.Module] = list(parts)
        self.optimizers: list[torch.optim.Optimizer] = [
            build_optimizer(part, cfg.optim, width_ratio(cfg.model)) for part in parts]
        self.pipeline: Pipeline | None = None
        if layout.pipelined:
            from keel.parallel.pipeline import Pipeline  # torch's pipelining loads torch._dynamo

            self.pipeline = Pipeline(cfg, layout, parts, stages, self.optimizers, objective)
        self.stepper, self.evaluate = setup.stepper(cfg, parts, self.optimizers, self.pipeline, autocast, objective)
        self.sync = StepSync(layout.loss_divisor)

    def _attach(self, users: list[Callback]) -> None:
        """The components (each declares where its hooks run: keel.core.callbacks), and the state each saves."""
        cfg, ctx, monitor, watchdog, hooks, c = self.cfg, self.ctx, self.monitor, self.watchdog, self.hooks, components
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.peak = resolve_peak_flops(cfg.monitor.peak_flops, ctx.device, self.dtype,
                                       measure=partial(measured_peak, self.run_dir, self.job, ctx.device, self.dtype))
        self.say.mfu_shown = self.peak.shown
        self.meter = StepMeter(self.tokens_per_step, flops_per_token(cfg.model, cfg.train.seq_len)
                               * self.tokens_per_step, ctx.world_size, self.peak.flops)
        straggler = StragglerDetector(cfg.health.straggler, ctx.rank, ctx.world_size, self.hosts, self.events,
                                      self.say, self.run_dir, ctx.device)
        comm = CommProfiler(cfg.monitor.profile_interval, ctx.device.type)
        self.checkpointing = ckpt = c.Checkpointing(cfg.checkpoint, self.manager, IntervalPolicy(cfg.checkpoint),
                                                    monitor, self.events, self.say, self.state, hooks.notify,
                                                    self.status, self.rank0)
        metering = c.Metering(monitor, self.meter, comm)
        signals = InstabilitySignals(cfg.monitor.signals_interval, self.parts, self.optimizers, cfg.model.n_layers,
                                     self.layout.degrees.pp, cfg.train.float8_recipe == "rowwise")
        self.replicas = None if cfg.fault_tolerance.replica_groups == 1 else ReplicaGroups(
            cfg.fault_tolerance, self.parts, self.optimizers, self.state, self.loader, self.layout.dp_rank,
            self.layout.dp, monitor, self.run_dir, self.events, self.say, self.rank0,
            cfg.guard.sdc.fingerprint_interval if cfg.guard.enabled else 0)
        inspection = c.GuardInspection(self.guards, monitor, self.stepper,
                                       lambda step: hooks.notify("on_backward", step, True), self.sync)
        pause = c.PauseRequests(self.requests, straggler, self.sync)
        self.metrics = c.IntervalMetrics(cfg.train.steps, monitor, metering, self.loader, self.optimizers,
                                         self.layout.degrees.pp, ckpt,
                                         [lambda: comm.last, lambda: signals.last, self.guards.metrics,
                                          lambda: straggler.last, self.replicas.metrics if self.replicas else dict],
                                         self.data.train_text, self.status, self.memory)
        self.evaluation = Evaluation(lambda: setup.validated_loss(self.evaluate(self.data.val_batches)), self.bpb,
                                     watchdog, monitor, hooks.notify, self.say, cfg.eval.interval, cfg.eval.final)
        writer = c.CheckpointWriter(ckpt, self.parts, self.optimizers, watchdog)
        self.stopping = Stopping(pause, ckpt, writer, self.hosts, self.run_dir, self.status)
        self.recovery = Recovery(self.guards, self.manager, self.loader, self.parts, self.optimizers, self.state,
                                 self.hosts, self.events, self.say, self.run_dir, self.rank0, ckpt, monitor,
                                 self.status)
        for component in [metering, signals, *([self.replicas] if self.replicas else []), inspection, pause,
                          c.CheckpointDecision(ckpt, self.sync), WatchdogSections(watchdog),
                          c.GuardCheck(self.guards, monitor, inspection, signals.of_step), writer, self.stopping,
                          self.recovery, *run_trackers(cfg, self.run_dir, monitor, self.events, self.say, self.rank0),
                          *expert_balance(cfg, self.parts, ctx.device), *users, WatchdogPhases(watchdog),
                          *memory_checkpoints(writer), StepEnd(monitor, self.events.emit, self.rank0)]:
            hooks.add(component)
        hooks.add(self.metrics, cfg.monitor.interval)
        hooks.add(self.evaluation, cfg.eval.interval or cfg.train.steps)
        for downstream in downstream_evaluation(cfg, self.parts[0], self.corpus, self.dtype, watchdog, monitor,
                                                self.say):
            hooks.add(downstream, cfg.eval.downstream_interval or cfg.train.steps)
        self._register_state()

    def _register_state(self) -> None:
        registered: list[tuple[str, Stateful]] = [("loader", self.loader_state), ("callbacks", self.hooks),
                                                  ("guards", self.guards), ("health", self.watchdog)]
        registered += [(cb.state_name, cb) for cb in self.hooks.callbacks if isinstance(cb, NamedState)]
        if self.replicas is not None:
            self.checkpointing.writer = self.recovery.writer = self.replicas.is_writer
            self.replicas.joined_by_peer = lambda: self.guards.resnapshot(self.state)
            self.replicas.verified_now = lambda: self.guards.keep_verified(self.state)
            self.replicas.before_heal = self.manager.fence  # a save in flight has copied what a heal replaces
        for name, stateful in registered:
            self.state.register(name, stateful)

    def _resume(self, resume: str, accepted: tuple[str, ...], restore: bool = True) -> int | None:
        """The newest checkpoint that verifies, unless told otherwise (or the state came from a live replica group)."""
        cfg, state, ledger = self.cfg, self.state, self.monitor.ledger
        loading = time.perf_counter()
        ledger.charge("startup")
        restored = self.manager.restore(self.parts, self.optimizers, resume, self.say) if restore else None
        ledger.charge("checkpoint_restore")
        load_s = time.perf_counter() - loading
        if restored is None and restore and cfg.model.init_from:
            setup.load_initial_weights(self.parts, cfg.model.init_from, self.say)
        if restored is not None:
            (saved, resume_from), tier = restored, self.manager.restored_tier
            state.load(saved.record)
            self.loader_state.allow_corpus_change = True  # a rollback's states are all this run's own
            state.interruptions += 1
            self.hooks.notify("on_checkpoint_loaded", state, resume_from)
            ledger.restored(state.step, tier, load_s)
            if self.rank0:
                self.events.emit("resume", state.step, "resume", checkpoint=str(resume_from), tier=tier,
                                 tokens_seen=state.tokens_seen, load_s=round(load_s, 3))
            self.say(f"resumed {cfg.name} from {resume_from} ({tier} tier) at step {state.step}")
        if state.step >= cfg.train.steps:
            self.status("finished")
            return already_finished(cfg, self.run_dir, state.step, self.events, self.say, self.rank0)
        if stop_agreed(self.requests, self.ctx.device):  # asked while loading: the checkpoint loaded is the newest
            return paused_before_training(self.requests, self.run_dir, self.events, self.say, self.rank0,
                                          state.step, self.manager.latest())
        return None

    def _announce(self) -> None:
        cfg, ctx, state = self.cfg, self.ctx, self.state
        if self.rank0:
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        self.status("running", pid=os.getpid(), host=host(), world_size=ctx.world_size)
        self.say(f"training {cfg.name}: {param_count(cfg.model) / 1e6:.2f}M parameters, {ctx.world_size} × "
                 f"{ctx.device.type} ({self.layout.describe()}), global batch {cfg.train.global_batch} × "
                 f"{cfg.train.seq_len} tokens, steps {state.step} → {cfg.train.steps}, run directory {self.run_dir}")
        self.say.log(self.peak.note())  # the log's, like the watchdog's timeouts: not for the first screen
        if cfg.health.watchdog.enabled:
            self.watchdog.hosts = self.hosts
            self.say.log(self.watchdog.describe(rendezvous_timeout()))

    def fit(self) -> int:
        """Each step: a batch, forward and backward, the step's one reduction, the components' verdict after
        the backward, update or skip, advance, the step-end components; then what the strongest action asks."""
        state, hooks, stepper, cfg = self.state, self.hooks, self.stepper, self.cfg
        while state.step < cfg.train.steps:
            hooks.notify("before_step", state)
            step = Step(state.step + 1, state, last=state.step + 1 == cfg.train.steps,
                        lr=lr_at(state.step, cfg.optim, cfg.train.steps))
            hooks.notify("on_step_start", step)
            started = time.perf_counter()
            step.micro_batches, step.batch = self.loader.next(), self.loader.last_batch
            step.data_s = time.perf_counter() - started
            hooks.notify("on_batch", step)
            started = time.perf_counter()
            step.loss = stepper.forward_backward(step.micro_batches)
            hooks.notify("on_backward", step, False)
            step.own_s = time.perf_counter() - started
            step.grad_norm = stepper.grad_norm()
            step.report = self.sync.reduce(step.number, step.loss, step.grad_norm,
                                           partial(stepper.nonfinite_here, step.loss), step.data_s,
                                           time.perf_counter() - started)
            step.compute_s = time.perf_counter() - started
            step.updated, started = hooks.ask("after_backward", step).updates, time.perf_counter()
            if step.updated:
                stepper.update(step.lr, step.grad_norm)
            else:
                stepper.drop()
            step.update_s = time.perf_counter() - started
            if not step.action.ends_step:
                state.step += 1
                state.tokens_seen += self.tokens_per_step
                hooks.ask("on_step_end", step)
            if (code := hooks.carry_out(step)) is not None:
                return code
        return self._finish()

    def _finish(self) -> int:
        self.hooks.notify("on_end", self.state)
        val_loss = self.evaluation.val_loss
        summary = setup.run_summary(self.cfg, self.state, self.corpus, self.metrics.train_loss, val_loss,
                                    self.bpb(val_loss), self.run_dir, self.manager.latest())
        self.requests.consume()  # a pause asked for at the last step has nothing left to pause
        self.status("finished" if self.checkpointing.final_saved else "failed")
        return finished(summary, self.checkpointing, self.run_dir)

    def close(self) -> None:
        """A save still in flight after an error is abandoned: its .tmp is cleaned at the next start."""
        if hasattr(self, "loader"):
            self.loader.close()
        if (replicas := getattr(self, "replicas", None)) is not None:
            replicas.close()

    def status(self, kind: str, **detail: object) -> None:
        if self.rank0:
            latest = self.manager.latest() if hasattr(self, "manager") else None
            write_status(self.run_dir, kind, self.state.step, checkpoint=latest, **detail)

    def bpb(self, loss: float) -> float:
        return bits_per_byte(loss, *self.data.val_text)
