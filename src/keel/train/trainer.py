"""The training loop of one worker process. Read `train()` top to bottom: setup, resume, the loop."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import keel
from keel.checkpoint.identity import run_identity
from keel.checkpoint.interval import IntervalPolicy
from keel.checkpoint.manager import CheckpointManager, SaveOutcome, checkpoint_root
from keel.config import Config, check_vocab_size, resolve_layout, to_toml
from keel.core.actions import CONTINUE, Action
from keel.core.state import TrainState, seed_everything
from keel.core.sync import reduce_report
from keel.data.loader import GlobalOrderLoader, SequenceIndex, validation_batches
from keel.data.shards import Corpus, open_corpus
from keel.data.tokenizer import bits_per_byte, open_tokenizer
from keel.errors import EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE, DataError, KeelError, StorageError
from keel.guard.engine import Guards
from keel.health.preflight import run_preflight, verdict
from keel.health.signals import StopRequests
from keel.health.straggler import StragglerDetector
from keel.health.watchdog import Watchdog, is_collective_timeout
from keel.model.flops import flops_per_token, param_count
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.monitor.metrics import CommProfiler, StepMeter, peak_memory
from keel.monitor.mfu import resolve_peak_flops
from keel.monitor.run_monitor import RunMonitor
from keel.parallel.apply import parallelize
from keel.parallel.mesh import Dist, Mesh, build_mesh, destroy_distributed, init_distributed, pick_device
from keel.parallel.pipeline import Pipeline, stage_ids, stage_module
from keel.rundir.events import EventLog, RunLog, host
from keel.rundir.lock import RunLock, held_by_launcher, hold_as_worker
from keel.rundir.progress import Progress, summary_lines
from keel.rundir.quarantine import quarantined_nodes
from keel.rundir.status import read_status, write_status
from keel.train.callbacks import load_callbacks
from keel.train.optim import build_optimizer, lr_at, update_norm_sq
from keel.train.step import Stepper, evaluate


def train(cfg: Config, run_dir: Path, resume: str = "auto", accepted: tuple[str, ...] = ()) -> int:
    """Run (or resume) the training job described by `cfg` in this process. Returns the exit code.
    `accepted`: identity fields a resume may change on purpose (keel.checkpoint.identity)."""
    device = pick_device(cfg.train.device)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    entered = time.time()
    ctx = init_distributed(device)
    times = {"process_started": keel.STARTED, "entered": entered, "group_ready": time.time()}
    crashed = True
    lock = None
    requests = StopRequests(run_dir, ctx.rank)
    try:
        if not held_by_launcher(run_dir):  # started by torchrun itself: rank 0 holds the run directory
            lock = _lock_in_rank0(run_dir, ctx.rank)
        hold_as_worker(run_dir)
        mesh = build_mesh(ctx, resolve_layout(cfg, ctx.world_size))
        with RunLog(run_dir, ctx.rank, mesh.layout.describe()) as log:
            watchdog = Watchdog(cfg.health.watchdog, run_dir, ctx.rank, ctx.world_size, log.events, log.say)
            watchdog.start()
            monitor = RunMonitor(cfg, run_dir, ctx.rank, ctx.device, log, attempt_started(),
                                 checkpoint_root(cfg, run_dir).path())
            try:
                code = _train(cfg, run_dir, resume, accepted, ctx, mesh, log, requests, watchdog, monitor, times)
                monitor.close(ENDED.get(code, "failed"))
            except Exception as e:
                if watchdog.cfg.enabled and is_collective_timeout(e):
                    watchdog.collective_timed_out(e)  # names the stuck ranks, then ends the process
                raise
            finally:
                monitor.stop()
                watchdog.stop()
        crashed = False
        return code
    except KeelError:
        crashed = False  # bad input: every rank meets it at the same point
        raise
    except BaseException as e:
        if ctx.rank == 0 and run_dir.is_dir():
            last = read_status(run_dir)
            write_status(run_dir, "failed", last.get("step", 0), checkpoint=last.get("checkpoint"),
                         reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        requests.close()
        destroy_distributed(wait_for_peers=not crashed)
        if lock is not None:
            lock.release()


OVERDUE_FLOOR_S = 60.0
ENDED = {0: "finished", EXIT_PAUSED: "paused", EXIT_QUARANTINE: "stopped", EXIT_GUARD_STOP: "stopped"}


def attempt_started() -> float:
    """When this start of the run began, for the goodput ledger: the launcher's start for its first worker
    group, this process's own for a group the agent restarted or for a plain torchrun job (when each
    first imported keel: the kernel's process start times are rounded to the second)."""
    launched = os.environ.get("KEEL_LAUNCHED_AT")
    if launched and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return float(launched)
    return keel.STARTED


def _lock_in_rank0(run_dir: Path, rank: int) -> RunLock | None:
    lock, error = None, ""
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except KeelError as e:
            error = str(e)
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise KeelError(shared[0])
    return lock


def precision_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def build_model(cfg: Config, mesh: Mesh, param_dtype: torch.dtype) -> Llama:
    """Build on the meta device, parallelise, then allocate and initialise only this rank's shards."""
    return build_model_parts(cfg, mesh, param_dtype)[0][0]


def build_model_parts(cfg: Config, mesh: Mesh, param_dtype: torch.dtype) -> tuple[list[Llama], list[int]]:
    """The model, or this rank's pipeline stages and their stage numbers, parallelised and initialised."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    if mesh.layout.pp == 1:
        parts, stages = [model], [0]
    else:
        n_stages = mesh.layout.pp * cfg.parallel.pp_stages_per_rank
        stages = stage_ids(mesh.mesh.get_local_rank("pp"), mesh.layout.pp, cfg.parallel.pp_stages_per_rank)
        parts = [stage_module(model, stage, n_stages) for stage in stages]
    for part in parts:
        parallelize(part, mesh, cfg.parallel, param_dtype)
        part.to_empty(device=mesh.mesh.device_type)
        init_weights(part, cfg.train.seed)
    return parts, stages


def _train(cfg: Config, run_dir: Path, resume: str, accepted: tuple[str, ...], ctx: Dist, mesh: Mesh, log: RunLog,
           requests: StopRequests, watchdog: Watchdog, monitor: RunMonitor, times: dict[str, float]) -> int:
    """`times`: when this process first imported keel, entered `train` and had its process group (for the
    start event, from which recovery times are measured)."""
    rank0, events, say = ctx.rank == 0, log.events, log.say
    ledger, registry = monitor.ledger, monitor.registry
    if _stop_agreed(requests, ctx.device):  # asked to stop while starting: nothing to save yet
        return _paused_before_training(requests, run_dir, events, say, rank0)

    corpus = open_corpus(cfg.data.dir, cfg.data.verify_checksums)
    check_vocab_size(cfg, corpus.vocab_size)
    callbacks = load_callbacks(cfg.callbacks, cfg.drill.inject)
    if cfg.drill.inject:
        from keel.drill.faults import attach_injectors

        attach_injectors(callbacks.callbacks, cfg.drill.inject, events, run_dir)
    if cfg.health.preflight != "off":
        probes = [cb.corrupt_probe for cb in callbacks.callbacks if hasattr(cb, "corrupt_probe")]
        checks = run_preflight(cfg, checkpoint_root(cfg, run_dir).path(), param_count(cfg.model), events, say,
                               corrupt=probes[0] if probes else None, device=ctx.device)
        if (code := verdict(checks, cfg.health.preflight, run_dir, ctx.rank)) is not None:
            say(f"error: preflight failed; the nodes at fault are in {run_dir / 'quarantine.json'}; exiting with "
                f"code {code} so that the job goes on without them")
            return code
    seed_everything(cfg.train.seed, ctx.rank)
    dtype = precision_dtype(cfg, ctx.device)
    autocast_dtype = dtype if dtype != torch.float32 else None
    tp = mesh.layout.tp > 1
    parts, stages = build_model_parts(cfg, mesh, dtype)
    optimizers = [build_optimizer(part, cfg.optim) for part in parts]
    pipeline = Pipeline(cfg, mesh, parts, stages, optimizers, tp) if mesh.layout.pp > 1 else None
    if set(corpus.sources) != set(cfg.data.sources):
        raise DataError(f"data.dir {cfg.data.dir} holds the sources {', '.join(corpus.sources)}, the config names "
                        f"{', '.join(cfg.data.sources)}; name them alike in [data.sources] or prepare the corpus again")
    loader = GlobalOrderLoader(
        corpus.sources, weights={name: s.weight for name, s in cfg.data.sources.items()},
        schedule=[(p.step, p.weights) for p in cfg.data.schedule], seq_len=cfg.train.seq_len,
        global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch, dp_rank=mesh.dp_rank,
        dp_size=mesh.layout.dp, seed=cfg.train.seed,
        fingerprint=corpus.fingerprint, prefetch=cfg.data.prefetch, skips=cfg.data.skip_batches)
    val_batches = validation_batches(corpus.splits["val"], seq_len=cfg.train.seq_len, sequences=cfg.eval.sequences,
                                     micro_batch=cfg.train.micro_batch, dp_rank=mesh.dp_rank,
                                     dp_size=mesh.layout.dp)
    val_tokens, val_bytes = validation_text(corpus, cfg.train.seq_len, cfg.eval.sequences)
    train_tokens, train_bytes = corpus.manifest["tokens"]["train"], corpus.manifest["text_bytes"]["train"]
    # Where the tokenizer's file lies, for `keel ckpt export` to find it (its sha256 says it is the same one).
    described = {**corpus.manifest["tokenizer"], "corpus": str(corpus.dir.resolve())}
    manager = CheckpointManager(cfg, run_dir, mesh.layout.describe(), events, on_write=callbacks.on_checkpoint_write,
                                tokenizer=described,
                                identity=run_identity(cfg, corpus.fingerprint, corpus.manifest["tokenizer"]),
                                accepted=accepted)
    stepper = Stepper(parts, optimizers, pipeline, grad_clip=cfg.optim.grad_clip, autocast_dtype=autocast_dtype,
                      loss_parallel=tp)
    guards = Guards(cfg, mesh, parts, optimizers, stepper.params, loader, manager, callbacks.guards(), events, say,
                    run_dir)

    # Resume: the newest checkpoint of the run that verifies, unless told otherwise.
    state = TrainState()
    events.emit("start", 0, pid=os.getpid(), host=host(), world_size=ctx.world_size, device=str(ctx.device),
                config_digest=cfg.digest(), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                **times)
    loading = time.perf_counter()
    ledger.charge("startup")
    restored = manager.restore(parts, optimizers, resume, say)
    ledger.charge("checkpoint_restore")
    load_s = time.perf_counter() - loading
    if restored is None and cfg.model.init_from:
        from keel.checkpoint.export import load_hf_weights

        for part in parts:
            load_hf_weights(part, Path(cfg.model.init_from.removeprefix("hf:")))
        say(f"initialised the weights from {cfg.model.init_from}")
    if restored is not None:
        state, resume_from = restored
        state.interruptions += 1
        loader.load_state_dict(state.loader, "data.corpus" in accepted)
        callbacks.load_state_dict(state.callbacks)
        guards.load_state_dict(state.guards)
        watchdog.load_state_dict(state.health)
        callbacks.on_checkpoint_loaded(state, resume_from)
        if rank0:
            events.emit("resume", state.step, "resume", checkpoint=str(resume_from), tokens_seen=state.tokens_seen,
                        load_s=round(load_s, 3))
        say(f"resumed {cfg.name} from {resume_from} at step {state.step}")
    if state.step >= cfg.train.steps:
        if rank0:
            write_status(run_dir, "finished", state.step, checkpoint=manager.latest())
        return _already_finished(cfg, run_dir, state, events, say, rank0)

    if _stop_agreed(requests, ctx.device):  # asked while loading: the checkpoint just loaded is the newest
        return _paused_before_training(requests, run_dir, events, say, rank0, state.step, manager.latest())

    def status(kind: str, **detail: object) -> None:
        if rank0:
            write_status(run_dir, kind, state.step, checkpoint=manager.latest(), **detail)

    if rank0:
        (run_dir / "config.toml").write_text(to_toml(cfg))
    status("running", pid=os.getpid(), host=host(), world_size=ctx.world_size)
    n_params = param_count(cfg.model)
    say(f"training {cfg.name}: {n_params / 1e6:.2f}M parameters, {ctx.world_size} × {ctx.device.type} "
        f"({mesh.layout.describe()}), "
        f"global batch {cfg.train.global_batch} × {cfg.train.seq_len} tokens, steps {state.step} → {cfg.train.steps}, "
        f"run directory {run_dir}")

    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    peak, peak_note = resolve_peak_flops(cfg.monitor.peak_flops, ctx.device, dtype)
    say(f"MFU against {peak_note}")
    if cfg.health.watchdog.enabled:
        watchdog.hosts = guards.hosts
        say(watchdog.describe(rendezvous_timeout()))
    meter = StepMeter(tokens_per_step, flops_per_token(cfg.model, cfg.train.seq_len) * tokens_per_step,
                      ctx.world_size, peak)
    straggler = StragglerDetector(cfg.health.straggler, ctx.rank, ctx.world_size, guards.hosts, events, say, run_dir,
                                  ctx.device)
    comm = CommProfiler(cfg.monitor.profile_interval, ctx.device.type, also_every=straggler.cfg.interval)
    policy = IntervalPolicy(cfg.checkpoint)

    def after_save(outcome: SaveOutcome) -> None:
        """Every rank handles the same outcome at the same step."""
        if outcome.committed:
            monitor.checkpoint_committed()
            say(f"checkpoint {outcome.path} committed: {outcome.bytes / 2**20:.1f} MiB, training blocked "
                f"{outcome.blocking_s:.3f} s, written in the background in {outcome.write_s:.2f} s")
            callbacks.on_checkpoint_saved(state, outcome.path)
            status("running")
        elif outcome.volume_error and cfg.checkpoint.on_storage_error == "stop":
            status("stopped", reason=outcome.error)
            raise StorageError(f"the checkpoint of step {outcome.step} failed: {outcome.error}; stopped "
                               f"(checkpoint.on_storage_error = \"stop\"), the newest checkpoint is {manager.latest()}",
                               every_rank=True)
        else:
            say(f"warning: the checkpoint of step {outcome.step} failed ({outcome.error}); training continues, "
                f"the next save retries")
            callbacks.on_checkpoint_failed(state, outcome.step, outcome.error)
        if rank0 and outcome.waited_s > 0.01:
            events.emit("checkpoint", state.step, "waited", waited_s=round(outcome.waited_s, 3),
                        reason=f"the save of step {outcome.step} was still being written")
        monitor.publish({"step": state.step, "checkpoint/blocking_s": outcome.blocking_s,
                    "checkpoint/write_s": outcome.write_s, "checkpoint/waited_s": outcome.waited_s})
        decision = policy.update(outcome.blocking_s, outcome.train_s, state.interruptions)
        if decision and rank0:
            events.emit("checkpoint", state.step, "interval", **decision)
            say(f"checkpoint interval (Young/Daly): every {decision['interval_s']:.1f} s of training for a blocking "
                f"cost of {decision['delta_s']:.3f} s and a mean time between failures of {decision['mtbf_s']:.0f} s")

    def carry_out(action: Action) -> int | None:
        """Let the guards roll back, stop or quarantine, once the save in flight has finished; returns
        an exit code when the run must end."""
        nonlocal state
        outcome = manager.finish()
        if outcome is not None:
            after_save(outcome)
        ledger.spent("productive")
        state, code = guards.apply(action, state)
        ledger.charge("checkpoint_restore" if action.rolls_back else "guard_checks")
        if code is not None:
            status("stopped" if code in (EXIT_GUARD_STOP, EXIT_QUARANTINE) else "failed", reason=action.reason)
        return code

    callbacks.on_build(parts, optimizers)
    callbacks.on_start(state)
    guards.begin(state)
    monitor.begin(guards.metrics())
    steps_since_log = 0
    ledger.charge("startup")
    meter.restart()
    started = last_save = time.perf_counter()
    train_loss = val_loss = float("nan")
    final_saved = True
    first_step = True
    try:
        while state.step < cfg.train.steps:
            step = state.step + 1  # the step being made
            watchdog.begin("step", step)
            ledger.begin_step(step)
            with monitor.phase("data_wait", "time/data_s") as waited:
                micro_batches = loader.next()
            data_s = waited.seconds
            meter.add_data_wait(data_s)
            callbacks.on_step_start(state, micro_batches, loader.last_batch)
            lr = lr_at(state.step, cfg.optim, cfg.train.steps) * guards.lr_factor(state.step)
            log_step = step % cfg.monitor.interval == 0 or step == cfg.train.steps
            action = CONTINUE
            with comm.profile(step):
                computing = time.perf_counter()
                watchdog.phase("forward_backward")
                loss = stepper.forward_backward(micro_batches)
                callbacks.after_backward(state, False)
                watchdog.phase("reduce")  # from here on a rank waits for the others in collectives
                grad_norm = stepper.grad_norm()
                # The step's one host synchronisation: the guards' report, which also tells every rank
                # whether the background save has finished everywhere, how long ago the last one was, and
                # whether any rank was asked to pause.
                report = reduce_report(step, loss, grad_norm, mesh.layout.dp * mesh.layout.tp,
                                       [float(manager.done()), time.perf_counter() - last_save,
                                        float(requests.pending())],
                                       partial(stepper.nonfinite_here, loss), data_s=data_s,
                                       step_s=time.perf_counter() - computing)
                registry.add("time/forward_backward_s", time.perf_counter() - computing)
                with monitor.phase("guard_checks") as inspecting:
                    if guards.reporting:
                        replay = partial(stepper.recompute, micro_batches,
                                         partial(callbacks.after_backward, state, True))
                        action = guards.inspect(state, report, replay)
                watchdog.phase("update")
                with monitor.phase("productive", "time/optimizer_s"):
                    if action.kind == "continue":
                        stepper.update(lr, grad_norm)
                    else:
                        stepper.drop()
            if action.kind not in ("continue", "skip"):
                if (code := carry_out(action)) is not None:
                    return code
                if action.rolls_back:
                    continue
            leave = straggler.due(step) and straggler.observe(step, comm.compute_s)
            state.step += 1
            state.tokens_seen += tokens_per_step
            meter.step_done()
            monitor.step_done(state.step)
            steps_since_log += 1
            last_step = state.step == cfg.train.steps
            metrics = {"step": state.step, "optim/lr": lr}
            pause = report.extras[2] > 0 or leave  # every rank sees the same sum: all stop at this step
            if report.extras[0] == ctx.world_size:
                after_save(manager.finish())
            save_now = (policy.due_by_step(state.step) or last_step or pause
                        or policy.due_by_time(report.extras[1] / ctx.world_size))

            if log_step:
                train_loss = report.loss
                registry.add("optim/update_norm_sq", update_norm_sq(optimizers, mesh.layout.pp)
                             * (action.kind == "continue"), reduce="sum")
                registry.add("memory/peak_bytes_max_rank", peak_memory(ctx.device), reduce="max")
                reduced = registry.reduce()  # the interval's one reduction of every metric
                report.update_norm = reduced.pop("optim/update_norm_sq") ** 0.5
                metrics.update({"train/loss": train_loss,
                                "train/bpb": bits_per_byte(train_loss, train_tokens, train_bytes),
                                **{f"data/tokens/{name}": n for name, n in loader.tokens_by_source().items()},
                                "optim/grad_norm": report.grad_norm,
                                "optim/update_norm": report.update_norm,
                                "train/tokens_seen": state.tokens_seen, **meter.window(), **reduced, **comm.last,
                                **guards.metrics(), **straggler.last})
                # The seconds between checkpoints the overdue alert expects: a few seconds of jitter (an
                # eval, a rollback) is no overdue checkpoint, so never less than OVERDUE_FLOOR_S.
                expected_s = max(OVERDUE_FLOOR_S, policy.every_s if policy.every_s < float("inf") else
                                 cfg.checkpoint.interval * metrics["time/step_s"])
                monitor.interval(metrics, steps_since_log, report.extras[1] / ctx.world_size, expected_s)
                steps_since_log = 0
                say.step(state.step, cfg.train.steps, metrics)
                status("running")

            watchdog.end()
            if (cfg.eval.interval and state.step % cfg.eval.interval == 0) or last_step:
                watchdog.begin("eval", state.step)
                with monitor.phase("evaluation", whole_step=False):
                    val_loss = _validate(pipeline.evaluate(val_batches) if pipeline else
                                         evaluate(parts[0], val_batches, autocast_dtype, loss_parallel=tp))
                watchdog.end()
                val_bpb = bits_per_byte(val_loss, val_tokens, val_bytes)
                monitor.publish({"step": state.step, "val/loss": val_loss, "val/bpb": val_bpb})
                metrics.update({"val/loss": val_loss, "val/bpb": val_bpb})
                say(f"step {state.step}: validation loss {val_loss:.4f} ({val_bpb:.4f} bits per byte)")
                callbacks.on_eval(state, val_loss)

            with monitor.phase("guard_checks") as checking:
                checked = guards.check(state, save_now)  # replica fingerprints before the state is saved or snapshotted
            registry.add("time/guard_s", inspecting.seconds + checking.seconds)
            if checked.kind != "continue":
                if (code := carry_out(checked)) is not None:
                    return code
                if checked.rolls_back:
                    continue

            if save_now:
                state.train_seconds += time.perf_counter() - started
                started = time.perf_counter()
                state.loader = loader.state_dict()
                state.callbacks = callbacks.state_dict()
                state.guards = guards.state_dict()
                state.health = watchdog.state_dict()
                watchdog.begin("checkpoint", state.step)
                with monitor.phase("checkpoint_blocking", whole_step=False) as saving:
                    for outcome in manager.save(parts, optimizers, state, wait=last_step or pause):
                        after_save(outcome)
                        final_saved = outcome.committed
                watchdog.end()
                last_save = time.perf_counter()
                ledger.flush(state.step)
            registry.add("time/checkpoint_s", saving.seconds if save_now else 0.0)  # a step's mean share
            if pause and not last_step:
                return _stop_here(requests, report.extras[2], state.step, final_saved, manager.latest(), guards.hosts,
                                  run_dir, events, say, status, rank0, straggler=leave)
            callbacks.on_step_end(state, metrics)
            ledger.spent("productive")
            if first_step and rank0:  # the start's first step is done: recovery ends here
                events.emit("step", state.step, "first")
            first_step = False
    finally:
        loader.close()  # a save still in flight after an error is abandoned: its .tmp is cleaned at the next start

    callbacks.on_end(state)
    summary = {"name": cfg.name, "step": state.step, "train_loss": train_loss, "val_loss": val_loss,
               "val_bpb": bits_per_byte(val_loss, val_tokens, val_bytes),
               "tokenizer": corpus.manifest["tokenizer"]["name"],
               "unigram_entropy": corpus.manifest["stats"]["unigram_entropy_nats"],
               "tokens_seen": state.tokens_seen, "train_seconds": round(state.train_seconds, 2),
               "tokens_per_s": state.tokens_seen / max(state.train_seconds, 1e-9),
               "run_dir": str(run_dir), "checkpoint": manager.latest()}
    requests.consume()  # a pause asked for at the last step has nothing left to pause
    status("finished" if final_saved else "failed")
    if rank0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        events.emit("finish", state.step, "finished", train_loss=train_loss, val_loss=val_loss,
                    train_seconds=summary["train_seconds"])
        say.lines(summary_lines(summary))
    if not final_saved:
        say(f"error: the final checkpoint could not be written; the newest checkpoint is {manager.latest()}, "
            f"run the same command again to redo the steps after it")
        return 1
    return 0


def rendezvous_timeout() -> float | None:
    """The elastic agent's join timeout, when the launcher set one (an elastic multi-node job)."""
    value = os.environ.get("KEEL_RDZV_TIMEOUT_S")
    return float(value) if value else None


def _stop_here(requests: StopRequests, asked: float, step: int, saved: bool, checkpoint: str | None,
               hosts: list[str], run_dir: Path, events: EventLog, say: Progress, status: Callable[..., None],
               rank0: bool, straggler: bool) -> int:
    """Every rank has written its part of the step's checkpoint (synchronously). Exit 75 (paused: the
    rerun resumes there), or 76 when a node of this job is quarantined (a straggler, or `keel
    quarantine`, whose launcher then stopped its workers): the other nodes restart without it.
    `asked`: how many ranks were asked to pause (a signal each, and rank 0 the control file)."""
    reason = requests.reason() if requests.pending() else f"asked on {asked:.0f} other rank(s)"
    # Only an elastic job can go on without a node, unless a straggler's node was just listed.
    consult = straggler or rendezvous_timeout() is not None
    leaving = [sorted(quarantined_nodes(run_dir) & set(hosts)) if rank0 and consult else None]
    dist.broadcast_object_list(leaving, src=0)  # every rank exits with the same code
    dist.barrier()  # no rank leaves while another still commits: the agent would stop it half-way
    requests.consume()
    where = f"checkpoint {checkpoint} committed" if saved else f"its checkpoint failed, the newest is {checkpoint}"
    if leaving[0]:
        if rank0:
            events.emit("leave", step, "quarantine", nodes=leaving[0], checkpoint=checkpoint, saved=saved)
        status("stopped", reason=f"node(s) {', '.join(leaving[0])} quarantined: restarting without them")
        say(f"stopped at step {step}: node(s) {', '.join(leaving[0])} quarantined; {where}; exiting with code "
            f"{EXIT_QUARANTINE} so that the job goes on without them")
        return EXIT_QUARANTINE
    if rank0:
        events.emit("pause", step, "paused", reason=reason, checkpoint=checkpoint, saved=saved)
    status("paused", reason=reason)
    say(f"paused at step {step} ({reason}): {where}; run the same command to resume")
    return EXIT_PAUSED


def _stop_agreed(requests: StopRequests, device: torch.device) -> bool:
    """Whether any rank was asked to stop, agreed by all (every rank takes the same branch)."""
    flag = torch.tensor([float(requests.pending())], device=device)
    dist.all_reduce(flag)
    return bool(flag.item() > 0)


def _paused_before_training(requests: StopRequests, run_dir: Path, events: EventLog, say: Progress, rank0: bool,
                            step: int = 0, checkpoint: str | None = None) -> int:
    """A pause asked for before the first step: the run is where its newest checkpoint left it."""
    reason = requests.reason() or "asked on another rank"
    dist.barrier()
    requests.consume()
    if rank0:
        last = read_status(run_dir)
        checkpoint = checkpoint or last.get("checkpoint")
        write_status(run_dir, "paused", step or last.get("step", 0), checkpoint=checkpoint, reason=reason)
        events.emit("pause", step, "paused", reason=reason, checkpoint=checkpoint, saved=False, before_training=True)
    say(f"paused before training ({reason}); the newest checkpoint is {checkpoint or 'none yet'}; run the same "
        f"command to resume")
    return EXIT_PAUSED


def validation_text(corpus: Corpus, seq_len: int, val_sequences: int) -> tuple[int, int]:
    """Target tokens of the fixed validation set and the UTF-8 bytes they stand for, so that its bits per
    byte are exact whatever the tokenizer (training's use the training split's average bytes per token)."""
    token_bytes = open_tokenizer(corpus.dir, corpus.manifest["tokenizer"]).token_bytes()
    targets = SequenceIndex(corpus.splits["val"], seq_len).tokens(np.arange(val_sequences))[:, 1:]
    return targets.size, int(token_bytes[targets].sum())


def _validate(sums: tuple[torch.Tensor, torch.Tensor]) -> float:
    # Ranks of one tensor-parallel group see the same batches: the sums scale alike, the mean is right.
    both = torch.stack(sums)
    dist.all_reduce(both)
    return (both[0] / both[1]).item()


def _already_finished(cfg: Config, run_dir: Path, state: TrainState, events: EventLog, say: Progress,
                      rank0: bool) -> int:
    if rank0:
        events.emit("finish", state.step, "already_finished")
        say(f"run {cfg.name} already finished at step {state.step} (train.steps = {cfg.train.steps}); nothing to "
            f"train. Raise train.steps to train further, or use another --run-dir to start over.")
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            say.lines(summary_lines(json.loads(summary_path.read_text())))
    return 0

