"""What `keel train` costs over a bare torchrun FSDP2 loop training the same thing, measured end to end.

keel: `python -m keel train --nproc N --run-dir DIR --config C OVERRIDES`, as a user runs it (the launcher,
torchrun's agent, every default feature on; the exporter on a free port instead of 9400, which another job
may hold). The baseline: `python -m torch.distributed.run --standalone --nproc-per-node N bench/bare_loop.py`
on the same config and overrides (bench/bare_loop.py says what it shares with keel: model, initialisation,
optimizer, schedule, data order, batch, FSDP2 wrapping, clipping). Both are fresh processes started by this
script, so imports, start-up and teardown are in their figures. Per run:

  step       steady-state seconds per step from the run's own step timestamps: (t(last) − t(W)) / (last − W),
             W = --warmup steps in (keel: the `time` of its metrics.jsonl records, one every monitor.interval
             steps and at the last; the bare loop: its record of every step). What a feature does every
             k steps is in it when the window W..last holds a multiple of k.
  cpu        user + system CPU seconds of the whole process tree (os.wait4 on the command: the launcher or
             torchrun reaps the agent's workers, so theirs are included).
  first step seconds from the command's start to the end of its first step (keel: its `step`/`first`
             event; the bare loop: its step 1 record).
  wall       seconds from the command's start to its exit.
  load       the 1-minute load average as the run started (the machine may be shared: interleaving spreads it).

Each repeat runs the bare loop and the keel variants of a cell (a shape and a number of processes) one after
the other, the order reversed every other repeat (ABAB…, BA…); ratios keel / bare are taken within a repeat
and reported as their median and min–max. One cell (--attribution-shape, --attribution-nproc) runs keel with
every default on, with each feature of --features off one at a time, and with all of them off. Results:
bench/results/step_overhead.json; `python -m bench.tables` renders its tables into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "step_overhead.json"
BARE_LOOP = REPO / "bench" / "bare_loop.py"
METRICS = ("step_s", "cpu_s", "first_step_s", "wall_s")
# The tiny config (3.1M parameters, 32 × 256 tokens a step), and its model at twice the width on a quarter of the
# batch: about the FLOPs of a tiny step on 4× the parameters, so that what keel does per parameter (the update
# norm, fingerprints, snapshots, checkpoints) weighs 4× as much. (The small config's step holds about 25× the
# FLOPs of tiny's: minutes per run on 2 cores.)
SHAPES: dict[str, tuple[str, list[str]]] = {
    "tiny": ("configs/tiny.toml", []),
    "tiny-x2": ("configs/tiny.toml", ["model.dim=512", "train.global_batch=8", "train.micro_batch=4"]),
}
# What turns each default feature off (keel.config.schema). Eval still runs at the end with interval 0, the
# last step is still saved whatever the checkpoint interval, and SDC checks still run before a checkpoint
# and when another guard fires: keel has no switch for those. The profiler is off by default (its switch
# `monitor.profile_interval=N` turns it on).
FEATURES: dict[str, list[str]] = {
    "guards": ["guard.enabled=false"],
    "sdc": ["guard.sdc.fingerprint_interval=0", "guard.sdc.replay_interval=0"],
    "watchdog": ["health.watchdog.enabled=false"],
    "telemetry": ["monitor.telemetry_interval_s=0"],
    "exporter": ["monitor.prometheus_port=0"],
    "eval": ["eval.interval=0", "eval.final=false"],
    "checkpoints": [f"checkpoint.interval={2**62}"],
    "preflight": ["health.preflight=off"],
    "straggler": ["health.straggler.interval=0"],
    "checksums": ["data.verify_checksums=false"],
}
# keel with its defaults / the bare loop, on the tiny shape with 2 processes.
TARGETS = {"step_s": 1.03, "cpu_s": 1.08, "first_step_s": 1.1}
DEFAULT_FEATURES = ["guards", "sdc", "watchdog", "telemetry", "exporter", "eval", "checkpoints"]


# ---------------------------------------------------------------- what one run's records say


def steady_step_s(steps: list[tuple[int, float]], warmup: int) -> float:
    """Seconds per step between the record of step `warmup` (or the first after it) and the last record."""
    later = [(s, t) for s, t in steps if s >= warmup]
    if len(later) < 2:
        raise SystemExit(f"fewer than 2 step records from step {warmup} on: give the runs more --steps")
    (s0, t0), (s1, t1) = later[0], later[-1]
    return (t1 - t0) / (s1 - s0)


def keel_steps(run_dir: Path) -> tuple[list[tuple[int, float]], float]:
    """(step, time) of keel's metrics.jsonl records, and the time its first step ended."""
    from keel.rundir.events import read_jsonl

    steps = [(r["step"], r["time"]) for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    first = next(e["time"] for e in read_jsonl(run_dir / "events.jsonl")
                 if e["kind"] == "step" and e["action"] == "first")
    return steps, first


def bare_steps(path: Path) -> tuple[list[tuple[int, float]], float]:
    from keel.rundir.events import read_jsonl

    steps = [(r["step"], r["time"]) for r in read_jsonl(path) if "step" in r]
    return steps, steps[0][1]


def ratios(pairs: list[dict[str, dict[str, float]]], variant: str) -> dict[str, dict]:
    """For each figure: keel `variant` / bare within each repeat, their median and min–max, and each side's
    median."""
    out = {}
    for m in METRICS:
        each = [p[variant][m] / p["bare"][m] for p in pairs]
        out[m] = {"ratio": statistics.median(each), "min": min(each), "max": max(each), "ratios": each,
                  "keel": statistics.median(p[variant][m] for p in pairs),
                  "bare": statistics.median(p["bare"][m] for p in pairs)}
    return out


def cost(pairs: list[dict[str, dict[str, float]]], variant: str) -> dict[str, float]:
    """What the features `variant` turns off cost, per figure, as a share of the bare loop's: the median over
    the repeats of (keel with its defaults − keel `variant`) / bare."""
    return {m: statistics.median((p["defaults"][m] - p[variant][m]) / p["bare"][m] for p in pairs)
            for m in METRICS}


FIGURES = {"step_s": "steady-state step, s", "cpu_s": "CPU, s (process tree)", "first_step_s": "to first step, s",
           "wall_s": "wall, s"}


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _ratio(figure: dict) -> str:
    return f"**{figure['ratio']:.3f}** ({figure['min']:.3f}–{figure['max']:.3f})"


def markdown(results: dict) -> str:
    """The comparison of every cell, keel's defaults against the bare loop, then the attribution cell's
    variants: docs/benchmarks.md's tables."""
    repeats, extra = results["repeats"], " ".join(f"`{o}`" for o in results.get("overrides", []))
    loads = [run["load"] for c in results["cells"] for pair in c["runs"] for run in pair.values() if "load" in run]
    lines = [f"{results['steps']} steps a run, steps {results['warmup']} to {results['steps']} the steady state"
             + (f"; both sides with {extra}" if extra else "")
             + (f"; 1-minute load average {min(loads):.1f}–{max(loads):.1f} as the runs started" if loads else "")
             + ":", "",
             _row(["shape", "processes", "figure", "keel", "bare loop", f"keel / bare, median of {repeats} (min–max)",
                   "target"]), "|---|---:|---|---:|---:|---|---:|"]
    for c in results["cells"]:
        defaults = c["variants"]["defaults"]
        for m, label in FIGURES.items():
            target = results["targets"].get(m) if (c["shape"], c["nproc"]) == ("tiny", 2) else None
            lines.append(_row([c["shape"], str(c["nproc"]), label, f"{defaults[m]['keel']:.3f}",
                               f"{defaults[m]['bare']:.3f}", _ratio(defaults[m]), f"{target:.2f}" if target else ""]))
    attribution = next((c for c in results["cells"] if len(c["variants"]) > 1), None)
    if attribution is None:
        return "\n".join(lines)
    lines += ["", _row([f"keel, {attribution['shape']}, {attribution['nproc']} processes",
                        *(f"{label.split(',')[0]} / bare" for label in FIGURES.values()),
                        *(f"cost: {label.split(',')[0]}" for label in FIGURES.values())]),
              "|---|" + "---|" * 4 + "---:|" * 4]
    for name, figures in attribution["variants"].items():
        costs = cost(attribution["runs"], name) if name != "defaults" else {}
        lines.append(_row([name, *(_ratio(figures[m]) for m in FIGURES),
                           *(f"{costs[m]:+.3f}" if costs else "" for m in FIGURES)]))
    return "\n".join(lines)


# ---------------------------------------------------------------- running the two sides


def timed(cmd: list[str], log: Path) -> tuple[float, float, float]:
    """Run `cmd` to its end; (wall clock at its start, its wall seconds, CPU seconds of its process tree)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as out:
        started, clock = time.time(), time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - clock
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return started, wall, usage.ru_utime + usage.ru_stime


def run_keel(config: str, overrides: list[str], nproc: int, work: Path, warmup: int) -> dict[str, float]:
    from keel.core.net import free_port

    port = [] if "monitor.prometheus_port=0" in overrides else [f"monitor.prometheus_port={free_port()}"]
    run_dir = work / "keel"
    cmd = [sys.executable, "-m", "keel", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
           "--config", config, *port, *overrides]
    load = os.getloadavg()[0]
    started, wall, cpu = timed(cmd, work / "keel.log")
    steps, first = keel_steps(run_dir)
    return {"step_s": steady_step_s(steps, warmup), "cpu_s": cpu, "first_step_s": first - started, "wall_s": wall,
            "load": load}


def run_bare(config: str, overrides: list[str], nproc: int, work: Path, warmup: int) -> dict[str, float]:
    out = work / "bare.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(BARE_LOOP), "--config", config, "--out", str(out), *overrides]
    load = os.getloadavg()[0]
    started, wall, cpu = timed(cmd, work / "bare.log")
    steps, first = bare_steps(out)
    return {"step_s": steady_step_s(steps, warmup), "cpu_s": cpu, "first_step_s": first - started, "wall_s": wall,
            "load": load}


def variants(features: list[str]) -> dict[str, list[str]]:
    """keel's variants of the attribution cell: the overrides of each."""
    every_off = [o for name in features for o in FEATURES[name]]
    return {"defaults": [], **{f"no {name}": FEATURES[name] for name in features}, "all off": every_off}


def cell(shape: str, nproc: int, keel_variants: dict[str, list[str]], args: argparse.Namespace) -> dict:
    config, shape_overrides = SHAPES[shape]
    common = [*shape_overrides, f"train.steps={args.steps}", *args.overrides]
    order = ["bare", *keel_variants]
    pairs = []
    for repeat in range(args.repeats):
        got = {}
        for who in order if repeat % 2 == 0 else order[::-1]:
            with tempfile.TemporaryDirectory(prefix="keel-bench-overhead-") as tmp:
                if who == "bare":
                    got[who] = run_bare(config, common, nproc, Path(tmp), args.warmup)
                else:
                    got[who] = run_keel(config, [*common, *keel_variants[who]], nproc, Path(tmp), args.warmup)
            print(f"  {shape}, {nproc} proc, repeat {repeat}, {who}: " +
                  ", ".join(f"{m} {got[who][m]:.3f}" for m in METRICS), flush=True)
        pairs.append(got)
    return {"shape": shape, "config": config, "overrides": common, "nproc": nproc,
            "variants": {name: ratios(pairs, name) for name in keel_variants}, "runs": pairs}


def report(cells: list[dict]) -> None:
    print(f"\n{'shape':<9}{'proc':>5} {'keel variant':<18}" + "".join(f"{m:>22}" for m in METRICS))
    for c in cells:
        for name, figures in c["variants"].items():
            print(f"{c['shape']:<9}{c['nproc']:>5} {name:<18}" + "".join(
                f"{figures[m]['ratio']:>8.3f} ({figures[m]['min']:.3f}–{figures[m]['max']:.3f})" for m in METRICS))
    print("keel / bare loop, median of the repeats (min–max)")


def names(known: dict) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from `known`."""
    def parse(text: str) -> list[str]:
        got = [name for name in text.split(",") if name]
        if unknown := [name for name in got if name not in known]:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; expected some of {', '.join(known)}")
        return got
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=names(SHAPES), default=list(SHAPES), help="comma-separated, of "
                    f"{', '.join(SHAPES)} (default: all)")
    ap.add_argument("--nproc", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2],
                    help="comma-separated process counts (default: 1,2)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the steady state (keel records "
                    "every monitor.interval steps: a multiple of it)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--features", type=names(FEATURES), default=DEFAULT_FEATURES,
                    help=f"comma-separated, turned off one at a time in the attribution cell, of {', '.join(FEATURES)} "
                    f"(default: {','.join(DEFAULT_FEATURES)})")
    ap.add_argument("--attribution-shape", default="tiny", choices=list(SHAPES))
    ap.add_argument("--attribution-nproc", type=int, default=2, help="0: no attribution cell")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for both sides (e.g. data.dir=...)")
    args = ap.parse_args()
    os.chdir(REPO)  # the configs' relative paths (data.dir) are the repository's
    from keel.cli.data import ensure_corpus
    from keel.config import load_config

    plan = [(shape, nproc) for shape in args.shapes for nproc in args.nproc]
    attribution = (args.attribution_shape, args.attribution_nproc)
    if args.attribution_nproc and attribution not in plan:
        plan.append(attribution)
    for shape in dict.fromkeys(shape for shape, _ in plan):
        config, shape_overrides = SHAPES[shape]
        cfg = load_config(config, [*shape_overrides, f"train.steps={args.steps}", *args.overrides])
        # Both sides' steady state must run between the same two steps, and keel records one in monitor.interval.
        if args.warmup % cfg.monitor.interval or args.steps <= args.warmup:
            ap.error(f"--warmup {args.warmup}, --steps {args.steps}: the warm-up must be a multiple of "
                     f"monitor.interval ({cfg.monitor.interval}) and fewer than the steps")
        ensure_corpus(cfg, verbose=True)  # a missing built-in corpus is prepared here, not inside a timed run
    cells = []
    for shape, nproc in plan:
        keel_variants = variants(args.features) if (shape, nproc) == attribution else {"defaults": []}
        cells.append(cell(shape, nproc, keel_variants, args))
    report(cells)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "step_overhead", "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats,
        "features": {name: FEATURES[name] for name in args.features}, "targets": TARGETS, "cells": cells,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
