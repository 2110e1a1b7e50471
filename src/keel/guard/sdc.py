"""Silent data corruption: ranks that should agree bit for bit are made to show it.

Replica fingerprints: ranks that hold the same shard (the data-parallel replicas of HSDP) compare a
fingerprint of their parameters and optimizer state every `fingerprint_interval` steps and before
every checkpoint. A rank that disagrees with the majority of its replicas is the suspect. Two replicas
cannot outvote each other: the run then rolls back to the newest verified state and re-executes, and
the replica whose disputed tensors lie far further from their re-executed values (or, failing that,
whose own loss departed first from its re-execution) is the suspect.

Step replay: every `replay_interval` steps, and whenever the numerics or spike guards fire, each rank
recomputes the step's forward and backward and compares its loss and gradient fingerprint bitwise with
the first computation. Deterministic kernels make them equal; a rank where they differ computed wrong.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw

from keel.config import GuardConfig
from keel.core.actions import Action
from keel.core.dtensor import local
from keel.core.replica import in_replica_group
from keel.core.sync import StepReport
from keel.guard.snapshots import live_tensors
from keel.parallel.layout import Layout

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: Sequence[torch.Tensor | None], host: bool = True) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bit patterns read as integers of their own width, wrapping
    around (a flip of bit k moves it by 2^k modulo 2^width: never by nothing). Any single flipped bit, in any
    position, changes it; so does any change of one element. Integer sums are the same in any order, and
    wrapping ones run at memory bandwidth (no widening). Computed where the tensors are and read back once
    (`host`), or left there."""
    present = [local(t).detach() for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors), dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.int64, device=present[0].device)
    sums = []
    for t in tensors:
        if t is None:
            sums.append(zero)
            continue
        t = local(t).detach()
        bits = t.view(_BITS[t.element_size()]) if t.is_floating_point() else t
        total = bits.sum(dtype=bits.dtype).long() if t.is_floating_point() else bits.sum(dtype=torch.int64)
        sums.append(total if total.device == zero.device else total.to(zero.device))  # Adam's step stays on the host
    return torch.stack(sums).cpu() if host else torch.stack(sums)


def adamw_into_scratch(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> torch.Tensor:
    """The fingerprints of `p` and its AdamW state (in live_tensors' order) after the update `optimizer.step()`
    is about to make, computed on copies by the same functional kernels (fused or foreach as the group steps)."""
    state = optimizer.state.get(p, {})
    if p.grad is None:  # not updated: stays as it is
        return fingerprint([p, *(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))])
    if not state:  # the first update: AdamW starts from zeros, as its own initialisation does
        state = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                 "step": torch.zeros((), dtype=torch.float32, device=p.device if group["fused"] else "cpu")}
    scratch = {k: v.clone() for k, v in state.items()}
    param = p.detach().clone()
    adamw(foreach=group["foreach"], capturable=group["capturable"], differentiable=False, fused=group["fused"],
          params=[param], grads=[p.grad], exp_avgs=[scratch["exp_avg"]], exp_avg_sqs=[scratch["exp_avg_sq"]],
          max_exp_avg_sqs=[], state_steps=[scratch["step"]], amsgrad=group["amsgrad"], beta1=group["betas"][0],
          beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
          maximize=group["maximize"])
    return fingerprint([param, *(scratch[k] for k in sorted(scratch))])


def tensor_names(optimizers: list[torch.optim.Optimizer], names: Mapping[torch.nn.Parameter, str]) -> list[str]:
    """The name of each tensor of live_tensors, in its order: the parameter's (from `names`, else its place)
    and `NAME/exp_avg` for its optimizer state's."""
    out: list[str] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names.get(p, f"parameter {len(out)}")
                state = optimizer.state.get(p, {})
                out += [name] + [f"{name}/{k}" for k in sorted(k for k, v in state.items()
                                                                if isinstance(v, torch.Tensor))]
    return out


DECISIVE = 4.0  # how much further one replica must have moved than the other to be named alone


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; a NaN or Inf on either side counts as infinitely far."""
    diff = (a.double() - local(b).detach().to("cpu", torch.float64)).abs()
    return float("inf") if not torch.isfinite(diff).all() else float(diff.max()) if diff.numel() else 0.0


def same_bits(a: float, b: float) -> bool:
    """Equal as float32 bit patterns (a NaN equals the same NaN)."""
    return struct.pack("f", a) == struct.pack("f", b)


class SdcGuard:
    name = "sdc"

    def __init__(self, cfg: GuardConfig, layout: Layout, optimizers: list[torch.optim.Optimizer],
                 params: list[torch.nn.Parameter], deterministic: bool,
                 names: Mapping[torch.nn.Parameter, str] | None = None) -> None:
        self.cfg, self.optimizers, self.params = cfg.sdc, optimizers, params
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = layout.replicas.get_group() if layout.replicas is not None else None
        self.replicas = dist.get_process_group_ranks(self.group) if self.group is not None else [self.rank]
        self.can_replay = deterministic
        # A replica group's verdicts are its own, and a rollback of one group alone would part it from the others
        # (which averaged its gradients meanwhile): there the groups' comparison of their states covers it.
        self.at_rest_interval = 0 if in_replica_group() else self.cfg.at_rest_interval
        self.last_verified = 0  # newest step whose state passed a check
        self.losses: dict[int, float] = {}  # this rank's own loss at each step since then
        self.pending: dict | None = None  # a two-replica disagreement, waiting for its re-execution
        self.disputed: dict[int, torch.Tensor] = {}  # this rank's copy of the tensors in dispute
        self.check_s = self.replay_s = self.at_rest_s = 0.0  # the last check, replay, at-rest check and seal
        self.moments_every = self.cfg.at_rest_moments_every
        self.sealed: tuple[int, list[int], torch.Tensor] | None = None  # the step sealed, what of watched, fingerprint
        self.watched: list[torch.Tensor] = []  # the local shards sealed
        self.turns: list[int] = []  # each watched tensor's turn: -1 for a parameter (every check)
        self.held: list = []  # the parameters and optimizer state they are the local shards of
        self.update_due = False  # the coming update is re-executed (its step's replay passed)
        self.expected: torch.Tensor | None = None  # the re-executed update's fingerprints
        self.update_s = 0.0
        self.names = names or {}  # each parameter's name, for the events

    # ------------------------------------------------------------ step replay (before the update)

    def record(self, report: StepReport) -> None:
        if self.group is not None:  # for telling two replicas apart; dropped at each passed check
            self.losses[report.step] = report.local_loss

    def wants_replay(self, step: int, fired: bool) -> bool:
        return self.can_replay and (fired or (self.cfg.replay_interval > 0 and step % self.cfg.replay_interval == 0))

    def replay(self, report: StepReport, recompute: Callable[[], tuple[torch.Tensor, list]]) -> Action | None:
        started = time.perf_counter()
        first = fingerprint([p.grad for p in self.params])
        loss, grads = recompute()
        again = fingerprint(grads)
        loss_again = float(loss.detach().float())
        differs = not same_bits(report.local_loss, loss_again) or not torch.equal(first, again)
        flags: list = [None] * self.world
        dist.all_gather_object(flags, (differs, report.local_loss, loss_again, int((first != again).sum())))
        self.replay_s = time.perf_counter() - started
        suspects = tuple(r for r, f in enumerate(flags) if f[0])
        if not suspects:
            if self.group is None:  # without replicas, a clean replay is the best verification there is:
                self.last_verified = report.step  # this step's update is made from verified gradients
            return None
        evidence = {"detector": "replay", "ranks": list(suspects),
                    "loss": {r: flags[r][1] for r in suspects}, "replayed_loss": {r: flags[r][2] for r in suspects},
                    "differing_gradients": {r: flags[r][3] for r in suspects}}
        return Action("quarantine", self.name, f"step {report.step} computed differently when replayed on rank(s) "
                      f"{', '.join(map(str, suspects))}", evidence, ranks=suspects, to_step=report.step - 1,
                      verified_only=True)

    # ------------------------------------------------------------ the update, re-executed on replayed steps

    def reexecute_update(self) -> None:
        """Just before the optimizers step on a step whose replay passed (`update_due`): each parameter's update
        computed from the same inputs into scratch memory, one parameter at a time, by the kernels the optimizer
        runs (AdamW is elementwise and deterministic on a given device); its fingerprints are what the update must
        write (`check_update`)."""
        started = time.perf_counter()
        expected = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    expected.append(adamw_into_scratch(optimizer, group, p))
        self.expected = torch.cat(expected)
        self.update_s = time.perf_counter() - started

    def _gather_changed(self, expected: torch.Tensor, chosen: list[int] | None = None) -> list[list[str]]:
        """Every rank's names of its live tensors (those `chosen`, by position) whose fingerprint is not
        `expected`'s (this rank's, on the host)."""
        live, names = live_tensors(self.optimizers)[0], tensor_names(self.optimizers, self.names)
        if chosen is not None:
            live, names = [live[i] for i in chosen], [names[i] for i in chosen]
        now = fingerprint(live)
        changed = ([names[i] for i in (now != expected).nonzero().flatten().tolist()]
                   if now.shape == expected.shape else ["the optimizer state's layout"])
        found: list = [None] * self.world
        dist.all_gather_object(found, changed)
        return found

    def check_update(self, step: int) -> Action | None:
        """After the update of a step re-executed: does every rank's state match its re-execution bitwise?"""
        if self.expected is None:
            return None
        started = time.perf_counter()
        expected, self.expected = self.expected, None
        found = self._gather_changed(expected)
        self.update_s += time.perf_counter() - started
        suspects = tuple(r for r, tensors in enumerate(found) if tensors)
        if not suspects:
            return None
        evidence = {"detector": "update_replay", "ranks": list(suspects), "tensors": {r: found[r] for r in suspects}}
        return Action("quarantine", self.name, f"the update of step {step} computed differently when re-executed on "
                      f"rank(s) {', '.join(map(str, suspects))}: " + "; ".join(
                          f"rank {r}: {', '.join(found[r][:3])}" for r in suspects),
                      evidence, ranks=suspects, to_step=step - 1, verified_only=True)

    # ------------------------------------------------------------ state at rest (sealed after, verified before)

    def seal(self, step: int, force: bool = False) -> None:
        """After the update of `step` (every `at_rest_interval` steps), a restore, rollback or heal (`force`):
        this rank's fingerprint of its own shards of the parameters and of the optimizer state whose turn it is
        (all of it when forced) as written, kept where they are (a GPU's reduction at memory bandwidth, no copy
        to the host)."""
        interval = self.at_rest_interval
        if interval and (force or step % interval == 0):
            started = time.perf_counter()
            watched, turn = self._watched(), (step // interval) % self.moments_every
            chosen = (list(range(len(watched))) if force or self.moments_every == 1 else
                      [i for i, t in enumerate(self.turns) if t in (-1, turn)])
            self.sealed = (step, chosen, fingerprint([watched[i] for i in chosen], host=False))
            self.at_rest_s += time.perf_counter() - started
        else:
            self.sealed = None  # an update since: unsealed until the next sealed step

    def _watched(self) -> list[torch.Tensor]:
        """live_tensors' local shards, found again only when the optimizer holds other tensors than last time (its
        first update, a loaded state): unwrapping each DTensor costs more than summing its shard."""
        held = [t for o in self.optimizers for g in o.param_groups for p in g["params"]
                for t in (p, *o.state.get(p, {}).values())]
        if len(held) != len(self.held) or any(a is not b for a, b in zip(held, self.held, strict=True)):
            self.held, (self.watched, keys) = held, live_tensors(self.optimizers)  # views the updates write in place
            self.turns = self._turns(keys)
        return self.watched

    def _turns(self, keys: list[tuple[int, tuple]]) -> list[int]:
        """Each watched tensor's turn (live_tensors' order): -1 for a parameter; the optimizer state is dealt out
        to `moments_every` turns, each tensor to the turn holding the fewest bytes so far, so that the turns
        cost alike."""
        turns, load = [], [0] * self.moments_every
        for _, state in keys:
            turns.append(-1)
            for _ in state:
                tensor = self.watched[len(turns)]
                turn = min(range(self.moments_every), key=load.__getitem__)
                load[turn] += tensor.numel() * tensor.element_size()
                turns.append(turn)
        return turns

    def changed_at_rest(self, step: int, device: torch.device) -> torch.Tensor:
        """Before the update of `step`, on the device: how many of this rank's tensors no longer match their seal
        (0 when the state was not sealed after the previous step, or was replaced since, by a peer's). The step's
        reduction sums it over the ranks: no synchronisation of its own."""
        if self.sealed is None or self.sealed[0] != step - 1:
            return torch.zeros((), device=device)
        started = time.perf_counter()
        _, chosen, sealed = self.sealed
        now = fingerprint([self.watched[i] for i in chosen], host=False)  # the tensors sealed
        changed = (now != sealed).sum() if now.shape == sealed.shape else torch.ones((), device=now.device)
        self.at_rest_s = time.perf_counter() - started  # a step's check, then its seal
        return changed.float().to(device)

    def at_rest(self, step: int) -> Action:
        """The state changed at rest on some rank (the step's reduction said so): a tensor whose fingerprint moved
        was changed by nothing the run did (the forward and backward read it; the update has not run). With no
        replica to vote, its own seal names the rank and the tensor; the run goes back to the state sealed."""
        assert self.sealed is not None
        sealed_at, chosen, sealed = self.sealed
        found = self._gather_changed(sealed.cpu(), chosen)
        suspects = tuple(r for r, tensors in enumerate(found) if tensors)
        evidence = {"detector": "at_rest", "ranks": list(suspects), "sealed_step": sealed_at,
                    "tensors": {r: found[r] for r in suspects}}
        return Action("quarantine", self.name, f"rank(s) {', '.join(map(str, suspects))} hold state that changed at "
                      f"rest after step {sealed_at}: " + "; ".join(f"rank {r}: {', '.join(found[r][:3])}"
                                                                  for r in suspects),
                      evidence, ranks=suspects, to_step=sealed_at)

    # ------------------------------------------------------------ replica fingerprints (after the update)

    def wants_check(self, step: int, save_due: bool) -> bool:
        return self.group is not None and (save_due or self.pending is not None and step == self.pending["step"] or
                                           (self.cfg.fingerprint_interval > 0 and
                                            step % self.cfg.fingerprint_interval == 0))

    def check(self, step: int) -> Action | None:
        started = time.perf_counter()
        mine = fingerprint(live_tensors(self.optimizers)[0])
        gathered = [torch.empty_like(mine) for _ in self.replicas]
        dist.all_gather(gathered, mine, group=self.group)
        keys = [tuple(g.tolist()) for g in gathered]
        majority, votes = Counter(keys).most_common(1)[0]
        differing = sorted({i for k in keys for i, (a, b) in enumerate(zip(k, majority, strict=True)) if a != b})
        verdict: tuple[str, list[int]]
        if votes == len(keys):
            verdict = ("agree", [])
        elif votes > len(keys) / 2:
            verdict = ("outvoted", [r for r, k in zip(self.replicas, keys, strict=True) if k != majority])
        else:
            verdict = ("tie", list(self.replicas))
        attribution = self._attribution_evidence(step, mine)
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, (verdict, len(differing), attribution))
        self.check_s = time.perf_counter() - started
        outvoted = sorted({r for (kind, ranks), _, _ in everyone if kind == "outvoted" for r in ranks})
        tied = sorted({tuple(ranks) for (kind, ranks), _, _ in everyone if kind == "tie"})
        tensors = max(n for _, n, _ in everyone)
        if outvoted or tied:
            evidence = {"detector": "fingerprint", "outvoted": outvoted, "tied": [r for g in tied for r in g],
                        "differing_tensors": tensors, "last_verified_step": self.last_verified}
            if outvoted and not tied:
                return Action("quarantine", self.name, f"rank(s) {', '.join(map(str, outvoted))} disagree with "
                              f"their replicas at step {step}", evidence, ranks=tuple(outvoted), to_step=step,
                              verified_only=True)
            self.pending = {"step": step, "groups": [list(g) for g in tied], "losses": sorted(self.losses.items())}
            # This rank's copy of the tensors its replicas disagree on, to measure against the re-execution.
            live = live_tensors(self.optimizers)[0]
            self.disputed = {i: live[i].detach().to("cpu", copy=True) for i in differing}
            return Action("rollback", self.name, f"replicas {' and '.join(', '.join(map(str, g)) for g in tied)} "
                          f"disagree at step {step} and cannot outvote each other: re-executing from the newest "
                          f"verified state to tell which one departed", evidence, to_step=step, verified_only=True)
        self.last_verified = step
        self.losses = {s: v for s, v in self.losses.items() if s > step}
        if self.pending is not None and step == self.pending["step"]:
            return self._attribute(step, [a for _, _, a in everyone])
        return None

    def _attribution_evidence(self, step: int, mine: torch.Tensor) -> tuple[float | None, int | None] | None:
        """For a pending two-replica disagreement, once re-executed to its step: how far this rank's
        disputed tensors were from their re-executed values (largest absolute difference; unknown if
        the run restarted in between), and the first step where its loss differed."""
        if self.pending is None or step != self.pending["step"]:
            return None
        deviation = None
        if self.disputed:
            live = live_tensors(self.optimizers)[0]
            deviation = max(_max_abs_diff(old, live[i]) for i, old in self.disputed.items())
        departed = [s for s, loss in self.pending["losses"] if s in self.losses and not same_bits(loss, self.losses[s])]
        return deviation, departed[0] if departed else None

    def _attribute(self, step: int, evidence: list) -> Action:
        """In each pair of disagreeing replicas, the suspect is the one whose state had moved far further
        from the re-executed one (a corrupted value, against the small drift the other caught through
        the averaged gradients), or else the one whose loss departed first; otherwise both."""
        assert self.pending is not None
        suspects, how = [], {}
        for group in self.pending["groups"]:
            deviation = {r: evidence[r][0] for r in group}
            departed = {r: evidence[r][1] for r in group if evidence[r][1] is not None}
            known = sorted((d, r) for r, d in deviation.items() if d is not None)
            if len(known) == len(group) and known[-1][0] > 0 and known[-1][0] >= DECISIVE * known[-2][0]:
                suspects.append(known[-1][1])
                how[known[-1][1]] = (f"its state was {known[-1][0]:.3g} from the re-executed one, the other "
                                     f"replica's {known[-2][0]:.3g}")
            elif departed and list(departed.values()).count(min(departed.values())) == 1:
                first = min(departed, key=lambda r: departed[r])
                suspects.append(first)
                how[first] = f"its loss departed first from the re-execution, at step {departed[first]}"
            else:
                suspects += group
                how.update({r: "the replicas cannot be told apart" for r in group})
        self.pending, self.disputed = None, {}
        return Action("quarantine", self.name, f"rank(s) {', '.join(map(str, suspects))} named after re-executing "
                      f"to step {step}: " + "; ".join(f"rank {r}: {why}" for r, why in how.items()),
                      {"detector": "fingerprint", "attributed_by": "re-execution",
                       "deviation": {r: e[0] for r, e in enumerate(evidence) if e is not None},
                       "departed_at": {r: e[1] for r, e in enumerate(evidence) if e is not None}},
                      ranks=tuple(suspects))

    # ------------------------------------------------------------ state

    def rolled_back(self, step: int) -> None:
        self.losses = {s: v for s, v in self.losses.items() if s <= step}

    def state_dict(self) -> dict:
        return {"last_verified": self.last_verified, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.last_verified = state.get("last_verified", 0)
        self.pending = state.get("pending")
