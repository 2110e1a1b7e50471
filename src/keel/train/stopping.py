"""Ending a run on request: a pause (exit 75, the rerun resumes) or a node's leave (exit 76), after the
step's checkpoint; and a pause asked before the first step."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import Config
from keel.core.actions import Action
from keel.core.callbacks import Step
from keel.errors import EXIT_PAUSED, EXIT_QUARANTINE, EXIT_STORAGE
from keel.health.signals import StopRequests
from keel.rundir.events import EventLog
from keel.rundir.progress import Progress, summary_lines
from keel.rundir.quarantine import quarantined_nodes
from keel.rundir.status import read_status, write_status
from keel.train.components import Builtin, Checkpointing, CheckpointWriter, PauseRequests


def rendezvous_timeout() -> float | None:
    """The elastic agent's join timeout, when the launcher set one (an elastic multi-node job)."""
    value = os.environ.get("KEEL_RDZV_TIMEOUT_S")
    return float(value) if value else None


class Stopping(Builtin):
    """A pause the step asked for ends the run once every rank has written its part of the step's
    checkpoint (synchronously): exit 75 (paused: the rerun resumes there), or 76 when a node of this job
    is quarantined (a straggler, or `keel quarantine`, whose launcher then stopped its workers): the
    other nodes restart without it."""
    priority = 50  # after the writer: a pause follows its save

    def __init__(self, pause: PauseRequests, ckpt: Checkpointing, writer: CheckpointWriter, hosts: list[str],
                 run_dir: Path, status: Callable[..., None]) -> None:
        self.pause, self.ckpt, self.writer, self.hosts = pause, ckpt, writer, hosts
        self.run_dir, self.status = run_dir, status

    def on_step_end(self, step: Step) -> Action | None:
        if step.action.kind != "pause" or step.last:
            return None
        code = self._stop(step.state.step, step.action.reason)
        return Action("pause", step.action.guard, step.action.reason, exit_code=code)

    def carry_out(self, step: Step) -> int | None:
        """A pause asked after this component's turn (by a configured callback, which runs after it): the step's
        checkpoint is written to the end (or the one written in the background finished), then the stop."""
        if step.action.kind != "pause" or step.action.exit_code is not None or step.last:
            return None
        if self.writer.saved_step == step.state.step:
            self.ckpt.finish()
        else:
            self.writer.save(step, wait=True)
        return self._stop(step.state.step, step.action.reason)

    def _stop(self, step: int, asked_for: str) -> int:
        requests, ckpt, rank0 = self.pause.requests, self.ckpt, self.ckpt.rank0
        saved, checkpoint, events, say = ckpt.final_saved, ckpt.manager.latest(), ckpt.events, ckpt.say
        reason = (requests.reason() if requests.pending() else
                  f"asked on {self.pause.asked:.0f} other rank(s)" if self.pause.asked else asked_for)
        # Only an elastic job can go on without a node, unless a straggler's node was just listed.
        consult = self.pause.leave or rendezvous_timeout() is not None
        leaving = [sorted(quarantined_nodes(self.run_dir) & set(self.hosts)) if rank0 and consult else None]
        dist.broadcast_object_list(leaving, src=0)  # every rank exits with the same code
        dist.barrier()  # no rank leaves while another still commits: the agent would stop it half-way
        requests.consume()
        where = (f"checkpoint {checkpoint} committed" if saved and ckpt.writer() else
                 f"another replica group writes the run's checkpoints, the newest is {checkpoint}" if saved else
                 f"its checkpoint failed, the newest is {checkpoint}")
        if leaving[0]:
            if rank0:
                events.emit("leave", step, "quarantine", nodes=leaving[0], checkpoint=checkpoint, saved=saved)
            self.status("stopped", reason=f"node(s) {', '.join(leaving[0])} quarantined: restarting without them")
            say(f"stopped at step {step}: node(s) {', '.join(leaving[0])} quarantined; {where}; exiting with code "
                f"{EXIT_QUARANTINE} so that the job goes on without them")
            return EXIT_QUARANTINE
        if rank0:
            events.emit("pause", step, "paused", reason=reason, checkpoint=checkpoint, saved=saved)
        self.status("paused", reason=reason)
        say(f"paused at step {step} ({reason}): {where}; run the same command to resume")
        return EXIT_PAUSED


def stop_agreed(requests: StopRequests, device: torch.device) -> bool:
    """Whether any rank was asked to stop, agreed by all (every rank takes the same branch)."""
    flag = torch.tensor([float(requests.pending())], device=device)
    dist.all_reduce(flag)
    return bool(flag.item() > 0)


def paused_before_training(requests: StopRequests, run_dir: Path, events: EventLog, say: Callable[[str], None],
                           rank0: bool, step: int = 0, checkpoint: str | None = None) -> int:
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


def finished(summary: dict, ckpt: Checkpointing, run_dir: Path) -> int:
    """The run made its last step: its summary written, announced and printed (on rank 0); exit 0, or the code
    of a final checkpoint that could not be written (EXIT_STORAGE when the volume refused it: no restart)."""
    if ckpt.rank0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        ckpt.events.emit("finish", summary["step"], "finished", train_loss=summary["train_loss"],
                         val_loss=summary["val_loss"], train_seconds=summary["train_seconds"])
        ckpt.say.lines(summary_lines(summary))
    if ckpt.final_saved:
        return 0
    ckpt.say(f"error: the final checkpoint could not be written; the newest checkpoint is {ckpt.manager.latest()}, "
             f"run the same command again to redo the steps after it")
    # A volume that refused the last save refuses a restart's too: not one the agent should spend.
    return EXIT_STORAGE if ckpt.volume_refused else 1


def already_finished(cfg: Config, run_dir: Path, step: int, events: EventLog, say: Progress, rank0: bool) -> int:
    """A resume of a run that has made all its steps: nothing to train."""
    if rank0:
        events.emit("finish", step, "already_finished")
        say(f"run {cfg.name} already finished at step {step} (train.steps = {cfg.train.steps}); nothing to train. "
            f"Raise train.steps to train further, or use another --run-dir to start over.")
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            say.lines(summary_lines(json.loads(summary_path.read_text())))
    return 0
