"""Detection matrix: which guard catches a single flipped bit, where, and how soon.

For each target (parameters, gradients, Adam's first and second moments) and bit (sign, exponent,
mantissa), a real multi-process run of the small test model gets one bit of one element of rank 1's
tensor flipped at step 13 (parameters and moments after that step's update, gradients before it),
and the outcome is compared with a clean run of the same layout:

  replicated  two data-parallel replicas: fingerprints every 5 steps, replays every 5 (not at 13)
  4 replicas  four data-parallel replicas (4 processes), the same intervals: a majority can outvote
  sharded     FSDP over two ranks, no replicas: a replay at every step
  HSDP        2 replicas × 2 shards (4 processes): fingerprints and replays every 5 steps

In every layout each rank's state is also sealed after every update and checked before the next one
(`guard.sdc.at_rest_interval = 1`, the default), and a replayed step's update is re-executed and compared (on by
default). The replays are more frequent than the default (every 200 steps) so that a gradient's flip lands on one.

A cell reads `detector +latency, outcome`: the first guard that acted and how many steps after the
flip; `exact` = rolled back and finished bitwise equal to the clean run; `recovered` = rolled back,
finished different (data was skipped); `absorbed` = nothing detected and nothing changed (the flip
was rounded away); `missed` = nothing detected, the final state differs. Results: a markdown table
and bench/results/detection_matrix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import repeat
from pathlib import Path

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl

RESULTS = Path(__file__).parent / "results" / "detection_matrix.json"
STEPS, FLIP_AT = 30, 13
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
         "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "monitor.interval=5",
         "optim.warmup_steps=5", "eval.interval=0", "eval.sequences=8", f"checkpoint.interval={STEPS}",
         f"train.steps={STEPS}", "guard.snapshot_interval=5", "guard.snapshots=3", "guard.rollback_steps=3",
         "guard.skip_batches=4", "guard.spike.warmup=8", "guard.spike.window=20"]
LAYOUTS = {  # name: (processes, overrides)
    "replicated": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "guard.sdc.fingerprint_interval=5",
                       "guard.sdc.replay_interval=5"]),
    "4 replicas": (4, ["parallel.dp_replicate=4", "parallel.dp_shard=1", "train.global_batch=16",
                       "guard.sdc.fingerprint_interval=5", "guard.sdc.replay_interval=5"]),
    "sharded": (2, ["parallel.dp_shard=2", "guard.sdc.replay_interval=1"]),
    "HSDP": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "train.global_batch=16",
                 "guard.sdc.fingerprint_interval=5", "guard.sdc.replay_interval=5"]),
}
AT_REST = ["guard.sdc.at_rest_interval=1"]  # every layout: the default, said out loud
TARGETS = ("params", "grads", "exp_avg", "exp_avg_sq")
BITS = {31: "sign", 30: "exponent (top)", 23: "exponent (lowest)", 22: "mantissa (top)", 0: "mantissa (lowest)"}
TENSOR, ELEMENT = 3, 5  # the first block's attention wq weight (2-D, sharded or replicated), element 5

Runner = Callable[[list[str], Path], int]


def subprocess_runner(args: list[str], cwd: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "keel", *args], cwd=cwd, env=env, capture_output=True,
                          timeout=600).returncode


def train(runner: Runner, corpus: Path, run_dir: Path, layout: str, *extra: str) -> None:
    nproc, overrides = LAYOUTS[layout]
    code = runner(["train", "--nproc", str(nproc), "--run-dir", str(run_dir), f"data.dir={corpus}", *MODEL,
                   *overrides, *AT_REST, *extra], run_dir.parent)
    if code != 0:
        raise RuntimeError(f"{run_dir.name}: keel train exited {code}")


def final_state(run_dir: Path) -> str:
    return state_sha256(run_dir / "checkpoints" / f"step-{STEPS:06d}")


def cell(runner: Runner, corpus: Path, work: Path, layout: str, target: str, bit: int, clean: str) -> dict:
    run_dir = work / f"{layout.replace(' ', '_')}-{target}-{bit}"
    train(runner, corpus, run_dir, layout,
          f'drill.inject=["bitflip:step={FLIP_AT},rank=1,target={target},tensor={TENSOR},element={ELEMENT},bit={bit}"]')
    events = read_jsonl(run_dir / "events.jsonl")
    acted = [e for e in events if e["kind"] == "guard" and e["action"] != "rolled_back"]
    flipped = any(e["kind"] == "drill" and e["action"] == "inject" for e in events)
    same = final_state(run_dir) == clean
    suspects = sorted({r for e in acted if e["action"] == "quarantine" for r in e["detail"]["ranks"]})
    if acted:
        first = acted[0]
        detector = first["detail"].get("detector") or first["detail"]["guard"]
        outcome = "exact" if same else "recovered"
        return {"layout": layout, "target": target, "bit": bit, "detector": detector,
                "latency": first["step"] - FLIP_AT, "outcome": outcome, "named": suspects, "flipped": flipped,
                "actions": [f"{e['step']}:{e['detail']['guard']}:{e['action']}" for e in acted]}
    return {"layout": layout, "target": target, "bit": bit, "detector": None, "latency": None,
            "outcome": "absorbed" if same else "missed", "named": [], "actions": [], "flipped": flipped}


def run_matrix(runner: Runner, corpus: Path, work: Path, layouts: tuple[str, ...] = tuple(LAYOUTS),
               targets: tuple[str, ...] = TARGETS, bits: tuple[int, ...] = tuple(BITS),
               concurrent: int = 1) -> list[dict]:
    """The cells in order, layout by layout. `concurrent`: how many of a layout's flipped runs train at
    once (each is independent of the others, and its outcome is counted in steps and bits, not seconds)."""
    cells = []
    for layout in layouts:
        clean_dir = work / f"{layout.replace(' ', '_')}-clean"
        train(runner, corpus, clean_dir, layout)
        clean = final_state(clean_dir)
        flips = [(target, bit) for target in targets for bit in bits]
        with ThreadPoolExecutor(max_workers=concurrent) as pool:
            cells += pool.map(partial(cell, runner, corpus, work, layout), *zip(*flips, strict=True),
                              repeat(clean))
    return cells


def describe(c: dict) -> str:
    if c["detector"] is None:
        return c["outcome"]
    named = f", {'ranks' if len(c['named']) > 1 else 'rank'} {' and '.join(map(str, c['named']))} named" \
        if c["named"] else ""
    return f"{c['detector']} +{c['latency']}, {c['outcome']}{named}"


def markdown(cells: list[dict]) -> str:
    layouts = list(dict.fromkeys(c["layout"] for c in cells))
    lines = ["| flipped | bit | " + " | ".join(layouts) + " |", "|---|---|" + "---|" * len(layouts)]
    for target in dict.fromkeys(c["target"] for c in cells):
        for bit in dict.fromkeys(c["bit"] for c in cells):
            row = {c["layout"]: describe(c) for c in cells if c["target"] == target and c["bit"] == bit}
            lines.append(f"| {target} | {bit} {BITS[bit]} | " + " | ".join(row[lay] for lay in layouts) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", type=Path, help="prepared corpus (default: a small slice of the standard library)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-matrix-") as tmp:
        work = Path(tmp)
        corpus = args.corpus
        if corpus is None:
            from keel.data.prepare import prepare
            from tests.conftest import SMALL_SOURCES, small_data

            corpus = work / "corpus"
            prepare(small_data(SMALL_SOURCES), corpus)
        started = time.perf_counter()
        cells = run_matrix(subprocess_runner, corpus, work)
    table = markdown(cells)
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "detection_matrix", "steps": STEPS, "flip_at": FLIP_AT,
                                   "layouts": LAYOUTS, "cells": cells, "markdown": table,
                                   "seconds": round(time.perf_counter() - started, 1),
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
