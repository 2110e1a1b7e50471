"""keel's checkpoints against what a user would otherwise write, side by side in one process.

One model of at least 300M parameters with its AdamW state (about 4.4 GB in fp32) on the CPU. Each
repeat times, on the same state:
  keel save     the time the training loop is blocked (staging into reused host buffers); the
                background write, checksums and commit are reported beside it
  torch.save    of the model and optimizer state dicts, to one file
  dcp.save      synchronous torch.distributed.checkpoint save (fsync'd, like keel's)
  memcpy        a plain copy of the same bytes into preallocated buffers: the floor of staging
  keel load     resume: verify every file's checksum and load (checksums run beside the load)
  dcp.load      get_state_dict → dcp.load → set_state_dict, no verification
Before those, the training throughput of a window of steps containing a save, against a window
without one, measured while the process holds only what training holds.
Medians of the repeats; ratios against the targets of the checkpointing issue. Results go to
bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from keel.checkpoint.manager import _FLAT, CheckpointManager, _state_dict
from keel.config import load_config, resolve_layout
from keel.core.state import TrainState
from keel.parallel.mesh import build_mesh, destroy_distributed, init_distributed
from keel.rundir.events import EventLog
from keel.train.optim import build_optimizer
from keel.train.setup import build_model_parts
from keel.train.step import train_step

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
# ~368M parameters: 24 blocks of width 1024 and a 32k vocabulary.
MODEL = ["model.dim=1024", "model.n_layers=24", "model.n_heads=16", "model.n_kv_heads=16",
         "model.vocab_size=32000", "model.max_seq_len=64", "train.seq_len=64", "train.micro_batch=1",
         "train.global_batch=1"]


def tensors(state: dict) -> list[torch.Tensor]:
    return [t for part in state.values() for t in part.values() if isinstance(t, torch.Tensor)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memcpy(sources: list[torch.Tensor]) -> float:
    """A plain copy of the tensors into buffers whose pages are already touched; the buffers are freed
    afterwards, as the page cache needs the room for the checkpoints read back later."""
    buffers = [torch.empty_like(t) for t in sources]
    for b, s in zip(buffers, sources, strict=True):
        b.copy_(s)
    return timed(lambda: [b.copy_(s) for b, s in zip(buffers, sources, strict=True)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=20, help="training steps per throughput window")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory on this disk)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="keel-bench-ckpt-", dir=args.dir))
    # The training loop keeps one core; the background writer and the checksums get the other.
    torch.set_num_threads(1)
    cfg = load_config(None, [*MODEL, f"checkpoint.dir={work / 'keel'}", "checkpoint.keep_last=1", *args.overrides])
    ctx = init_distributed(torch.device("cpu"))
    try:
        mesh = build_mesh(ctx, resolve_layout(cfg, 1))
        parts, _ = build_model_parts(cfg, mesh, torch.float32)
        model, optimizer = parts[0], build_optimizer(parts[0], cfg.optim)
        n_params = sum(p.numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(0)
        batch = torch.randint(0, 256, (1, cfg.train.seq_len + 1), generator=gen)
        micro = [(batch[:, :-1], batch[:, 1:])]

        def step() -> None:
            train_step(model, optimizer, micro, lr=1e-4, grad_clip=1.0)[0].item()

        step()  # optimizer state exists from here on
        state_bytes = sum(t.numel() * t.element_size() for t in tensors(_state_dict(parts, [optimizer])))
        print(f"model {n_params / 1e6:.0f}M parameters, state {state_bytes / 1e9:.2f} GB, in {work}", flush=True)
        events = EventLog(work / "events.jsonl", 0)
        manager = CheckpointManager(cfg, work, mesh.layout.describe(), events)
        train_state = TrainState(step=1)

        def keel_save() -> dict:
            started = time.perf_counter()
            manager.save(parts, [optimizer], train_state)
            blocking = time.perf_counter() - started
            outcome = manager.finish()
            assert outcome is not None and outcome.committed, outcome
            return {"blocking_s": blocking, "write_s": outcome.write_s}

        first = keel_save()  # allocates the staging buffers, once per run

        # Throughput first, while the process holds only what training holds: the baselines below
        # (torch.save, dcp.load's copies) leave the allocator and the page cache in another state.
        # How independent the two halves of the machine are: a step with a busy loop on another core.
        alone = timed(lambda: [step() for _ in range(2)]) / 2
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            beside_busy_core = timed(lambda: [step() for _ in range(2)]) / 2
        finally:
            burner.kill()
            burner.wait()
        print(f"step alone {alone:.2f} s, beside a busy loop on another core {beside_busy_core:.2f} s", flush=True)

        # Throughput: a window of steps with a save at its start, against one without.
        windows: dict[str, list[float]] = {"without_save": [], "with_save": []}
        for repeat in range(args.repeats):
            for kind in ("without_save", "with_save") if repeat % 2 == 0 else ("with_save", "without_save"):
                started = time.perf_counter()
                if kind == "with_save":
                    train_state.step += 1
                    manager.save(parts, [optimizer], train_state)
                for _ in range(args.window):
                    step()
                if kind == "with_save":  # the window holds the whole save: a write that outlasts the steps counts
                    outcome = manager.finish()
                    assert outcome is not None and outcome.committed
                windows[kind].append(time.perf_counter() - started)
            print(f"window {repeat + 1}/{args.repeats}: without {windows['without_save'][-1]:.2f} s, with "
                  f"{windows['with_save'][-1]:.2f} s", flush=True)
        results: dict[str, list[float]] = {k: [] for k in ("keel_blocking", "keel_write", "torch_save", "dcp_save",
                                                            "memcpy", "keel_load", "dcp_load")}
        target, plain = work / "torch.pt", work / "dcp"
        for repeat in range(args.repeats):
            train_state.step += 1
            saved = keel_save()
            results["keel_blocking"].append(saved["blocking_s"])
            results["keel_write"].append(saved["write_s"])
            results["memcpy"].append(memcpy(tensors(_state_dict(parts, [optimizer]))))
            results["torch_save"].append(timed(lambda: torch.save(
                {"model": model.state_dict(), "optim": optimizer.state_dict()}, target)))
            target.unlink()
            results["dcp_save"].append(timed(lambda: dcp.save(_state_dict(parts, [optimizer]), checkpoint_id=plain)))

            def plain_load() -> None:
                state = _state_dict(parts, [optimizer])
                dcp.load(state, checkpoint_id=plain)
                set_model_state_dict(model, state["model"])
                set_optimizer_state_dict(model, optimizer, state["optim"], options=_FLAT)

            loads = [("dcp_load", plain_load), ("keel_load", lambda: manager.restore(parts, [optimizer], "auto",
                                                                                     print))]
            for name, fn in loads if repeat % 2 == 0 else loads[::-1]:
                results[name].append(timed(fn))
            shutil.rmtree(plain)
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in
                                                                        results.items()), flush=True)

        events.close()
    finally:
        destroy_distributed()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    win = {k: statistics.median(v) for k, v in windows.items()}
    ratios = {
        "keel_blocking / dcp_save": (med["keel_blocking"] / med["dcp_save"], 0.1),
        "keel_blocking / memcpy": (med["keel_blocking"] / med["memcpy"], 2.0),
        "keel_load / dcp_load": (med["keel_load"] / med["dcp_load"], 1.2),
        "window with save / without": (win["with_save"] / win["without_save"], 1.05),
    }
    print(f"\n{'operation':<22}{'median s':>10}{'GB/s':>8}")
    for name, value in med.items():
        print(f"{name:<22}{value:>10.3f}{state_bytes / value / 1e9:>8.2f}")
    for name, value in win.items():
        print(f"{'window ' + name:<22}{value:>10.3f}")
    print(f"\n{'ratio':<30}{'value':>8}{'target':>8}  met")
    for name, (value, target) in ratios.items():
        print(f"{name:<30}{value:>8.3f}{target:>8.2f}  {'yes' if value <= target else 'NO'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "checkpoint", "parameters": n_params, "state_bytes": state_bytes, "repeats": args.repeats,
        "window_steps": args.window, "first_keel_save": first,
        "step_s_alone": alone, "step_s_beside_busy_core": beside_busy_core, "median_s": med, "window_median_s": win,
        "ratios": {k: {"value": v, "target": t, "met": v <= t} for k, (v, t) in ratios.items()},
        "timings": results, "windows": windows, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
