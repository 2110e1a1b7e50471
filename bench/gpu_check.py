"""Everything one CUDA device can tell about keel, in one command of a few minutes.

configs/gpu_1b.toml (1.24B parameters, Llama 3.2 1B shapes, bf16) is trained twice by `keel train --nproc 1`
(called in this process: with one process keel trains in the launcher's own process, so this is the
command users run), `parallel.compile` off and then on, for a few steps on the built-in corpus; then, compile
off, the same shapes as a mixture of experts with as many active parameters (MOE below: 1.24B active of 2.37B;
one save, at the end, so that its 28 GB checkpoint is on disk once). Of each run:
  tokens/s          median of the logged windows after the first (compile and allocator warm-up) and
                    without a checkpoint in them
  MFU               those tokens/s × keel's FLOPs per token (of the active parameters) / the catalog's dense
                    bf16 peak of the detected device (keel.core.accelerators), beside keel's throughput/mfu
  peak memory       torch.cuda.max_memory_allocated over the run, against the planner's prediction for
                    the same model, batch and layout (keel.plan.memory.memory); the reserved peak, and
                    the allocator's fragmentation (reserved / allocated - 1) against the planner's 5%
  checkpoint        training blocked by the first save (its pinned buffers reserved at start-up) and a later one
                    (buffers reused; the MoE run makes none), from the run's checkpoint events
  NVML telemetry    the gpu source's readings (utilization, memory, power, temperature, SM clock, ECC, XID)
One table, printed as each run ends, and bench/results/gpu_check.json, rewritten after each run. The exit
code is non-zero, naming the missing figures, when any is missing: 2 without a CUDA device.

  python bench/gpu_check.py                  on a machine with one CUDA device (about 3 minutes on an H200)
  python bench/gpu_check.py --cpu-dry-run    the same code path on the CPU at a tiny size, 3 steps per run:
                                             proves the script; the CUDA figures are reported missing (exit 2)
  --no-moe                                   leaves the MoE run out (reported as not run)
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from keel.cli import main as keel
from keel.config import Config, load_config
from keel.core.accelerators import Accelerator, by_key, lookup
from keel.errors import KeelError
from keel.model.flops import active_param_count, flops_per_token, param_count
from keel.plan.layout import Layout, Workload
from keel.plan.memory import MemoryBreakdown, memory
from keel.train.setup import precision_dtype

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu_check.json"
GPU_CONFIG = REPO / "configs" / "gpu_1b.toml"
# Both modes: no exporter port to share with whatever else runs on the machine; telemetry often enough for
# a few readings within a short run.
COMMON = ["monitor.prometheus_port=0", "eval.interval=0"]
# The dry run: the tiny config at the size of the test suite's runs, checkpoints after steps 2 and 3.
DRY_RUN = ["train.device=cpu", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.max_seq_len=64", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4",
           "train.steps=3", "monitor.interval=1", "checkpoint.interval=2", "eval.sequences=8",
           "health.preflight_probe_mib=4", "monitor.telemetry_interval_s=1"]
# The MoE run: gpu_1b's shapes in DeepSeek-V3's layout, as configs/tiny_moe.toml at its scale: the first block
# dense, each other one 2 shared and 8 routed experts of a quarter of the dense SwiGLU's width (8192), 2 routed
# per token, so that a token goes through as many feed-forward parameters as in gpu_1b (2.37B parameters,
# 1.24B active); sigmoid scores and auxiliary-loss-free balancing. Its AdamW state is 28 GB: the planner puts
# it at 59 GiB at micro-batches of 4, within an 80 GB H100. No save but the last: the checkpoint is 28 GB.
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.shared_experts=2", "model.moe.expert_dim=2048",
       "model.moe.dense_layers=1", "model.moe.score=sigmoid", "model.moe.bias_update_rate=0.001",
       "checkpoint.interval=1000"]
DRY_RUN_MOE = ["model.moe.expert_dim=48"]  # a quarter of the dry run's dense width (192)
TORCHTITAN = ("torchtitan, docs/performance.md: Llama 3.1 8B, FSDP on 8 or 128 H100s, bf16, selective "
              "activation checkpointing: 33% to 39% MFU")
GIB = 2**30
# NVML readings shown: (label, reduction over the run's samples, format, missing when absent). Clock event
# reasons, ECC and XID counts are not read on every GPU: shown when read, never missing.
NVML = {"gpu_utilization_ratio": ("GPU utilization, max", max, lambda v: f"{v:.0%}", True),
        "gpu_memory_used_bytes": ("GPU memory used (NVML), max", max, lambda v: f"{v / GIB:.1f} GiB", True),
        "gpu_power_watts": ("GPU power, max", max, lambda v: f"{v:.0f} W", True),
        "gpu_temperature_celsius": ("GPU temperature, max", max, lambda v: f"{v:.0f} °C", True),
        "gpu_sm_clock_hertz": ("SM clock, median", statistics.median, lambda v: f"{v / 1e6:.0f} MHz", True),
        "gpu_throttle_reasons": ("clock event reasons, last", lambda vs: vs[-1], lambda v: f"{int(v):#x}", False),
        "gpu_ecc_errors_total": ("ECC errors, last", lambda vs: vs[-1], lambda v: f"{v:.0f}", False),
        "gpu_xid_errors_total": ("XID errors, last", lambda vs: vs[-1], lambda v: f"{v:.0f}", False)}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steady(metrics: list[dict], key: str) -> float | None:
    """Median of `key` over the training windows after the first, leaving out those a save blocked."""
    windows = [r for r in metrics if "train/loss" in r][1:]
    values = [r[key] for r in windows if not r.get("time/checkpoint_s") and r.get(key) is not None]
    return statistics.median(values) if values else None


def nvml_readings(samples: list[dict]) -> dict[str, float]:
    """Each NVML reading reduced over the samples (one device: its labels other than the kind dropped)."""
    series: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample["readings"].items():
            name = key.split("{")[0]
            kind = key.split("type=")[1].rstrip("}") if "type=" in key else ""
            if name in NVML:
                series.setdefault(f"{name}:{kind}" if kind else name, []).append(value)
    return {key: NVML[key.split(":")[0]][1](values) for key, values in series.items()}


def device_entry(cuda: bool) -> tuple[str, Accelerator | None]:
    if not cuda:
        return "CPU", None
    name = torch.cuda.get_device_name()
    return name, lookup(name)


def train(cfg_path: Path, run_dir: Path, overrides: list[str], cuda: bool) -> dict:
    """One `keel train --nproc 1` and what its run directory and the CUDA allocator say about it."""
    left_over = 0
    if cuda:
        gc.collect()  # a previous run's model and optimizer, should a reference cycle still hold them
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        left_over = torch.cuda.memory_allocated()  # what is still held counts in this run's peak
        if left_over:
            print(f"gpu_check: warning: {left_over / GIB:.2f} GiB still allocated before this run count in its "
                  f"peak memory", flush=True)
    started = time.perf_counter()
    code = keel(["train", "--config", str(cfg_path), "--nproc", "1", "--run-dir", str(run_dir), *overrides])
    wall = time.perf_counter() - started
    metrics, events = records(run_dir / "metrics.jsonl"), records(run_dir / "events.jsonl")
    saves = [e["detail"] for e in events if e["kind"] == "checkpoint" and e["action"] == "committed"]
    gpu_off = [e["detail"]["reason"] for e in events
               if e["kind"] == "telemetry" and e["action"] == "unavailable" and e["detail"]["source"] == "gpu"]
    return {"exit_code": code, "wall_s": wall, "tokens_per_s": steady(metrics, "throughput/tokens_per_s"),
            "keel_mfu": steady(metrics, "throughput/mfu"),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "allocated_before_bytes": left_over,
            "checkpoint_blocking_s": [s["blocking_s"] for s in saves],
            "checkpoint_bytes": saves[0]["bytes"] if saves else None,
            "nvml": nvml_readings(records(run_dir / "telemetry.jsonl")),
            "nvml_unavailable": gpu_off[0] if gpu_off else None}


def figures(run: dict, flops: float, peak: float | None, predicted: float, why_not_cuda: str, saves: int = 2) -> dict:
    """The figures of one run: value, or None with the reason in `missing`. A run of one save (`saves`) has no
    later save's figure."""
    out: dict = {"missing": {}}

    def put(name: str, value: float | None, reason: str) -> None:
        out[name] = value
        if value is None:
            out["missing"][name] = reason

    failed = f"keel train exited {run['exit_code']}" if run["exit_code"] else ""
    tps = run["tokens_per_s"]
    put("tokens_per_s", tps, failed or "no logged window after the first without a checkpoint")
    put("mfu", tps * flops / peak if tps and peak else None,
        why_not_cuda or failed or "no catalog peak for this device")
    put("keel_mfu", run["keel_mfu"], failed or "keel's metric reports MFU as unknown")
    measured = run["peak_allocated_bytes"] if run["exit_code"] == 0 else None
    put("peak_allocated_bytes", measured, why_not_cuda or failed)
    out["predicted_bytes"] = predicted
    put("measured_over_predicted", measured / predicted if measured else None, why_not_cuda or failed)
    # What the caching allocator held beyond its allocated peak: the planner's fragmentation factor, measured.
    reserved = run["peak_reserved_bytes"] if measured else None
    put("peak_reserved_bytes", reserved, why_not_cuda or failed)
    put("fragmentation", reserved / measured - 1 if reserved else None, why_not_cuda or failed)
    blocking = run["checkpoint_blocking_s"]
    put("checkpoint_first_blocking_s", blocking[0] if blocking else None, failed or "no checkpoint committed")
    if saves > 1:
        put("checkpoint_later_blocking_s", blocking[-1] if len(blocking) > 1 else None,
            failed or "fewer than two checkpoints committed")
    nvml = run["nvml"]
    for name, (*_, required) in NVML.items():
        if required:
            put(f"nvml/{name}", nvml.get(name), run["nvml_unavailable"] or why_not_cuda or "no NVML sample")
    return out


def fmt(value: float | None, kind: str, measured: bool = True) -> str:
    if not measured:
        return "-"  # not a figure of this run (the MoE run's later save)
    if value is None:
        return "MISSING"
    if kind == "gib" and value < GIB:
        return f"{value / 2**20:.1f} MiB"
    return {"gib": f"{value / GIB:.2f} GiB", "pct": f"{value:.1%}", "s": f"{value:.3f} s", "x": f"{value:.2f}",
            "tps": f"{value:,.0f}"}[kind]


ROWS = [("tokens/s (steady)", "tokens_per_s", "tps"), ("MFU, catalog bf16 peak", "mfu", "pct"),
        ("MFU, keel's metric", "keel_mfu", "pct"), ("peak memory allocated", "peak_allocated_bytes", "gib"),
        ("planner's prediction", "predicted_bytes", "gib"), ("measured / predicted", "measured_over_predicted", "x"),
        ("peak memory reserved", "peak_reserved_bytes", "gib"),
        ("fragmentation (reserved/allocated-1)", "fragmentation", "pct"),
        ("checkpoint blocking, first save", "checkpoint_first_blocking_s", "s"),
        ("checkpoint blocking, later save", "checkpoint_later_blocking_s", "s")]


def table(results: dict) -> str:
    runs = results["runs"]
    names = list(runs)
    if not names:
        return "(no run finished)"
    lines = [f"{'figure':<36}" + "".join(f"{n:>18}" for n in names)]
    for label, key, kind in ROWS:
        lines.append(f"{label:<36}" + "".join(f"{fmt(runs[n]['figures'].get(key), kind, key in runs[n]['figures']):>18}"
                                              for n in names))
    for name, (label, _, show, _) in NVML.items():
        keys = sorted({k for n in names for k in runs[n]["run"]["nvml"] if k.split(":")[0] == name})
        for key in keys or ([name] if f"nvml/{name}" in runs[names[0]]["figures"] else []):
            suffix = f" ({key.split(':')[1]})" if ":" in key else ""
            cells = [runs[n]["run"]["nvml"].get(key) for n in names]
            lines.append(f"{label + suffix:<36}" + "".join(f"{'MISSING' if v is None else show(v):>18}"
                                                            for v in cells))
    return "\n".join(lines)


def context(cfg: Config, device: str, hw: Accelerator | None, cuda: bool) -> list[str]:
    peak = hw.peak_flops.get("bf16") if hw else None
    bf16 = precision_dtype(cfg, torch.device("cuda" if cuda else "cpu")) == torch.bfloat16
    precision = "bf16 autocast over fp32 weights" if bf16 else "fp32"
    return [f"device: {device}" + (f" = {hw.name}, dense bf16 peak {peak / 1e12:.1f} TFLOP/s ({hw.source})"
                                   if hw and peak else ("" if not cuda else ", not in the accelerator catalog")),
            f"model: {param_count(cfg.model) / 1e9:.3f}B parameters, {cfg.train.global_batch} × {cfg.train.seq_len} "
            f"tokens per step in micro-batches of {cfg.train.micro_batch}, {precision} "
            f"(train.precision = {cfg.train.precision}), one process (keel wraps nothing in FSDP at one rank)",
            f"context: {TORCHTITAN}"]


def moe_context(cfg: Config, plan: MemoryBreakdown) -> str:
    moe = cfg.model.moe
    return (f"moe: {param_count(cfg.model) / 1e9:.3f}B parameters, {active_param_count(cfg.model) / 1e9:.3f}B "
            f"active: blocks {moe.dense_layers}-{cfg.model.n_layers - 1} of {moe.shared_experts} shared and "
            f"{moe.experts} routed experts of width {moe.expert_dim}, {moe.top_k} routed per token, "
            f"{moe.score} scores, bias_update_rate {moe.bias_update_rate:g}; one save, at the end; planner: "
            f"{plan.explain()}")


def missing(results: dict) -> list[str]:
    out = [f"{name}: {figure} ({reason})" for name, run in results["runs"].items()
           for figure, reason in run["figures"]["missing"].items()]
    return out + [f"{name}: not run ({reason})" for name, reason in results["not_run"].items()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="the tiny config on the CPU, 3 steps per run")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (default: the config's)")
    ap.add_argument("--data-dir", type=Path, default=REPO / "data" / "stdlib",
                    help="prepared corpus (prepared from the built-in sources when missing)")
    ap.add_argument("--compile", choices=("both", "off", "on"), default="both",
                    help="which runs (a run left out is reported missing; on a CPU, compiling takes minutes)")
    ap.add_argument("--no-moe", action="store_true", help="leave the MoE run out (reported as not run)")
    ap.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS.relative_to(REPO)}; "
                    "the dry run: gpu_check_dry_run.json beside it)")
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    return ap.parse_args(argv)


class RunSpec(NamedTuple):
    """One run of the check: its overrides beyond the common ones, and the saves it makes (2: a first and a later
    one; 1: the last step's alone)."""

    name: str
    compile: bool
    overrides: list[str]
    saves: int


def run_specs(args: argparse.Namespace) -> tuple[list[RunSpec], dict[str, str]]:
    """The runs asked for, and those left out with the reason."""
    moe = [*MOE, *(DRY_RUN_MOE if args.cpu_dry_run else [])]
    specs, left_out = [], {}
    for spec in (RunSpec("compile off", False, [], 2), RunSpec("compile on", True, [], 2),
                 RunSpec("moe, compile off", False, moe, 1)):
        if args.compile not in ("both", "on" if spec.compile else "off"):
            left_out[spec.name] = f"--compile {args.compile}"
        elif spec.overrides and args.no_moe:
            left_out[spec.name] = "--no-moe"
        else:
            specs.append(spec)
    return specs, left_out


def run_all(args: argparse.Namespace, cfg_path: Path, specs: list[RunSpec], overrides: list[str], figures_of,
            results: dict, out: Path, cuda: bool) -> None:
    """The runs, one after the other; the results file is rewritten after each."""
    work = Path(tempfile.mkdtemp(prefix="keel-gpu-check-", dir=args.work))
    try:
        for spec in specs:
            name, flag = spec.name, f"parallel.compile={str(spec.compile).lower()}"
            print(f"gpu_check: {name}: keel train --nproc 1 --config {cfg_path.relative_to(REPO)} "
                  f"{' '.join([*spec.overrides, flag])} ...", flush=True)
            run_dir = work / name.replace(", ", "-").replace(" ", "-")
            try:
                run = train(cfg_path, run_dir, [*overrides, *spec.overrides, flag], cuda)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: the other runs still tell their figures
                results["not_run"][name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                print(f"gpu_check: {name} failed: {results['not_run'][name]}", flush=True)
                continue
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)  # each run's checkpoints: 12 bytes per parameter
            results["runs"][name] = {"run": run, "figures": figures_of(spec, run)}
            write(out, results)
            print(f"gpu_check: {name} done in {run['wall_s']:.0f} s (exit {run['exit_code']})\n{table(results)}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        results["missing"] = missing(results)
        write(out, results)


def planned(cfg: Config, cuda: bool, hw: Accelerator | None) -> MemoryBreakdown:
    """The planner's figure for this model, batch, loss and layout on this device (a CPU adds its host copies)."""
    bf16 = precision_dtype(cfg, torch.device("cuda" if cuda else "cpu")) == torch.bfloat16
    return memory(Workload.of(cfg, param_dtype="bf16" if bf16 else "fp32"),
                  Layout(micro_batch=cfg.train.micro_batch, ac=cfg.parallel.activation_checkpoint),
                  hw or by_key("h100" if cuda else "cpu"))


def sizes(cfg: Config, plan: MemoryBreakdown) -> dict:
    """What a run's figures are measured against: its parameters, FLOPs per token and the planner's memory."""
    return {"parameters": param_count(cfg.model), "active_parameters": active_param_count(cfg.model),
            "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len), "predicted_bytes": plan.total}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    no_cuda = "" if cuda else ("--cpu-dry-run trains on the CPU" if torch.cuda.is_available() else
                               "no CUDA device on this machine")
    if not cuda and not args.cpu_dry_run:
        print(f"gpu_check: {no_cuda} (torch {torch.__version__}): every figure is missing; --cpu-dry-run checks "
              f"the rest on the CPU", flush=True)
        return 2
    out = args.out or (RESULTS.with_name("gpu_check_dry_run.json") if args.cpu_dry_run else RESULTS)
    cfg_path = REPO / "configs" / "tiny.toml" if args.cpu_dry_run else GPU_CONFIG
    overrides = [*COMMON, f"data.dir={args.data_dir}", *(DRY_RUN if args.cpu_dry_run else []),
                 *([f"train.steps={args.steps}"] if args.steps else [])]
    specs, left_out = run_specs(args)
    try:
        cfg = load_config(cfg_path, overrides)
        configs = {spec.name: load_config(cfg_path, [*overrides, *spec.overrides]) for spec in specs}
    except KeelError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if not args.data_dir.exists():  # the built-in corpus (the config's sources), as `make train` has it
        print(f"gpu_check: preparing the built-in corpus into {args.data_dir} ...", flush=True)
        if code := keel(["data", "prepare", "--config", str(cfg_path), "--out", str(args.data_dir)]):
            return code
    device, hw = device_entry(cuda)
    peak = hw.peak_flops.get("bf16") if hw else None
    plans = {name: planned(c, cuda, hw) for name, c in configs.items()}
    head = [*context(cfg, device, hw, cuda), f"planner: {planned(cfg, cuda, hw).explain()}",
            *[moe_context(configs[s.name], plans[s.name]) for s in specs if s.overrides]]
    print("\n".join(f"gpu_check: {line}" for line in head), flush=True)
    results: dict = {"benchmark": "gpu_check", "mode": "gpu" if cuda else "cpu-dry-run", "device": device,
                     "peak_flops": peak, "parameters": param_count(cfg.model),
                     "config": str(cfg_path.relative_to(REPO)), "overrides": overrides, "context": head,
                     "sizes": {name: sizes(c, plans[name]) for name, c in configs.items()},
                     "runs": {}, "not_run": left_out, "torch": torch.__version__, "machine": platform.platform(),
                     "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def figures_of(spec: RunSpec, run: dict) -> dict:
        size = results["sizes"][spec.name]
        return figures(run, size["flops_per_token"], peak, size["predicted_bytes"], no_cuda, spec.saves)

    run_all(args, cfg_path, specs, overrides, figures_of, results, out, cuda)
    print(f"gpu_check: wrote {out}")
    if results["missing"]:
        print("gpu_check: missing figures: " + "; ".join(results["missing"]), flush=True)
    if not cuda:
        print(f"gpu_check: {no_cuda}: the CUDA figures are missing", flush=True)
        return 2
    return 1 if results["missing"] else 0


def write(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
