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

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from keel.config import Config
from keel.errors import EXIT_PAUSED, KeelError
from keel.health.signals import SIGNALS as STOP_SIGNALS
from keel.rundir.events import EventLog
from keel.train.replicas import GROUP_ENV, LIGHTHOUSE_ENV, ROOT_ENV

GROUP_FLAGS = ("--replica-groups", "--run-dir", "--nproc", "--max-restarts")
LIGHTHOUSE_WAIT_S = 30.0


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir / "groups" / str(group)


def shared_checkpoints(cfg: Config, run_dir: Path) -> str:
    """The run's one checkpoint directory, which every group reads and the writing group writes."""
    return cfg.checkpoint.dir or str((run_dir / "checkpoints").resolve())


def group_argv(argv: list[str], cfg: Config, run_dir: Path, group: int, nproc: int, max_restarts: int) -> list[str]:
    """The user's command for one group: its own run directory, the run's checkpoint directory."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in GROUP_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in GROUP_FLAGS)):
            out.append(arg)
    return [*out, "--run-dir", str(group_dir(run_dir, group)), "--nproc", str(nproc),
            "--max-restarts", str(max_restarts), f"fault_tolerance.replica_groups={cfg.fault_tolerance.replica_groups}",
            f"checkpoint.dir={shared_checkpoints(cfg, run_dir)}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_lighthouse(cfg: Config, run_dir: Path) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse on loopback, its output in RUN_DIR/logs/lighthouse.log."""
    ft = cfg.fault_tolerance
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    if not binary.exists():
        raise KeelError(f"{binary} not found: fault_tolerance.replica_groups > 1 needs torchft "
                        f"(pip install 'keel-train[ft]'), or give fault_tolerance.lighthouse")
    port = free_port()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / "lighthouse.log", "ab") as log:
        proc = subprocess.Popen([str(binary), "--min_replicas", str(ft.min_replicas), "--bind", f"127.0.0.1:{port}",
                                 "--quorum_tick_ms", "100", "--join_timeout_ms", str(int(ft.join_timeout_s * 1000)),
                                 "--heartbeat_timeout_ms", str(int(ft.heartbeat_timeout_s * 1000))],
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


def launch_groups(cfg: Config, argv: list[str], run_dir: Path, nproc: int, max_restarts: int, say=print) -> int:
    """Run every replica group until all have ended. Returns 0 when the run finished, 75 when it paused,
    else the first failing group's code."""
    groups = cfg.fault_tolerance.replica_groups
    # The groups share the machine's cores as one job's processes would; torchft's own logs only warn.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc * groups))))
    os.environ.setdefault("RUST_LOG", "warn")
    events = EventLog(run_dir / "events.jsonl", rank=-1)
    lighthouse, address = (None, cfg.fault_tolerance.lighthouse) if cfg.fault_tolerance.lighthouse else \
        start_lighthouse(cfg, run_dir)
    events.emit("lighthouse", 0, "started" if lighthouse else "given", address=address)
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
        codes = [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait()
    for group, code in enumerate(codes):
        events.emit("group", 0, "ended", group=group, exit_code=code)
    events.close()
    if 0 in codes:  # the run reached its last step: a group lost for good on the way does not undo that
        return 0
    if EXIT_PAUSED in codes:
        return EXIT_PAUSED
    return next(code for code in codes if code != 0)
