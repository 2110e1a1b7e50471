"""A node's reach to its job's rendezvous: silence for the window is a node cut off, an answer is not."""

from __future__ import annotations

import socket
import time

from keel.health.reach import ReachWatch


def watch(endpoint: str, window_s: float) -> list[str]:
    lost: list[str] = []
    reach = ReachWatch(endpoint, window_s, lost.append, poll_s=0.2).start()
    time.sleep(window_s + 1.5)
    reach.stop()
    return lost


def test_a_rendezvous_that_answers_or_refuses_is_reached() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert watch(f"127.0.0.1:{server.getsockname()[1]}", window_s=1.0) == []
    with socket.socket() as s:  # a port nobody listens on: the host answers with a refusal (the job has ended)
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert watch(f"127.0.0.1:{free}", window_s=1.0) == []


def test_a_rendezvous_that_stays_silent_for_the_window_is_lost_once() -> None:
    # A host that takes no more connections and drops the attempts, as one behind a dead link does: a listener
    # that accepts none, its one-place queue already taken.
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            lost = watch(f"127.0.0.1:{port}", window_s=1.0)
    assert len(lost) == 1 and lost[0].startswith(f"the rendezvous at 127.0.0.1:{port} has not answered for "), lost
