"""The process group the replica groups average through: torchft's reconfigurable gloo group, with every
wait bounded by keel's settings (imported only when torchft is, from keel.train.replicas).

torchft configures its group at each new quorum from a prefix of the first group's store,
`/torchft/{quorum_id}/{group_rank}`, and with one timeout for everything. Two things then go wrong:
- a lighthouse started again numbers its quorums from 1 again, so a new quorum can meet the keys an
  earlier one left under the same prefix — the address of a process long dead, or of one that will
  never connect again — and its members connect to the wrong peers;
- a member that dies between the quorum and the configuration leaves the others waiting for its key for
  the whole collective timeout (`fault_tolerance.timeout_s`), heartbeating at the lighthouse all the
  while: no quorum forms without them, and every group stands still.
So each quorum configures under a prefix of its own (its id, its step and its members' ids, which name
each process's incarnation), the store and the gloo connection wait at most `connect_s`, and the
collectives keep their own timeout. Likewise, a healing group's request for a peer's state over HTTP is
answered once the peer's quorum allows it, right after its configuration; a peer whose quorum failed
never does, and the healing group would wait the whole transfer timeout, heartbeating: it waits
`connect_s` for the answer to begin (the transfer itself keeps the timeout between its reads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torchft.checkpointing import HTTPTransport
from torchft.process_group import ProcessGroupGloo


class QuorumRecorder:
    """torchft's manager client, keeping the last quorum it answered: the members' ids (with each process's
    incarnation) and the step, the same in every member of that quorum."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self.client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def quorum_tag(quorum: Any) -> str:
    """A store prefix no other quorum uses: its id, step and members (a lighthouse started again reuses ids)."""
    if quorum is None:
        return "q"
    members = ",".join(sorted(quorum.replica_ids))
    return "q" + hashlib.sha1(f"{quorum.quorum_id}|{quorum.max_step}|{members}".encode()).hexdigest()[:16]


class BoundedGloo(ProcessGroupGloo):
    """torchft's gloo group: configured under the quorum's own prefix, within `connect_s`; its collectives
    time out after `collective_s`."""

    def __init__(self, connect_s: float, collective_s: float, quorum: Callable[[], Any]) -> None:
        super().__init__(timeout=timedelta(seconds=connect_s))  # the store's waits and gloo's connection
        self.collective_timeout = timedelta(seconds=collective_s)
        self.quorum = quorum

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        super().configure(f"{store_addr}/{quorum_tag(self.quorum())}", replica_id, rank, world_size, quorum_id,
                          group_rank, group_world_size, global_ranks)

    def _opts_hook(self, opts: Any) -> Any:
        if hasattr(opts, "timeout"):  # the connection's short bound must not cut a collective short
            opts.timeout = self.collective_timeout
        return opts


class PromptHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport; a healing group waits at most `answer_s` for its peer to start
    answering (the socket's timeout, between reads), not the whole transfer timeout."""

    def __init__(self, timeout: timedelta, answer_s: float) -> None:
        super().__init__(timeout=timeout, num_chunks=0)
        self.answer = timedelta(seconds=answer_s)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        return super().recv_checkpoint(src_rank, metadata, step, min(timeout, self.answer))
