"""`keel plan --calibrate-sweep`: the planner's kernel and link figures measured on this machine's devices.

A short sweep (keel.plan.kernel_bench, one process per device, started by torchrun) times what the step model
times: the planned model's GEMMs and a few large square ones, its causal attention forward and backward, an
element-wise kernel bound by memory bandwidth, and the collectives over every device of the sweep. From them:

- `gemm_efficiency` (and `gemm_fp8_efficiency`): the fastest GEMM's FLOP/s over the dtype's dense peak, the
  figure a large GEMM reaches (`keel.plan.kernels.Kernels.gemm`); the tile and wave model gives the rest;
- `attention_forward_efficiency`, `attention_backward_efficiency`: the FLOPs the step model counts for the
  attention (the causal half of the scores; the backward twice the forward's) over its time, against the peak;
- `memory_efficiency`: the element-wise kernel's bytes a second over the memory bandwidth;
- `intra_gbps`: the bus bandwidth of the largest all-gather and reduce-scatter (what each rank's link moves:
  (n−1)/n of the buffer a second, nccl-tests' convention), over the plan's link efficiency, so that the planner's
  collectives over the sweep's devices take what they took here.

An accelerator without published figures (a CPU) gets its measured ones instead: `peak_tflops`, the rate the
model's own GEMMs reached (a CPU has no tile model: its GEMM share is then 1 by construction, not written),
`memory_gbps`, and `net_gbps` as `intra_gbps` (its processes share one host). The figures go into
DIR/cluster.toml beside the cluster's others, each with its source, and every timing with the step model's
prediction for it into DIR/sweep.json.

The sweep covers one node: the network between nodes stays the catalog's, or `--net-gbps`."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from keel.config import ffn_hidden_dim, head_size
from keel.core.accelerators import Accelerator, lookup
from keel.errors import KeelError
from keel.plan.cluster import Cluster, write_cluster
from keel.plan.kernels import CAUSAL_SHARE, float8_peak, gemm_seconds, kernels_for, peak_flops, with_figures
from keel.plan.layout import Workload
from keel.plan.throughput import DEFAULT, _Link, all_to_all, collective

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
SQUARE = "square"  # the label of the sweep's square GEMMs (the others are the model's)


@dataclass(frozen=True)
class Sizes:
    """How much work each part of the sweep does on a device of this kind."""

    squares: tuple[int, ...]  # sides of the square GEMMs
    memory_elements: int  # of each of the element-wise kernel's three buffers
    collective_bytes: tuple[int, ...]
    collective_calls: int
    min_s: float  # each timing's shortest batch of calls
    max_rows: int  # tokens of the model's GEMMs and attention at most (a long sequence's are timed on fewer)


GPU = Sizes((2048, 4096, 8192), 2**28, (2**22, 2**26, 2**30), 10, 0.05, 16384)
CPU = Sizes((256, 512, 1024), 2**24, (2**16, 2**20, 2**24), 3, 0.1, 8192)
CPU_PROCESSES_PER_CORE = 4  # a CPU sweep's processes a core at most: no plan of one host runs more
SWEEP_TIMEOUT_S = 900  # a sweep takes seconds to a minute: past this a process is stuck (a collective that hangs)


def model_gemms(work: Workload, rows: int) -> list[tuple[int, int, int, str]]:
    """The forward GEMMs of the model's block and head over one micro-batch of `rows` tokens (M, N, K, name)."""
    m = work.model
    hd, d = head_size(m), m.dim
    if m.moe.experts:  # one expert's share of the routed rows, its width
        width, ffn_rows = m.moe.expert_dim or ffn_hidden_dim(m), max(1, rows * m.moe.top_k // m.moe.experts)
    else:
        width, ffn_rows = ffn_hidden_dim(m), rows
    return [(rows, (m.n_heads + 2 * m.n_kv_heads) * hd, d, "qkv"), (rows, d, m.n_heads * hd, "attention out"),
            (ffn_rows, 2 * width, d, "ffn in"), (ffn_rows, d, width, "ffn out"), (rows, m.vocab_size, d, "head")]


def spec_for(work: Workload, micro_batch: int, device: str, sizes: Sizes) -> dict:
    """What every process of the sweep runs (keel.plan.kernel_bench)."""
    m = work.model
    squares = [(n, n, n, f"{SQUARE} {n}") for n in sizes.squares]
    seq = min(work.seq_len, sizes.max_rows)
    batch = max(1, min(micro_batch, sizes.max_rows // seq))
    return {"device": device, "dtype": work.param_dtype, "min_s": sizes.min_s,
            "gemms": [list(g) for g in squares + model_gemms(work, batch * seq)],
            "attention": {"batch": batch, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": head_size(m),
                          "seq": seq},
            "memory_elements": sizes.memory_elements, "collective_bytes": list(sizes.collective_bytes),
            "collective_calls": sizes.collective_calls}


def sweep_device(hw: Accelerator) -> tuple[str, int]:
    """The device kind the sweep runs on for `hw`, and how many of them this machine has; a GPU key on a machine
    without that GPU fails here, before anything runs."""
    if hw.key == "cpu":
        return "cpu", 0
    import torch

    if not torch.cuda.is_available():
        raise KeelError(f"--calibrate-sweep --hardware {hw.key}: this machine has no CUDA device; run the sweep on a "
                        f"node of the cluster, or pass --hardware cpu to measure this machine")
    found = torch.cuda.get_device_name(0)
    if (entry := lookup(found)) is None or entry.key != hw.key:
        raise KeelError(f"--calibrate-sweep --hardware {hw.key}: this machine's devices are {found} "
                        f"({entry.key if entry else 'not in the catalog'}); pass that --hardware, or run the sweep "
                        f"on a node of the cluster planned")
    return "cuda", torch.cuda.device_count()


def run_sweep(spec: dict, processes: int, out: Path) -> list[dict]:
    """The sweep on `processes` local processes; each one's results."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    # As keel's launcher gives its workers: the host's cores shared among the processes.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
           "-m", "keel.plan.kernel_bench", str(out / "spec.json"), str(out)]
    with (out / "sweep.log").open("w") as log:
        sweep = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            code = sweep.wait(timeout=SWEEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(sweep.pid, signal.SIGKILL)  # torchrun and every process it started
            sweep.wait()
            code = None
    files = list(out.glob("rank-*.json"))
    if code is None or code or len(files) != processes:
        said = [line for line in (out / "sweep.log").read_text().splitlines() if line.strip()]
        why = f"no result after {SWEEP_TIMEOUT_S} s" if code is None else \
            f"exit {code}: {next((line for line in reversed(said) if 'Error' in line), said[-1] if said else '')}"
        raise KeelError(f"keel plan --calibrate-sweep: the sweep failed ({why}); see {out / 'sweep.log'}")
    return [json.loads(f.read_text()) for f in files]


def _median_s(ranks: list[dict], part: str) -> list[dict]:
    """A part's timings, each the median over the processes (they ran at once, as a job's ranks do)."""
    return [{**row, "s": statistics.median(r[part][i]["s"] for r in ranks)} for i, row in enumerate(ranks[0][part])]


def _slowest_s(ranks: list[dict]) -> list[dict]:
    """Each collective's time: the slowest process's (a collective ends when its last rank does)."""
    return [{**row, "s": max(r["collectives"][i]["s"] for r in ranks)} for i, row in enumerate(ranks[0]["collectives"])]


def _flops(gemm: dict) -> float:
    return 2 * gemm["m"] * gemm["n"] * gemm["k"]


def _busbw(row: dict, n: int) -> float:
    return (n - 1) / n * row["bytes"] / row["s"]


@dataclass(frozen=True)
class Fitted:
    """What the sweep measured, as the cluster file's figures."""

    kernels: dict[str, float]  # by keel.plan.kernels.with_figures's names
    measured: dict[str, float]  # the cluster file's other figures: intra_gbps; peak_tflops, memory_gbps, net_gbps
    rows: list[dict]  # every timing beside the step model's prediction for it, with the figures fitted


def _device_figures(ranks: list[dict], work: Workload, hw: Accelerator) -> tuple[float, dict, dict]:
    """The peak the kernels are measured against, the kernel figures, and a CPU's own peak and bandwidth."""
    timed = _median_s(ranks, "gemm")
    kernels: dict[str, float] = {}
    measured: dict[str, float] = {}
    if hw.peak_flops:
        peak = peak_flops(work, hw)
        kernels["gemm"] = min(1.0, max(_flops(g) / g["s"] for g in timed) / peak)
    else:  # no published peak (and no tile model): the rate the model's own GEMMs reached, its share 1
        own = [g for g in timed if not g["label"].startswith(SQUARE)]
        peak = sum(map(_flops, own)) / sum(g["s"] for g in own)
        measured["peak_tflops"] = peak / 1e12
    if (fp8 := _median_s(ranks, "gemm_fp8")) and hw.peak_flops.get("fp8"):
        kernels["gemm_fp8"] = min(1.0, max(_flops(g) / g["s"] for g in fp8) / float8_peak(hw))
    att = ranks[0]["attention"]
    forward_s, backward_s = (statistics.median(r["attention"][k] for r in ranks) for k in ("forward_s", "backward_s"))
    flops = 4 * att["batch"] * att["seq"] * att["seq"] * att["heads"] * att["head_dim"] * CAUSAL_SHARE
    kernels["attention_forward"] = min(1.0, flops / forward_s / peak)
    kernels["attention_backward"] = min(1.0, 2 * flops / max(backward_s, 1e-12) / peak)
    bandwidth = statistics.median(r["memory"]["bytes"] / r["memory"]["s"] for r in ranks)
    if hw.memory_bw > 0:
        kernels["memory"] = min(1.0, bandwidth / hw.memory_bw)
    else:
        measured["memory_gbps"], kernels["memory"] = bandwidth / 1e9, 1.0
    return peak, kernels, measured


def fit(ranks: list[dict], work: Workload, hw: Accelerator, link: float = DEFAULT.link) -> Fitted:
    """The figures that make the step model time the sweep's kernels and collectives as this machine ran them."""
    n = len(ranks)
    peak, kernels, measured = _device_figures(ranks, work, hw)
    moves = _slowest_s(ranks)
    if n > 1:
        largest = max(r["bytes"] for r in moves)
        busbw = statistics.median(_busbw(r, n) for r in moves
                                  if r["bytes"] == largest and r["kind"] in ("all_gather", "reduce_scatter"))
        measured["intra_gbps"] = busbw / link / 1e9
        if not hw.peak_flops:  # a CPU's processes share one host: its "network" is the same memory
            measured["net_gbps"] = measured["intra_gbps"]
    fitted = replace(hw, memory_bw=measured.get("memory_gbps", hw.memory_bw / 1e9) * 1e9,
                     intra_bw=measured.get("intra_gbps", hw.intra_bw / 1e9) * 1e9)
    return Fitted(kernels, measured, _rows(ranks, moves, work, fitted, peak, kernels, link))


def _rows(ranks: list[dict], moves: list[dict], work: Workload, hw: Accelerator, peak: float,
          figures: dict[str, float], link: float) -> list[dict]:
    """Each GEMM and collective of the sweep, measured and as the step model times it with the fitted figures."""
    kern, n = with_figures(kernels_for(hw), figures), len(ranks)
    rows = []
    for part, rate, share, size in (("gemm", peak, kern.gemm, DTYPE_BYTES[work.param_dtype]),
                                    ("gemm_fp8", float8_peak(hw) if hw.peak_flops.get("fp8") else 0.0,
                                     kern.gemm_fp8, 1)):
        for g in _median_s(ranks, part):
            rows.append({"part": part, "what": f"{g['label']} {g['m']}x{g['n']}x{g['k']}", "measured_s": g["s"],
                         "modelled_s": gemm_seconds(g["m"], g["n"], g["k"], rate, hw.memory_bw, kern, share, size)})
    wire = _Link(hw.intra_bw * link, 1)
    for c in moves:
        modelled = all_to_all(c["bytes"], n, wire) if c["kind"] == "all_to_all" else \
            collective(c["kind"], c["bytes"], n, wire)
        rows.append({"part": c["kind"], "what": f"{c['bytes'] / 2**20:g} MiB over {n}", "measured_s": c["s"],
                     "modelled_s": modelled})
    return [{**r, "error": r["modelled_s"] / r["measured_s"] - 1} for r in rows]


SOURCES = {"gemm": "the fastest GEMM of the sweep over the dtype's peak",
           "gemm_fp8": "the fastest float8 GEMM of the sweep over the fp8 peak",
           "attention_forward": "the model's causal attention, forward: counted FLOPs a second over the peak",
           "attention_backward": "its backward: twice the forward's FLOPs a second over the peak",
           "memory": "an element-wise add: bytes a second over the memory bandwidth",
           "peak_tflops": "the rate the model's GEMMs reached in the sweep",
           "memory_gbps": "an element-wise add's bytes a second",
           "intra_gbps": "bus bandwidth of the largest all-gather and reduce-scatter, over link_efficiency",
           "net_gbps": "as intra_gbps: the processes share one host"}


def calibrate_sweep(work: Workload, micro_batch: int, hw: Accelerator, gpus: int, cluster: Cluster, out: Path,
                    say: Callable[[str], None]) -> tuple[Cluster, dict]:
    """Run the sweep on this machine, write OUT/cluster.toml (`cluster` with the fitted figures) and
    OUT/sweep.json; the cluster to plan with, and what to report."""
    device, count = sweep_device(hw)
    processes = gpus if device == "cpu" else min(gpus, count)
    if device == "cpu" and processes > CPU_PROCESSES_PER_CORE * (os.cpu_count() or 1):
        raise KeelError(f"--calibrate-sweep --gpus {gpus} --hardware cpu: one process a device would start {gpus} on "
                        f"this host's {os.cpu_count()} cores; sweep at most {CPU_PROCESSES_PER_CORE} a core")
    say(f"calibration sweep: GEMMs, attention, memory and collectives on {processes} {device} process(es)")
    ranks = run_sweep(spec_for(work, micro_batch, device, CPU if device == "cpu" else GPU), processes, out)
    link = cluster.link_efficiency or DEFAULT.link
    fitted = fit(ranks, work, hw, link)
    figures: dict[str, Any] = {**{f"{name}_efficiency": v for name, v in fitted.kernels.items()}, **fitted.measured}
    calibrated = replace(cluster, **figures)
    where = f"keel plan --calibrate-sweep ({out}, {processes} {ranks[0]['device']})"
    sources = {**{f"{k}_efficiency": f"{where}: {SOURCES[k]}" for k in fitted.kernels},
               **{k: f"{where}: {SOURCES[k]}" for k in fitted.measured}}
    path = write_cluster(out / "cluster.toml", calibrated, sources)
    result = {"processes": processes, "device": ranks[0]["device"], "kernels": fitted.kernels,
              "measured": fitted.measured, "rows": fitted.rows, "cluster_file": str(path)}
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    return calibrated, result


def sweep_lines(result: dict) -> list[str]:
    """The sweep as the plan prints it."""
    k, m = result["kernels"], result["measured"]
    said = [f"GEMM {k['gemm']:.0%} of the peak" if "gemm" in k else f"peak {m['peak_tflops']:.3g} TFLOP/s",
            *([f"float8 GEMM {k['gemm_fp8']:.0%}"] if "gemm_fp8" in k else []),
            f"attention {k['attention_forward']:.0%}/{k['attention_backward']:.0%} forward/backward",
            f"memory {m['memory_gbps']:.3g} GB/s" if "memory_gbps" in m else f"memory {k['memory']:.0%}",
            *([f"links {m['intra_gbps']:.3g} GB/s"] if "intra_gbps" in m else [])]
    out = ["", f"calibrated on this machine ({result['processes']} × {result['device']}): {', '.join(said)}",
           "kernel or collective                              measured s  modelled s   error"]
    out += [f"{r['part'] + ' ' + r['what']:<48}{r['measured_s']:>12.3g}{r['modelled_s']:>12.3g}{r['error']:>+8.0%}"
            for r in result["rows"]]
    out.append(f"figures written to {result['cluster_file']}: pass --cluster {result['cluster_file']}")
    return out
