"""One worker process of a run: its process group, the run directory's lock and logs, the watchdog and
the monitor around the Trainer, and the status left behind on every exit path."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import keel
from keel.checkpoint.memory import resume_on_restart
from keel.checkpoint.resume import checkpoint_root
from keel.config import CallbackSpec, Config
from keel.core import generations
from keel.errors import EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE, KeelError
from keel.health.signals import StopRequests
from keel.health.watchdog import Watchdog, is_collective_timeout
from keel.monitor.run_monitor import RunMonitor
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import Dist, destroy_distributed, init_distributed, pick_device
from keel.rundir.events import RunLog
from keel.rundir.lock import held_by_launcher, hold_as_worker
from keel.rundir.status import read_status, write_status
from keel.train.setup import attempt_started, lock_in_rank0
from keel.train.trainer import Trainer

ENDED = {0: "finished", EXIT_PAUSED: "paused", EXIT_QUARANTINE: "stopped", EXIT_GUARD_STOP: "stopped"}


def train(cfg: Config, run_dir: Path, resume: str = "auto", accepted: tuple[str, ...] = (),
          callbacks: list[CallbackSpec] | None = None) -> int:
    """Run (or resume) the training job described by `cfg` in this process. Returns the exit code.
    `accepted`: identity fields a resume may change on purpose (keel.checkpoint.identity); `callbacks`:
    the callbacks to attach (the configured ones unless given)."""
    device = pick_device(cfg.train.device)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    generation = generations.joined()
    while True:
        try:
            return _generation(cfg, run_dir, device, generation, resume, accepted, callbacks)
        except PeerReplaced as e:  # this process survived a peer's death: it meets the replacement
            generation = e.generation
            # From here on the process is of that generation, started when it began to rejoin (its goodput
            # attempt), and resumes the run's own latest checkpoint as a restarted worker does.
            os.environ[generations.GENERATION_ENV], keel.STARTED = str(generation), e.caught
            resume = resume_on_restart(cfg, checkpoint_root(cfg, run_dir), resume)
            print(f"keel: rank {e.rank}: {e.why}; rank(s) {', '.join(map(str, e.ranks))} replaced, this process "
                  f"rejoins the job (generation {generation}) and restores in place", file=sys.stderr, flush=True)


class PeerReplaced(Exception):
    """A peer of this worker died and its launcher started a replacement for it alone (keel.core.generations):
    this worker, its process group left, joins the next generation."""

    def __init__(self, rank: int, generation: int, ranks: list[int], why: str) -> None:
        super().__init__(f"rank(s) {ranks} replaced: generation {generation}")
        self.rank, self.generation, self.ranks, self.why, self.caught = rank, generation, ranks, why, time.time()


def _generation(cfg: Config, run_dir: Path, device: torch.device, generation: int, resume: str,
                accepted: tuple[str, ...], callbacks: list[CallbackSpec] | None) -> int:
    """One generation of the job's process group in this process: joined, trained in, left."""
    entered = time.time()
    ctx = init_distributed(device, generation)
    times = {"process_started": keel.STARTED, "entered": entered, "group_ready": time.time()}
    crashed = True
    lock = None
    requests = StopRequests(run_dir, ctx.rank)
    try:
        if not held_by_launcher(run_dir):  # started by torchrun itself: rank 0 holds the run directory
            lock = lock_in_rank0(run_dir, ctx.rank)
        hold_as_worker(run_dir)
        code = _run(cfg, run_dir, ctx, requests, resume, accepted, cfg.callbacks if callbacks is None else callbacks,
                    times)
        crashed = False
        return code
    except KeelError:
        crashed = False  # bad input: every rank meets it at the same point
        raise
    except BaseException as e:
        if isinstance(e, Exception) and generations.enabled() and \
                (ranks := generations.announced(generation + 1)) is not None and ctx.rank not in ranks:
            raise PeerReplaced(ctx.rank, generation + 1, ranks, str(e).splitlines()[0] if str(e) else
                               type(e).__name__) from e
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


def _run(cfg: Config, run_dir: Path, ctx: Dist, requests: StopRequests, resume: str, accepted: tuple[str, ...],
         callbacks: list[CallbackSpec], times: dict[str, float]) -> int:
    """The Trainer inside the run's logs, watchdog and monitor, which outlive it on every path."""
    layout = Layout.build(ctx.device.type, resolve_degrees(cfg, ctx.world_size))
    with RunLog(run_dir, ctx.rank, layout.describe()) as log:
        watchdog = Watchdog(cfg.health.watchdog, run_dir, ctx.rank, ctx.world_size, log.events, log.say)
        watchdog.start()
        monitor = RunMonitor(cfg.monitor, run_dir, ctx.rank, ctx.device, log, attempt_started(),
                             checkpoint_root(cfg, run_dir).path())
        try:
            trainer = Trainer(cfg, run_dir, ctx, layout, log, requests, watchdog, monitor)
            try:
                code = trainer.build(resume, accepted, callbacks, times)
                if code is None:
                    code = trainer.fit()
            finally:
                trainer.close()
            monitor.close(ENDED.get(code, "failed"))
            return code
        except Exception as e:
            if watchdog.cfg.enabled and is_collective_timeout(e):
                watchdog.collective_timed_out(e)  # names the stuck ranks, then ends the process
            raise
        finally:
            monitor.stop()
            watchdog.stop()
