"""deploy/slurm/keel.sbatch and keel-replicas.sbatch on a real Slurm: a one-node cluster (this machine)
with its own munged, slurmctld and slurmd, configured and started once for the module and stopped at
the end. The time limit's warning signal pauses the run, the script requeues the job, and the next
allocation resumes the run to the state of one that was never interrupted; two replica groups share
the node as two job steps, and a group killed mid-run heals while the other trains on."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.conftest import REPO, SMALL_RUN, TAG, free_port, keel_env, kill_tagged

pytestmark = pytest.mark.dist

STEPS = 40
SCRIPT = REPO / "deploy/slurm/keel.sbatch"
REPLICAS_SCRIPT = REPO / "deploy/slurm/keel-replicas.sbatch"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # the daemons live in sbin
# slurmctld checks time limits every 30 s from its start, and sends the warning at the first check
# within 30 s of the warning time: a job started just after the daemons are up gets SIGTERM about 57 s
# in. Steps 1-35 made 1.7 s slower (about 60 s of sleep alone) keep the run training at that moment
# however fast it started, and the last 5 steps at full speed keep the resumed allocation short.
TIME_LIMIT, WARNING = "2", "B:TERM@60"
SLOW = 'drill.inject=["slow:rank=-1,seconds=1.7,steps=35"]'


def wait_for(what: str, ready: Callable[[], bool], timeout: float, log: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s\n{log()}")
        time.sleep(0.5)


def finished(state: str) -> bool:
    return state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


class SlurmCluster:
    """A Slurm cluster of this machine alone, everything in `root`: its munge key and socket, slurm.conf
    with the machine's own CPUs and memory, state, spool and logs. Only commands given its `env`
    (SLURM_CONF) talk to it."""

    def __init__(self, root: Path) -> None:
        self.root, self.tag, self.daemons = root, uuid.uuid4().hex, []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env.update(SLURM_CONF=str(root / "slurm.conf"), PATH=SEARCH_PATH)
        node = subprocess.run(["slurmd", "-C"], env=self.env, capture_output=True, text=True, check=True)
        self.hardware = node.stdout.splitlines()[0]  # NodeName=... CPUs=... RealMemory=...
        self.node = self.hardware.split()[0].removeprefix("NodeName=")
        self.cpus = int(re.search(r"CPUs=(\d+)", self.hardware)[1])

    def start(self) -> None:
        root, user = self.root, getpass.getuser()
        (root / "key").mkdir(mode=0o700)
        (root / "key" / "munge.key").write_bytes(os.urandom(1024))
        (root / "key" / "munge.key").chmod(0o400)
        socket = root / "munge.socket"
        (root / "slurm.conf").write_text(f"""\
ClusterName=keel
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire + 1 s (120 by default) before it may start again.
AuthInfo=socket={socket},cred_expire=5
SchedulerParameters=sched_interval=1
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=300
{self.hardware} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=keel Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon("munged", "--foreground", f"--key-file={root}/key/munge.key", f"--socket={socket}",
                     f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed")
        wait_for("munged", socket.exists, 30, self.logs)
        self._daemon("slurmctld", "-D")
        self._daemon("slurmd", "-D", "-N", self.node)
        wait_for("the node idle", lambda: self.run("sinfo", "-h", "-o", "%t", check=False).strip() == "idle",
                 60, self.logs)

    def _daemon(self, *cmd: str) -> None:
        log = open(self.root / f"{cmd[0]}.out", "wb")  # noqa: SIM115 (the daemon's own until it ends)
        self.daemons.append(subprocess.Popen(cmd, env={**self.env, TAG: self.tag}, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
        assert self.daemons[-1].poll() is None, self.logs()

    def run(self, *cmd: str, check: bool = True, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        done = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, cwd=cwd)
        if check and done.returncode:
            pytest.fail(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr}\n{self.logs()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "-o", "show", "job", job_id)))

    def logs(self) -> str:
        paths = sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out"))
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in paths)

    def stop(self) -> None:
        """Cancel what still runs, wait for it to end, then stop the daemons."""
        if self.daemons and all(d.poll() is None for d in self.daemons):
            self.run("scancel", "--full", "--partition=keel", check=False)
            deadline = time.monotonic() + 60
            while self.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        kill_tagged(self.tag)  # slurmstepd and anything a job left behind


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    missing = [p for p in PROGRAMS if not shutil.which(p, path=SEARCH_PATH)]
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurmctld slurmd "
                    "slurm-client munge")
    # munged wants every directory above its socket open to all: not pytest's private tmp_path.
    root = Path(tempfile.mkdtemp(prefix="keel-slurm-"))
    root.chmod(0o755)
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_time_limit_pauses_requeues_and_resumes_bitwise(slurm: SlurmCluster, reference_run: Path,
                                                       small_corpus: Path, tmp_path: Path) -> None:
    run_dir, config, tag = tmp_path / "run", tmp_path / "defaults.toml", uuid.uuid4().hex
    config.write_text("# every option at its default, as the reference run has them\n")
    env = {**keel_env(), **slurm.env, TAG: tag, "RUN_DIR": str(run_dir), "NPROC": "2",
           "RDZV_PORT": str(free_port()), "PATH": os.pathsep.join([str(Path(sys.executable).parent), SEARCH_PATH])}
    # The script's own resources are a GPU node's: this node has no GPUs and its own CPU count.
    job = slurm.run("sbatch", "--parsable", f"--time={TIME_LIMIT}", f"--signal={WARNING}", "--gpus-per-node=0",
                    f"--cpus-per-task={slurm.cpus}", f"--output={tmp_path}/keel-%j.out", str(SCRIPT), str(config),
                    *SMALL_RUN, f"train.steps={STEPS}", f"data.dir={small_corpus}", SLOW, "health.preflight=warn",
                    env=env, cwd=tmp_path).strip()
    output = tmp_path / f"keel-{job}.out"

    def story() -> str:
        return (output.read_text() if output.exists() else "(no output yet)") + "\n" + slurm.logs()

    try:
        wait_for("the requeue", lambda: slurm.job(job).get("Restarts") == "1", 150, story)
        # The next allocation gets the time to finish rather than another warning.
        slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
        wait_for("the job's end", lambda: finished(slurm.job(job)["JobState"]), 150, story)
    finally:
        kill_tagged(tag)
    final = slurm.job(job)
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1"), story()

    lines = [line for line in output.read_text().splitlines() if line.startswith("keel.sbatch:")]
    assert lines == [f"keel.sbatch: job {job} start 0 on {slurm.node}", "keel.sbatch: SIGTERM: pausing the run",
                     "keel.sbatch: exit 75 (paused): requeued", f"keel.sbatch: job {job} start 1 on {slurm.node}",
                     "keel.sbatch: exit 0: job ends"], story()
    events = list(read_jsonl(run_dir / "events.jsonl"))
    (pause,) = [e for e in events if e["kind"] == "pause"]
    assert pause["detail"]["reason"] == "SIGTERM" and pause["detail"]["saved"], pause
    assert 0 < pause["step"] < STEPS
    assert [e["step"] for e in events if e["kind"] == "resume"] == [pause["step"]]
    final_checkpoint = f"checkpoints/step-{STEPS:06d}"
    assert state_sha256(run_dir / final_checkpoint) == state_sha256(reference_run / final_checkpoint)


REPLICA_STEPS = 30
# After the kill the live group sleeps 2.5 s in each step it makes without the killed one (up to 50 s over the
# 20 steps left), so that it is back (torchrun's restart and its heal) well before the survivor's last step.
REPLICA_FAULTS = 'drill.inject=["kill:step=10,rank=-1,group=1", "slow:rank=-1,seconds=2.5,while_missing=true"]'


def test_replica_groups_share_a_node_and_a_killed_group_heals(slurm: SlurmCluster, small_corpus: Path,
                                                              tmp_path: Path) -> None:
    run_dir, config, tag = tmp_path / "run", tmp_path / "defaults.toml", uuid.uuid4().hex
    config.write_text("# every option at its default\n")
    env = {**keel_env(), **slurm.env, TAG: tag, "RUN_DIR": str(run_dir), "REPLICA_GROUPS": "2", "NPROC": "1",
           "LIGHTHOUSE_PORT": str(free_port()),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), SEARCH_PATH])}
    job = slurm.run("sbatch", "--parsable", "--time=5", "--gpus-per-node=0", f"--cpus-per-task={slurm.cpus}",
                    f"--output={tmp_path}/keel-%j.out", str(REPLICAS_SCRIPT), str(config), *SMALL_RUN,
                    f"train.steps={REPLICA_STEPS}", f"data.dir={small_corpus}", "eval.interval=0",
                    "checkpoint.interval=100", REPLICA_FAULTS, env=env, cwd=tmp_path).strip()
    output = tmp_path / f"keel-{job}.out"

    def story() -> str:
        return (output.read_text() if output.exists() else "(no output yet)") + "\n" + slurm.logs()

    try:
        wait_for("the job's end", lambda: finished(slurm.job(job)["JobState"]), 150, story)
    finally:
        kill_tagged(tag)
    final = slurm.job(job)
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), story()
    assert "keel-replicas.sbatch: exit 0: job ends" in output.read_text(), story()
    assert sorted(p.name for p in (run_dir / "groups").iterdir()) == ["0", "1"]

    def events(group: int, kind: str) -> list[dict]:
        return [e for e in read_jsonl(run_dir / "groups" / str(group) / "events.jsonl") if e["kind"] == kind]

    assert len(events(0, "start")) == 1, "the surviving group must never restart"
    heals = [e["step"] for e in events(1, "quorum") if e["action"] == "heal"]
    assert heals and 10 <= heals[0] < REPLICA_STEPS, story()
    assert (run_dir / "checkpoints" / f"step-{REPLICA_STEPS:06d}").is_dir()
