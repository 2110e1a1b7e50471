"""keel's checkpoints against what a user would otherwise write, side by side in one process, at three
sizes of state (about 40M, 130M and 370M parameters with their AdamW state, 0.5 to 4.4 GB in fp32).

At each size, after one training step (the buffers of the first save are reserved at start-up, as
`keel train` does, beside that step), the first save is timed, then each repeat times on the same state:
  keel blocking   what the training loop waits for a save: starting it, and the fence before the next
                  update for what of the host copy the next step's forward and backward did not hide
                  (the save's own figure, `SaveOutcome.blocking_s`)
  first save      a start's first save, its buffers reserved beside the step before it, against the
                  later saves (each repeat starts with a fresh stager, as a restarted process does)
  steps           a window of training steps that starts with a save and holds the whole of it (the copy,
                  the write, the checksums and the commit run beside the steps), against the same number
                  of steps without one, and against the same steps beside `dd conv=fsync` of the
                  checkpoint's data file: what writing those bytes to this disk costs the steps by itself
  keel write      a save's background part (write, fsync, checksums, manifest, publish) with nothing
                  beside it, against `dd conv=fsync` of the checkpoint's data file: the disk's speed for
                  the same bytes
  dcp.save        a synchronous torch.distributed.checkpoint save, fsync'd like keel's
  memcpy          a plain copy of the same bytes into preallocated, touched buffers
  keel load       resume: every file's checksum verified, beside the load
  dcp.load        get_state_dict → dcp.load → set_state_dict, no verification
                  (both loads start with the page cache dropped, where the user may: they read the disk)
Pairs run in alternating order, and every timed write, load and window starts right after the same
touch of fresh memory (`warm`). Medians, min–max and the ratios against the targets of the checkpointing
work go to bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from keel.checkpoint.manager import _FLAT, CheckpointManager, SaveOutcome, _state_dict
from keel.checkpoint.staging import HostStager
from keel.config import load_config
from keel.core.state import TrainState
from keel.parallel.degrees import resolve_degrees
from keel.parallel.layout import Layout
from keel.parallel.mesh import Dist, destroy_distributed, init_distributed
from keel.rundir.events import EventLog
from keel.train.optim import build_optimizer
from keel.train.setup import build_model_parts
from keel.train.step import Stepper

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
SHAPE = ["model.vocab_size=32000", "model.max_seq_len=64", "train.seq_len=64", "train.micro_batch=1",
         "train.global_batch=1"]
# Width, blocks and heads: about 39M, 134M and 369M parameters with a 32k vocabulary.
SIZES = {"40M": (384, 8, 6), "130M": (768, 12, 12), "370M": (1024, 24, 16)}
SMOKE = {"smoke": (32, 1, 2)}  # a seconds-long run of every measurement, for the test suite
TARGETS = {  # ratio: (numerator, denominator, target or None for a reference), each a median of the repeats
    "blocking / dcp.save": ("keel_blocking", "dcp_save", 0.05),
    "blocking / memcpy": ("keel_blocking", "memcpy", 0.5),
    "steps with a save / without": ("steps_with_save", "steps_without_save", 1.1),
    "steps beside dd of the same bytes / without": ("steps_beside_dd", "steps_without_save", None),
    "first save's blocking / later": ("first_blocking", "keel_blocking", 1.2),
    "verified load / dcp.load": ("keel_load", "dcp_load", 1.1),
    "background write / dd conv=fsync": ("keel_write", "dd", 1.3),
}


def tensors(state: dict) -> list[torch.Tensor]:
    return [t for part in state.values() for t in part.values() if isinstance(t, torch.Tensor)]


def timed(fn: Callable[[], object]) -> float:
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


def dd(source: Path, target: Path, beside: Callable[[], object] = lambda: None) -> None:
    """`dd conv=fsync` of a file to a new one (the disk's sequential, durable write of the same bytes), with
    `beside` run meanwhile; returns once both have ended."""
    copy = subprocess.Popen(["dd", f"if={source}", f"of={target}", "bs=8M", "conv=fsync"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    beside()
    if copy.wait() != 0:
        raise SystemExit(f"dd of the checkpoint's data file to {target} failed (exit {copy.returncode})")
    target.unlink()


def warm(nbytes: int) -> None:
    """Touch `nbytes` of fresh memory and free it. A virtual machine may hand free memory back to its host once
    it has been idle for some seconds; the next write into it then waits for the host to map every page again
    (on the development machine: 3.4 GB touched in 11.7 s after 30 s idle, 0.28 s right after; `dd conv=fsync`
    of 3.4 GB took 13.6 s after 40 s idle and 3.2 s right after another). Whichever of two writes came first
    in a pair paid for it. Each timed measurement starts right after this, so that keel and its baseline find
    memory alike, as they do on a machine that keeps its memory."""
    torch.ones(nbytes, dtype=torch.uint8)


def cold(fn: Callable[[], object]) -> float:
    """`fn` timed after the page cache is dropped (where this user may), so that each load reads the disk,
    as a resume after a restart does, rather than whatever the writes before it left in memory."""
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return timed(fn)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class Bench:
    """One size: the model, its optimizer, and a manager saving as `keel train` does."""

    def __init__(self, size: str, work: Path, overrides: list[str]) -> None:
        dim, layers, heads = {**SIZES, **SMOKE}[size]
        self.work = work / size
        cfg = load_config(None, [*SHAPE, f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={heads}",
                                 f"model.n_kv_heads={heads}", f"checkpoint.dir={self.work / 'keel'}",
                                 "checkpoint.keep_last=1", *overrides])
        self.cfg = cfg

    def build(self, ctx: Dist) -> None:
        layout = Layout.build(ctx.device.type, resolve_degrees(self.cfg, 1))
        self.parts, _ = build_model_parts(self.cfg, layout, torch.float32)
        self.model, self.optimizer = self.parts[0], build_optimizer(self.parts[0], self.cfg.optim)
        self.params = sum(p.numel() for p in self.model.parameters())
        gen = torch.Generator().manual_seed(0)
        batch = torch.randint(0, 256, (1, self.cfg.train.seq_len + 1), generator=gen)
        self.micro = [(batch[:, :-1], batch[:, 1:])]
        self.stepper = Stepper(self.parts, [self.optimizer], None, grad_clip=1.0, autocast_dtype=None)
        self.events = EventLog(self.work / "events.jsonl", 0)
        self.manager = CheckpointManager(self.cfg, self.work, layout.describe(), self.events)
        self.manager.reserve(self.parts, [self.optimizer])  # as the trainer does, beside the rest of the start
        self.state = TrainState(step=0)

    def step(self) -> None:
        """One training step as the trainer runs it: forward and backward, global norm, clip and update."""
        loss = self.stepper.forward_backward(self.micro)
        self.stepper.update(1e-4, self.stepper.grad_norm())
        loss.item()

    def save(self, wait: bool = False) -> SaveOutcome | None:
        self.state.step += 1
        finished = self.manager.save(self.parts, [self.optimizer], self.state, wait=wait)
        return finished[-1] if wait else None

    def committed(self) -> SaveOutcome:
        outcome = self.manager.finish()
        assert outcome is not None and outcome.committed, outcome
        return outcome

    def first_save(self) -> SaveOutcome:
        """A save as the first of a start: its buffers were reserved beside the step before it."""
        self.save()
        self.step()
        return self.committed()

    def restart_stager(self) -> None:
        """Host buffers as a restarted process has them: none yet, reserved beside its first step."""
        self.manager.stager = HostStager(pin_memory=self.manager.stager.pin_memory)
        self.manager.reserve(self.parts, [self.optimizer])
        self.step()

    def saved_then_steps(self, steps: int) -> tuple[float, SaveOutcome]:
        """A window of `steps` steps that starts with a save and lasts until it is committed."""
        started = time.perf_counter()
        self.save()
        for _ in range(steps):
            self.step()
        outcome = self.committed()
        return time.perf_counter() - started, outcome

    def steps(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def data_file(self) -> Path:
        """The newest checkpoint's data file: the bytes a save writes."""
        latest = self.manager.latest()
        assert latest is not None
        return max(Path(latest).glob("*.distcp"), key=lambda p: p.stat().st_size)


def measure(ctx: Dist, size: str, work: Path, repeats: int, overrides: list[str]) -> dict:
    b = Bench(size, work, overrides)
    b.build(ctx)
    b.step()  # the optimizer state exists from here on; the reservation ran beside this step
    state_bytes = sum(t.numel() * t.element_size() for t in tensors(_state_dict(b.parts, [b.optimizer])))
    print(f"{size}: {b.params / 1e6:.0f}M parameters, state {state_bytes / 1e9:.2f} GB", flush=True)
    step_s = timed(b.step)
    warm(state_bytes)
    first = b.first_save()
    # Enough steps in a window to hold a whole save, write included.
    window = max(2, math.ceil((first.write_s + first.blocking_s) / step_s) + 1)
    r: dict[str, list[float]] = {k: [] for k in (
        "first_blocking", "keel_blocking", "steps_with_save", "steps_without_save", "steps_beside_dd", "keel_write",
        "dd", "dcp_save", "memcpy", "keel_load", "dcp_load")}
    plain, copied = b.work / "dcp", b.work / "dd.bin"
    for repeat in range(repeats):
        flip = repeat % 2 == 1
        b.restart_stager()
        warm(state_bytes)
        r["first_blocking"].append(b.first_save().blocking_s)
        for kind in ("steps_with_save", "steps_without_save", "steps_beside_dd")[::-1 if flip else 1]:
            warm(state_bytes)
            if kind == "steps_with_save":
                seconds, outcome = b.saved_then_steps(window)
                r["keel_blocking"].append(outcome.blocking_s)
            elif kind == "steps_without_save":
                seconds = timed(lambda: b.steps(window))
            else:
                seconds = timed(lambda: dd(b.data_file(), copied, beside=lambda: b.steps(window)))
            r[kind].append(seconds)
        for kind in ("keel_write", "dd")[::-1 if flip else 1]:
            warm(state_bytes)
            if kind == "keel_write":
                alone = b.save(wait=True)  # nothing beside it: the write's own speed
                assert alone is not None and alone.committed
                r[kind].append(alone.write_s)
            else:
                r[kind].append(timed(lambda: dd(b.data_file(), copied)))
        r["memcpy"].append(memcpy(tensors(_state_dict(b.parts, [b.optimizer]))))
        warm(state_bytes)
        r["dcp_save"].append(timed(lambda: dcp.save(_state_dict(b.parts, [b.optimizer]), checkpoint_id=plain)))

        def plain_load() -> None:
            state = _state_dict(b.parts, [b.optimizer])
            dcp.load(state, checkpoint_id=plain)
            set_model_state_dict(b.model, state["model"])
            set_optimizer_state_dict(b.model, b.optimizer, state["optim"], options=_FLAT)

        loads = [("dcp_load", plain_load),
                 ("keel_load", lambda: b.manager.restore(b.parts, [b.optimizer], "auto", print))]
        for name, fn in loads[::-1] if flip else loads:
            warm(state_bytes)
            r[name].append(cold(fn))
        shutil.rmtree(plain)
        print(f"  repeat {repeat + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in r.items()), flush=True)
    b.events.close()
    shutil.rmtree(b.work, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in r.items()}
    ratios = {}
    for label, (num, den, target) in TARGETS.items():
        each = [n / d for n, d in zip(r[num], r[den], strict=True)]
        ratios[label] = {**spread(each), "target": target,
                         "met": target is None or statistics.median(each) <= target}
    return {"parameters": b.params, "state_bytes": state_bytes, "step_s": step_s, "window_steps": window,
            "first_save": {"blocking_s": first.blocking_s, "write_s": first.write_s}, "median_s": medians,
            "ratios": ratios, "timings": r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory on this disk)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the results go")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES and s not in SMOKE]:
        raise SystemExit(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    work = Path(tempfile.mkdtemp(prefix="keel-bench-ckpt-", dir=args.dir))
    # The training loop keeps one core; the copy, the background writer and the checksums get the other.
    torch.set_num_threads(1)
    ctx = init_distributed(torch.device("cpu"))
    load = os.getloadavg()
    try:
        rows = {size: measure(ctx, size, work, args.repeats, args.overrides) for size in sizes}
    finally:
        destroy_distributed()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'size':<6}{'ratio':<46}{'median':>8}{'min':>8}{'max':>8}{'target':>8}  met")
    for size, row in rows.items():
        for label, x in row["ratios"].items():
            target = "-" if x["target"] is None else f"{x['target']:.2f}"
            print(f"{size:<6}{label:<46}{x['median']:>8.3f}{x['min']:>8.3f}{x['max']:>8.3f}{target:>8}  "
                  f"{'-' if x['target'] is None else 'yes' if x['met'] else 'NO'}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({
        "benchmark": "checkpoint", "repeats": args.repeats, "sizes": rows, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_before": load, "load_after": os.getloadavg(),
        "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
