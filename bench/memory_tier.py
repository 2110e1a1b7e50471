"""What the memory tier costs a run that never fails: the same training with `checkpoint.memory_interval` = N
and with the tier off.

Each repeat runs `keel train` twice on the same config (2 processes, FSDP, the guards at their defaults, the
launcher allowed one restart, as the tier requires), with the tier every `--interval` steps and without it,
alternating which goes first. A run's step time is its training time after the first logged window (start-up)
divided by its steps, so the memory saves (each copied beside the next step and written to /dev/shm in the
background) are paid for in it. The ratio on/off is taken per repeat and the median reported (target: at most
1.03 at an interval of 5). From the runs with the tier: a save's median blocking time (what the loop waited
for) and write time (the background part), and the bytes of one save. Results: a table and
bench/results/memory_tier.json, one entry per config.

The ratio of two runs carries the drift between them, which on a 2-core machine is several percent. With
`--log-interval 1` each run with the tier also gives its cost within itself (`cycle_cost`): every step after the
first cycle has a place in the save cycle, and the steps the background write runs beside (as many after each
save as the write lasts, at most interval - 1) are set against the others of the cycle after the saving step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from keel.rundir.events import read_jsonl

try:
    from bench.guard_overhead import run
except ImportError:  # run as a script: bench/ is the first entry of sys.path
    from guard_overhead import run  # type: ignore[no-redef]

RESULTS = Path(__file__).parent / "results" / "memory_tier.json"
TARGET = 1.03


def saves(run_dir: Path) -> dict:
    """The memory saves' median blocking and write seconds, and the bytes of one, from the run's records."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    done = [r for r in records if "checkpoint/memory_write_s" in r]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    committed = [e["detail"]["bytes"] for e in events if e["kind"] == "memory" and e["action"] == "committed"]
    return {"saves": len(done), "blocking_s": statistics.median(r["checkpoint/memory_blocking_s"] for r in done),
            "write_s": statistics.median(r["checkpoint/memory_write_s"] for r in done),
            "bytes": committed[-1] if committed else 0}


def cycle_cost(run_dir: Path, interval: int, write_s: float) -> float | None:
    """The tier's cost within one run logged every step, as a share of a cycle of `interval` steps: the median
    step at each place the background write reaches (it lasts `write_s`) less the median of the places it does
    not reach, the saving step itself left out. None where the write reaches every place."""
    times = {r["step"]: r["time/step_s"] for r in read_jsonl(run_dir / "metrics.jsonl")
             if "time/step_s" in r and r["step"] > interval}
    if not times:
        return None
    reached = min(interval - 1, math.ceil(write_s / statistics.median(times.values())))
    places: dict[int, list[float]] = {}
    for step, t in times.items():
        places.setdefault(step % interval, []).append(t)
    by_place = {p: statistics.median(ts) for p, ts in places.items() if p > 0}
    untouched = [t for p, t in by_place.items() if p > reached]
    if not untouched:
        return None
    base = statistics.median(untouched)
    return sum(t - base for p, t in by_place.items() if p <= reached) / (interval * base)


def bench_config(config: str, args: argparse.Namespace, work: Path) -> dict:
    pairs = []
    for repeat in range(args.repeats):
        got = {}
        for on in ([True, False] if repeat % 2 == 0 else [False, True]):
            run_dir = work / f"{Path(config).stem}-{repeat}-{int(on)}"
            tier = ["health.max_restarts=1", f"checkpoint.memory_interval={args.interval if on else 0}"]
            got[on] = run(config, "sharded", True, args, run_dir, [*tier, *args.overrides])
            if on:
                got[on].update(saves(run_dir))
                if args.log_interval == 1:
                    got[on]["cycle_cost"] = cycle_cost(run_dir, args.interval, got[on]["write_s"])
        pairs.append(got)
        print(f"  {config} repeat {repeat}: on {got[True]['step_s']:.4f} s/step, off {got[False]['step_s']:.4f} "
              f"s/step, ratio {got[True]['step_s'] / got[False]['step_s']:.4f}", flush=True)
    ratios = [p[True]["step_s"] / p[False]["step_s"] for p in pairs]
    on = [p[True] for p in pairs]
    within = [r["cycle_cost"] for r in on if r.get("cycle_cost") is not None]
    return {"config": config, "overrides": args.overrides, "interval": args.interval,
            "ratio": statistics.median(ratios), "ratios": ratios,
            "step_s_on": statistics.median(r["step_s"] for r in on),
            "step_s_off": statistics.median(p[False]["step_s"] for p in pairs),
            **{k: statistics.median(r[k] for r in on) for k in ("blocking_s", "write_s", "bytes", "saves")},
            "cycle_cost": statistics.median(within) if within else None, "cycle_costs": within,
            "runs": pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--configs", nargs="+", default=["configs/tiny.toml"])
    ap.add_argument("--interval", type=int, default=5, help="the memory tier's interval, in steps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. train.global_batch=8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-bench-memory-") as tmp:
        results = [bench_config(config, args, Path(tmp)) for config in args.configs]
    print(f"\n{'config':<22}{'on s/step':>11}{'off s/step':>11}{'ratio':>8}{'blocking s':>12}{'write s':>9}{'MB':>8}")
    for r in results:
        print(f"{r['config']:<22}{r['step_s_on']:>11.4f}{r['step_s_off']:>11.4f}{r['ratio']:>8.4f}"
              f"{r['blocking_s']:>12.4f}{r['write_s']:>9.3f}{r['bytes'] / 1e6:>8.1f}")
    print(f"ratio: the memory tier every {args.interval} steps / off, median over repeats (target <= {TARGET})")
    for r in results:
        if r["cycle_cost"] is not None:
            print(f"{r['config']}: within each run with the tier, the steps beside its writes cost "
                  f"{r['cycle_cost']:+.1%} of a cycle (median of {', '.join(f'{c:+.1%}' for c in r['cycle_costs'])})")
    earlier = json.loads(RESULTS.read_text())["results"] if RESULTS.exists() else []
    kept = [r for r in earlier if r["config"] not in {n["config"] for n in results}]
    for r in results:
        r.update({"nproc": args.nproc, "steps": args.steps, "repeats": args.repeats,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "memory_tier", "target": TARGET, "results": kept + results,
                                   "machine": platform.machine(), "cpus": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
