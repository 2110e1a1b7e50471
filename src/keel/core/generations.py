"""In-process restarts (`health.in_process_restart`). When a worker of a one-node job is killed, its launcher
starts a replacement for that rank alone; the other workers keep their processes, leave the process group whose
peer died and meet the replacement in a new one: generation g of the job's group, g = 1, 2, ... within one start
of the workers by the agent (its round). They meet through a store that the launcher holds: the workers' own
store is served by rank 0, which may be the rank that died.

The launcher announces generation g (the ranks it replaces) before it starts the replacements, whose
environment names g; a worker whose collective failed waits a few seconds for the next generation's
announcement, and without one fails as before (the agent then restarts every worker)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a store is made: the launcher reads the rest before it loads torch
    import torch.distributed as dist

STORE_ENV = "KEEL_GENERATION_STORE"  # host:port of the launcher's store; set only where in-process restarts are on
ROUND_ENV = "KEEL_ROUND"  # which start of the workers by the agent this process belongs to
GENERATION_ENV = "KEEL_GENERATION"  # the generation a replacement joins (unset: 0, the round's first)
ANNOUNCE_WAIT_S = 5.0  # how long a worker whose peer failed waits for its launcher to replace it
STORE_TIMEOUT = timedelta(seconds=60)


def enabled() -> bool:
    """Whether this worker's launcher restarts a killed peer alone."""
    return bool(os.environ.get(STORE_ENV))


def joined() -> int:
    """The generation this process starts in: 0, or the one it was started to join as a replacement."""
    return int(os.environ.get(GENERATION_ENV, "0"))


def _key(generation: int, name: str) -> str:
    return f"round/{os.environ.get(ROUND_ENV, '0')}/generation/{generation}/{name}"


def connect(address: str | None = None, timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A client of the launcher's store (`address`, default the environment's)."""
    import torch.distributed as dist

    host, _, port = (address or os.environ[STORE_ENV]).rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, use_libuv=True)


def group_store(generation: int) -> dist.Store:
    """Where generation `generation`'s process group is formed: keys of its own, never another's addresses."""
    import torch.distributed as dist

    return dist.PrefixStore(_key(generation, "group/"), connect())


def announce(store: dist.Store, generation: int, ranks: list[int]) -> None:
    """The launcher's word that generation `generation` replaces `ranks` (set before they start)."""
    store.set(_key(generation, "replaced"), json.dumps(ranks))


def announced(generation: int, wait_s: float = ANNOUNCE_WAIT_S) -> list[int] | None:
    """The ranks generation `generation` replaces, once the launcher has said so within `wait_s`; None: it did not
    (the failure was not a peer's death that the launcher handles alone)."""
    key, deadline = _key(generation, "replaced"), time.monotonic() + wait_s
    store = connect(timeout=timedelta(seconds=wait_s))
    while True:
        if store.check([key]):
            return json.loads(store.get(key))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
