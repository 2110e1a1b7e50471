"""Silent data corruption: ranks that should agree bit for bit are made to show it.

Replica fingerprints: ranks that hold the same shard (the data-parallel replicas of HSDP) compare a
fingerprint of their parameters and optimizer state every `fingerprint_interval` steps and before
every checkpoint. A rank that disagrees with the majority of its replicas is the suspect. Two replicas
cannot outvote each other: the run then rolls back to the newest verified state and re-executes, and
the rank whose own loss departed first from its re-execution (or, failing that, whose state changed
when re-executed) is the suspect.

Step replay: every `replay_interval` steps, and whenever the numerics or spike guards fire, each rank
recomputes the step's forward and backward and compares its loss and gradient fingerprint bitwise with
the first computation. Deterministic kernels make them equal; a rank where they differ computed wrong.
"""

from __future__ import annotations

import struct
import time
from collections import Counter

import torch
import torch.distributed as dist

from keel.config import GuardConfig
from keel.guard.actions import Action
from keel.guard.report import StepReport
from keel.guard.snapshots import live_tensors, local
from keel.parallel.mesh import Mesh

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bit patterns read as integers. Any single flipped
    bit, in any position, changes it; so does any change of one element."""
    sums = []
    for t in tensors:
        if t is None:
            sums.append(torch.zeros((), dtype=torch.int64))
            continue
        t = local(t).detach()
        bits = t.view(_BITS[t.element_size()]) if t.is_floating_point() else t
        sums.append(bits.sum(dtype=torch.int64).cpu())
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def same_bits(a: float, b: float) -> bool:
    """Equal as float32 bit patterns (a NaN equals the same NaN)."""
    return struct.pack("f", a) == struct.pack("f", b)


class SdcGuard:
    name = "sdc"

    def __init__(self, cfg: GuardConfig, mesh: Mesh, optimizers: list[torch.optim.Optimizer],
                 params: list[torch.nn.Parameter], deterministic: bool) -> None:
        self.cfg, self.optimizers, self.params = cfg.sdc, optimizers, params
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = mesh.mesh["dp_replicate"].get_group() if mesh.layout.dp_replicate > 1 else None
        self.replicas = dist.get_process_group_ranks(self.group) if self.group is not None else [self.rank]
        self.can_replay = deterministic
        self.last_verified = 0  # newest step whose state passed a check
        self.losses: dict[int, float] = {}  # this rank's own loss at each step since then
        self.pending: dict | None = None  # a two-replica disagreement, waiting for its re-execution
        self.check_s = self.replay_s = 0.0  # cost of the last check and replay

    # ------------------------------------------------------------ step replay (before the update)

    def record(self, report: StepReport) -> None:
        self.losses[report.step] = report.local_loss

    def wants_replay(self, step: int, fired: bool) -> bool:
        return self.can_replay and (fired or (self.cfg.replay_interval > 0 and step % self.cfg.replay_interval == 0))

    def replay(self, report: StepReport, recompute) -> Action | None:
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
        tied = sorted({r for (kind, ranks), _, _ in everyone if kind == "tie" for r in ranks})
        tensors = max(n for _, n, _ in everyone)
        if outvoted or tied:
            evidence = {"detector": "fingerprint", "outvoted": outvoted, "tied": tied, "differing_tensors": tensors,
                        "last_verified_step": self.last_verified}
            if outvoted and not tied:
                return Action("quarantine", self.name, f"rank(s) {', '.join(map(str, outvoted))} disagree with "
                              f"their replicas at step {step}", evidence, ranks=tuple(outvoted), to_step=step,
                              verified_only=True)
            self.pending = {"step": step, "ranks": tied or outvoted, "losses": sorted(self.losses.items()),
                            "fingerprint": mine.tolist()}
            return Action("rollback", self.name, f"replicas {', '.join(map(str, tied))} disagree at step {step} "
                          f"and cannot outvote each other: re-executing from the newest verified state to tell "
                          f"which one departed", evidence, to_step=step, verified_only=True)
        self.last_verified = step
        self.losses = {s: v for s, v in self.losses.items() if s > step}
        if self.pending is not None and step == self.pending["step"]:
            return self._attribute(step, [a for _, _, a in everyone])
        return None

    def _attribution_evidence(self, step: int, mine: torch.Tensor) -> tuple[int | None, bool] | None:
        """For a pending two-replica disagreement, once re-executed to its step: the first step where this
        rank's loss differs from the first execution, and whether its state changed."""
        if self.pending is None or step != self.pending["step"]:
            return None
        departed = [s for s, loss in self.pending["losses"] if s in self.losses and not same_bits(loss, self.losses[s])]
        return (departed[0] if departed else None, mine.tolist() != self.pending["fingerprint"])

    def _attribute(self, step: int, evidence: list) -> Action:
        candidates = self.pending["ranks"]
        self.pending = None
        departed = {r: evidence[r][0] for r in candidates if evidence[r][0] is not None}
        if departed:
            first = min(departed.values())
            suspects = [r for r, s in departed.items() if s == first]
            how = f"its loss departed first from the re-execution, at step {first}"
        else:
            suspects = [r for r in candidates if evidence[r][1]] or list(candidates)
            how = "its state changed when re-executed" if len(suspects) < len(candidates) else \
                "they cannot be told apart"
        return Action("quarantine", self.name, f"rank(s) {', '.join(map(str, suspects))} named after "
                      f"re-executing to step {step}: {how}",
                      {"detector": "fingerprint", "attributed_by": "re-execution", "candidates": candidates,
                       "departed_at": departed}, ranks=tuple(suspects))

    # ------------------------------------------------------------ state

    def rolled_back(self, step: int) -> None:
        self.losses = {s: v for s, v in self.losses.items() if s <= step}

    def state_dict(self) -> dict:
        return {"last_verified": self.last_verified, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.last_verified = state.get("last_verified", 0)
        self.pending = state.get("pending")
