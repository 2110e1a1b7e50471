"""Everything one CUDA device can tell about keel, and how it stands beside a bare loop and torchtitan, in one
command of about 9 minutes on an H200.

Two models, both Llama 3.2's shapes in bf16: configs/gpu_1b.toml (1.24B parameters) and configs/gpu_3b.toml
(3.21B), 16 × 2048 tokens per step in micro-batches of 4, on the built-in corpus. Each is trained by, one
after the other on the same device (the table of variants: bench/gpu_variants.py):
  keel              `keel train --nproc 1`, called in this process (with one process keel trains in the
                    launcher's own), compiled, in bf16 and with `train.precision = "fp8"` (the blocks' linear
                    layers in float8, rowwise); at 1B also eager and as a mixture of experts of about as many
                    active parameters (`moe`: 8 experts of half the dense width, 2 chosen, after one dense
                    block; MFU on the active FLOPs)
  bare              bench/bare_loop_cuda.py: keel's model in a hand-written compiled loop, nothing else
  torchtitan        torchtitan 0.3.0's trainer on its Llama 3 flavour of the same shapes ("1B", "3B"), in a
                    subprocess (bench/titan_train.py, bench/titan_run.py): same sequence, batch, micro-batches,
                    bf16 compute over fp32 weights, per-block compile; no activation checkpointing, no checkpoint
Before the runs, `keel plan --calibrate-sweep` on the device (bench/results key plan_sweep): the planner's kernel
figures measured here (GEMMs in bf16 and float8, the 1B model's attention forward and backward, the memory
bandwidth) beside the published ones it otherwise takes for the generation (keel.plan.kernels.KERNELS), and
each GEMM's time beside the step model's; about half a minute.
Of each run:
  tokens/s          median of the logged windows after the first (compile, CUDA graph capture, allocator warm-up)
                    and, for keel, without a checkpoint in them
  MFU               those tokens/s × keel's FLOPs per token (keel.model.flops; torchtitan's count for these
                    flavours is the same) / the catalog's dense bf16 peak of the detected device
                    (keel.core.accelerators): one FLOP count for every runner, fp8 included
  peak memory       reserved by the caching allocator, for every runner (torchtitan logs only that: the largest
                    of its windows); allocated, for keel and the bare loop; keel's against the planner's prediction
                    (keel.plan.memory.memory), and the allocator's fragmentation (reserved / allocated - 1)
  checkpoint        (keel at 1B) training blocked by the first save (pinned buffers reserved at start-up) and a
                    later one (buffers reused), from the run's checkpoint events
  NVML telemetry    (keel) the gpu source's readings (utilization, memory, power, temperature, SM clock, ECC, XID)
and per model the ratios of tokens/s: keel / torchtitan, keel / bare, keel fp8 / keel bf16. One table, printed
as each run ends, and bench/results/gpu_check.json, rewritten after each run. The exit code is non-zero,
naming the missing figures, when any is missing (a run left out, torchtitan that could not run): 2 without a
CUDA device.

Time on one H200, estimated (nothing of this set has run on a GPU yet): from the measured 1.24B runs (48.5% MFU
compiled, 58,410 tokens/s, about a minute a run of 30 steps with two saves), 20 steps a run at 45% MFU (1.24B:
0.6 s a step; 3.21B, 2.6 times the FLOPs per token: 1.6 s) plus 30-60 s each of start-up, compile and keel's
last save: about 9 minutes for the eight comparison runs (1B and 3B: keel, bare, torchtitan, keel fp8), about
11 with the 1B eager and MoE runs. --budget-s (default 540) leaves out a run that its estimate (gpu_variants)
says would end past the budget, reported as not run; --budget-s 0 runs all. keel's checkpoints go to /dev/shm
when it has room (the 3B's is 41 GB), the work directory otherwise.

  python bench/gpu_check.py                  on a machine with one CUDA device
  python bench/gpu_check.py --only 1b        the 1B variants only (or names: --only "1b keel,1b torchtitan")
  python bench/gpu_check.py --cpu-dry-run    the same code on the CPU at a tiny size, 3 steps per run, every
                                             shape the tiny model: proves the script; torchtitan is reported not
                                             run (it trains on CUDA only) after its spec is written from the real
                                             configs and its log parser is checked on a line of torchtitan's
                                             format; the CUDA figures are reported missing (exit 2)

torchtitan on a machine that cannot reach a package index (its wheels travel with the repository). Here, in the
repository's root, with a pip that can reach one:
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 tyro==1.0.17 \
      docstring-parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
(2.6 MB; .whl/ is git-ignored; torchtitan's other requirements, torch >= 2.11, tokenizers, safetensors,
tensorboard, einops, pillow, triton, pyarrow, pandas, huggingface-hub, are in a CUDA image with PyTorch; wandb
is imported only when enabled). There, before the check:
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
Without torchtitan the check says so in its results and runs the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from keel.cli import main as keel
from keel.config import Config, load_config
from keel.core.accelerators import Accelerator, by_key, lookup
from keel.errors import KeelError
from keel.model.flops import ffn_hidden_dim, flops_per_token, param_count
from keel.plan.kernels import kernels_for
from keel.plan.layout import Layout, Workload
from keel.plan.memory import memory
from keel.train.setup import precision_dtype

try:
    from bench import bare_loop_cuda, gpu_variants, titan_run
except ImportError:  # run as a script: bench/ is the first entry of sys.path
    import bare_loop_cuda  # type: ignore[no-redef]
    import gpu_variants  # type: ignore[no-redef]
    import titan_run  # type: ignore[no-redef]

Variant = gpu_variants.Variant
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu_check.json"
CONFIGS = REPO / "configs"
# Every run: no exporter port to share with whatever else runs on the machine; telemetry often enough for
# a few readings within a short run.
COMMON = ["monitor.prometheus_port=0", "eval.interval=0"]
# The dry run: the tiny config at the size of the test suite's runs, checkpoints after steps 2 and 3.
DRY_RUN = ["train.device=cpu", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.max_seq_len=64", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4",
           "train.steps=3", "monitor.interval=1", "checkpoint.interval=2", "eval.sequences=8",
           "health.preflight_probe_mib=4", "monitor.telemetry_interval_s=1"]
TORCHTITAN = ("torchtitan, docs/performance.md: Llama 3.1 8B, FSDP on 8 or 128 H100s, bf16, selective "
              "activation checkpointing: 33% to 39% MFU")
GIB = 2**30
BUDGET_S = 540.0
CHECKPOINT_BYTES_PER_PARAM = 13  # fp32 weights and AdamW's two moments, and the metadata (the 1.24B's: 12.9)
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


def figures(run: dict, flops: float, peak: float | None, predicted: float, why_not_cuda: str,
            checkpoints: bool = True) -> dict:
    """The figures of one keel run: value, or None with the reason in `missing`. `checkpoints`: the run saves
    before its last step, so that its blocking is measured."""
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
    if checkpoints:
        put("checkpoint_first_blocking_s", blocking[0] if blocking else None, failed or "no checkpoint committed")
        put("checkpoint_later_blocking_s", blocking[-1] if len(blocking) > 1 else None,
            failed or "fewer than two checkpoints committed")
    nvml = run["nvml"]
    for name, (*_, required) in NVML.items():
        if required:
            put(f"nvml/{name}", nvml.get(name), run["nvml_unavailable"] or why_not_cuda or "no NVML sample")
    return out


def fmt(value: float | None, kind: str, absent: bool = False) -> str:
    if absent:  # a figure this runner does not measure
        return "-"
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
    width = max(18, *(len(n) + 2 for n in names))
    lines = [f"{'figure':<36}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, kind in ROWS:
        cells = [fmt(runs[n]["figures"].get(key), kind, key not in runs[n]["figures"]) for n in names]
        lines.append(f"{label:<36}" + "".join(f"{c:>{width}}" for c in cells))
    for name, (label, _, show, _) in NVML.items():
        nvml = [runs[n]["run"].get("nvml") for n in names]
        keys = sorted({k for readings in nvml if readings for k in readings if k.split(":")[0] == name})
        for key in keys or ([name] if any(f"nvml/{name}" in runs[n]["figures"] for n in names) else []):
            suffix = f" ({key.split(':')[1]})" if ":" in key else ""
            cells = ["-" if readings is None else "MISSING" if readings.get(key) is None else show(readings[key])
                     for readings in nvml]
            lines.append(f"{label + suffix:<36}" + "".join(f"{c:>{width}}" for c in cells))
    ratios = [f"{key} {fmt(value, 'x')}" for key, value in results.get("ratios", {}).items()]
    return "\n".join(lines + (["ratios of tokens/s: " + ", ".join(ratios)] if ratios else []))


def context(cfgs: dict[str, Config], device: str, hw: Accelerator | None, cuda: bool) -> list[str]:
    """The device, and of each model its size, batch, precision and the planner's memory figure."""
    peak = hw.peak_flops.get("bf16") if hw else None
    lines = [f"device: {device}" + (f" = {hw.name}, dense bf16 peak {peak / 1e12:.1f} TFLOP/s ({hw.source})"
                                    if hw and peak else ("" if not cuda else ", not in the accelerator catalog"))]
    for shape, cfg in cfgs.items():
        bf16 = precision_dtype(cfg, torch.device("cuda" if cuda else "cpu")) == torch.bfloat16
        precision = "bf16 autocast over fp32 weights" if bf16 else "fp32"
        layout = Layout(micro_batch=cfg.train.micro_batch, ac=cfg.parallel.activation_checkpoint)
        plan = memory(Workload.of(cfg, param_dtype="bf16" if bf16 else "fp32"), layout,
                      hw or by_key("h100" if cuda else "cpu"))
        lines += [f"model {shape}: {param_count(cfg.model) / 1e9:.3f}B parameters, {cfg.train.global_batch} × "
                  f"{cfg.train.seq_len} tokens per step in micro-batches of {cfg.train.micro_batch}, {precision} "
                  f"(train.precision = {cfg.train.precision}), one process (keel wraps nothing in FSDP at one "
                  f"rank)", f"planner {shape}: {plan.explain()}"]
    return [*lines, f"context: {TORCHTITAN}"]


def missing(results: dict) -> list[str]:
    out = [f"{name}: {figure} ({reason})" for name, run in results["runs"].items()
           for figure, reason in run["figures"]["missing"].items()]
    out += [f"{name}: not run ({reason})" for name, reason in results["not_run"].items()]
    return out + [f"{key}: ({reason})" for key, reason in results.get("ratios_missing", {}).items()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="the tiny config on the CPU, 3 steps per run")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (default: each variant's)")
    ap.add_argument("--data-dir", type=Path, default=REPO / "data" / "stdlib",
                    help="prepared corpus (prepared from the built-in sources when missing)")
    ap.add_argument("--compile", choices=("both", "off", "on"), default="both",
                    help="off: leave out the compiled-only runs and run the others eager; on: leave out the eager "
                         "one (a run left out is reported missing; on a CPU, compiling takes minutes)")
    ap.add_argument("--only", default="", help="comma-separated variant names or shapes (1b, 3b); default all")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="leave out a run estimated to end past this many seconds (0: none; not on a CPU)")
    ap.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS.relative_to(REPO)}; "
                    "the dry run: gpu_check_dry_run.json beside it)")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the runs go (default: /dev/shm when it has room for the checkpoints, else a "
                         "temporary directory)")
    return ap.parse_args(argv)


class Session:
    """What every run of one invocation shares: the options, the device and its peak, the results so far."""

    def __init__(self, args: argparse.Namespace, cuda: bool, no_cuda: str, results: dict, work: Path) -> None:
        self.args, self.cuda, self.no_cuda, self.results, self.work = args, cuda, no_cuda, results, work
        self.device = torch.device("cuda" if cuda else "cpu")
        _, self.hw = device_entry(cuda)
        self.peak = self.hw.peak_flops.get("bf16") if self.hw else None
        self.started = time.perf_counter()

    def overrides(self, variant: Variant, compiled: bool) -> list[str]:
        base = load_config(self.config_path(variant), DRY_RUN if self.args.cpu_dry_run else [])
        half = ffn_hidden_dim(base.model) // 2  # each expert's width, of the model trained
        return [*COMMON, f"data.dir={self.args.data_dir}", *(o.format(half=half) for o in variant.overrides),
                *(DRY_RUN if self.args.cpu_dry_run else []),
                *([f"train.steps={self.args.steps}"] if self.args.steps else []),
                f"parallel.compile={str(compiled).lower()}"]

    def config_path(self, variant: Variant) -> Path:
        return CONFIGS / ("tiny.toml" if self.args.cpu_dry_run else gpu_variants.SHAPES[variant.shape])

    def real_config(self, variant: Variant, compiled: bool) -> Config:
        """The variant's config at its real size (the dry run's too): what torchtitan's spec is written from."""
        real = [o for o in self.overrides(variant, compiled) if o not in DRY_RUN]
        return load_config(CONFIGS / gpu_variants.SHAPES[variant.shape], real)

    def plan_bytes(self, cfg: Config) -> float:
        bf16 = precision_dtype(cfg, self.device) == torch.bfloat16
        layout = Layout(micro_batch=cfg.train.micro_batch, ac=cfg.parallel.activation_checkpoint)
        hw = self.hw or by_key("h100" if self.cuda else "cpu")
        return memory(Workload.of(cfg, param_dtype="bf16" if bf16 else "fp32"), layout, hw).total


def run_keel(s: Session, variant: Variant, cfg_path: Path, overrides: list[str], cfg: Config) -> dict:
    run_dir = s.work / variant.name.replace(" ", "-")
    try:
        run = train(cfg_path, run_dir, overrides, s.cuda)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoints: 13 bytes per parameter
    saves = cfg.checkpoint.interval < cfg.train.steps
    return {"run": run, "figures": figures(run, flops_per_token(cfg.model, cfg.train.seq_len), s.peak,
                                           s.plan_bytes(cfg), s.no_cuda, checkpoints=saves)}


def other_figures(run: dict, flops: float, peak: float | None, why_not_cuda: str, runner: str) -> dict:
    """tokens/s, MFU on keel's FLOPs, and the peak memory a bare or torchtitan run reports."""
    out: dict = {"missing": {}}
    failed = f"{runner} exited {run['exit_code']}" + (f": {run['error']}" if run.get("error") else "")
    failed = failed if run["exit_code"] else ""
    tps = run["tokens_per_s"]
    keys = ["peak_reserved_bytes"] + (["peak_allocated_bytes"] if runner == "bare" else [])
    values = {"tokens_per_s": tps, "mfu": tps * flops / peak if tps and peak else None,
              **{k: run.get(k) for k in keys}}
    for key, value in values.items():
        out[key] = value
        if value is None:
            out["missing"][key] = failed or (why_not_cuda if key != "tokens_per_s" else "") or \
                (f"no {runner} log window after the first" if key != "mfu" else "no catalog peak for this device")
    return out


def run_bare(s: Session, cfg: Config, compiled: bool) -> dict:
    gc.collect()
    if s.cuda:
        torch.cuda.empty_cache()
    started = time.perf_counter()
    run = {**bare_loop_cuda.train(cfg, s.device, compiled), "wall_s": 0.0}
    run["wall_s"] = time.perf_counter() - started
    gc.collect()
    return {"run": run, "figures": other_figures(run, flops_per_token(cfg.model, cfg.train.seq_len), s.peak,
                                                 s.no_cuda, "bare")}


def run_titan(s: Session, variant: Variant, compiled: bool) -> dict | str:
    """torchtitan's run, or why it is not run. The spec is written from the real config in any case; on a
    machine where torchtitan cannot run, its log parser is checked on the recorded line of its format."""
    cfg = s.real_config(variant, compiled)
    work = s.work / variant.name.replace(" ", "-")
    try:
        spec = titan_run.spec(cfg, work / "dump", compiled)
    except ValueError as e:
        return str(e)
    checks = s.results.setdefault("torchtitan", {"version": titan_run.VERSION})
    checks[variant.name] = {"spec": spec, "command": titan_run.command(work / "spec.json")}
    if why := titan_run.unavailable(s.cuda):
        checks["sample_log"] = {"line": titan_run.SAMPLE_LOG,
                                "parsed": titan_run.windows(titan_run.SAMPLE_LOG)}
        return why
    gc.collect()
    torch.cuda.empty_cache()  # what keel's runs left cached in this process is the subprocess's to use
    started = time.perf_counter()
    try:
        run = {**titan_run.run(spec, work, timeout_s=600), "wall_s": time.perf_counter() - started}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"run": run, "figures": other_figures(run, flops_per_token(cfg.model, cfg.train.seq_len), s.peak,
                                                 s.no_cuda, "torchtitan")}


def run_variant(s: Session, variant: Variant, compiled: bool) -> dict | str:
    cfg_path, overrides = s.config_path(variant), s.overrides(variant, compiled)
    cfg = load_config(cfg_path, overrides)
    if s.cuda and s.args.budget_s and s.peak:
        estimate = gpu_variants.estimate_s(variant, cfg.train.steps, flops_per_token(cfg.model, cfg.train.seq_len)
                                           * cfg.train.global_batch * cfg.train.seq_len, s.peak, compiled)
        if (elapsed := time.perf_counter() - s.started) + estimate > s.args.budget_s:
            return (f"--budget-s {s.args.budget_s:.0f}: {elapsed:.0f} s spent, this run estimated at "
                    f"{estimate:.0f} s")
    flags = " ".join(overrides[len(COMMON) + 1:])
    print(f"gpu_check: {variant.name}: {variant.runner} on {cfg_path.relative_to(REPO)} {flags} ...", flush=True)
    if variant.runner == "bare":
        return run_bare(s, cfg, compiled)
    if variant.runner == "torchtitan":
        return run_titan(s, variant, compiled)
    return run_keel(s, variant, cfg_path, overrides, cfg)


def run_all(s: Session, variants: tuple[Variant, ...], out: Path) -> None:
    """The runs, one after the other; the results file is rewritten after each."""
    results = s.results
    try:
        for variant in variants:
            compiled = variant.compiled(s.args.compile)
            if compiled is None:
                results["not_run"][variant.name] = f"--compile {s.args.compile}"
                continue
            try:
                done = run_variant(s, variant, compiled)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: the other runs still tell their figures
                done = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            if isinstance(done, str):
                results["not_run"][variant.name] = done
                print(f"gpu_check: {variant.name}: not run: {done}", flush=True)
                continue
            results["runs"][variant.name] = done
            results["ratios"], results["ratios_missing"] = gpu_variants.ratios(results["runs"], results["not_run"])
            write(out, results)
            print(f"gpu_check: {variant.name} done in {done['run']['wall_s']:.0f} s (exit "
                  f"{done['run']['exit_code']})\n{table(results)}", flush=True)
    finally:
        results["ratios"], results["ratios_missing"] = gpu_variants.ratios(results["runs"], results["not_run"])
        results["missing"] = missing(results)
        write(out, results)


def plan_sweep(s: Session, cfg_path: Path) -> dict | str:
    """`keel plan --calibrate-sweep` on this device, as a team would run it on a node of its cluster: the
    planner's kernel figures measured here (GEMMs in bf16 and float8, the model's attention, memory bandwidth)
    beside the published ones the planner otherwise takes for this generation (keel.plan.kernels.KERNELS)."""
    hw = s.hw if s.cuda and s.hw else by_key("cpu")
    # Every device here (with two or more, its links too); the dry run's two CPU processes measure a link.
    devices = torch.cuda.device_count() if s.cuda else 2
    cmd = [sys.executable, "-m", "keel", "plan", "--config", str(cfg_path), "--gpus", str(devices),
           "--hardware", hw.key, "--tokens", "1e9", "--trials", "20", "--json", "--calibrate-sweep", "--measure-dir",
           str(s.work / "plan-sweep"), *(DRY_RUN if s.args.cpu_dry_run else [])]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        return f"keel plan --calibrate-sweep exited {done.returncode}: {said[-1] if said else 'no message'}"
    swept = json.loads(done.stdout)["calibration_sweep"]
    kern = kernels_for(hw)
    forward, backward = kern.attention_efficiency("flash2")
    published = {"gemm": kern.gemm, "gemm_fp8": kern.gemm_fp8, "attention_forward": forward,
                 "attention_backward": backward, "memory": kern.memory}
    return {"hardware": hw.key, "measured": swept["kernels"], "published": published, "rows": swept["rows"],
            "figures": swept["measured"], "wall_s": time.perf_counter() - started}


def work_root(args: argparse.Namespace, variants: tuple[Variant, ...]) -> Path | None:
    """--work, else /dev/shm when it can hold the largest checkpoint of the runs (written there in seconds, not
    on a disk that may lack the room), else None (the temporary directory)."""
    if args.work or args.cpu_dry_run:
        return args.work
    largest = max(param_count(load_config(CONFIGS / gpu_variants.SHAPES[v.shape]).model) for v in variants)
    shm = Path("/dev/shm")
    room = shutil.disk_usage(shm).free if shm.is_dir() else 0
    return shm if room > 1.2 * CHECKPOINT_BYTES_PER_PARAM * largest else None


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
    try:
        variants = gpu_variants.select(args.only)
        paths = {v.shape: CONFIGS / ("tiny.toml" if args.cpu_dry_run else gpu_variants.SHAPES[v.shape])
                 for v in variants}
        cfgs = {shape: load_config(path, [*COMMON, f"data.dir={args.data_dir}",
                                          *(DRY_RUN if args.cpu_dry_run else [])]) for shape, path in paths.items()}
        first = next(iter(paths.values()))
    except (KeelError, ValueError) as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if not args.data_dir.exists():  # the built-in corpus (the config's sources), as `make train` has it
        print(f"gpu_check: preparing the built-in corpus into {args.data_dir} ...", flush=True)
        if code := keel(["data", "prepare", "--config", str(first), "--out", str(args.data_dir)]):
            return code
    device, hw = device_entry(cuda)
    head = context(cfgs, device, hw, cuda)
    print("\n".join(f"gpu_check: {line}" for line in head), flush=True)
    results: dict = {"benchmark": "gpu_check", "mode": "gpu" if cuda else "cpu-dry-run", "device": device,
                     "peak_flops": hw.peak_flops.get("bf16") if hw else None,
                     "variants": [vars(v) for v in variants], "context": head, "runs": {}, "not_run": {},
                     "torch": torch.__version__, "machine": platform.platform(),
                     "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    work = Path(tempfile.mkdtemp(prefix="keel-gpu-check-", dir=work_root(args, variants)))
    try:
        session = Session(args, cuda, no_cuda, results, work)
        swept = plan_sweep(session, first)  # about half a minute: first, so the budget never leaves it out
        if isinstance(swept, str):
            results["not_run"]["plan sweep"] = swept
        else:
            results["plan_sweep"] = swept
        print(f"gpu_check: plan sweep: {swept if isinstance(swept, str) else swept['measured']}", flush=True)
        run_all(session, variants, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
