"""Replica groups (fault_tolerance.replica_groups > 1): this group's part in torchft's quorum.

Each replica group is a whole torchrun job holding a full copy of the model in any layout; the groups
meet only here, through torchft's `Manager`. Every step begins with a quorum (synchronous, so every
group knows before it reads data who takes part); a group that is behind — a restarted one — receives
the model, optimizer and train state of a live peer through torchft's checkpoint transport and joins
at the live step, never reading storage. The live groups split the global batch between them, so the
global batch, the loss scale and the data order stay those of the fault-free run whatever the number
of groups; after the backward, the gradients (and the loss) are averaged over the live groups in one
flat all-reduce; the update is applied only when torchft commits the step, and an uncommitted step is
made again from the same batch by the groups of the next quorum.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from keel.config import FaultToleranceConfig
from keel.core.actions import Action
from keel.core.callbacks import Step
from keel.core.dtensor import local
from keel.core.replica import LIGHTHOUSE_ENV, PARTICIPANTS, ROOT_ENV, replica_group
from keel.core.state import TrainState, rng_state, set_rng_state
from keel.data.loader import GlobalOrderLoader
from keel.errors import EXIT_QUARANTINE, EXIT_REPLICA_WAIT, ConfigError
from keel.guard.sdc import fingerprint
from keel.monitor.run_monitor import RunMonitor
from keel.rundir.events import EventLog, host
from keel.rundir.quarantine import add_to_quarantine
from keel.train.components import Builtin

QUORUM_RETRY_S = 0.5
# The groups' process group is configured within one heartbeat timeout and this: a member that died
# between the quorum and the configuration is given up then, not after the collective timeout.
CONNECT_GRACE_S = 1.0
BOUND_GRACE_S = 5.0  # the watchdog's margin over the sum of the timeouts a quorum's waits are given
# What the drills' faults (keel.drill.faults) hook into, called with the moment and the step: "join" as a
# group starts its first quorum, "serve" as it hands its state to a healing peer, "heal" as it received one.
DRILL_HOOKS: list[Callable[[str, int], None]] = []


def disagreeing(table: torch.Tensor) -> list[int]:
    """The rows (replica groups) that differ from the majority's row; every row when there is none."""
    rows = [tuple(row.tolist()) for row in table]
    common, count = Counter(rows).most_common(1)[0]
    if count == len(rows):
        return []
    if count * 2 > len(rows):
        return [i for i, row in enumerate(rows) if row != common]
    return list(range(len(rows)))


def heartbeats(lighthouse: str, within_s: float) -> set[str] | None:
    """The replica ids (`keel_group_G:UUID`) whose heartbeat the lighthouse saw within `within_s`, read from
    its status page (None when the page cannot be read or parsed)."""
    try:
        with urllib.request.urlopen(f"{lighthouse}/status", timeout=2) as response:
            page = response.read().decode()
    except OSError:
        return None
    if "Heartbeats" not in page:
        return None
    return {replica for replica, ago in re.findall(r"(keel_group_\d+:\S*?): seen ([0-9.e-]+)s ago", page)
            if float(ago) < within_s}


def heartbeating(lighthouse: str, within_s: float) -> set[int] | None:
    """The replica groups whose heartbeat the lighthouse saw within `within_s` (None: the page cannot be read,
    then nobody waits on it)."""
    seen = heartbeats(lighthouse, within_s)
    return None if seen is None else {int(replica.split(":")[0].removeprefix("keel_group_")) for replica in seen}


class ReplicaGroups(Builtin):
    """The quorum at each step's start, the cross-group gradient average after the backward, and the
    commit vote before the update."""
    priority = 150  # the cross-group average before the guards read the step
    state_name = "replicas"  # its part of the host train state

    def __init__(self, cfg: FaultToleranceConfig, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 state: TrainState, loader: GlobalOrderLoader, dp_rank: int, dp_size: int, monitor: RunMonitor,
                 run_dir: Path, events: EventLog, say: Any, rank0: bool, check_every: int = 0) -> None:
        try:
            from torchft import Manager
            from torchft.checkpointing.pg_transport import PGTransport

            from keel.train.replica_pg import BoundedGloo, PromptHTTPTransport, QuorumRecorder
        except ImportError as e:
            raise ConfigError("fault_tolerance.replica_groups > 1 needs torchft: pip install 'keel-pretrain[ft]' "
                              f"({e})") from e
        self.cfg, self.parts, self.optimizers, self.state, self.loader = cfg, parts, optimizers, state, loader
        self.dp_rank, self.dp_size, self.events, self.say, self.rank0 = dp_rank, dp_size, events, say, rank0
        self.monitor = monitor
        self.group = replica_group()
        self.address = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        timeout = timedelta(seconds=cfg.timeout_s)
        self.recorder: QuorumRecorder | None = None
        connect_s = cfg.heartbeat_timeout_s + CONNECT_GRACE_S
        pg = BoundedGloo(connect_s, cfg.timeout_s, lambda: self.recorder.last if self.recorder else None)
        device = next(parts[0].parameters()).device
        # http: an HTTP server on each group's rank 0 that a healing group reads from.
        transport = PGTransport(pg, timeout=timeout, device=device) if cfg.transport == "pg" else \
            PromptHTTPTransport(timeout, answer_s=connect_s)
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, checkpoint_transport=transport,
            min_replica_size=cfg.min_replicas, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s), connect_timeout=timeout,
            # A quorum the lighthouse failed (it died, or is starting again) is asked again every
            # QUORUM_RETRY_S within the quorum timeout: torchft's default, no retry, waits out the timeout.
            quorum_retries=max(1, int(cfg.quorum_timeout_s / QUORUM_RETRY_S)),
            replica_id=f"keel_group_{self.group}", lighthouse_addr=self.address,
            init_sync=False)  # every group initialises the same weights from the seed
        # The quorum's members, read when the process group is configured (see keel.train.replica_pg).
        self.recorder = self.manager._client = QuorumRecorder(self.manager._client)
        self.manager.register_state_dict_fn("keel", self._load_peer_state, self._peer_state)
        self.participants, self.replica_rank = 0, -1
        self.heals, self.heal_s, self.quorums, self.retries = 0, 0.0, 0, 0
        self.position: dict = {}  # the loader's state before this step's batch: an uncommitted step reads it again
        self.joined, self.joined_at = False, 0.0
        self.joined_by_peer: Callable[[], None] = lambda: None  # a group joined with its own state
        self.before_heal: Callable[[], None] = lambda: None  # called before a peer's state replaces this group's
        self.check_every, self.verified = check_every, 0
        self.verified_now: Callable[[], None] = lambda: None  # the state now is verified: its snapshot is kept
        self.root = Path(os.environ.get(ROOT_ENV) or run_dir)  # where the run's quarantine.json is

    # ------------------------------------------------------------ what a healing group receives

    def _drill(self, moment: str) -> None:
        for hook in DRILL_HOOKS:
            hook(moment, self.state.step)

    def _peer_state(self) -> dict:
        self._drill("serve")
        return {"parts": [part.state_dict() for part in self.parts],
                "optimizers": [opt.state_dict() for opt in self.optimizers],
                "train": self.state.to_dict(), "rng": rng_state()}

    def _load_peer_state(self, peer: dict) -> None:
        self._drill("heal")
        self.before_heal()
        for part, saved in zip(self.parts, peer["parts"], strict=True):
            part.load_state_dict(saved)
        for opt, saved in zip(self.optimizers, peer["optimizers"], strict=True):
            opt.load_state_dict(saved)
        self.state.load(peer["train"])
        set_rng_state(peer["rng"])

    def state_dict(self) -> dict:
        """The manager's counters, saved with the train state (and so in checkpoints)."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, saved: dict) -> None:
        self.manager.load_state_dict(saved)

    # ------------------------------------------------------------ the quorum

    def join(self) -> bool:
        """The first step's quorum, before anything is restored: True when this group was behind a live
        peer and received its state (then storage is not read); False when no live group has progressed
        further, so every member of the quorum restores the same newest checkpoint."""
        self.joined, self.joined_at = True, time.monotonic()
        self.monitor.ledger.charge("startup")
        if self.rank0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            self._wait_for_groups()
        self._drill("join")
        healed = self._quorum()
        while not healed and self._others_left_out():
            time.sleep(QUORUM_RETRY_S)
            healed = self._quorum()
        self.monitor.ledger.charge("replica_quorum")
        if healed:
            self.say(f"replica group {self.group} healed from a live peer at step {self.state.step} in "
                     f"{self.heal_s:.2f} s ({self.participants} group(s) in the quorum)")
        return healed

    def _others_left_out(self) -> bool:
        """Whether this group's first quorum left out groups that heartbeat at the lighthouse (or failed): then it
        asks again, within the quorum timeout. A lighthouse started again knows no group, and gives its first
        quorum to whichever asks first, alone: a restarted group must not train from a checkpoint while a live
        one is ahead of it. The same answer on every rank of the group (they ask for quorums together)."""
        live = heartbeating(self.address, self.cfg.heartbeat_timeout_s) if self.rank0 else None
        again = torch.tensor([float(live is not None and self.participants < len(live))])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(again, op=dist.ReduceOp.MAX)
        if not again.item():
            return False
        if time.monotonic() - self.joined_at > self.cfg.quorum_timeout_s:
            self.say(f"warning: replica group {self.group}'s quorum still leaves out live groups after "
                     f"{self.cfg.quorum_timeout_s:.0f} s; it trains with those it holds")
            return False
        return True

    def _wait_for_groups(self) -> None:
        """At a group's first start, until every replica group's manager heartbeats at the lighthouse (at
        most `join_timeout_s`): the first quorum then holds them all, instead of the first group to start
        training alone until the others heal from it."""
        deadline = time.monotonic() + self.cfg.join_timeout_s
        while time.monotonic() < deadline:
            live = heartbeating(self.address, self.cfg.heartbeat_timeout_s)
            if live is None or len(live) >= self.cfg.replica_groups:
                return
            time.sleep(0.1)
        self.say(f"warning: not every replica group reached the lighthouse within {self.cfg.join_timeout_s:.0f} s; "
                 f"training starts without the missing ones, which heal when they join")

    def before_step(self, state: TrainState) -> None:
        if not self.joined:
            with self.monitor.phase("replica_quorum"):
                self._quorum()
        self.joined = False
        self.position = self.loader.state_dict()

    def on_step_start(self, step: Step) -> None:
        step.metrics[PARTICIPANTS] = float(self.participants)  # what this step's quorum holds, from its start

    @contextlib.contextmanager
    def _bounded(self, what: str) -> Iterator[None]:
        """A watchdog over a wait inside torchft that keel cannot interrupt: every wait in it has a timeout
        (the quorum, the process group's configuration, the heal's transfer), so one that outlives their sum
        never ends, and the worker exits for its launcher to start it again, out of the lighthouse's
        heartbeats: the other groups then go on without it."""
        cfg = self.cfg
        limit_s = cfg.quorum_timeout_s + cfg.heartbeat_timeout_s + CONNECT_GRACE_S + 2 * cfg.timeout_s + BOUND_GRACE_S
        timer = threading.Timer(limit_s, self._stuck, args=(what, limit_s))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _stuck(self, what: str, limit_s: float) -> None:
        self.say(f"error: replica group {self.group}'s {what} did not end within {limit_s:.0f} s (the sum of its "
                 f"fault_tolerance timeouts); the worker exits {EXIT_REPLICA_WAIT} and its launcher starts it again")
        faulthandler.dump_traceback(all_threads=True)  # where it waited
        if self.rank0:
            self.events.emit("quorum", self.state.step, "stuck", group=self.group, what=what, waited_s=round(limit_s))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_REPLICA_WAIT)

    def _quorum(self) -> bool:
        started, step_before = time.perf_counter(), self.manager.current_step()
        with self._bounded("quorum"):
            self.manager.start_quorum()  # synchronous: a heal is applied before this returns
        if (error := self.manager.errored()) is not None:
            # No process group (a member died before it was configured, or the heal failed): nothing this
            # step computes is committed, it is made again by the next quorum; the last good quorum's
            # shares stand meanwhile (this one may count a dead process among its members).
            if self.rank0:
                cause = getattr(error, "original_exception", error)
                self.events.emit("quorum", self.state.step, "failed", group=self.group, error=str(cause)[:300])
            return False
        healed = self.manager.current_step() > step_before
        if healed:
            self.heals, self.heal_s = self.heals + 1, time.perf_counter() - started
        participants, rank = self.manager.num_participants(), self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(f"replica group {self.group} is not part of the quorum it joined")
        if participants > self.participants and not healed and self.participants:
            self.joined_by_peer()
        if participants > self.participants or healed:  # a heal made the groups' states equal
            self.verified = self.state.step
        if (participants, rank) != (self.participants, self.replica_rank) or healed:
            self.quorums += 1
            if self.rank0:
                self.events.emit("quorum", self.state.step, "heal" if healed else "change", group=self.group,
                                 participants=participants, replica_rank=rank, heal_s=round(self.heal_s, 3)
                                 if healed else 0.0, quorum_s=round(time.perf_counter() - started, 3))
        self.participants, self.replica_rank = participants, rank
        # The live groups split every global batch: this rank's slice of the live data-parallel ranks.
        self.loader.share(rank * self.dp_size + self.dp_rank, participants * self.dp_size)
        return healed

    # ------------------------------------------------------------ average, then commit

    def on_backward(self, step: Step, replaying: bool) -> None:
        """Average this rank's gradient shards and loss with the same rank of every live group: one flat
        buffer, one all-reduce (a group lost inside it makes the step uncommitted, not a crash); sum the step's
        tallies alike."""
        if replaying:
            return
        assert step.loss is not None
        grads = [local(p.grad) for part in self.parts for p in part.parameters() if p.grad is not None]
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), step.loss.detach().float().reshape(1)])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        step.loss = flat[-1].clone()
        if step.tallies:  # summed in float64 (counts exact up to 2**53), in their own buffer
            table = torch.cat([t.reshape(-1).double() for t in step.tallies])
            self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
            offset = 0
            for t in step.tallies:
                t.copy_(table[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def after_backward(self, step: Step) -> Action | None:
        ledger = self.monitor.ledger
        if self.manager.should_commit():
            missing = 1 - self.participants / self.cfg.replica_groups
            if missing > 0 and not ledger.recomputing:  # this step's share of the groups that are not there
                ledger.spent("productive")
                ledger.move(step.compute_s * missing, "productive", "replica_cover")
            return None
        ledger.charge("wasted")  # the step is made again
        self.retries += 1
        if self.rank0:
            self.events.emit("quorum", step.state.step, "retry", group=self.group, participants=self.participants)
        self.loader.load_state_dict(self.position)  # the same global batch again, shared by the next quorum
        return Action("retry", "replica_groups", f"step {step.number} was not committed by the replica groups "
                      f"(a group was lost during it); made again by the next quorum")

    # ------------------------------------------------------------ the groups' states compared

    def on_start(self, state: TrainState) -> None:
        """The state the run starts from is the same in every group (the same seed, the same checkpoint, or a
        peer's): the first verified one."""
        self.verified = state.step
        self.verified_now()

    def on_step_end(self, step: Step) -> Action | None:
        """Every `guard.sdc.fingerprint_interval` steps: every group must hold bitwise the same parameters
        and optimizer moments (they applied the same averaged gradients). A group that differs from the
        majority computed wrong — silent data corruption — and leaves the quorum for good, named in
        quarantine.json; its gradients went into every group's updates since the last verified state, so the
        others go back to that state and train on from there. With no majority (two groups), every group rolls
        back to it."""
        number = step.state.step
        self.verified = min(self.verified, number - 1)  # a rollback went back further than the verified state
        if not self.check_every or number % self.check_every or self.participants < 2:
            return None
        checked = [*(p for part in self.parts for p in part.parameters()),
                   *(v for opt in self.optimizers for s in opt.state.values() for k, v in sorted(s.items())
                     if isinstance(v, torch.Tensor) and k != "step")]
        table = torch.zeros(self.participants, len(checked), dtype=torch.int64)
        table[self.replica_rank] = fingerprint(checked)
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:  # a group was lost during the check: the next one decides
            return None
        flags = torch.zeros(self.participants)
        flags[list(disagreeing(table))] = 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # a suspect seen from any rank is the group's verdict
        suspects = [g for g, f in enumerate(flags.tolist()) if f]
        if not suspects:
            self.verified = number
            self.verified_now()
            return None
        return self._suspected(number, suspects)

    def _suspected(self, number: int, suspects: list[int]) -> Action:
        """What each group does about the suspects: with no majority, every group rolls back to the verified
        state; otherwise a suspect leaves (exit 76, its checkpoints since that state retired, named in
        quarantine.json) and the others roll back to it. No collective spans the groups until the next quorum,
        which is formed without the suspects."""
        reason = (f"replica group(s) at quorum rank {', '.join(map(str, suspects))} hold other parameters or optimizer "
                  f"moments than the others at step {number}")
        if self.rank0:
            self.events.emit("alert", number, "sdc_suspect", severity="critical", message=reason, group=self.group,
                             suspects=suspects, verified_step=self.verified)
        if len(suspects) == self.participants:  # no majority: nobody can be named, everyone goes back
            return Action("rollback", "replica_groups", reason + "; no majority, every group rolls back to step "
                          f"{self.verified}", to_step=self.verified)
        if self.replica_rank not in suspects:  # their gradients are in this group's updates since the verified state
            return Action("rollback", "replica_groups", reason + f"; they leave the quorum, the other groups roll back "
                          f"to step {self.verified}, the last verified state, and train on without them",
                          to_step=self.verified)
        if self.rank0:
            add_to_quarantine(self.root, [host()], source="replica_groups", reason=reason, step=number,
                              group=self.group)
        self.say(f"error: replica group {self.group} computed wrong ({reason}); it leaves the quorum with exit code "
                 f"{EXIT_QUARANTINE}, the other groups roll back to step {self.verified} and train on")
        return Action("stop", "replica_groups", reason, to_step=self.verified, exit_code=EXIT_QUARANTINE)

    def metrics(self) -> dict[str, float]:
        return {PARTICIPANTS: float(self.participants), "ft/heals_total": float(self.heals),
                "ft/heal_s": self.heal_s, "ft/quorum_changes_total": float(self.quorums),
                "ft/retries_total": float(self.retries)}

    def is_writer(self) -> bool:
        """Whether this group writes the run's checkpoints: the first group of the quorum."""
        return self.replica_rank == 0

    def close(self) -> None:
        self.manager.shutdown(wait=False)
