"""`keel train --nproc N [--nnodes MIN:MAX --rdzv-endpoint HOST:PORT]`: hand the command to torchrun's
elastic agent, one agent per node.

The agent is torchrun's own (`LocalElasticAgent`), taught four things:
a worker's "do not retry" (bad input, a guard's stop, a pause) ends the job instead of using up the
restarts; a node listed in the run's quarantine.json leaves the job the way a preempted node does
(so the rendezvous stays open and the other nodes go on without it); a run that keeps failing
without getting past the same step stops before its restart budget is spent; and a hang of its
workers (a heartbeat stopped, a worker stopped while its peers wait, a worker's exit on a hang that
its peers could not name) is one it names, ending the workers, which it restarts (keel.health.heartbeat).

Its workers are forked from the worker server (keel.worker_server).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.elastic.multiprocessing.api as elastic_processes
import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous
import torch.distributed.launcher.api as launcher_api
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError
from torch.distributed.run import config_from_args, get_args_parser

import keel
from keel.core import generations
from keel.core.net import carrier_changes, job_interfaces, links_down
from keel.core.torch_elastic import respawn_worker, worker_processes
from keel.errors import EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE, EXIT_STORAGE
from keel.health.heartbeat import HeartbeatWatch
from keel.health.reach import ReachWatch, until_answered
from keel.health.signals import SIGNALS as STOP_SIGNALS
from keel.health.signals import stop_requested_early
from keel.monitor.goodput import account_exit
from keel.rundir.events import EventLog
from keel.rundir.quarantine import QUARANTINE, add_to_quarantine, is_quarantined, node_name
from keel.rundir.status import read_status
from keel.worker_server import start_worker_server, stop_worker_server

LAUNCHER_FLAGS = ("--nproc", "--max-restarts", "--nnodes", "--rdzv-endpoint", "--local-addr")
FINAL = (EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_STORAGE)  # a restart would meet the same end
# A node that stops sending keep-alives is dropped from the rendezvous after interval × attempts seconds.
KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS = 2, 3
# A rendezvous store call that takes longer has lost the store: this node is cut off from the job (a network
# fault) and leaves it, where torch's default (60 s, then retries) would keep its launcher waiting for minutes.
STORE_READ_TIMEOUT_S = 20
# A node that cannot reach the rendezvous this long is cut off: longer than a flap a job should ride out.
REACH_WINDOW_S = 15.0
CUT_OFFS_ENV = "KEEL_CUT_OFFS"  # how many times this node's command was cut off from its job and rejoined it
LEAVING = threading.Event()  # set once this node is cut off from its job: it joins no more rounds as it is
LEAVE_LOCK = threading.Lock()
QUARANTINE_POLL_S = 5.0
# How often the agent looks at its workers when none ends (torchrun's interval): a worker's end wakes it at once.
MONITOR_S = 0.1
WorkerEntry = Callable[[dict[str, str], list[str]], None]  # (the launcher's environment, the worker's argv)


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` without `flags` and their values (`--flag VALUE` or `--flag=VALUE`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def worker_argv(argv: list[str]) -> list[str]:
    """The user's command without the flags that only the launcher reads."""
    return without_flags(argv, LAUNCHER_FLAGS)


class LeaveJob(SignalException):
    """This node is quarantined: stop its workers and leave without closing the rendezvous."""

    def __init__(self, node: str) -> None:
        super().__init__(f"node {node} is listed in quarantine.json", signal.SIGTERM)


class StoreLost(SignalException):
    """This node's agent lost the rendezvous store (a network fault): it leaves without closing the rendezvous,
    as torch's agent would on its way out, ending the job for every node the moment the link returns."""

    def __init__(self, why: str) -> None:
        super().__init__(f"the rendezvous store is unreachable ({why})", signal.SIGTERM)


class KeelAgent(LocalElasticAgent):
    """torchrun's agent, deciding about restarts with keel's exit codes and the run's quarantine list."""

    run_dir: Path
    elastic: bool
    no_progress_limit: int
    outcome: tuple[int, str, bool] | None  # the job's exit code, why, and whether the launcher must say so
    heartbeats: HeartbeatWatch
    _quarantine_checked: float  # when the quarantine list was last read (monotonic)
    flap_limit: int  # flaps of the job's links after which this node leaves (0: never)
    _carriers: int  # the job's links' carrier changes when this command began
    _stalled: int  # restarts in a row that got no further than the one before
    _last_step: int  # the furthest step the run reached
    _generations: TCPStore | None  # with in-process restarts: the store survivors and replacements meet at
    _round: int  # starts of every worker by this agent
    _generation: int  # the process group's generation in this round (keel.core.generations)

    def run(self, *args, **kwargs) -> RunResult:
        try:
            return super().run(*args, **kwargs)
        except RendezvousConnectionError as e:
            raise StoreLost(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
        finally:
            self.heartbeats.close()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # A node cut off from the job rejoins as a new process (`_cut_off`): this one, its pid and so its
        # rendezvous identity the same, must not rejoin first, as the node it was, when the link returns.
        if LEAVING.is_set():
            threading.Event().wait()  # for ever: the cut-off ends this process
        super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # The workers run in the launcher's environment as it is when they start (the heartbeat directory that
        # `prepare` made is in it), not as it was when the command began.
        launcher_env = worker_group.spec.args[0]
        self._round, self._generation = self._round + 1, 0  # every worker new: generation 0 of a new round
        os.environ[generations.ROUND_ENV] = str(self._round)
        launcher_env.clear()
        launcher_env.update(os.environ)
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        # torchrun sleeps its interval between looks (a millisecond here); this waits as long, or until a worker
        # ends: a killed worker is seen, and restarted, within milliseconds instead of half an interval.
        running = [proc.sentinel for proc in worker_processes(self._pcontext) if proc.exitcode is None]
        if running:
            multiprocessing.connection.wait(running, timeout=MONITOR_S)
        # A hung worker is killed here with the others, so that the result below is their failure, and before
        # torchrun's own end of the workers (SIGTERM, which a stopped one never takes) would wait for it.
        self.heartbeats.end_hang({w.global_rank: w.id for w in worker_group.workers if w.id is not None},
                                 restarting=self._remaining_restarts > 0, exits=self._exit_codes(worker_group))
        self._end_survivors_of_a_killed_worker(worker_group)
        result = super()._monitor_workers(worker_group)
        now = time.monotonic()
        # Only an elastic job can go on without a node; a one-node job ends with the workers' 76.
        if self.elastic and (now - self._quarantine_checked > QUARANTINE_POLL_S or result.state == WorkerState.FAILED):
            self._quarantine_checked = now
            self._leave_if_flapping()
            if is_quarantined(self.run_dir, node_name()):
                raise LeaveJob(node_name())
        if result.state != WorkerState.FAILED:
            return result
        codes = sorted({f.exitcode for f in result.failures.values()})
        failed_at = time.time()
        step = int(read_status(self.run_dir).get("step", 0))  # the furthest the run got
        final = [c for c in codes if c in FINAL]
        if final:
            self._give_up(final[0], f"a worker exited with {final[0]}", announce=False)  # it said why
        elif EXIT_QUARANTINE in codes and not self.elastic:
            self._give_up(EXIT_QUARANTINE, "a rank was quarantined; requeue the job without its node")
        elif EXIT_QUARANTINE in codes:
            self._remaining_restarts += 1  # a node left: a change of membership, not a failure of the job
        elif self._remaining_restarts == 0:
            self._give_up(EXIT_GUARD_STOP, f"the workers failed {worker_group.spec.max_restarts + 1} times "
                          f"(--max-restarts {worker_group.spec.max_restarts}); not retrying")
        else:
            self._stalled = self._stalled + 1 if step <= self._last_step else 0
            self._last_step = max(step, self._last_step)
            if self._stalled >= self.no_progress_limit:
                self._give_up(EXIT_GUARD_STOP, f"{self._stalled} restarts in a row did not get past step {step}; "
                              f"not retrying (health.no_progress_restarts = {self.no_progress_limit})")
        events = EventLog(self.run_dir / "events.jsonl", rank=-1)  # -1: this node's agent
        events.emit("failure", step, "stop" if self.outcome else "restart", node=node_name(), exit_codes=codes,
                    ranks=sorted(result.failures), restarts_left=self._remaining_restarts, detected=failed_at)
        events.close()
        return result

    def _leave_if_flapping(self) -> None:
        """A node whose links flapped `flap_limit` times since its command began lists itself in quarantine.json
        (and so leaves, below): a link that keeps failing costs every node a wait each time."""
        flaps = (carrier_changes() - self._carriers) // 2
        if self.flap_limit and flaps >= self.flap_limit and not is_quarantined(self.run_dir, node_name()):
            links = ", ".join(job_interfaces())
            why = f"its link {links} flapped {flaps} times (health.flap_limit = {self.flap_limit})"
            step = int(read_status(self.run_dir).get("step", 0))
            add_to_quarantine(self.run_dir, [node_name()], "network", why, step=step)
            _record(self.run_dir, "leave", "flapping", nodes=[node_name()], reason=why)

    def _exit_codes(self, worker_group: WorkerGroup) -> dict[int, int | None]:
        """The workers' exit codes by global rank, None while one runs."""
        procs = worker_processes(self._pcontext)
        return {w.global_rank: procs[w.local_rank].exitcode for w in worker_group.workers if w.local_rank < len(procs)}

    def _end_survivors_of_a_killed_worker(self, worker_group: WorkerGroup) -> None:
        """A worker killed by a signal (SIGKILL, the OOM killer, a segfault) leaves its peers unable to finish
        any collective, save or pause. torchrun would ask them to stop with SIGTERM and wait for them, and a keel
        worker takes SIGTERM as a pause, which it can only give up once its next collective fails: the restart
        they are headed for waited that long. They are killed at once instead, unless it is restarted alone."""
        procs = worker_processes(self._pcontext)
        killed = [i for i, proc in enumerate(procs) if proc.exitcode is not None and proc.exitcode < 0]
        if not killed or self._restart_alone(worker_group, killed, procs):
            return
        for proc in procs:
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    def _restart_alone(self, worker_group: WorkerGroup, killed: list[int], procs: list) -> bool:
        """With in-process restarts on, killed workers whose peers all run are started again alone, as the next
        generation of the process group, which the survivors rejoin (keel.core.generations); each uses one
        restart. Whether it did: otherwise every worker is restarted."""
        survivors = [proc for i, proc in enumerate(procs) if i not in killed]
        if self._generations is None or self._remaining_restarts == 0 or not survivors or \
                any(proc.exitcode is not None for proc in survivors):
            return False
        detected = time.time()
        self._remaining_restarts -= 1
        self._generation += 1
        replaced = [w for w in worker_group.workers if w.local_rank in killed]
        ranks = sorted(w.global_rank for w in replaced)
        codes = sorted({procs[w.local_rank].exitcode for w in replaced})
        generations.announce(self._generations, self._generation, ranks)
        for w in replaced:
            w.id = respawn_worker(self._pcontext, w.local_rank, {generations.GENERATION_ENV: str(self._generation)})
        print(f"keel: rank(s) {', '.join(map(str, ranks))} killed by signal {', '.join(str(-c) for c in codes)}: "
              f"restarted alone (health.in_process_restart), the other workers keep their processes; "
              f"{self._remaining_restarts} restart(s) left", file=sys.stderr, flush=True)
        _record(self.run_dir, "failure", "in_process", node=node_name(), exit_codes=codes, ranks=ranks,
                generation=self._generation, restarts_left=self._remaining_restarts, detected=detected)
        return True

    def _give_up(self, code: int, why: str, announce: bool = True) -> None:
        self.outcome = (code, why, announce)
        self._remaining_restarts = 0  # the agent's loop then stops the workers and returns the failure

    def prepare(self, run_dir: Path, elastic: bool, no_progress_limit: int, flap_limit: int = 0,
                in_process: bool = False) -> None:
        self.run_dir, self.elastic, self.no_progress_limit = run_dir, elastic, no_progress_limit
        self._round = self._generation = 0
        self._generations = None
        if in_process:  # the store where survivors and replacements meet (keel.core.generations)
            self._generations = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
            os.environ[generations.STORE_ENV] = f"127.0.0.1:{self._generations.port}"
        self.flap_limit, self._carriers = flap_limit, carrier_changes()
        self.outcome = None
        self.heartbeats = HeartbeatWatch(run_dir)
        self._quarantine_checked = time.monotonic()
        self._stalled, self._last_step = 0, int(read_status(run_dir).get("step", 0))


def _cut_off(run_dir: Path, say: Callable[[str], None], rendezvous: Rendezvous, limit: int) -> Callable[[str], None]:
    """What a node does once it cannot reach its job's rendezvous (keel.health.reach): says so, records it where
    it still can, and ends its workers; the other nodes go on without them. Once the rendezvous answers again the
    node starts its command afresh and rejoins (the other nodes' agents restart to take it in), unless that was
    its `limit`-th time in this command: a link that keeps failing lists the node in quarantine.json. A link
    still dead after the rendezvous timeout ends the command (76)."""

    def leave(why: str) -> None:
        with LEAVE_LOCK:  # the reach watch and the agent (its store lost) may both find it: one acts
            if LEAVING.is_set():
                threading.Event().wait()  # for ever: the other caller ends this process
            LEAVING.set()
        node, times, down = node_name(), int(os.environ.get(CUT_OFFS_ENV, "0")) + 1, links_down()
        # The node's own link says which side the fault is on: a rendezvous host cut off silences every node.
        side = (f"this node's link {', '.join(down)} is down" if down else f"this node's link "
                f"{', '.join(job_interfaces()) or '(none found)'} is up: the fault is the rendezvous host's or between")
        say(f"keel: node {node} is cut off from the job: {why}; {side}; its workers end, the other nodes go on "
            f"without it")
        _record(run_dir, "leave", "cut_off", nodes=[node], reason=why, links_down=down)
        stop_worker_server()  # the workers die with the server that forked them
        waited = until_answered(rendezvous.endpoint, rendezvous.timeout_s)
        if waited is None:
            say(f"keel: node {node} has not reached the rendezvous for {rendezvous.timeout_s} s more; leaving the "
                f"job (exit {EXIT_QUARANTINE}: rerun the command here once its network is back)")
        elif times >= limit:
            add_to_quarantine(run_dir, [node], "network", f"cut off from the job {times} times: its network keeps "
                              f"failing", step=int(read_status(run_dir).get("step", 0)))
            say(f"keel: node {node} reaches the rendezvous again, but it was cut off {times}× (health.cut_off_limit "
                f"= {limit}); listed in {run_dir / QUARANTINE}, it leaves the job (exit "
                f"{EXIT_QUARANTINE}; `keel quarantine {run_dir} {node} --release` lets it back)")
        else:
            say(f"keel: node {node} reaches the rendezvous again after {waited:.0f} s; rejoining the job")
            sys.stdout.flush()
            sys.stderr.flush()
            # Started again as the command started, the environment as it found it: a new launcher, lock and
            # worker server, joining the rendezvous as a node that arrives does.
            os.execve(sys.executable, sys.orig_argv, {**keel.ENVIRON, CUT_OFFS_ENV: str(times)})
        sys.stdout.flush()
        os._exit(EXIT_QUARANTINE)

    return leave


def _record(run_dir: Path, kind: str, action: str, **detail: Any) -> None:
    """An event of this node's launcher, where the run directory can still be written."""
    with contextlib.suppress(OSError):
        events = EventLog(run_dir / "events.jsonl", rank=-1)
        events.emit(kind, int(read_status(run_dir).get("step", 0)), action, **detail)
        events.close()


def _caller_name(depth: int = 2) -> str:
    """What torch's rendezvous names its log records by, the function `depth` frames up, without the
    source lines of every frame that its `inspect.stack()` reads (seconds per job with torch loaded)."""
    return sys._getframe(depth).f_code.co_name


class _WorkerTracebackOnly(logging.Filter):
    """The agent logs a worker's failure with the exception that carries the worker's traceback (as text, in
    its message) under the launcher's own stack, which says nothing more and whose formatting imports torch's
    compiler (a second, in the launcher, at every failure). The record keeps the message alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg, record.args = f"{record.getMessage()}{record.exc_info[1]}", ()
        record.exc_info = None
        return True


def launch(nproc: int, max_restarts: int, argv: list[str], run_dir: Path, entry: WorkerEntry,
           rendezvous: Rendezvous | None = None, *, shutdown_grace_s: int = 120, no_progress_restarts: int = 2,
           cut_off_limit: int = 3, flap_limit: int = 0, in_process_restart: bool = False, say=print) -> int:
    """Run this node's workers under torchrun's elastic agent. Returns the job's exit code: 0 finished,
    2 bad input, 3 stopped (do not requeue), 73 the checkpoint volume refused a save, 75 paused (rerun
    resumes), 76 this node or a rank was
    quarantined (requeue without it); 128 + N when the launcher itself was killed by signal N. Each worker
    runs `entry(the launcher's environment, its argv)`; `rendezvous` says how this node meets the others (none:
    a job of this node alone)."""
    start_worker_server(nproc)  # unless the command started it already
    logging.getLogger(elastic_processes.__name__).addFilter(_WorkerTracebackOnly())
    # Workers restarted by the agent must not share the rendezvous store: they would read the
    # previous attempt's addresses and fail to connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ["KEEL_NODE"] = node_name()  # the workers name their node as the launcher does
    # The agent passes these on to the workers: SIGUSR1 pauses them as SIGTERM does.
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    # The goodput ledger counts this command's own start-up (imports, rendezvous) as the run's.
    os.environ["KEEL_LAUNCHED_AT"] = str(keel.STARTED)
    rendezvous = rendezvous or Rendezvous()
    elastic = rendezvous.nnodes != "1"
    config = _agent_config(nproc, max_restarts, run_dir, rendezvous, shutdown_grace_s)

    agents: list[KeelAgent] = []

    def make_agent(*a, **kw) -> KeelAgent:
        agent = KeelAgent(*a, **kw)
        agent.prepare(run_dir, elastic, no_progress_restarts, flap_limit, in_process_restart and not elastic)
        agents.append(agent)
        return agent

    original, method_name = launcher_api.LocalElasticAgent, dynamic_rendezvous.get_method_name
    dynamic_rendezvous.get_method_name = _caller_name
    # launch_agent builds its agent through this name; mypy sees a class replaced by a function.
    launcher_api.LocalElasticAgent = make_agent  # type: ignore[misc,assignment]
    # Until the agent starts the workers (and installs its own handlers), a stop signal ends the
    # rendezvous the way the agent's would, without closing it for the other nodes.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_signal)
    leave = _cut_off(run_dir, say, rendezvous, cut_off_limit)
    reach = ReachWatch(rendezvous.endpoint, REACH_WINDOW_S, leave).start() if elastic else None
    try:
        if received := stop_requested_early():  # caught while this command was still validating
            raise SignalException(f"{received} received", getattr(signal, received))
        # The first argument is the launcher's environment, which the agent fills as it starts the workers.
        return _launch(config, entry, [{}, worker_argv(argv)], agents, run_dir, say, leave)
    finally:
        if reach is not None:
            reach.stop()
        for sig in STOP_SIGNALS:  # the job's outcome is decided; a late signal changes nothing
            signal.signal(sig, signal.SIG_IGN)
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]  # the class back in its place
        dynamic_rendezvous.get_method_name = method_name
        if not elastic:  # the workers are gone: their exit (or their crash) until now goes to the ledger
            account_exit(run_dir)


@dataclass(frozen=True)
class Rendezvous:
    """How this node meets the others: MIN:MAX nodes ("1": a job of this node alone), the c10d store's HOST:PORT,
    this node's own address (empty: its host name, as torchrun takes it) and how long a rendezvous may wait."""

    nnodes: str = "1"
    endpoint: str = ""
    local_addr: str = ""
    timeout_s: int = 900

    def args(self, run_dir: Path) -> list[str]:
        if self.nnodes == "1":
            return ["--standalone"]
        conf = (f"join_timeout={self.timeout_s},last_call_timeout=2,keep_alive_interval={KEEP_ALIVE_S},"
                f"keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS},read_timeout={STORE_READ_TIMEOUT_S}")
        local = []
        if self.local_addr:  # where host names do not say which node hosts the store, the address does
            conf += f",is_host={str(self.local_addr == self.endpoint.rpartition(':')[0]).lower()}"
            local = ["--local-addr", self.local_addr]
        return ["--nnodes", self.nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", f"keel-{run_dir.resolve().name}", "--rdzv-conf", conf, *local]


def _agent_config(nproc: int, max_restarts: int, run_dir: Path, rendezvous: Rendezvous,
                  shutdown_grace_s: int) -> launcher_api.LaunchConfig:
    """torchrun's launch config for this node, as its command line would give it, its workers forked."""
    if rendezvous.nnodes != "1":
        os.environ["KEEL_RDZV_TIMEOUT_S"] = str(rendezvous.timeout_s)
    args = get_args_parser().parse_args([
        *rendezvous.args(run_dir), f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        f"--shutdown-timeout={shutdown_grace_s}", "--module", "keel"])  # the workers run `entry` instead
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", f"keel-{os.getpid()}"
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"  # from the worker server (keel.worker_server)
    config.monitor_interval = 0.001  # the least it takes: KeelAgent._monitor_workers waits instead
    return config


def _launch(config, entry: WorkerEntry, args: list, agents: list[KeelAgent], run_dir: Path, say,
            leave: Callable[[str], None]) -> int:
    try:
        launcher_api.launch_agent(config, entry, args)
    except ChildFailedError as e:
        # The first worker to fail holds the cause; the agent then stops the others with signals.
        outcome = agents[0].outcome if agents else None
        if outcome is not None:
            code, why, announce = outcome
            if announce:
                say(f"keel: {why}")
            return code
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode in (*FINAL, EXIT_QUARANTINE) else 1
    except LeaveJob as e:
        say(f"keel: {e}; this node leaves the job, the others go on without it")
        return EXIT_QUARANTINE
    except StoreLost as e:
        leave(str(e))  # as when the rendezvous is found silent (keel.health.reach): never returns
    except RendezvousClosedError:
        if read_status(run_dir).get("state") != "finished":
            raise
        say("keel: the job finished while this node was away (its rendezvous is closed); nothing is left to join")
        return 0
    except SignalException as e:
        return _stopped(e, run_dir, say)
    return 0


def _stop_signal(signum: int, frame: object) -> None:
    raise SignalException(f"process {os.getpid()} got signal {signum}", signal.Signals(signum))


def _stopped(e: SignalException, run_dir: Path, say) -> int:
    """The job's code after a signal to the launcher, which the agent passed on to the workers. SIGTERM and
    SIGUSR1 pause at any moment: the workers paused at a step boundary with a checkpoint, or paused before
    training, or were stopped before they could; either way the newest verified checkpoint is the one to
    resume, so the job is requeued (75). A run that had already finished stays finished."""
    status = read_status(run_dir)
    if status.get("state") == "finished" and status.get("time", 0) > keel.STARTED:  # by this job, not a past one
        return 0
    if e.sigval not in STOP_SIGNALS:
        return 128 + int(e.sigval)
    if status.get("state") != "paused":
        say(f"keel: {signal.Signals(e.sigval).name} received before the workers could pause at a step; the same "
            f"command resumes from the newest verified checkpoint ({status.get('checkpoint') or 'none yet'})")
    return EXIT_PAUSED
