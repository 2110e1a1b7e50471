"""keel's training step (the Stepper the Trainer runs) against a bare PyTorch loop: same model, batch and
optimizer, one process.

Each repeat builds both sides afresh and times N steps of each, alternating which goes first, and
the ratio of the medians is reported (target: at most 1.05). Results go to bench/results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from keel.config import load_config, resolve_layout
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.parallel.mesh import build_mesh, destroy_distributed, init_distributed
from keel.train.optim import build_optimizer, lr_at
from keel.train.setup import build_model_parts
from keel.train.step import Stepper

RESULTS = Path(__file__).parent / "results" / "step_overhead.json"


def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
              targets: torch.Tensor, lr: float, clip: float) -> None:
    """What a user writes by hand: forward, loss, backward, clip, update."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (cfg.train.micro_batch, cfg.train.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    lr = lr_at(cfg.optim.warmup_steps, cfg.optim, cfg.train.steps)
    ctx = init_distributed(torch.device("cpu"))

    def keel_side() -> Callable[[], None]:
        model = build_model_parts(cfg, build_mesh(ctx, resolve_layout(cfg, 1)), torch.float32)[0][0]
        stepper = Stepper([model], [build_optimizer(model, cfg.optim)], None, grad_clip=cfg.optim.grad_clip,
                          autocast_dtype=None, loss_parallel=False)

        def step() -> None:  # the Trainer's step: forward/backward, the global norm, clip and update
            loss = stepper.forward_backward([(inputs, targets)])
            norm = stepper.grad_norm()
            stepper.update(lr, norm)
            loss.item()  # the trainer reads the loss at each logged step
        return step

    def bare_side() -> Callable[[], None]:
        model = Llama(cfg.model)
        init_weights(model, cfg.train.seed)
        optimizer = build_optimizer(model, cfg.optim)
        return lambda: bare_step(model, optimizer, inputs, targets, lr, cfg.optim.grad_clip)

    # Which side is built and run first alternates between repeats: the allocator favours one order.
    timings: dict[str, list[float]] = {"keel": [], "bare": []}
    try:
        for repeat in range(args.repeats):
            sides = [("keel", keel_side), ("bare", bare_side)]
            sides = sides if repeat % 2 == 0 else sides[::-1]
            steps = [(name, build()) for name, build in sides]
            for _, fn in steps:  # warm-up: optimizer state, allocator
                fn()
            for name, fn in steps:
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                timings[name].append((time.perf_counter() - start) / args.steps)
            del steps
            gc.collect()
    finally:
        destroy_distributed()

    keel_s, bare_s = statistics.median(timings["keel"]), statistics.median(timings["bare"])
    ratio = keel_s / bare_s
    print(f"{'loop':<8}{'median s/step':>16}{'min':>10}{'max':>10}")
    for name, values in timings.items():
        print(f"{name:<8}{statistics.median(values):>16.4f}{min(values):>10.4f}{max(values):>10.4f}")
    print(f"ratio keel/bare = {ratio:.4f} (target <= 1.05)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "step_overhead", "config": args.config, "overrides": args.overrides,
        "micro_batch": cfg.train.micro_batch, "seq_len": cfg.train.seq_len, "steps_per_block": args.steps,
        "repeats": args.repeats, "keel_s_per_step": keel_s, "bare_s_per_step": bare_s, "ratio": ratio,
        "target": 1.05, "timings": timings, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
