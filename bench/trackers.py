"""What an experiment tracker costs the training, and what one that dies mid-run costs.

Each repeat runs `keel train` three times on the same config, in a rotating order:
- none: no tracker;
- mlflow: `[monitor.mlflow]` logging to a real `mlflow server` on loopback;
- mlflow_down: the same, but the server is killed once the run's first metrics reached it, so that every
  later record meets a dead server (the records wait in the bounded queue, then are dropped and counted).
A run's tokens/s is its training tokens after the first logged window (start-up) over their time. The
ratios to `none` are taken per repeat; the median and the range are reported (target: within the noise
of `none`, i.e. the range of ratios spans 1). Results: a table and bench/results/trackers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from keel.core.net import free_port

RESULTS = Path(__file__).parent / "results" / "trackers.json"
ARMS = ("none", "mlflow", "mlflow_down")


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    root.mkdir(parents=True)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts")],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("mlflow server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def reached_server(run_dir: Path) -> bool:
    """The tracker has sent metrics (it keeps the last step it sent in trackers.json)."""
    try:
        return json.loads((run_dir / "trackers.json").read_text())["mlflow"]["sent_step"] > 0
    except (OSError, ValueError, KeyError):
        return False


def run(arm: str, args: argparse.Namespace, run_dir: Path) -> dict:
    server, url = start_server(run_dir.parent / f"{run_dir.name}-mlflow") if arm != "none" else (None, "")
    tracker = [] if arm == "none" else ["monitor.mlflow.enabled=true", f"monitor.mlflow.tracking_uri={url}"]
    cmd = [sys.executable, "-m", "keel", "train", "--config", args.config, "--nproc", str(args.nproc), "--quiet",
           "--run-dir", str(run_dir), f"train.steps={args.steps}", f"monitor.interval={args.interval}",
           "eval.interval=0", f"checkpoint.interval={args.steps}", *tracker, *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    killed_at = None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        while arm == "mlflow_down" and killed_at is None and proc.poll() is None:
            if reached_server(run_dir):
                assert server is not None
                stop_server(server)
                killed_at = time.time()
            time.sleep(0.2)
        _, err = proc.communicate(timeout=args.timeout)
    finally:
        if server is not None:
            stop_server(server)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "train/loss" in r][1:]  # the first window holds start-up
    tokens = windows[-1]["train/tokens_seen"] - [r for r in records if "train/loss" in r][0]["train/tokens_seen"]
    seconds = sum(r["time/step_s"] * args.interval for r in windows)
    lost = [e["detail"] for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
            if e["kind"] == "tracker"]
    return {"tokens_per_s": tokens / seconds, "server_killed": killed_at is not None,
            "dropped": lost[-1]["dropped"] if lost else 0, "refused": lost[-1]["failed"] if lost else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=1, help="monitor.interval (1: a record per step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args()
    repeats = []
    with tempfile.TemporaryDirectory(prefix="keel-bench-trackers-") as tmp:
        for repeat in range(args.repeats):
            order = ARMS[repeat % 3:] + ARMS[:repeat % 3]
            got = {arm: run(arm, args, Path(tmp) / f"{repeat}-{arm}") for arm in order}
            repeats.append(got)
            print(f"repeat {repeat}: " + ", ".join(f"{arm} {got[arm]['tokens_per_s']:.0f} tok/s" for arm in ARMS) +
                  f" (down: {got['mlflow_down']['dropped']} dropped, {got['mlflow_down']['refused']} refused)",
                  flush=True)
    ratios = {arm: [r[arm]["tokens_per_s"] / r["none"]["tokens_per_s"] for r in repeats] for arm in ARMS[1:]}
    print(f"\n{'arm':<14}{'tokens/s':>10}{'ratio to none':>15}{'range':>18}")
    for arm in ARMS:
        rate = statistics.median(r[arm]["tokens_per_s"] for r in repeats)
        spread = f"{min(ratios[arm]):.3f}-{max(ratios[arm]):.3f}" if arm in ratios else ""
        ratio = f"{statistics.median(ratios[arm]):.3f}" if arm in ratios else "1"
        print(f"{arm:<14}{rate:>10.0f}{ratio:>15}{spread:>18}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "trackers", "config": args.config, "overrides": args.overrides, "nproc": args.nproc,
        "steps": args.steps, "interval": args.interval, "repeats": args.repeats,
        "ratio": {arm: statistics.median(v) for arm, v in ratios.items()}, "ratios": ratios, "runs": repeats,
        "machine": platform.machine(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
