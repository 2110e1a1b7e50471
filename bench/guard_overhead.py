"""What the guards cost: the same training with every guard at its default interval, and with none.

Each repeat runs `keel train` twice on the same config, guards on (`guard.enabled=true`, defaults)
and off (`guard.enabled=false`: no per-step report, no snapshots, no checks), alternating which goes
first. Two layouts (`--layouts`): `sharded`, FSDP over the processes with no replica (the at-rest check and
the replays are the detectors of silent corruption there), and `replicated`, data-parallel replicas
(`parallel.dp_replicate` = processes), where the replicas' fingerprints run as well. A run's step time is its
training time after the first logged window (start-up) divided by its steps, so the occasional replay,
fingerprint check and snapshot, and the at-rest check of every step, are paid for in it. The ratio on/off is
taken per repeat and the median reported (target: at most 1.015). From the guarded runs' metrics: the cost of
one fingerprint check, one replay, one snapshot and a step's at-rest check and seal, as fractions of a median
step. Results: a table and bench/results/guard_overhead.json, one entry per config and layout.
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
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "guard_overhead.json"


TARGET = 1.015
LAYOUTS = {"sharded": lambda n: ["parallel.dp_replicate=1", f"parallel.dp_shard={n}"],
           "replicated": lambda n: [f"parallel.dp_replicate={n}", "parallel.dp_shard=1"]}
COSTS = ("fingerprint_s", "replay_s", "snapshot_s", "at_rest_s")  # guard/<name>: the last one of each, in seconds


def run(config: str, layout: str, guards: bool, args: argparse.Namespace, run_dir: Path,
        overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "keel", "train", "--config", config, "--nproc", str(args.nproc),
           "--run-dir", str(run_dir), f"train.steps={args.steps}", f"monitor.interval={args.log_interval}",
           "eval.interval=0", f"checkpoint.interval={args.steps}", *LAYOUTS[layout](args.nproc),
           "monitor.profile_interval=0", f"guard.enabled={str(guards).lower()}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "train/loss" in r][1:]  # the first window holds start-up
    steps = len(windows) * args.log_interval
    seconds = sum(r["time/step_s"] * args.log_interval for r in windows)
    out = {"step_s": seconds / steps, "median_window_step_s": statistics.median(r["time/step_s"] for r in windows)}
    if guards:
        last = windows[-1]
        out.update({k.removeprefix("guard/"): last[k] for k in ("guard/sdc_replays_total", "guard/sdc_checks_total")
                    if k in last})
        for cost in COSTS:  # the median over the windows of the latest one (0 where the layout has none)
            seen = [r[f"guard/{cost}"] for r in windows if r.get(f"guard/{cost}")]
            out[cost] = statistics.median(seen) if seen else 0.0
    return out


def bench_config(config: str, layout: str, args: argparse.Namespace, work: Path, overrides: list[str]) -> dict:
    pairs = []
    for repeat in range(args.repeats):
        order = [True, False] if repeat % 2 == 0 else [False, True]
        got = {on: run(config, layout, on, args, work / f"{Path(config).stem}-{layout}-{repeat}-{int(on)}",
                       overrides) for on in order}
        pairs.append(got)
        print(f"  {config} {layout} repeat {repeat}: on {got[True]['step_s']:.4f} s/step, off "
              f"{got[False]['step_s']:.4f} s/step, ratio {got[True]['step_s'] / got[False]['step_s']:.4f}",
              flush=True)
    ratios = [p[True]["step_s"] / p[False]["step_s"] for p in pairs]
    step_off = statistics.median(p[False]["step_s"] for p in pairs)
    on = [p[True] for p in pairs]
    return {
        "config": config, "layout": layout, "overrides": overrides, "ratio": statistics.median(ratios),
        "ratios": ratios, "step_s_on": statistics.median(p["step_s"] for p in on), "step_s_off": step_off,
        **{f"{cost.removesuffix('_s')}_fraction": statistics.median(p[cost] for p in on) / step_off
           for cost in COSTS},
        "replays": on[0].get("sdc_replays_total", 0), "fingerprint_checks": on[0].get("sdc_checks_total", 0),
        "runs": pairs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--configs", nargs="+", default=["configs/tiny.toml", "configs/small.toml"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="steps per run (the defaults replay every 200)")
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. train.global_batch=8")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="keel-bench-guards-") as tmp:
        for config in args.configs:
            for layout in args.layouts:
                results.append(bench_config(config, layout, args, Path(tmp), args.overrides))
    print(f"\n{'config':<22}{'layout':<12}{'on s/step':>11}{'off s/step':>11}{'ratio':>8}{'fingerprint':>13}"
          f"{'replay':>9}{'snapshot':>10}{'at rest':>9}")
    for r in results:
        print(f"{r['config']:<22}{r['layout']:<12}{r['step_s_on']:>11.4f}{r['step_s_off']:>11.4f}{r['ratio']:>8.4f}"
              f"{r['fingerprint_fraction']:>13.4f}{r['replay_fraction']:>9.3f}{r['snapshot_fraction']:>10.4f}"
              f"{r['at_rest_fraction']:>9.4f}")
    print(f"ratio: guards on / off, median over repeats (target <= {TARGET}); the last four columns: one fingerprint "
          "check, one replay, one snapshot, a step's at-rest check and seal, as fractions of a step")
    # One entry per config, layout and overrides: a run of some keeps the others' results.
    earlier = json.loads(RESULTS.read_text())["results"] if RESULTS.exists() else []
    measured = {(n["config"], n["layout"], tuple(n["overrides"])) for n in results}
    kept = [r for r in earlier if (r["config"], r.get("layout"), tuple(r["overrides"])) not in measured
            and "layout" in r]
    for r in results:
        r.update({"nproc": args.nproc, "steps": args.steps, "repeats": args.repeats,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "guard_overhead", "target": TARGET, "results": kept + results, "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
