"""The replica groups' process group: configured under a prefix of the quorum's own, within a short bound when
a member never comes, while its collectives keep their own timeout (real gloo, two members in threads)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from torch.distributed import AllreduceOptions, TCPStore  # noqa: E402

from keel.core.net import free_port  # noqa: E402
from keel.train.replica_pg import BoundedGloo, quorum_tag  # noqa: E402

CONNECT_S = 1.0


def quorum(quorum_id: int = 1, step: int = 0, members: tuple[str, ...] = ("keel_group_0:a", "keel_group_1:b")) -> Any:
    return SimpleNamespace(quorum_id=quorum_id, max_step=step, replica_ids=list(members))


def test_a_quorum_tag_names_its_id_step_and_members_and_nothing_else() -> None:
    assert quorum_tag(quorum()) == quorum_tag(quorum(members=("keel_group_1:b", "keel_group_0:a")))
    others = [quorum(2), quorum(step=5), quorum(members=("keel_group_0:a", "keel_group_1:c"))]
    assert len({quorum_tag(q) for q in [quorum(), *others]}) == 4


def _member(port: int, rank: int, late: tuple[float, float], seen: Any, out: dict) -> None:
    """Configure `late[0]` seconds late, then all-reduce `late[1]` seconds late."""
    pg = BoundedGloo(CONNECT_S, collective_s=30.0, quorum=lambda: seen)
    time.sleep(late[0])
    started = time.monotonic()
    try:
        pg.configure(f"127.0.0.1:{port}/torchft/1/0", f"g{rank}", rank, 2)
    except Exception as e:  # what torchft's manager reports as the quorum's error
        out[rank] = ("configure failed", time.monotonic() - started, str(e))
        return
    time.sleep(late[1])
    tensor = torch.full((3,), float(rank + 1))
    pg.allreduce([tensor], AllreduceOptions()).wait()
    out[rank] = ("reduced", tensor.tolist())


def _run(port: int, members: dict[int, tuple[float, float]], seen: Any) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=_member, args=(port, rank, late, seen, out)) for rank, late in members.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_a_member_that_never_comes_fails_the_configuration_within_the_bound_not_the_collective_timeout() -> None:
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out = _run(port, {0: (0.0, 0.0)}, quorum())
    state, waited, error = out[0]
    assert state == "configure failed" and "timeout" in error
    assert waited < 10 * CONNECT_S  # the collective timeout is 30 s
    del store


def test_a_collective_waits_for_a_late_member_beyond_the_connection_bound() -> None:
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    out = _run(port, {0: (0.0, 0.0), 1: (0.0, 2.5 * CONNECT_S)}, quorum())
    assert out == {0: ("reduced", [3.0, 3.0, 3.0]), 1: ("reduced", [3.0, 3.0, 3.0])}
    # The same store, a quorum numbered 1 again (a lighthouse started again) with another process for group 1,
    # a little late: the first's keys (addresses no one listens on now) are not read, the two connect.
    again = _run(port, {0: (0.0, 0.0), 1: (0.3 * CONNECT_S, 0.0)}, quorum(members=("keel_group_0:a", "keel_group_1:c")))
    assert again == out
    del store
