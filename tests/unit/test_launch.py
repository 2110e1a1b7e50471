"""The launcher's agent: what it does with the other workers when one dies."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.process import BaseProcess
from types import SimpleNamespace

from keel.launch import KeelAgent, Rendezvous


def _sleeper(code: int | None = None) -> BaseProcess:
    """A real process, as the agent's workers are (forked), that sleeps or exits with `code`."""
    target = (lambda: os._exit(code)) if code is not None else (lambda: time.sleep(60))
    proc = multiprocessing.get_context("fork").Process(target=target)
    proc.start()
    return proc


def _agent_over(procs: list[BaseProcess]) -> KeelAgent:
    agent = KeelAgent.__new__(KeelAgent)  # only its process context is used: no in-process restarts
    agent._pcontext = SimpleNamespace(_pc=SimpleNamespace(processes=procs))
    agent._generations = None
    return agent


NO_WORKERS = SimpleNamespace(workers=[])


def test_the_others_are_killed_at_once_when_a_worker_is_killed_by_a_signal() -> None:
    procs = [_sleeper() for _ in range(3)]
    try:
        procs[1].kill()
        procs[1].join(10)
        _agent_over(procs)._end_survivors_of_a_killed_worker(NO_WORKERS)
        for p in procs:
            p.join(10)
        assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 3
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_workers_that_exit_with_a_code_leave_the_others_to_their_own_end() -> None:
    """A pause, a guard's stop or an error ends every rank by itself (a code, not a signal): no one is killed."""
    procs = [_sleeper(), _sleeper(75)]
    try:
        procs[1].join(10)
        _agent_over(procs)._end_survivors_of_a_killed_worker(NO_WORKERS)
        assert procs[1].exitcode == 75 and procs[0].exitcode is None
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_the_node_whose_address_is_the_endpoints_hosts_the_rendezvous(tmp_path) -> None:
    def conf(local: str) -> tuple[str, list[str]]:
        args = Rendezvous("2", "10.0.0.1:29400", local).args(tmp_path)
        return args[args.index("--rdzv-conf") + 1], args[args.index("--rdzv-conf") + 2:]

    assert conf("10.0.0.1") == (conf("10.0.0.1")[0], ["--local-addr", "10.0.0.1"])
    assert conf("10.0.0.1")[0].endswith(",is_host=true") and conf("10.0.0.2")[0].endswith(",is_host=false")
    # Without an address torch decides by host name, as torchrun does.
    assert "is_host" not in conf("")[0] and conf("")[1] == []
    assert Rendezvous().args(tmp_path) == ["--standalone"]
