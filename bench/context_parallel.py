"""What context parallelism costs and saves: the tiny model on long sequences over 1, 2 and 4 processes (cp = 1,
2, 4), side by side in one run.

Each point is two real `keel train --nproc CP parallel.cp=CP` runs of the same config and sequence length. The
first, unprofiled, gives tokens/s (median of the logged windows after the first, with their min–max) and per-rank
memory: the peak resident memory above the runtime of the rank that holds the most, and of it the activations'
part (less the parameters, gradients and Adam moments, 16 bytes per parameter, which FSDP shards over the cp
ranks). The second, short and profiled, gives the share of a step spent in collectives (the profiler's own
buffers would otherwise count as memory). Ratios are against cp = 1 at the same sequence length. glibc is told to
return large freed blocks at once (MALLOC_MMAP_THRESHOLD_), so that the resident peak follows what a step holds.

On a CPU the processes share the cores: tokens/s says what the exchange costs here, not on a GPU; the memory per
rank is what context parallelism is for. Results: a table and bench/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from keel.config import load_config
from keel.model.flops import param_count

RESULTS = Path(__file__).parent / "results" / "context_parallel.json"
MIB = 2**20
TIGHT = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc: blocks above 128 KiB are their own mappings


def train(seq: int, cp: int, steps: int, profile: bool, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """A `keel train` run of the point; its logged windows after the first (which holds start-up)."""
    cmd = [sys.executable, "-m", "keel", "train", "--config", args.config, "--nproc", str(cp), "--run-dir",
           str(run_dir), f"parallel.cp={cp}", f"model.max_seq_len={seq}", f"train.seq_len={seq}",
           f"train.global_batch={args.batch}", "train.micro_batch=1", f"train.steps={steps}",
           f"monitor.interval={args.log_interval}", f"monitor.profile_interval={args.log_interval if profile else 0}",
           "eval.interval=0", "eval.final=false", "eval.sequences=4", f"checkpoint.interval={steps}",
           "health.preflight=off", *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **TIGHT)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/loss" in r][1:]


def run_point(seq: int, cp: int, args: argparse.Namespace, work: Path) -> dict:
    """Two runs of the point: unprofiled for tokens/s and memory (the profiler's own buffers are a fixed
    ~100 MiB per rank here, which would hide what the sequence costs), and a short profiled one for the
    share of a step spent in collectives."""
    started = time.perf_counter()
    try:
        steps = train(seq, cp, args.steps, False, args, work / f"seq{seq}_cp{cp}")
        profiled = train(seq, cp, 2 * args.log_interval, True, args, work / f"seq{seq}_cp{cp}_profiled")
    except RuntimeError as e:
        return {"seq": seq, "cp": cp, "error": str(e)}
    params = param_count(load_config(Path(args.config), [f"model.max_seq_len={seq}", *args.overrides]).model)
    above = max(r["memory/above_runtime_bytes_max_rank"] for r in steps)
    speeds = [r["throughput/tokens_per_s"] for r in steps]
    return {"seq": seq, "cp": cp, "tokens_per_s": statistics.median(speeds), "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds),
            "comm_share": statistics.median(r.get("time/comm_share", math.nan) for r in profiled),
            "peak_above_runtime_mib": above / MIB, "activation_mib": (above - 16 * params / cp) / MIB,
            "final_loss": steps[-1]["train/loss"], "wall_s": time.perf_counter() - started}


def markdown(results: dict) -> str:
    """The results as docs/benchmarks.md shows them (bench/tables.py renders them there)."""
    lines = ["| sequence | cp | tokens/s | vs cp = 1 (spread) | comm share | peak above runtime (MiB, max rank) "
             "| activations (MiB) | vs cp = 1 |", "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['cp']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['seq']} | {r['cp']} | {r['tokens_per_s']:.0f} | {r['speed_vs_cp1']:.2f} "
                     f"({r['speed_vs_cp1_min']:.2f}–{r['speed_vs_cp1_max']:.2f}) | {r['comm_share']:.0%} | "
                     f"{r['peak_above_runtime_mib']:.0f} | {r['activation_mib']:.0f} | {r['activation_vs_cp1']:.2f} |")
    return "\n".join(lines)


def compare(rows: list[dict]) -> None:
    """Each point's ratios to cp = 1 at its sequence length."""
    for r in rows:
        base = next((b for b in rows if b["seq"] == r["seq"] and b["cp"] == 1 and "error" not in b), None)
        if base is None or "error" in r:
            continue
        r["speed_vs_cp1"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["speed_vs_cp1_min"] = r["tokens_per_s_min"] / base["tokens_per_s_max"]
        r["speed_vs_cp1_max"] = r["tokens_per_s_max"] / base["tokens_per_s_min"]
        r["activation_vs_cp1"] = r["activation_mib"] / base["activation_mib"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--log-interval", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("overrides", nargs="*", help="config overrides for every point")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_point(seq, cp, args, Path(tmp)) for seq in args.seqs for cp in args.cps]
    compare(rows)
    results = {"benchmark": "context_parallel", "config": args.config, "batch": args.batch, "steps": args.steps,
               "overrides": args.overrides, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(markdown(results))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
