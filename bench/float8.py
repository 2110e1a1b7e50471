"""Float8 numerics: a config (the tiny one by default) trained for 200 steps in bf16 and in fp8 side by side on
the built-in corpus, one process each, the same seed and data. On a CPU torchao's float8 is emulated (the
numerics of a GPU run, not its speed); on CUDA (`--device cuda`) it runs on the hardware, compiled as float8
requires there. Reported: each step's relative gap between the two training losses (largest, and mean over the
last 50 steps), the validation losses, and (on a CPU: the signals read eager blocks) the float8 signals' largest
flushed share. Results: bench/results/float8.json for the tiny config on a CPU (a table in docs/precision.md),
bench/results/float8-CONFIG-DEVICE.json otherwise.

    python -m bench.float8 [--steps 200] [--recipes rowwise,tensorwise]
    python -m bench.float8 --config small --device cuda      the small config's curve: minutes on one GPU
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "float8.json"
COMMON = ["monitor.interval=1", "checkpoint.interval=100000", "health.preflight=off", "monitor.prometheus_port=0",
          "guard.enabled=false"]
DEVICE = {"cpu": ["train.device=cpu", "monitor.signals_interval=10"],
          "cuda": ["train.device=cuda", "parallel.compile=true"]}  # float8 compiles on a GPU; signals read eager


def run(name: str, steps: int, work: Path, config: str = "tiny", device: str = "cpu") -> dict:
    """One `keel train` run: bf16, or fp8 with the given recipe. Its per-step losses, validation and signals."""
    run_dir = work / name
    precision = ["train.precision=bf16"] if name == "bf16" else ["train.precision=fp8", f"train.float8_recipe={name}"]
    cmd = [sys.executable, "-m", "keel", "train", "--run-dir", str(run_dir), "--config", config, *COMMON,
           *DEVICE[device], f"train.steps={steps}", *precision]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=4 * 3600)
    if done.returncode:
        raise SystemExit(f"{name}: keel train exited {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"name": name, "wall_s": time.perf_counter() - started,
            "losses": {r["step"]: r["train/loss"] for r in records if "train/loss" in r},
            "val": {r["step"]: r["val/loss"] for r in records if "val/loss" in r},
            "underflow_max": max((r["signals/float8_underflow_max"] for r in records
                                  if "signals/float8_underflow_max" in r), default=None)}


def compare(base: dict, other: dict) -> dict:
    steps = sorted(base["losses"])
    gaps = [abs(other["losses"][s] - base["losses"][s]) / base["losses"][s] for s in steps]
    final = steps[-1]
    return {"max_gap": max(gaps), "gap_at": steps[gaps.index(max(gaps))],
            "mean_gap_last_50": statistics.fmean(gaps[-50:]),
            "val": other["val"].get(final), "val_bf16": base["val"].get(final),
            "underflow_max": other["underflow_max"], "wall_s": other["wall_s"], "wall_s_bf16": base["wall_s"]}


def markdown(results: dict) -> str:
    rows = ["| recipe | largest step gap (step) | mean gap, last 50 steps | validation fp8 / bf16 | largest flushed "
            "share | wall s fp8 / bf16 |", "|---|---:|---:|---:|---:|---:|"]
    for recipe, c in results["recipes"].items():
        rows.append(f"| {recipe} | {c['max_gap']:.2%} ({c['gap_at']}) | {c['mean_gap_last_50']:.2%} | "
                    f"{c['val']:.4f} / {c['val_bf16']:.4f} | "
                    f"{'-' if c['underflow_max'] is None else format(c['underflow_max'], '.2e')} | "
                    f"{c['wall_s']:.0f} / {c['wall_s_bf16']:.0f} |")
    where = (f"The {results.get('config', 'tiny')} config, {results['steps']} steps, 1 process each, on "
             f"{results['cpus']} cores ({results['machine']}), torch {results['torch']}, torchao {results['torchao']}"
             + ("; emulated float8: its wall time is no measure of a GPU's." if results.get("device", "cpu") == "cpu"
                else ", on CUDA, compiled."))
    return "\n".join([*rows, "", where])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipes", default="rowwise,tensorwise")
    parser.add_argument("--config", default="tiny", help="a shipped config's name or a TOML file")
    parser.add_argument("--device", choices=tuple(DEVICE), default="cpu",
                        help="cuda: one GPU, the runs one after the other")
    args = parser.parse_args(argv)
    recipes = args.recipes.split(",")
    names = ["bf16", *recipes]
    at_once = 1 if args.device == "cuda" else len(names)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=at_once) as pool:
        runs = dict(zip(names, pool.map(lambda n: run(n, args.steps, Path(tmp), args.config, args.device), names),
                        strict=True))
    import torch
    import torchao

    results = {"config": args.config, "device": args.device, "steps": args.steps, "cpus": os.cpu_count(),
               "machine": platform.processor() or platform.machine(),
               "torch": torch.__version__, "torchao": torchao.__version__,
               "recipes": {r: compare(runs["bf16"], runs[r]) for r in recipes},
               "losses": {name: run["losses"] for name, run in runs.items()}}
    out = RESULTS if (args.config, args.device) == ("tiny", "cpu") else (
        RESULTS.with_name(f"float8-{Path(args.config).stem}-{args.device}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
