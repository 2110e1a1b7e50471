"""Two processes on one checkpoint directory, as two replica groups share one: a writer that saves in the
background, back to back, and a starter that builds a CheckpointManager (what a restarted group's worker
does first) at seeded random moments of those saves. Run by tests/dist/test_checkpoint_race.py.

  python -m tests.dist.checkpoint_race_probe writer ROOT RUN_DIR STOP OUT
  python -m tests.dist.checkpoint_race_probe starter ROOT RUN_DIR SEED MOMENTS
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from keel.checkpoint.manager import CheckpointManager
from keel.config import load_config
from keel.core.state import TrainState
from keel.rundir.events import EventLog

WIDTH = 128  # 64 KiB of weights, twice that of Adam moments: a save of a few hundred KiB


def manager(root: str, run_dir: str) -> CheckpointManager:
    cfg = load_config(None, [f"checkpoint.dir={root}", "checkpoint.keep_last=100000"])
    return CheckpointManager(cfg, Path(run_dir), "dp=1", EventLog(Path(run_dir) / "events.jsonl", rank=0))


def write(root: str, run_dir: str, stop: str, out: str) -> None:
    """Save steps 1, 2, … in the background, each with every weight equal to its step, until `stop` exists;
    then write every save's outcome to `out`."""
    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    saver = manager(root, run_dir)
    outcomes = []
    step = 0
    while not Path(stop).exists():
        step += 1
        saver.fence()  # the save in flight has copied the weights: they may change
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        outcomes += saver.save([model], [optimizer], TrainState(step=step))
    outcomes += [o for o in [saver.finish()] if o is not None]
    Path(out).write_text(json.dumps([{"step": o.step, "committed": o.committed, "error": o.error}
                                     for o in outcomes]))


def start(root: str, run_dir: str, seed: int, moments: int) -> None:
    """Build a CheckpointManager `moments` times, each at a random moment after a save was seen in flight."""
    chance = random.Random(seed)
    for _ in range(moments):
        deadline = time.monotonic() + 120
        while not any(p.name.endswith(".tmp") for p in Path(root).glob("step-*")):
            if time.monotonic() > deadline:
                raise SystemExit("no save in flight seen for 120 s")
            time.sleep(0.001)
        time.sleep(chance.uniform(0, 0.05))
        manager(root, run_dir)


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if role == "writer":
        write(*args)
    else:
        start(args[0], args[1], int(args[2]), int(args[3]))
    dist.destroy_process_group()
