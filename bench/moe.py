"""Mixture of experts on the built-in corpus: what the tiny model gains from experts at the same active
parameters, what expert parallelism costs, and how auxiliary-loss-free balancing evens the experts' loads.
Every point is a real `keel train` run (the guards off: they would cost time and change nothing here).

1. Dense against MoE: configs/tiny.toml and configs/tiny_moe.toml (the same attention, 3 of its 4 feed-forwards
   replaced by 8 experts of half the width, 2 per token), 200 steps of 32 × 256 tokens each, validation loss
   every 20 steps. Each run is 1 process with 2 micro-batches of 16: the global batch `make train` makes on 2
   processes. Training FLOPs per token are keel.model.flops's (6 × the active matmul parameters plus the
   attention's), so the MoE's extra cost per token is its routers'. The loss at equal FLOPs: both at the dense
   run's total training FLOPs, the MoE's read off its validation curve by linear interpolation in cumulative
   FLOPs between the two evaluations around that budget.
2. Expert parallelism: tiny_moe on 4 processes with parallel.ep = 1 (dp_shard = 4), 2 and 4, 16 × 256 tokens
   per step, the layouts interleaved repeat by repeat so that the machine's other load falls on each alike.
   tokens/s: the median of a run's logged windows after the first; its ratio to ep = 1 of the same repeat.
   A separate short run per layout profiles a few steps (`CollectiveShare`, configured as a callback): the share
   of a step spent in gloo's all-to-all (the dispatch and combine, forward and backward, and the counts' small
   exchange), beside that of every collective. On 2 cores, 4 processes measure what the code path costs, not
   how expert parallelism scales.
3. Balancing: tiny_moe as in 1 with model.moe.bias_update_rate = 0 (no balancing), 0.001 (DeepSeek-V3's),
   0.003 and 0.01, the rate the config ships being the run of 1; the largest over the MoE layers of max/mean
   expert load (moe/imbalance_max, the loads of the step logged every 10 steps) and the validation loss.

The runs of 1 and 3 go 2 at a time after those of 2. Results: tables, bench/results/moe.json and the imbalance
curves, docs/moe-imbalance.svg.

  python -m bench.moe                       everything (about 25 minutes on 2 idle cores)
  python -m bench.moe --parts ep            part 2 again, parts 1 and 3 kept from bench/results/moe.json
  python -m bench.moe --render              the figures, tables and curves again from the runs in the results
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
from typing import Any

from torch.profiler import ProfilerActivity, profile

from keel.core.callbacks import Build, Callback, Step
from keel.monitor.metrics import covered

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "moe.json"
CURVES = REPO / "docs" / "moe-imbalance.svg"
DENSE, MOE = "configs/tiny.toml", "configs/tiny_moe.toml"
COMMON = ["guard.enabled=false", "health.preflight=off", "monitor.prometheus_port=0", "checkpoint.keep_last=1"]
LOSS_RUN = ["train.micro_batch=16", "eval.interval=20", "monitor.interval=10", "checkpoint.interval=100000"]
EP_RUN = ["train.global_batch=16", "train.micro_batch=4", "eval.interval=0", "eval.final=false",
          "checkpoint.interval=100000"]
EP_NPROC = 4
RATES = [0.0, 0.001, 0.003, 0.01]


# ---------------------------------------------------------------- the profiled step's collectives

class CollectiveShare(Callback):
    """Every `every` steps but the last, one step under the PyTorch profiler (as `monitor.profile_interval`
    profiles one), its gloo collectives told apart: each rank appends the step's all-to-all share and every
    collective's share of the step to RUN_DIR/collectives-rank<R>.jsonl."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.out = Path()
        self.profiler: Any = None
        self.started = 0.0

    def on_build(self, build: Build) -> None:
        self.out = build.run_dir / f"collectives-rank{build.rank}.jsonl"

    def on_step_start(self, step: Step) -> None:
        if step.number % self.every == 0 and not step.last:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.started = time.perf_counter()

    def on_step_end(self, step: Step) -> None:
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        step_s = time.perf_counter() - self.started
        spans = [(e.name, (e.time_range.start, e.time_range.end)) for e in self.profiler.events()
                 if e.name.startswith("gloo:")]
        self.profiler = None
        record = {"step": step.number, "step_s": step_s,
                  "all_to_all_share": covered([s for name, s in spans if name == "gloo:all_to_all"]) / step_s,
                  "comm_share": covered([s for _, s in spans]) / step_s}
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------- runs

def train(config: str, overrides: list[str], run_dir: Path, nproc: int = 1) -> list[dict]:
    """A `keel train` run; its metrics records."""
    cmd = [sys.executable, "-m", "keel", "train", "--config", config, "--nproc", str(nproc), "--run-dir",
           str(run_dir), *COMMON, *overrides]
    # The workers import the profiling callback from this file: the repository is on their path.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise RuntimeError(f"{' '.join(cmd[3:])}: exit {done.returncode}: {lines[-1]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def loss_run(config: str, rate: float | None, args: argparse.Namespace, work: Path) -> dict:
    """A run of part 1 or 3: its validation and imbalance curves."""
    extra = [] if rate is None else [f"model.moe.bias_update_rate={rate}"]
    name = Path(config).stem + ("" if rate is None else f"-rate{rate:g}")
    started = time.perf_counter()
    records = train(config, [*LOSS_RUN, f"train.steps={args.steps}", *extra, *args.overrides], work / name)
    return {"config": config, "rate": rate, "val_loss": curve(records, "val/loss"),
            "imbalance_max": curve(records, "moe/imbalance_max"),
            "imbalance_layers": {k: curve(records, k) for k in sorted({k for r in records for k in r
                                                                        if k.startswith("moe/imbalance/")})},
            "wall_s": time.perf_counter() - started}


def ep_run(ep: int, steps: int, profile_every: int, args: argparse.Namespace, run_dir: Path) -> dict:
    overrides = [*EP_RUN, f"parallel.ep={ep}", f"train.steps={steps}", f"monitor.interval={args.log_interval}",
                 *args.overrides]
    if profile_every:
        overrides.append(f'callbacks=[{{path = "bench.moe:CollectiveShare", args = {{every = {profile_every}}}}}]')
    records = train(MOE, overrides, run_dir, nproc=EP_NPROC)
    windows = [r for r in records if "throughput/tokens_per_s" in r][1:]
    speeds = [r["throughput/tokens_per_s"] for r in windows if not r.get("time/checkpoint_s")]
    profiled = [json.loads(line) for path in sorted(run_dir.glob("collectives-rank*.jsonl"))
                for line in path.read_text().splitlines()]
    return {"tokens_per_s": statistics.median(speeds), "windows": speeds, "profiled": profiled,
            "imbalance_max": curve(records, "moe/imbalance_max")}


def expert_parallel(args: argparse.Namespace, work: Path) -> dict:
    """Part 2: the unprofiled repeats, interleaved, then one profiled run per layout."""
    started, load_before = time.monotonic(), os.getloadavg()
    runs: dict[int, list[dict]] = {ep: [] for ep in args.eps}
    for repeat in range(args.repeats):
        for ep in args.eps:
            runs[ep].append(ep_run(ep, args.ep_steps, 0, args, work / f"ep{ep}-{repeat}"))
            print(f"moe: ep = {ep}, repeat {repeat + 1}: {runs[ep][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    rows = []
    for ep in args.eps:
        profiled = ep_run(ep, 2 * args.profile_every + 1, args.profile_every, args, work / f"ep{ep}-profiled")
        speeds = [r["tokens_per_s"] for r in runs[ep]]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[ep], runs[args.eps[0]], strict=True)]
        rows.append({"ep": ep, "tokens_per_s": statistics.median(speeds), "tokens_per_s_each": speeds,
                     "vs_ep1": statistics.median(ratios), "vs_ep1_each": ratios,
                     "all_to_all_share": statistics.median(p["all_to_all_share"] for p in profiled["profiled"]),
                     "comm_share": statistics.median(p["comm_share"] for p in profiled["profiled"]),
                     "imbalance_max": statistics.median(v for r in runs[ep] for _, v in r["imbalance_max"]),
                     "profiled_steps": profiled["profiled"], "windows": [r["windows"] for r in runs[ep]]})
    from keel.config import load_config

    experts = load_config(REPO / MOE, args.overrides).model.moe.experts
    return {"rows": rows, "experts": experts, "steps": args.ep_steps, "repeats": args.repeats, "overrides": EP_RUN,
            "log_interval": args.log_interval, **machine_load(started, load_before)}


# ---------------------------------------------------------------- analysis

def at(points: list[tuple[float, float]], x: float) -> float:
    """The value of the piecewise-linear curve through `points` (x ascending) at x, within its range."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and x == points[-1][0]:
        return points[-1][1]
    span = f"{points[0][0]:g}–{points[-1][0]:g}" if points else "empty"
    raise ValueError(f"{x:g} is outside the curve's range ({span})")


def dense_vs_moe(dense: dict, moe: dict, tokens_per_step: int, seq_len: int) -> dict:
    """Part 1's figures: each model's sizes, FLOPs per token, and validation loss at the same tokens and at the
    same training FLOPs (the smaller of the two runs' totals)."""
    from keel.config import load_config
    from keel.model.flops import active_param_count, flops_per_token, param_count

    models = {}
    for name, run in (("dense", dense), ("moe", moe)):
        cfg = load_config(REPO / run["config"], []).model
        per_token = flops_per_token(cfg, seq_len)
        models[name] = {"config": run["config"], "parameters": param_count(cfg), "active": active_param_count(cfg),
                        "flops_per_token": per_token, "val_loss": run["val_loss"],
                        "flops_curve": [(s * tokens_per_step * per_token, v) for s, v in run["val_loss"]]}
    budget = min(m["flops_curve"][-1][0] for m in models.values())
    for m in models.values():
        m["tokens"] = m["val_loss"][-1][0] * tokens_per_step
        m["loss_at_tokens"] = m["val_loss"][-1][1]
        m["loss_at_flops"] = at(m["flops_curve"], budget)
        m["tokens_at_flops"] = budget / m["flops_per_token"]
    return {"models": models, "flops_budget": budget, "tokens_per_step": tokens_per_step}


def mean_over(points: list[tuple[int, float]], first: int) -> float:
    return statistics.fmean(v for s, v in points if s >= first)


def balancing(runs: list[dict], steps: int) -> list[dict]:
    """Part 3's row per rate: the imbalance at the first and last logged steps, its mean over the second half,
    and the final validation loss."""
    rows = []
    for r in sorted(runs, key=lambda r: r["rate"]):
        curve_ = r["imbalance_max"]
        rows.append({"rate": r["rate"], "first": curve_[0], "last": curve_[-1],
                     "second_half_mean": mean_over(curve_, steps // 2 + 1), "val_loss": r["val_loss"][-1][1],
                     "layers_last": {k.rsplit("_", 1)[1]: v[-1][1] for k, v in r["imbalance_layers"].items()}})
    return rows


# ---------------------------------------------------------------- tables and figure

def markdown(results: dict) -> str:
    """The three tables as docs/benchmarks.md shows them (bench/tables.py renders them there)."""
    d = results["dense_vs_moe"]
    lines = [f"| model | parameters | active | training FLOPs/token | validation loss at "
             f"{d['models']['dense']['tokens'] / 1e6:.2f}M tokens | at {d['flops_budget'] / 1e12:.1f} TFLOP "
             "(tokens) |", "|---|---:|---:|---:|---:|---:|"]
    for name, m in d["models"].items():
        lines.append(f"| {name} (`{m['config']}`) | {m['parameters'] / 1e6:.2f}M | {m['active'] / 1e6:.2f}M | "
                     f"{m['flops_per_token'] / 1e6:.3f}M | {m['loss_at_tokens']:.4f} | {m['loss_at_flops']:.4f} "
                     f"({m['tokens_at_flops'] / 1e6:.3f}M) |")
    e = results["expert_parallel"]
    lines += ["", f"| ep ({EP_NPROC} processes) | experts per rank | tokens/s, median (each repeat) | vs ep = 1, "
              "median (min–max) | all-to-all share | all collectives' share | max/mean load, median |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in e["rows"]:
        each = ", ".join(f"{x:.0f}" for x in r["tokens_per_s_each"])
        held = f"all {e['experts']}" if r["ep"] == 1 else f"{e['experts'] // r['ep']} of {e['experts']}"
        dp = EP_NPROC // r["ep"]
        held += f", FSDP over {dp}" if dp > 1 else ""
        lines.append(f"| {r['ep']} | {held} | {r['tokens_per_s']:.0f} ({each}) | "
                     f"{r['vs_ep1']:.2f} ({min(r['vs_ep1_each']):.2f}–{max(r['vs_ep1_each']):.2f}) | "
                     f"{r['all_to_all_share']:.0%} | {r['comm_share']:.0%} | {r['imbalance_max']:.2f} |")
    lines += ["", f"| bias_update_rate | max/mean load, step {results['balancing'][0]['first'][0]} | "
              f"step {results['balancing'][0]['last'][0]} | mean of steps {results['steps'] // 2 + 1}–"
              f"{results['steps']} | per MoE layer at the end | validation loss |", "|---|---:|---:|---:|---|---:|"]
    for r in results["balancing"]:
        name = f"{r['rate']:g}" + (" (shipped)" if r["rate"] == results["shipped_rate"] else
                                   " (no balancing)" if r["rate"] == 0 else " (DeepSeek-V3's)" if r["rate"] == 0.001
                                   else "")
        layers = ", ".join(f"{v:.2f}" for v in r["layers_last"].values())
        lines.append(f"| {name} | {r['first'][1]:.2f} | {r['last'][1]:.2f} | **{r['second_half_mean']:.2f}** | "
                     f"{layers} | {r['val_loss']:.4f} |")
    return "\n".join(lines)


def curves_svg(results: dict) -> str:
    """moe/imbalance_max over the steps, one line per bias update rate."""
    sys.path.insert(0, str(REPO / "src"))
    from keel.config import load_config
    from keel.report.html import LAYER_COLORS
    from keel.report.svg import Series, line_chart

    runs = sorted(results["runs"]["moe"], key=lambda r: r["rate"])
    series = [Series(f"bias_update_rate {r['rate']:g}", [s for s, _ in r["imbalance_max"]],
                     [v for _, v in r["imbalance_max"]], LAYER_COLORS[i % len(LAYER_COLORS)], dots=True)
              for i, r in enumerate(runs)]
    names = ", ".join(f"{r['rate']:g} ({color}{', shipped' if r['rate'] == results['shipped_rate'] else ''})"
                      for r, color in zip(runs, ("blue", "orange", "green", "purple"), strict=False))
    moe = load_config(REPO / MOE, results["overrides"]).model.moe
    # From 1, every expert as loaded as the mean, to experts / top_k, every token on the same top_k experts.
    return line_chart(series, width=600, height=240, y_domain=(1.0, moe.experts / moe.top_k),
                      label="tiny_moe: max/mean expert load of the worst MoE layer against the step, "
                      f"bias_update_rate {names}") + "\n"


def render(results: dict) -> None:
    print(markdown(results))
    CURVES.write_text(curves_svg(results))


# ---------------------------------------------------------------- main

def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="steps of each run of parts 1 and 3")
    ap.add_argument("--rates", type=float, nargs="+", default=RATES, help="bias update rates of part 3")
    ap.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4], help="expert-parallel degrees (first: base)")
    ap.add_argument("--ep-steps", type=int, default=30, help="steps of each unprofiled run of part 2")
    ap.add_argument("--repeats", type=int, default=3, help="unprofiled runs per layout")
    ap.add_argument("--log-interval", type=int, default=5, help="steps per logged window in part 2")
    ap.add_argument("--profile-every", type=int, default=4, help="part 2's profiled runs: a step in this many")
    ap.add_argument("--parallel", type=int, default=2, help="runs of parts 1 and 3 at once")
    ap.add_argument("--parts", nargs="+", choices=("ep", "loss"), default=["ep", "loss"],
                    help="measure these (ep: part 2; loss: parts 1 and 3), keep the others' from the results file")
    ap.add_argument("--render", action="store_true", help=f"only sum up the runs of {RESULTS.relative_to(REPO)} "
                    "again (part 1 with the rate configs/tiny_moe.toml now ships), its tables and figure")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for every run (e.g. data.dir=...)")
    return ap.parse_args(argv)


def machine_load(started: float, load_before: tuple[float, ...]) -> dict:
    """How busy the machine was (load averages over 1, 5 and 15 minutes) and how long the part took."""
    return {"load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.monotonic() - started), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def measure(args: argparse.Namespace, work: Path) -> dict:
    """The parts asked for; those not asked for are kept from the results file."""
    old = json.loads(RESULTS.read_text()) if set(args.parts) != {"ep", "loss"} else {}
    parallel = expert_parallel(args, work) if "ep" in args.parts else old["expert_parallel"]
    if "loss" not in args.parts:
        return summarize({**old, "expert_parallel": parallel})
    started, load_before = time.monotonic(), os.getloadavg()
    jobs = [(DENSE, None), *[(MOE, rate) for rate in args.rates]]
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda job: loss_run(*job, args, work), jobs))
    return summarize({"benchmark": "moe", "steps": args.steps, "overrides": args.overrides, "loss_run": LOSS_RUN,
                      "expert_parallel": parallel, "runs": {"dense": runs[0], "moe": runs[1:]},
                      "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                      **machine_load(started, load_before)})


def summarize(results: dict) -> dict:
    """Parts 1 and 3's figures from their runs, part 1 with the run at the rate configs/tiny_moe.toml ships."""
    from keel.config import load_config

    cfg = load_config(REPO / MOE, results["overrides"])
    moe = results["runs"]["moe"]
    shipped = next(r for r in moe if r["rate"] == cfg.model.moe.bias_update_rate)
    return {**results, "shipped_rate": shipped["rate"],
            "dense_vs_moe": dense_vs_moe(results["runs"]["dense"], shipped,
                                         cfg.train.global_batch * cfg.train.seq_len, cfg.train.seq_len),
            "balancing": balancing(moe, results["steps"])}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.render:
        results = summarize(json.loads(RESULTS.read_text()))
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        render(results)
        return
    from keel.cli.data import ensure_corpus
    from keel.config import load_config

    shipped = load_config(REPO / MOE, args.overrides).model.moe.bias_update_rate
    if shipped not in args.rates:
        raise SystemExit(f"--rates must include {MOE}'s bias_update_rate {shipped:g}: part 1 compares that run")
    ensure_corpus(load_config(REPO / DENSE, args.overrides), verbose=True)
    with tempfile.TemporaryDirectory(prefix="keel-moe-") as tmp:
        results = measure(args, Path(tmp))
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    render(results)


if __name__ == "__main__":
    main()
