"""A callback the replica-group tests attach: after every committed step, what each rank of each group
holds (parameter and optimizer hashes, the loader's cursor and the rows of tokens it trained on), so that
a faulted run can be compared with a fault-free one step by step."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keel.core.callbacks import Build, Callback, Step
from keel.core.dtensor import local
from keel.core.state import TrainState


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a whole tensor (a collective for a sharded one): FSDP2 leaves the root module's
    parameters unsharded after an evaluation's forward, a local view would then differ from a sharded one."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def tensors_sha256(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local(t).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class StepLedger(Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_build(self, build: Build) -> None:
        self.parts, self.optimizers = build.parts, build.optimizers
        self.out.mkdir(parents=True, exist_ok=True)
        self.name = f"{os.environ.get('KEEL_REPLICA_GROUP', '0')}-{dist.get_rank()}"
        self.file = open(self.out / f"{self.name}.jsonl", "a")

    def on_backward(self, step: Step, replaying: bool) -> None:
        """The rows this rank's gradients were computed from, once they are averaged across the groups (the
        probe runs after the averaging): recorded now, since a group killed later in the step contributed
        them to the update all the same."""
        if not replaying:
            rows = [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16]
                    for inputs, _ in step.micro_batches for row in inputs]
            self.file.write(json.dumps({"kind": "rows", "step": step.number, "rows": rows}) + "\n")
            self.file.flush()

    def on_step_end(self, step: Step) -> None:
        params = [whole(p) for part in self.parts for p in part.parameters()]
        moments = [v for opt in self.optimizers for s in opt.state.values() for k, v in sorted(s.items())
                   if isinstance(v, torch.Tensor) and k != "step"]
        loader = step.state.stateful["loader"].state_dict()
        self.file.write(json.dumps({
            "kind": "state", "step": step.state.step, "time": time.time(), "pid": os.getpid(), "params": tensors_sha256(params),
            "optimizer": tensors_sha256(moments), "batch": step.batch, "loader_batch": loader["batch"],
            "consumed": loader["consumed"], "tokens_seen": step.state.tokens_seen,
            "loss": float(step.report.loss) if step.report else None}) + "\n")
        self.file.flush()

    def on_end(self, state: TrainState) -> None:
        torch.save([whole(p).detach().clone() for part in self.parts for p in part.parameters()],
                   self.out / f"{self.name}-final.pt")
