"""Learning-rate transfer across widths (Yang et al., "Tensor Programs V"), measured with `keel sweep` itself on
the built-in corpus: the same grid of peak learning rates × widths (same depth and heads, each head wider) once
under the standard parametrization and once under μP with the narrowest width as the base. Each point is a
real `keel train` run (1 process, the guards off so that no rollback hides a diverging rate); its loss is the
final validation loss.

Per parametrization: the optimal learning rate per width (keel sweep's parabola-refined optimum), how far it
moves across the widths (largest / smallest, and in grid steps), and the transfer test of the acceptance: the
loss at the widest width when trained at the narrowest width's optimal grid rate, over the widest width's best
loss. Results: a table, bench/results/transfer.json and docs/transfer-curves.svg (loss against learning rate
per width, both parametrizations). A sweep directory (--work) is resumable: rerun with the same --work to finish
an interrupted measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "transfer.json"
CURVES = REPO / "docs" / "transfer-curves.svg"
SHAPE = ["model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.max_seq_len=128", "train.seq_len=128",
         "train.global_batch=16", "train.micro_batch=16", "optim.warmup_steps=15", "guard.enabled=false",
         "monitor.interval=10", "eval.interval=0", "eval.sequences=32", "checkpoint.interval=50",
         "checkpoint.keep_last=1", "health.preflight=off", "monitor.prometheus_port=0"]
PARAMETRIZATIONS = {"sp": [], "mup": ["model.parametrization=mup"]}  # base_dim: the narrowest width, added below


def sweep(name: str, args: argparse.Namespace, work: Path) -> dict:
    extra = PARAMETRIZATIONS[name] + ([f"model.base_dim={args.widths.split(',')[0]}"] if name == "mup" else [])
    cmd = [sys.executable, "-m", "keel", "sweep", "--grid", f"optim.lr={args.lrs}", "--grid",
           f"model.dim={args.widths}", "--steps", str(args.steps), "--parallel", str(args.parallel), "--out",
           str(work / name), *SHAPE, *extra, *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return json.loads((work / name / "sweep.json").read_text())


def transfer_gap(series: dict) -> dict:
    """The widest width's loss at the narrowest width's best grid rate, against its own best loss."""
    narrow, wide = series["widths"][0], series["widths"][-1]
    finite = [(loss, lr) for lr, loss in zip(narrow["lrs"], narrow["losses"], strict=True) if loss is not None]
    lr = min(finite)[1]
    at = wide["losses"][wide["lrs"].index(lr)]
    return {"narrow_lr": lr, "wide_loss_at_narrow_lr": at, "wide_best_loss": wide["best_loss"],
            "gap": None if at is None else at / wide["best_loss"] - 1}


def markdown(results: dict) -> str:
    widths = results["widths"]
    lines = ["| parametrization | " + " | ".join(f"optimal lr at {w}" for w in widths)
             + " | drift (grid steps) | slope | widest's loss at narrowest's lr |",
             "|---|" + "---:|" * (len(widths) + 3)]
    for name, r in results["parametrizations"].items():
        s = r["series"]
        cells = [f"{w['optimum_lr']:.3g}" + (" (edge)" if w["optimum_at_edge"] else "")
                 if w["optimum_lr"] is not None else "-" for w in s["widths"]]
        t, gap = s["transfer"], r["gap"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {t['drift']:.2f}× ({t['grid_steps']:.1f}) | "
                     f"{t['slope']:.2f} | " + ("diverged" if gap["gap"] is None else f"+{gap['gap']:.1%}") + " |")
    lrs = results["parametrizations"]["sp"]["series"]["widths"][0]["lrs"]
    lines += ["", "| final validation loss | " + " | ".join(f"lr {lr:.3g}" for lr in lrs) + " | LR sensitivity |",
              "|---|" + "---:|" * (len(lrs) + 1)]
    for name, r in results["parametrizations"].items():
        for w in r["series"]["widths"]:
            best = w["best_loss"]
            cells = ["diverged" if v is None else (f"**{v:.3f}**" if v == best else f"{v:.3f}") for v in w["losses"]]
            lines.append(f"| {name}, width {w['width']} | " + " | ".join(cells) + f" | {w['sensitivity']:.3f} |")
    return "\n".join(lines)


def curves_svg(results: dict) -> str:
    sys.path.insert(0, str(REPO / "src"))
    from keel.report.html import LAYER_COLORS
    from keel.report.svg import Series, line_chart

    series = []
    for name, r in results["parametrizations"].items():
        for i, w in enumerate(r["series"]["widths"]):
            series.append(Series(f"{name} width {w['width']}", [math.log10(lr) for lr in w["lrs"]], w["losses"],
                                 LAYER_COLORS[i % len(LAYER_COLORS)], dash="" if name == "mup" else "4 2",
                                 dots=True))
    return line_chart(series, width=600, height=260, x_fmt=lambda v: f"{10 ** v:.2g}",
                      label="final validation loss against the peak learning rate: μP solid, standard dashed; "
                      "widths " + ", ".join(str(w) for w in results["widths"]) + " (blue, orange, green, purple)") \
        + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="64,128,256,512")
    ap.add_argument("--lrs", default="3e-4..3e-2:8", help="the learning-rate axis, as keel sweep's --grid")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--parallel", type=int, default=2, help="points at once")
    ap.add_argument("--work", type=Path, default=Path("/tmp/keel-transfer"), help="the sweeps' directory")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = ap.parse_args()
    started = time.monotonic()
    results: dict = {"benchmark": "transfer", "steps": args.steps, "shape": SHAPE, "widths":
                     [int(w) for w in args.widths.split(",")], "parametrizations": {}}
    for name in PARAMETRIZATIONS:
        result = sweep(name, args, args.work)
        (series,) = result["series"]
        results["parametrizations"][name] = {"series": series, "gap": transfer_gap(series),
                                             "points": result["points"]}
    results |= {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "seconds": round(time.monotonic() - started), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(markdown(results))
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    CURVES.write_text(curves_svg(results))


if __name__ == "__main__":
    main()
