"""`keel train --replica-groups R --nproc N`: a torchft lighthouse and one keel launcher per replica group.

Each group is a whole job of its own — its own torchrun agent, rendezvous and store, restarts
(`fault_tolerance.max_restarts`) and run directory (RUN_DIR/groups/G: its logs, events, status and
heartbeats) — and every group reads and writes the run's one checkpoint directory (RUN_DIR/checkpoints
unless `checkpoint.dir` says otherwise). The groups find each other through the lighthouse: started
here on loopback, or the one `fault_tolerance.lighthouse` names (on a cluster, one group per Slurm
job step or Kubernetes pod set, each started with KEEL_REPLICA_GROUP set). A group that fails is
restarted by its own agent and heals from the live groups while they keep training.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType

from keel.config import Config
from keel.core.net import free_port
from keel.core.replica import GROUP_ENV, LIGHTHOUSE_ENV, ROOT_ENV
from keel.errors import EXIT_PAUSED, EXIT_STORAGE, KeelError
from keel.health.signals import SIGNALS as STOP_SIGNALS
from keel.launch import without_flags
from keel.rundir.events import EventLog
from keel.rundir.status import read_status
from keel.train import lighthouse as lighthouse_script
from keel.train.replicas import heartbeats

GROUP_FLAGS = ("--replica-groups", "--run-dir", "--nproc", "--max-restarts")
LIGHTHOUSE_WAIT_S = 30.0
LIGHTHOUSE_POLL_S = 0.05  # how soon a lighthouse that died is started again
LIGHTHOUSE_READ_S = 1.0  # how often the groups the lighthouse sees heartbeat are read from it


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir / "groups" / str(group)


def shared_checkpoints(cfg: Config, run_dir: Path) -> str:
    """The run's one checkpoint directory, which every group reads and the writing group writes."""
    return cfg.checkpoint.dir or str((run_dir / "checkpoints").resolve())


def group_argv(argv: list[str], cfg: Config, run_dir: Path, group: int, nproc: int, max_restarts: int) -> list[str]:
    """The user's command for one group: its own run directory, the run's checkpoint directory, and its restart
    budget alone to end it: a restarted group resumes at its live peers' step, so restarts that do not get it
    past the step it last reached (`health.no_progress_restarts`) are no sign that the run stopped moving."""
    return [*without_flags(argv, GROUP_FLAGS), "--run-dir", str(group_dir(run_dir, group)), "--nproc", str(nproc),
            "--max-restarts", str(max_restarts), f"fault_tolerance.replica_groups={cfg.fault_tolerance.replica_groups}",
            f"checkpoint.dir={shared_checkpoints(cfg, run_dir)}", f"health.no_progress_restarts={max_restarts + 1}"]


def start_lighthouse(cfg: Config, run_dir: Path, port: int = 0) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse on loopback (on `port`, or a free one), its output in RUN_DIR/logs/lighthouse.log."""
    ft = cfg.fault_tolerance
    if lighthouse_script.extension() is None:
        raise KeelError("torchft not found: fault_tolerance.replica_groups > 1 needs torchft "
                        "(pip install 'keel-pretrain[ft]'), or give fault_tolerance.lighthouse")
    port = port or free_port()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / "lighthouse.log", "ab") as log:
        proc = subprocess.Popen(lighthouse_script.command(ft.min_replicas, f"127.0.0.1:{port}", ft.join_timeout_s,
                                                          ft.heartbeat_timeout_s),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KeelError(f"the torchft lighthouse exited with {proc.returncode}; see "
                            f"{run_dir / 'logs' / 'lighthouse.log'}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise KeelError(f"the torchft lighthouse did not listen on 127.0.0.1:{port} within {LIGHTHOUSE_WAIT_S:.0f} s")


class KeptLighthouse:
    """The lighthouse `keel train` started, started again at once on its port when it dies: the groups'
    managers retry their quorum and heartbeats against the same address, and find it there.

    A fresh lighthouse knows nobody, and would give its first quorum to whichever group asks first,
    alone, while the others still reconnect. So the restarted one is told, for one heartbeat timeout, of
    the groups the old one last saw heartbeat (read from its status page while it lived): its first
    quorum then waits for them, and a group that died meanwhile ages out as it would have."""

    def __init__(self, cfg: Config, run_dir: Path, events: EventLog) -> None:
        self.cfg, self.run_dir, self.events = cfg, run_dir, events
        self.proc, self.address = start_lighthouse(cfg, run_dir)
        self.seen: set[str] = set()
        self.read_at, self.remind_until = 0.0, 0.0
        self.client: object = None

    def tend(self) -> None:
        """Called every LIGHTHOUSE_POLL_S while the groups run."""
        now, timeout_s = time.monotonic(), self.cfg.fault_tolerance.heartbeat_timeout_s
        if self.proc.poll() is not None:
            self.restart(now)
        elif now < self.remind_until:
            for replica in self.seen:
                with contextlib.suppress(Exception):  # the remaining reminders still count
                    self.client.heartbeat(replica, timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
        elif now - self.read_at >= LIGHTHOUSE_READ_S:
            self.read_at = now
            self.seen = heartbeats(self.address, timeout_s) or self.seen

    def restart(self, lost_at: float) -> None:
        from torchft._torchft import LighthouseClient

        died = self.proc.returncode
        self.proc, _ = start_lighthouse(self.cfg, self.run_dir, int(self.address.rpartition(":")[2]))
        self.client = LighthouseClient(self.address, timedelta(seconds=self.cfg.fault_tolerance.timeout_s))
        self.remind_until = time.monotonic() + self.cfg.fault_tolerance.heartbeat_timeout_s
        self.events.emit("lighthouse", 0, "restarted", address=self.address, pid=self.proc.pid, exit_code=died,
                         restart_s=round(time.monotonic() - lost_at, 3), groups_seen=sorted(self.seen))
        self.tend()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def wait_all(procs: list[subprocess.Popen], lighthouse: KeptLighthouse | None,
             ended: Callable[[int, int, int], None] = lambda group, code, running: None) -> list[int]:
    """Every group's exit code, once all have ended, tending the lighthouse meanwhile; `ended(group, code, the
    groups still running)` as each group ends."""
    running = set(range(len(procs)))
    while running:
        for group in sorted(running):
            if procs[group].poll() is not None:
                running.discard(group)
                ended(group, procs[group].returncode, len(running))
        if lighthouse is not None:
            lighthouse.tend()
        time.sleep(LIGHTHOUSE_POLL_S)
    return [proc.wait() for proc in procs]


def group_lost(events: EventLog, run_dir: Path, groups: int) -> Callable[[int, int, int], None]:
    """What a group's end says: one that failed for good (its launcher gave up: restart budget spent, a guard
    stopped it, voted out) while others train on raises an alert; the run goes on with fewer groups."""

    def ended(group: int, code: int, running: int) -> None:
        events.emit("group", 0, "ended", group=group, exit_code=code)
        if code in (0, EXIT_PAUSED) or not running:
            return
        step = int(read_status(group_dir(run_dir, group)).get("step", 0))
        message = (f"replica group {group} was given up (its launcher exited {code}; see "
                   f"{group_dir(run_dir, group) / 'events.jsonl'}): the run goes on with {running} of {groups} groups")
        events.emit("alert", step, "replica_group_lost", severity="critical", message=message, group=group,
                    exit_code=code, groups_left=running)
        print(f"keel: warning: {message}", file=sys.stderr, flush=True)

    return ended


def launch_groups(cfg: Config, argv: list[str], run_dir: Path, nproc: int, max_restarts: int, say=print) -> int:
    """Run every replica group until all have ended. Returns 73 when the checkpoint volume refused a group's
    save (the writing group's last one, say, while the others finish), 0 when the run finished, 75 when it
    paused, else the first failing group's code."""
    groups = cfg.fault_tolerance.replica_groups
    # The groups share the machine's cores as one job's processes would; torchft's own logs only warn.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc * groups))))
    os.environ.setdefault("RUST_LOG", "warn")
    events = EventLog(run_dir / "events.jsonl", rank=-1)
    given = cfg.fault_tolerance.lighthouse
    lighthouse = None if given else KeptLighthouse(cfg, run_dir, events)
    address = lighthouse.address if lighthouse else given
    events.emit("lighthouse", 0, "started" if lighthouse else "given", address=address,
                pid=lighthouse.proc.pid if lighthouse else None)
    procs: list[subprocess.Popen] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        for group in range(groups):
            env = {**os.environ, GROUP_ENV: str(group), LIGHTHOUSE_ENV: address, ROOT_ENV: str(run_dir.resolve())}
            procs.append(subprocess.Popen([sys.executable, "-m", "keel",
                                           *group_argv(argv, cfg, run_dir, group, nproc, max_restarts)], env=env))
            events.emit("group", 0, "started", group=group, pid=procs[-1].pid, nproc=nproc)
        say(f"keel: {groups} replica groups × {nproc} process(es), lighthouse {address}; each group's logs are in "
            f"{run_dir / 'groups'}/G")
        codes = wait_all(procs, lighthouse, group_lost(events, run_dir, groups))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if lighthouse is not None:
            lighthouse.stop()
    events.close()
    return job_code(codes)


def job_code(codes: list[int]) -> int:
    """The job's exit code from its groups' codes."""
    if EXIT_STORAGE in codes:  # the writing group's save was refused: the others' 0 saved nothing
        return EXIT_STORAGE
    if 0 in codes:  # the run reached its last step: a group lost for good on the way does not undo that
        return 0
    if EXIT_PAUSED in codes:
        return EXIT_PAUSED
    return next(code for code in codes if code != 0)
