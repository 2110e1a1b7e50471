"""`keel plan --measure K`: the plan checked on the machine at hand.

One calibration run trains the config's layout (FSDP over every device when the config sets none) for a few
steps with the profiler on in every other window, and the efficiency factors are fitted to it as `--calibrate`
fits them (on a CPU, with its measured peak and link bandwidth). The plan made with them names its K fastest
layouts; each trains here as `keel train` runs it, for the same few steps without the profiler (whose buffers and
time would weigh in), and is set beside its prediction: step time and peak memory. The layouts are ranked again
by what they measured, and the fitted figures go into a cluster file (DIR/cluster.toml) that the next `keel plan
--cluster` reads."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from keel.core.accelerators import Accelerator, by_key
from keel.errors import KeelError
from keel.plan.cluster import Cluster, write_cluster
from keel.plan.layout import Layout, config_layout, parse_layout
from keel.plan.layouts import Candidate, search
from keel.plan.memory import GIB, METRIC
from keel.plan.report import Question, basis
from keel.plan.throughput import Efficiency, measured_run
from keel.rundir.events import read_jsonl

# Steps per logged window (monitor.interval); the first window, the warm-up, is left out. The calibration run
# profiles every other window: the others give its step time (keel.plan.throughput.measured_run).
WINDOW = 2


def train_overrides(layout: Layout) -> list[str]:
    """The `keel train` overrides that run `layout` (ZeRO stage 3, FSDP, is the only one keel runs)."""
    schedule = [f"parallel.pp_schedule={layout.pp_schedule()}"] if layout.pp > 1 else []
    return [f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.pp_stages_per_rank={layout.v}",
            f"parallel.dp_shard={layout.dp_shard}", f"parallel.dp_replicate={layout.dp_replicate}",
            f"parallel.cp={layout.cp}", f"parallel.ep={layout.ep}", f"train.micro_batch={layout.micro_batch}",
            f"parallel.activation_checkpoint={layout.ac}", *schedule]


@dataclass(frozen=True)
class Invocation:
    """How this machine's runs are started: the plan's own config and overrides, on `gpus` local processes."""

    config: str | None  # None: keel's built-in default config
    overrides: list[str]
    gpus: int
    steps: int

    def train(self, layout: Layout, run_dir: Path, profile: bool) -> None:
        config = ["--config", self.config] if self.config else []
        cmd = [sys.executable, "-m", "keel", "train", *config, "--nproc", str(self.gpus),
               "--run-dir", str(run_dir), "--quiet", *self.overrides, *train_overrides(layout),
               f"train.steps={self.steps}", f"monitor.interval={WINDOW}",
               f"monitor.profile_interval={2 * WINDOW if profile else 0}", "eval.interval=0",
               f"checkpoint.interval={self.steps}"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), stdin=subprocess.DEVNULL)
        if done.returncode:
            said = [line for line in done.stderr.splitlines() if line.strip()]
            raise KeelError(f"keel plan --measure: {layout.describe()} did not train (exit {done.returncode}): "
                            f"{said[-1] if said else 'no message'}; see {run_dir}")


def step_seconds(run_dir: Path) -> float:
    """A run's mean step time over its logged windows after the first."""
    windows = [r["time/step_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("time/step_s")][1:]
    if not windows:
        raise KeelError(f"{run_dir}/metrics.jsonl has no window after the first: measure more steps")
    return statistics.fmean(windows)


def peak_gib(run_dir: Path) -> float | None:
    """The largest rank's peak memory above its runtime, as keel measured it (None where it did not)."""
    peaks = [r[METRIC] for r in read_jsonl(run_dir / "metrics.jsonl") if METRIC in r]
    return max(peaks) / GIB if peaks else None


@dataclass(frozen=True)
class Measurement:
    layout: Layout
    rank: int  # the plan's rank of the layout (1: its first pick)
    predicted_s: float
    predicted_gib: float
    measured_s: float
    measured_gib: float | None

    def row(self) -> dict:
        return {"layout": self.layout.describe(), "spec": self.layout.spec(), "planned_rank": self.rank,
                "predicted_s": self.predicted_s, "measured_s": self.measured_s,
                "error": self.predicted_s / self.measured_s - 1, "predicted_gib": self.predicted_gib,
                "measured_gib": self.measured_gib}


def measure(q: Question, how: Invocation, k: int, out: Path, cluster: Cluster,
            say: Callable[[str], None], swept: bool = False) -> dict:
    """Calibrate on one layout, run the plan's `k` fastest, and compare; the figures fitted go to
    OUT/cluster.toml. `swept`: the plan's figures are a calibration sweep's (keel.plan.calibration, its file
    already in OUT), and no layout is trained to calibrate."""
    calibration = None if swept else _calibration(q, how, out, say)
    hw, eff, work = basis(q if swept else replace(q, calibrate_from=out / "calibration"))
    fitting = [c for c in search(work, q.gpus, hw, eff) if c.fits and c.layout.zero == 3]
    rows = []
    for rank, candidate in enumerate(fitting[:k], start=1):
        rows.append(_measured(candidate, rank, how, out / f"layout-{rank}", say))
    by_speed = sorted(rows, key=lambda m: m.measured_s)
    path = out / "cluster.toml"
    if calibration is not None:
        calibration = {**calibration, "measured_s": measured_run(out / "calibration", hw).step_s,
                       "efficiency": asdict(eff)}
        path = _write_fitted(q, cluster, hw, eff, work.param_dtype, path, calibration["layout"])
    return {"calibration": calibration, "rows": [m.row() for m in rows],
            "best": by_speed[0].row() if by_speed else None,
            "measured_order": [m.layout.describe() for m in by_speed], "cluster_file": str(path)}


def _calibration(q: Question, how: Invocation, out: Path, say: Callable[[str], None]) -> dict:
    """The calibration run: the config's layout (FSDP over every device when it sets none), profiled."""
    given = parse_layout(q.layout, q.gpus) if q.layout else config_layout(q.cfg, q.gpus)[0]
    first = given or Layout(dp_shard=q.gpus, micro_batch=q.cfg.train.micro_batch)
    say(f"calibration: {first.describe()} for {how.steps} steps, profiled")
    how.train(first, out / "calibration", profile=True)
    return {"layout": first.describe(), "run_dir": str(out / "calibration")}


def _write_fitted(q: Question, cluster: Cluster, hw: Accelerator, eff: Efficiency, dtype: str, path: Path,
                  layout: str) -> Path:
    """The factors fitted to the calibration run (and a CPU's measured peak and links) as a cluster file."""
    measured = replace(cluster, compute_efficiency=eff.compute, overlap=eff.overlap, link_efficiency=eff.link)
    sources = dict.fromkeys(("compute_efficiency", "overlap", "link_efficiency"),
                            f"keel plan --measure: fitted to {layout} ({path.parent / 'calibration'})")
    if not by_key(q.hardware).peak_flops:  # an accelerator without published figures: what this machine measured
        measured = replace(measured, peak_tflops=hw.peak_flops[dtype] / 1e12,
                           intra_gbps=hw.intra_bw / 1e9, net_gbps=hw.inter_bw / 1e9)
        sources.update(dict.fromkeys(("peak_tflops", "intra_gbps", "net_gbps"),
                                     "keel plan --measure: the calibration run's matmul probe and all-reduce"))
    return write_cluster(path, measured, sources)


def _measured(candidate: Candidate, rank: int, how: Invocation, run_dir: Path,
              say: Callable[[str], None]) -> Measurement:
    say(f"layout {rank}: {candidate.layout.describe()}, predicted {candidate.step.total:.3g} s a step")
    how.train(candidate.layout, run_dir, profile=False)
    return Measurement(candidate.layout, rank, candidate.step.total, candidate.memory.total / GIB,
                       step_seconds(run_dir), peak_gib(run_dir))


def measure_lines(result: dict) -> list[str]:
    """The comparison as the plan prints it."""
    calib = result["calibration"]
    planned_with = "with the calibration sweep's figures" if calib is None else \
        f"calibrated on {calib['layout']}, {calib['measured_s']:.3g} s a step outside its profiled windows"
    out = ["", f"measured on this machine ({planned_with}):",
           "layout                                plan rank  predicted s  measured s   error  predicted GiB  "
           "measured GiB"]
    for r in result["rows"]:
        gib = f"{r['measured_gib']:.2f}" if r["measured_gib"] is not None else "-"
        out.append(f"{r['layout']:<38}{r['planned_rank']:>9}  {r['predicted_s']:>11.3g}  {r['measured_s']:>10.3g}  "
                   f"{r['error']:>+6.0%}  {r['predicted_gib']:>13.2f}  {gib:>12}")
    if result["best"]:
        first = result["rows"][0]["layout"]
        best = result["best"]["layout"]
        out.append(f"measured best: {best}" + (" (the plan's first pick)" if best == first else
                                               f" (the plan's first pick, {first}, measured slower)"))
    if calib is not None:
        out.append(f"fitted figures written to {result['cluster_file']}: pass --cluster {result['cluster_file']}")
    return out
