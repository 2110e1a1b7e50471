"""`keel plan`: size a run before booking the cluster."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from keel.cli.config import add_config_args, config_from_args, config_path
from keel.cli.pathargs import PathArg, reads, writes_dir, writes_file
from keel.errors import KeelError

if TYPE_CHECKING:
    from keel.config import Config
    from keel.plan.cluster import Cluster
    from keel.plan.report import Question


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plan", help="size a run before booking the cluster: layout, memory, step time, checkpoint "
                        "interval, wall time, goodput and cost with failures")
    add_config_args(pl)
    pl.add_argument("--gpus", type=int, required=True, help="accelerators of the job")
    pl.add_argument("--hardware", default="h100", help="accelerator key: h100, h100-pcie, h200, a100, a100-40, b200, "
                    "mi300x, l40s, tpu-v4, tpu-v5p, ...")
    pl.add_argument("--tokens", type=float, required=True, help="the run's token budget, e.g. 15e12")
    pl.add_argument("--price", type=float, default=None, help="price per accelerator-hour (default: docs/planning.md)")
    pl.add_argument("--storage-gbps", type=float, default=None, help="aggregate checkpoint write bandwidth in "
                    "GB/s (default 2000, Llama 3's storage)")
    pl.add_argument("--mtbf-hours", type=float, default=None, help="mean hours between failures of one "
                    "accelerator (default: its generation's published runs, docs/planning.md)")
    pl.add_argument("--net-gbps", type=float, default=None, help="inter-node bandwidth per accelerator, GB/s one "
                    "way (default: the accelerator catalog's, e.g. 50 for 400 Gb/s per H100)")
    pl.add_argument("--detect-s", type=float, default=None, help="seconds until a failure is noticed (default 120)")
    pl.add_argument("--restart-s", type=float, default=None, help="seconds to restart the job after a failure "
                    "(default 300)")
    pl.add_argument("--repair-h", type=float, default=None, help="hours until a failed node is back (default 4)")
    pl.add_argument("--spares", default=None, metavar="N|auto", help="hot spare nodes kept (and billed) for "
                    "failures (default auto: as many as pay for themselves)")
    pl.add_argument("--memory-coverage", type=float, default=None, help="share of the failures the memory tier "
                    "restores, p_m (default 0.916: all but Llama 3's network switch and cable failures)")
    pl.add_argument("--fragmentation", type=float, default=None, help="memory the allocator reserves beyond the "
                    "allocated peak, as a share of it (default 0.05; a CUDA run's max reserved / max allocated - 1)")
    pl.add_argument("--cluster", action=PathArg, check=reads("file", "pass a TOML file of the cluster's figures"),
                    metavar="FILE", help="a TOML file of the cluster's figures (net_gbps, detect_s, restart_s, "
                    "repair_h, spares, mtbf_hours, storage_gbps, price, fragmentation, memory_coverage, and how "
                    "failures show: hang_share, hang_detect_s, silent_share, silent_detect_s, manual_share, triage_h, "
                    "rollbacks_per_day); flags win over it")
    pl.add_argument("--layout", default="", metavar="tp=T,pp=P,...", help="predict this layout (tp, pp, v, dp_shard, "
                    "dp_replicate, cp, ep, micro_batch, ac, zero, schedule) and rank it among the searched ones; a "
                    "config's [parallel] gives one too")
    pl.add_argument("--calibrate", action=PathArg, check=reads("dir", "pass the run directory of a measured run"),
                    metavar="RUN_DIR", help="fit the efficiency factors to a measured run")
    pl.add_argument("--calibrate-sweep", action="store_true", help="first time GEMMs, attention, a memory-bound kernel "
                    "and collectives on this machine's devices (--gpus processes, one node), write the figures into "
                    "MEASURE_DIR/cluster.toml and plan with them")
    pl.add_argument("--measure", type=int, default=0, metavar="K", help="run the calibration layout and the plan's K "
                    "fastest layouts on this machine (--gpus processes) for a few steps each, compare them with the "
                    "predictions and write the fitted figures into MEASURE_DIR/cluster.toml")
    pl.add_argument("--measure-steps", type=int, default=16, help="steps of each measured run (default 16)")
    pl.add_argument("--measure-dir", action=PathArg, check=writes_dir, default=None, metavar="DIR",
                    help="where --measure or --calibrate-sweep keeps its runs and cluster file (default "
                    "keel-plan-measure, keel-plan-calibration); empty or new")
    pl.add_argument("--sweep", action=PathArg, check=reads("dir", "pass the directory of a keel sweep"),
                    metavar="DIR", help="a keel sweep's directory: the learning rate and "
                    "warmup it transfers to this model, and the loss its power law extrapolates to")
    pl.add_argument("--trials", type=int, default=2000, help="Monte Carlo trials")
    pl.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    pl.add_argument("--json", action="store_true", help="one JSON object")
    pl.add_argument("--html", action=PathArg, check=writes_file, metavar="FILE",
                    help="also write plots to this HTML file")
    pl.set_defaults(handler=cmd_plan)


MAX_TOKENS = 1e16  # ten thousand trillion: beyond any planned run, and a Monte Carlo of it takes minutes
MAX_TRIALS = 1_000_000
MAX_MEASURED = 20  # layouts --measure runs: each trains for a while on this machine
# Three logged windows of keel.plan.measure.WINDOW steps: the first the warm-up, the next profiled, the third not.
MIN_MEASURE_STEPS = 6
SWEEP_DIR = "keel-plan-calibration"  # where --calibrate-sweep keeps its results without --measure-dir


def check_numbers(args: argparse.Namespace) -> None:
    """Every number of the question, before any planning: one line naming the flag and what would do."""
    def bad(flag: str, value: object, valid: str) -> KeelError:
        return KeelError(f"{flag} {value}: expected {valid}")

    if args.gpus < 1:
        raise bad("--gpus", args.gpus, "a positive number of accelerators")
    if not (math.isfinite(args.tokens) and 0 < args.tokens <= MAX_TOKENS):
        raise bad("--tokens", args.tokens, f"a token budget above 0 and at most {MAX_TOKENS:.0e}, e.g. 15e12")
    if not 1 <= args.trials <= MAX_TRIALS:
        raise bad("--trials", args.trials, f"between 1 and {MAX_TRIALS:,} Monte Carlo trials")
    if args.seed < 0:
        raise bad("--seed", args.seed, "0 or a positive integer")
    if not 0 <= args.measure <= MAX_MEASURED:
        raise bad("--measure", args.measure, f"a number of layouts to run, from 1 to {MAX_MEASURED}")
    if args.measure and args.calibrate:
        raise KeelError(f"--measure {args.measure} --calibrate {args.calibrate}: --measure calibrates on a run of its "
                        f"own; drop one of them")
    if args.calibrate_sweep and args.calibrate:
        raise KeelError(f"--calibrate-sweep --calibrate {args.calibrate}: each calibrates the plan its own way (a "
                        f"sweep of kernels, a measured run); drop one of them")
    if args.measure and args.measure_steps < MIN_MEASURE_STEPS:
        raise bad("--measure-steps", args.measure_steps, f"at least {MIN_MEASURE_STEPS} (the first logged window "
                  f"is the warm-up)")


def cmd_plan(args: argparse.Namespace) -> int:
    from keel.plan.calibration import sweep_lines
    from keel.plan.cluster import cluster_from
    from keel.plan.measure import measure_lines
    from keel.plan.report import Question, answer, lines, to_json, write_html

    check_numbers(args)
    cluster = cluster_from(args.cluster, {name: getattr(args, name) for name in (
        "net_gbps", "detect_s", "restart_s", "repair_h", "spares", "mtbf_hours", "storage_gbps", "price",
        "fragmentation", "memory_coverage")})
    cfg = config_from_args(args)
    swept = None
    if args.calibrate_sweep:
        cluster, swept = _swept(args, cfg, cluster)
    q = Question(cfg, args.gpus, args.hardware, args.tokens, price=cluster.price,
                 storage_gbs=cluster.storage_gbps, mtbf_hours=cluster.mtbf_hours, net_gbps=cluster.net_gbps,
                 fabric_devices=cluster.fabric_devices,
                 fragmentation=cluster.fragmentation, memory_coverage=cluster.memory_coverage,
                 recovery=cluster.recovery(), mix=cluster.mix(), silent_detect_s=cluster.silent_detect_s,
                 spares=cluster.spares, layout=args.layout,
                 calibrate_from=args.calibrate, efficiency=cluster.efficiency(), peak_tflops=cluster.peak_tflops,
                 intra_gbps=cluster.intra_gbps, memory_gbps=cluster.memory_gbps,
                 kernel_figures=tuple(cluster.kernel_figures().items()),
                 sweep=args.sweep, trials=args.trials, seed=args.seed)
    measured = _measured(args, q, cluster, swept is not None) if args.measure else None
    # After --measure the plan is the one its calibration run gives, as --calibrate would.
    calibrated = measured and measured["calibration"]
    a = answer(replace(q, calibrate_from=Path(calibrated["run_dir"])) if calibrated else q)
    if measured is not None:
        a["measured"] = measured
    if swept is not None:
        a["calibration_sweep"] = swept
    text = lines(a) + (measure_lines(measured) if measured else []) + (sweep_lines(swept) if swept else [])
    print(to_json(a) if args.json else "\n".join(text))
    if args.html:  # checked as it was read (keel.cli.pathargs): its directory is made if missing
        args.html.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {write_html(q, a, args.html)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _empty_dir(args: argparse.Namespace, default: str, flag: str) -> Path:
    out = args.measure_dir or Path(default)
    if out.exists() and any(out.iterdir()):
        raise KeelError(f"--measure-dir {out}: not empty; {flag} keeps its runs there, so name a new or empty "
                        f"directory")
    return out


def _swept(args: argparse.Namespace, cfg: Config, cluster: Cluster) -> tuple[Cluster, dict]:
    """`--calibrate-sweep`: the kernels and collectives timed here, as the cluster's figures
    (keel.plan.calibration)."""
    from keel.core.accelerators import by_key
    from keel.plan.calibration import calibrate_sweep
    from keel.plan.layout import Workload

    hw = by_key(args.hardware)
    out = _empty_dir(args, SWEEP_DIR, "--calibrate-sweep")
    work = Workload.of(cfg, args.tokens, cfg.train.compute_precision("cpu") if hw.key == "cpu" else "bf16")
    calibrated, result = calibrate_sweep(work, cfg.train.micro_batch, hw, args.gpus, cluster, out,
                                         lambda line: print(line, file=sys.stderr, flush=True))
    # The file keeps what was measured; a flag still wins over it for this plan.
    return (calibrated if args.net_gbps is None else replace(calibrated, net_gbps=args.net_gbps)), result


def _measured(args: argparse.Namespace, q: Question, cluster: Cluster, swept: bool) -> dict:
    """`--measure K`: the calibration run (unless a sweep calibrated the plan) and the K fastest layouts trained
    here (keel.plan.measure)."""
    from keel.plan.measure import Invocation, measure

    # After a sweep its directory holds the runs too (checked empty before the sweep).
    out = (args.measure_dir or Path(SWEEP_DIR)) if swept else _empty_dir(args, "keel-plan-measure", "--measure")
    config = config_path(args)
    how = Invocation(str(config) if config else None, list(args.overrides), args.gpus, args.measure_steps)
    return measure(q, how, args.measure, out, cluster, lambda line: print(line, file=sys.stderr, flush=True), swept)
