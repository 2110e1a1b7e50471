"""Instability at high learning rates, and the levers against it (Wortsman et al., "Small-scale proxies for
large-scale Transformer training instabilities", ICLR 2024), on the built-in corpus.

For each configuration (the baseline; QK-norm and z-loss 1e-4) and each peak learning rate of a grid, a real
`keel train` run of a small model (1 process; the guards off, so that no rollback hides the instability) with
the instability signals every 10 steps. Per run: the final loss (the mean training loss of the last 10 steps),
whether it diverged (a non-finite loss, or a final loss above the first step's), and the largest attention
logit and log Z the signals saw. Per configuration: the LR sensitivity, Wortsman et al.'s E_lr[min(L(lr), L0)
- L*] over the grid, L0 the loss at initialisation (the first step's) and L* the best final loss of that
configuration. Results: a table, bench/results/stability.json, and the loss curves at the learning rates where
the baseline's logits grew, docs/stability-curves.svg.
"""

from __future__ import annotations

import argparse
import json
import math
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
RESULTS = REPO / "bench" / "results" / "stability.json"
CURVES = REPO / "docs" / "stability-curves.svg"
SHAPE = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.max_seq_len=128",
         "train.seq_len=128", "train.global_batch=16", "train.micro_batch=16", "optim.warmup_steps=20",
         "guard.enabled=false", "monitor.interval=1", "monitor.signals_interval=10", "eval.interval=0",
         "eval.final=false", "checkpoint.interval=100000", "health.preflight=off", "monitor.prometheus_port=0"]
CONFIGS = {"baseline": [], "qk_norm + z_loss": ["model.qk_norm=true", "train.z_loss=1e-4"]}
LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def run(name: str, lr: float, steps: int, work: Path, overrides: list[str]) -> dict:
    run_dir = work / f"{name.replace(' ', '').replace('+', '_')}-{lr:g}"
    cmd = [sys.executable, "-m", "keel", "train", "--run-dir", str(run_dir), *SHAPE, f"train.steps={steps}",
           f"optim.lr={lr}", *CONFIGS[name], *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    logits = [r["signals/attn_logit_max"] for r in records if "signals/attn_logit_max" in r]
    log_z = [r["signals/log_z_max"] for r in records if "signals/log_z_max" in r]
    final = statistics.fmean(losses[-10:]) if len(losses) >= 10 else math.inf
    diverged = done.returncode != 0 or not all(math.isfinite(v) for v in losses) or final > losses[0]
    return {"config": name, "lr": lr, "exit": done.returncode, "first_loss": losses[0] if losses else None,
            "final_loss": final if math.isfinite(final) else None, "diverged": diverged, "losses": losses,
            "attn_logit_max": max(logits, default=None), "log_z_max": max(log_z, default=None)}


def sensitivity(runs: list[dict]) -> float:
    """keel sweep's LR sensitivity, with the first step's loss (averaged over the grid) as the initial loss."""
    from keel.sweep.analysis import sensitivity as lr_sensitivity

    return lr_sensitivity([r["final_loss"] for r in runs], statistics.fmean(r["first_loss"] for r in runs))


def markdown(results: dict) -> str:
    lines = ["| configuration | " + " | ".join(f"lr {lr:g}" for lr in results["lrs"]) + " | LR sensitivity |",
             "|---|" + "---:|" * (len(results["lrs"]) + 1)]
    for name, summary in results["configs"].items():
        cells = []
        for r in summary["runs"]:
            loss = "diverged" if r["final_loss"] is None else f"{r['final_loss']:.3f}" + (" (up)" if r["diverged"]
                                                                                          else "")
            logit = "" if r["attn_logit_max"] is None else f"; logit {r['attn_logit_max']:.0f}"
            cells.append(loss + logit)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {summary['sensitivity']:.3f} |")
    return "\n".join(lines)


def curves_svg(results: dict, lrs: tuple[float, ...] = (3e-2, 1e-1)) -> str:
    """The training loss of both configurations at the learning rates where the baseline's attention logits
    grew into the thousands (solid: the first, dashed: the second)."""
    sys.path.insert(0, str(REPO / "src"))
    from keel.report.svg import Series, line_chart

    colors = {"baseline": "#dc2626", "qk_norm + z_loss": "#2563eb"}
    series = [Series(f"{name}, lr {lr:g}", list(range(1, len(r["losses"]) + 1)), r["losses"], colors[name],
                     dash="" if lr == lrs[0] else "4 2")
              for lr in lrs for name, summary in results["configs"].items() for r in summary["runs"] if r["lr"] == lr]
    return line_chart(series, width=600, height=240, label="training loss: baseline (red) and QK-norm + z-loss "
                      "(blue) at lr " + " (solid) and ".join(f"{lr:g}" for lr in lrs) + " (dashed)") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=2, help="runs at once")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for every run (e.g. data.dir=...)")
    args = ap.parse_args()
    os.chdir(REPO)
    sys.path.insert(0, str(REPO / "src"))
    from keel.cli.data import ensure_corpus
    from keel.config import load_config

    ensure_corpus(load_config(None, args.overrides), verbose=True)
    work = Path(tempfile.mkdtemp(prefix="keel-stability-"))
    grid = [(name, lr) for name in CONFIGS for lr in LRS]
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda point: run(*point, args.steps, work, args.overrides), grid))
    configs = {name: {"runs": [r for r in runs if r["config"] == name]} for name in CONFIGS}
    for summary in configs.values():
        summary["sensitivity"] = sensitivity(summary["runs"])
    results = {"benchmark": "stability", "steps": args.steps, "shape": SHAPE, "lrs": LRS, "configs": configs,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(markdown(results))
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    CURVES.write_text(curves_svg(results))


if __name__ == "__main__":
    main()
