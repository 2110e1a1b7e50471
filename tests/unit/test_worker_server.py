"""The worker server: a worker forked from it starts with torch and keel imported, in the launcher's
environment under the agent's variables, in a session of its own, dying with the server; the server
outlives a SIGTERM meant for the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import keel_env

# A launcher in miniature: it starts the server, then has it fork one worker the way the agent does (the
# agent's variables set in the child, then keel's entry), and prints what the worker reports.
LAUNCHER = """
import json, multiprocessing, multiprocessing.forkserver, os, signal, sys, time
from keel.worker_server import start_worker_server
from tests.unit.test_worker_server import report

start_worker_server(1)
os.environ["SET_AFTER_THE_SERVER_STARTED"] = "launcher"
ctx = multiprocessing.get_context("forkserver")
queue = ctx.SimpleQueue()
worker = ctx.Process(target=report, args=(queue, dict(os.environ), time.time()))
worker.start()
seen = queue.get()
os.kill(seen["parent"], signal.SIGTERM)  # as a scheduler signals every process of a job
time.sleep(0.5)
print(json.dumps({**seen, "launcher": os.getpid(), "server_alive": multiprocessing.forkserver._forkserver.
                  _forkserver_pid == seen["parent"] and os.waitpid(seen["parent"], os.WNOHANG) == (0, 0)}))
worker.join()
"""


def launch(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A launcher script run in a fresh interpreter that imports these tests' worker functions."""
    path = os.pathsep.join([str(Path.cwd()), keel_env()["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env={**keel_env(), "PYTHONPATH": path, **env},
                          capture_output=True, text=True, timeout=120)


def report(queue, launcher_env: dict[str, str], forked_at: float) -> None:
    """In the forked worker: what it had before keel's entry ran, and what it has after."""
    imported = sorted(m for m in ("torch", "torch.distributed.fsdp", "keel.train.worker") if m in sys.modules)
    os.environ.update(RANK="3", SET_AFTER_THE_SERVER_STARTED="agent")  # what torchrun's _wrap does
    import keel
    from keel.worker_server import become_worker

    become_worker(launcher_env)
    queue.put({"imported_before_entry": imported, "rank": os.environ["RANK"],
               "launcher_variable": os.environ.get("LAUNCHER_ONLY"), "agent_wins": os.environ[
                   "SET_AFTER_THE_SERVER_STARTED"], "server_flag": os.environ.get("KEEL_WORKER_SERVER_OF"),
               "server_cuda_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
               "own_session": os.getsid(0) == os.getpid(), "dies_with": int(os.environ["KEEL_AGENT_PID"]),
               "parent": os.getppid(), "clock_restarted": forked_at <= keel.STARTED,
               "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL})


def test_a_forked_worker_has_its_imports_done_and_the_launchers_environment(tmp_path: Path) -> None:
    out = launch(LAUNCHER, tmp_path, LAUNCHER_ONLY="yes")
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout)
    assert seen["imported_before_entry"] == ["keel.train.worker", "torch", "torch.distributed.fsdp"]
    assert seen["rank"] == "3" and seen["agent_wins"] == "agent"  # the agent's variables over the launcher's
    assert seen["launcher_variable"] == "yes"  # the launcher's variables, not those set for the server only
    assert seen["server_flag"] is None and seen["server_cuda_check"] is None
    assert seen["own_session"]
    assert seen["dies_with"] == seen["parent"] != seen["launcher"]  # the server, which dies with the launcher
    assert seen["server_alive"] and seen["sigterm_default"]  # a job-wide SIGTERM is for the workers, not the server
    assert seen["clock_restarted"]  # keel.STARTED: when the worker was forked, not when the server started


# The agent passes a pause on to workers that are still starting: one forked worker, signalled as it starts.
PAUSED_AS_IT_STARTS = """
import multiprocessing, os
from keel.worker_server import start_worker_server
from tests.unit.test_worker_server import asked_to_pause_while_starting

start_worker_server(1)
ctx = multiprocessing.get_context("forkserver")
queue = ctx.Queue()
worker = ctx.Process(target=asked_to_pause_while_starting, args=(queue, dict(os.environ)))
worker.start()
worker.join(60)
print(queue.get(timeout=1) if worker.exitcode == 0 else f"exit code {worker.exitcode}")
"""


def asked_to_pause_while_starting(queue, launcher_env: dict[str, str]) -> None:
    """SIGUSR1 before keel's entry has run, SIGTERM after it and before `keel train` listens: both kept for
    the loop, the first one named."""
    os.kill(os.getpid(), signal.SIGUSR1)
    from keel.health.signals import stop_requested_early, stop_signals_kept
    from keel.worker_server import become_worker

    become_worker(launcher_env)
    os.kill(os.getpid(), signal.SIGTERM)
    with stop_signals_kept():
        queue.put(f"kept {stop_requested_early()}")


def test_a_pause_sent_while_a_worker_starts_waits_for_its_handlers(tmp_path: Path) -> None:
    out = launch(PAUSED_AS_IT_STARTS, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "kept SIGUSR1"  # not lost to the server's SIG_IGN, nor killed by SIG_DFL
