"""What watching a run costs: the same training with telemetry, every sink and the exporter on, and off.

Each repeat runs `keel train` twice on the same config, alternating which goes first:
- on: node telemetry every `--telemetry-interval` seconds, TensorBoard files, the Prometheus exporter
  scraped every second by this script (a busier scraper than Prometheus' 15 s), the alert rules;
- off: no telemetry, no TensorBoard, no exporter (metrics.jsonl, events.jsonl and the goodput ledger
  are the run directory's record and stay on in both).
A run's step time is its training time after the first logged window (start-up) divided by its
steps. The ratio on/off is taken per repeat and the median reported (target: at most 1.01).
Results: a table and bench/results/telemetry_overhead.json.
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
import threading
import time
import urllib.request
from pathlib import Path

from keel.core.net import free_port

RESULTS = Path(__file__).parent / "results" / "telemetry_overhead.json"


def scrape_every_second(port: int, stop: threading.Event, counts: list[int]) -> None:
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                response.read()
            counts[0] += 1
        except OSError:
            pass  # not serving yet, or already gone


def run(config: str, on: bool, args: argparse.Namespace, run_dir: Path) -> dict:
    port = free_port()
    watch = [f"monitor.telemetry_interval_s={args.telemetry_interval}", "monitor.tensorboard=true",
             f"monitor.prometheus_port={port}"] if on else \
        ["monitor.telemetry_interval_s=0", "monitor.tensorboard=false", "monitor.prometheus_port=0"]
    cmd = [sys.executable, "-m", "keel", "train", "--config", config, "--nproc", str(args.nproc), "--quiet",
           "--run-dir", str(run_dir), f"train.steps={args.steps}", f"monitor.interval={args.interval}",
           "eval.interval=0", f"checkpoint.interval={args.steps}", *watch, *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    stop, scrapes = threading.Event(), [0]
    scraper = threading.Thread(target=scrape_every_second, args=(port, stop, scrapes), daemon=True)
    if on:
        scraper.start()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    finally:
        stop.set()
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "train/loss" in r][1:]  # the first window holds start-up
    steps = len(windows) * args.interval
    seconds = sum(r["time/step_s"] * args.interval for r in windows)
    samples = len((run_dir / "telemetry.jsonl").read_text().splitlines()) if on else 0
    return {"step_s": seconds / steps, "scrapes": scrapes[0], "telemetry_samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--interval", type=int, default=10, help="monitor.interval")
    ap.add_argument("--telemetry-interval", type=float, default=10.0, help="monitor.telemetry_interval_s when on")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="keel-bench-telemetry-") as tmp:
        for repeat in range(args.repeats):
            order = [True, False] if repeat % 2 == 0 else [False, True]
            got = {on: run(args.config, on, args, Path(tmp) / f"{repeat}-{'on' if on else 'off'}") for on in order}
            pairs.append(got)
            print(f"repeat {repeat}: on {got[True]['step_s']:.4f} s/step ({got[True]['scrapes']} scrapes, "
                  f"{got[True]['telemetry_samples']} telemetry samples), off {got[False]['step_s']:.4f} s/step, "
                  f"ratio {got[True]['step_s'] / got[False]['step_s']:.4f}", flush=True)
    ratios = [p[True]["step_s"] / p[False]["step_s"] for p in pairs]
    on_s, off_s = (statistics.median(p[side]["step_s"] for p in pairs) for side in (True, False))
    print(f"\n{'config':<22}{'on s/step':>11}{'off s/step':>11}{'ratio':>8}")
    print(f"{args.config:<22}{on_s:>11.4f}{off_s:>11.4f}{statistics.median(ratios):>8.4f}")
    print("ratio: telemetry, TensorBoard and the scraped exporter on / off, median over repeats (target <= 1.01)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "telemetry_overhead", "target": 1.01, "config": args.config, "overrides": args.overrides,
        "nproc": args.nproc, "steps": args.steps, "interval": args.interval,
        "telemetry_interval_s": args.telemetry_interval, "repeats": args.repeats, "ratio": statistics.median(ratios),
        "ratios": ratios, "step_s_on": on_s, "step_s_off": off_s, "runs": pairs, "machine": platform.machine(),
        "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
