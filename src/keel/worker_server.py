"""The server a node's workers are forked from (multiprocessing's forkserver). The launcher starts it as soon
as it knows it launches workers; it imports torch and keel's worker modules once, while the launcher goes on
with its own checks, and forks every worker, first or restarted, with those imports done instead of each
spending seconds on them. Nothing here imports torch before the server is started."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Iterator

import keel
from keel.health.lifeline import AGENT_PID_ENV, die_with_launcher
from keel.health.signals import SIGNALS as PAUSE_SIGNALS

# What a worker imports before its first step: the worker server imports them once for every worker it forks.
# torch._inductor.config: torch.use_deterministic_algorithms imports it, and torch's compiler with it (a second).
WORKER_MODULES = ("keel.worker_server", "keel.launch", "keel.cli", "keel.train.worker", "keel.drill.faults",
                  "keel.parallel.apply", "torch._inductor.config")  # torch-private: preloaded, never called
# In the worker server (this module is among what it imports) its own pid and environment; a forked worker
# inherits them, and tells from them which of its variables the agent set for it.
SERVER_PID, SERVER_ENV = os.getpid(), dict(os.environ)
SERVER_OF = "KEEL_WORKER_SERVER_OF"  # set for the server only: the pid of the launcher that started it
# A scheduler may signal every process of the job (Slurm's scancel does): the server ignores what is meant for
# the launcher and its workers (a pause, a stop), or its end would SIGKILL the workers before they paused.
IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def start_worker_server(nproc: int) -> None:
    """Start the server that forks this node's workers, unless it runs: it imports WORKER_MODULES while
    the launcher goes on (the earlier, the more of them overlap its own start), and ends with the launcher."""
    if _server_pid():
        return
    # libgomp reads its thread count once, when torch loads it: in the server, for every worker it forks.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_MODULES))
    # PYTHONUNBUFFERED: a worker's output reaches the console as it is written. PYTHONWARNINGS: the resource
    # tracker started with the server frees the agent's semaphores when the launcher is killed, as it should,
    # without a warning that they leaked. PYTORCH_NVML_BASED_CUDA_CHECK: should anything the server imports ask
    # whether CUDA is there, NVML answers, without initialising the CUDA driver that a forked worker could then
    # not use.
    launcher = str(os.getpid())
    with _variables(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore:resource_tracker:UserWarning",
                    PYTORCH_NVML_BASED_CUDA_CHECK="1", **{SERVER_OF: launcher, AGENT_PID_ENV: launcher}):
        multiprocessing.forkserver.ensure_running()
    atexit.register(stop_worker_server)


def _server_pid() -> int | None:
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def stop_worker_server() -> None:
    """Left to itself the server would end once it notices the launcher gone, after freeing every torch
    module, holding the job's console open a second longer; its workers have ended, so it is killed. Its
    workers die with it (keel.health.lifeline)."""
    if pid := _server_pid():
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@contextlib.contextmanager
def _variables(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def become_worker(launcher_env: dict[str, str]) -> None:
    """First thing in a worker the server forked: the launcher's environment when it launched (the server's
    is older) under the variables the agent set for this worker; a session of its own, as torchrun gives its
    workers, so that a Ctrl-C reaches only the launcher, which passes it on; the server as the process whose
    end it dies with (keel.health.lifeline); and keel's clock started now, not when the server started."""
    for sig in IGNORED:  # what the server ignores, a worker takes as a fresh Python process does
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # Sent since the fork, they waited: now they act. A pause waits on until `keel train` keeps it for its loop.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(IGNORED) - set(PAUSE_SIGNALS))
    own = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**launcher_env, **own})
    os.environ[AGENT_PID_ENV] = str(SERVER_PID if os.getpid() != SERVER_PID else os.getppid())
    os.setsid()
    keel.STARTED = time.time()
    if threads := os.environ.get("OMP_NUM_THREADS", "").strip():
        import torch  # imported already: the server did

        torch.set_num_threads(int(threads))


# The server dies with its launcher, even by SIGKILL, and its workers with it (each dies with the process that
# forked it). It cannot notice the launcher's end by itself: every worker holds its liveness pipe open.
if os.environ.get(SERVER_OF) == str(os.getppid()):
    die_with_launcher()
    for _sig in IGNORED:
        signal.signal(_sig, signal.SIG_IGN)
    # Blocked as well: a worker inherits the mask, so a signal the agent sends it before it has handlers of its
    # own (a pause asked for as the workers start) stays pending for them instead of being ignored and lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
