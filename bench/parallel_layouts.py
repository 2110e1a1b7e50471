"""What each parallel layout costs: the same training in every layout, side by side.

Each layout is a real `keel train --nproc N` run of the same config and steps. From its
metrics.jsonl: tokens/s (median of the logged windows after the first), MFU, the share of a
profiled step spent in collectives, the share spent waiting for a pipeline neighbour (exposed
bubble plus transfer), and the largest peak memory of any rank. Tokens/s are also given as a ratio
to the first layout (FSDP over all processes). Results: a table and bench/results/parallel_layouts.json.

On a CPU the processes share the cores, so absolute speed says little; the ratios and shares are
what compare, and MFU is against a peak each run measures at its start under the same contention
(noisy). On a GPU machine run it with `--config configs/small.toml` for MFU against the catalog peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "parallel_layouts.json"

LAYOUTS: dict[str, list[str]] = {
    "fsdp4": [],
    "hsdp2x2": ["parallel.dp_replicate=2"],
    "tp2xdp2": ["parallel.tp=2"],
    "tp4": ["parallel.tp=4", "parallel.dp_shard=1"],
    "pp2xdp2_1f1b": ["parallel.pp=2"],
    "pp2xdp2_interleaved": ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
    "pp2xtp2": ["parallel.pp=2", "parallel.tp=2"],
    "pp4_1f1b": ["parallel.pp=4"],
    "fsdp4_ac_full": ["parallel.activation_checkpoint=full"],
}


def run_layout(name: str, overrides: list[str], args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "-m", "keel", "train", "--config", args.config, "--nproc", str(args.nproc),
           "--run-dir", str(run_dir), f"train.steps={args.steps}", f"monitor.interval={args.log_interval}",
           f"monitor.profile_interval={args.log_interval}", "eval.interval=0", f"checkpoint.interval={args.steps}",
           "train.micro_batch=4", *args.overrides, *overrides]  # small micro-batches: every layout splits 32
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        return {"layout": name, "error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r][1:]  # the first window holds start-up
    mfu = [r["throughput/mfu"] for r in steps if r.get("throughput/mfu") is not None]
    return {
        "layout": name, "overrides": overrides,
        "tokens_per_s": statistics.median(r["throughput/tokens_per_s"] for r in steps),
        "step_s": statistics.median(r["time/step_s"] for r in steps),
        "tflops_per_device": statistics.median(r["throughput/tflops_per_device"] for r in steps),
        "mfu": statistics.median(mfu) if mfu else None,
        "comm_share": statistics.median(r["time/comm_share"] for r in steps),
        "pp_wait_share": statistics.median(r["time/pp_wait_share"] for r in steps),
        "peak_memory_mib": max(r["memory/peak_bytes_max_rank"] for r in steps) / 2**20,
        "final_loss": steps[-1]["train/loss"],
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--log-interval", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every layout")
    args = ap.parse_args()
    names = args.only or list(LAYOUTS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_layout(name, LAYOUTS[name], args, Path(tmp)) for name in names]
    base = next((r["tokens_per_s"] for r in rows if "tokens_per_s" in r), None)
    print(f"{'layout':<22}{'tokens/s':>10}{'vs first':>10}{'GFLOP/s/dev':>13}{'MFU':>8}{'comm':>7}{'pp wait':>9}"
          f"{'peak MiB':>10}{'loss':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:<22} failed: {r['error']}")
            continue
        r["vs_first"] = r["tokens_per_s"] / base
        mfu = "unknown" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"{r['layout']:<22}{r['tokens_per_s']:>10.0f}{r['vs_first']:>10.2f}"
              f"{r['tflops_per_device'] * 1e3:>13.1f}{mfu:>8}{r['comm_share']:>7.0%}"
              f"{r['pp_wait_share']:>9.0%}{r['peak_memory_mib']:>10.0f}{r['final_loss']:>8.4f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "parallel_layouts", "config": args.config, "nproc": args.nproc,
                                   "steps": args.steps, "overrides": args.overrides, "rows": rows,
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
