"""Mixture-of-experts balance: the tiny MoE config (configs/tiny_moe.toml) trained for its 200 steps on the built-in
corpus with the auxiliary-loss-free bias update at several rates, 0 (no balancing) among them, side by side (one
process each, the same seed and batches). Per rate, over the logged intervals: the busiest expert's load over the
mean (imbalance, the worst layer's), the least-loaded expert's share of its fair load (the worst layer's: 0 is an
expert that gets no token, a collapse), and the final validation loss. Results: bench/results/moe.json and a
table in docs/benchmarks.md.

    python -m bench.moe [--steps 200] [--rates 0,0.001,0.01]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "moe.json"
COMMON = ["--config", "tiny_moe", "monitor.interval=10", "checkpoint.interval=100000", "health.preflight=off",
          "monitor.prometheus_port=0"]


def run(rate: float, steps: int, work: Path) -> dict:
    run_dir = work / f"rate-{rate:g}"
    cmd = [sys.executable, "-m", "keel", "train", "--run-dir", str(run_dir), *COMMON, f"train.steps={steps}",
           f"model.moe.bias_update_rate={rate}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=4 * 3600)
    if done.returncode:
        raise SystemExit(f"rate {rate:g}: keel train exited {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "moe/imbalance_max" in r]
    min_load = [min(v for k, v in r.items() if k.startswith("moe/min_load/layer_")) for r in logged]
    return {"rate": rate, "steps": [r["step"] for r in logged], "imbalance": [r["moe/imbalance_max"] for r in logged],
            "min_load": min_load, "val": [r["val/loss"] for r in records if "val/loss" in r][-1]}


def markdown(results: dict) -> str:
    rows = ["| bias update rate | imbalance (max / mean), first → last interval, mean of the last 5 | least-loaded "
            "expert's share of its fair load, first → last, mean of the last 5 | validation loss |",
            "|---|---|---|---:|"]
    for r in results["runs"]:
        tail_i, tail_m = r["imbalance"][-5:], r["min_load"][-5:]
        rows.append(f"| {r['rate']:g}{' (off)' if not r['rate'] else ''} | {r['imbalance'][0]:.2f} → "
                    f"{r['imbalance'][-1]:.2f}, {sum(tail_i) / len(tail_i):.2f} | {r['min_load'][0]:.2f} → "
                    f"{r['min_load'][-1]:.2f}, {sum(tail_m) / len(tail_m):.2f} | {r['val']:.4f} |")
    where = (f"configs/tiny_moe.toml, {results['steps']} steps, intervals of 10 steps (the worst of its 3 expert "
             f"layers), 1 process per run on {results['cpus']} cores ({results['machine']}), torch "
             f"{results['torch']}.")
    return "\n".join([*rows, "", where])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rates", default="0,0.001,0.01")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=len(rates)) as pool:
        runs = list(pool.map(lambda rate: run(rate, args.steps, Path(tmp)), rates))
    import torch

    results = {"steps": args.steps, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
               "torch": torch.__version__, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
