"""Workers die with their launcher. torchrun's agent starts each worker in a session of its own, so a
SIGKILL of the launcher (or of its process group) would leave the workers training on, writing into a run
directory that the next job then enters. Each worker asks the kernel for a SIGKILL when the process that
started it ends (Linux's parent-death signal), and checks that it did not already end before it asked."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
AGENT_PID_ENV = "KEEL_AGENT_PID"  # the process that started this worker: the launcher's worker server


def kill_when_parent_dies() -> bool:
    """Ask the kernel for a SIGKILL when this process's parent (the thread that started it) ends; it survives
    exec, so a launcher passes it as `preexec_fn`. False where the kernel has no such request or refuses it."""
    if not sys.platform.startswith("linux"):
        return False
    return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


def die_with_launcher() -> None:
    """Called first thing by a torchrun worker. The parent-death signal fires when the thread that
    started this process ends: the worker server forks from its main thread, and ends with the launcher."""
    if not kill_when_parent_dies():
        return  # not allowed here (a sandbox): the run lock still keeps a second job out
    expected = os.environ.get(AGENT_PID_ENV)
    if expected and os.getppid() != int(expected):  # the launcher died before the request was made
        os._exit(128 + signal.SIGKILL)
