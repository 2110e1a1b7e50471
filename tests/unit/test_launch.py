"""The launcher's agent: what it does with the other workers when one dies."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

from keel.launch import KeelAgent

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _agent_over(procs: list[subprocess.Popen]) -> KeelAgent:
    agent = KeelAgent.__new__(KeelAgent)  # only its process context is used
    agent._pcontext = SimpleNamespace(subprocess_handlers={i: SimpleNamespace(proc=p) for i, p in enumerate(procs)})
    return agent


def test_the_others_are_killed_at_once_when_a_worker_is_killed_by_a_signal() -> None:
    procs = [subprocess.Popen(SLEEPER) for _ in range(3)]
    try:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        _agent_over(procs)._end_survivors_of_a_killed_worker()
        assert [p.wait(10) for p in procs] == [-signal.SIGKILL] * 3
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_workers_that_exit_with_a_code_leave_the_others_to_their_own_end() -> None:
    """A pause, a guard's stop or an error ends every rank by itself (a code, not a signal): no one is killed."""
    procs = [subprocess.Popen(SLEEPER), subprocess.Popen([sys.executable, "-c", "raise SystemExit(75)"])]
    try:
        procs[1].wait(10)
        _agent_over(procs)._end_survivors_of_a_killed_worker()
        assert procs[0].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
