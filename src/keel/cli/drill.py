"""`keel drill`: rehearse failures on real runs and check each recovery against a clean run."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from keel.cli.config import add_config_args, config_path
from keel.cli.data import ensure_corpus
from keel.cli.pathargs import PathArg, writes_dir
from keel.config import load_config
from keel.errors import KeelError
from keel.paths import check_writable_dir


def add_parsers(sub: argparse._SubParsersAction) -> None:
    dr = sub.add_parser("drill", help="rehearse failures on real runs and check each recovery against a clean run")
    add_config_args(dr)
    dr.add_argument("--suite", choices=("quick", "moe", "network", "full"), default="quick",
                    help="quick: one scenario of each recovery on a small model and batch (minutes); moe: the "
                         "mixture-of-experts scenarios on that small model; network: faults of the links between "
                         "nodes made of network namespaces, on that small model (needs root); full: every scenario "
                         "on the config as given")
    dr.add_argument("--scenario", help="NAME[,NAME]: only these scenarios (`--list` names them)")
    dr.add_argument("--list", action="store_true", help="print the catalog: each scenario and its promise")
    dr.add_argument("--chaos", action="store_true", help="one run with faults drawn at random from the catalog")
    dr.add_argument("--mtbf", default="30s", help="chaos: mean time between faults, e.g. 30s, 2m")
    dr.add_argument("--duration", default="10m", help="chaos: training time of the run, e.g. 10m, 1h")
    dr.add_argument("--seed", type=int, default=0, help="chaos: seed of the faults drawn")
    dr.add_argument("--nproc", type=int, default=2, help="processes of each run")
    dr.add_argument("--steps", type=int, default=None, help="steps of each run (default 30 quick, 40 full)")
    dr.add_argument("--interval", type=int, default=10, help="checkpoint interval of each run")
    dr.add_argument("--workdir", action=PathArg, check=writes_dir, default=Path("runs/drill"),
                    help="runs, cached clean references and drill.json (`keel report` shows it)")
    dr.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take")
    dr.add_argument("--json", action="store_true", help="one JSON object per scenario, as a list")
    dr.set_defaults(handler=cmd_drill)


def cmd_drill(args: argparse.Namespace) -> int:
    from keel.drill.runner import Drill, DrillError, with_baseline
    from keel.drill.scenarios import QUICK_SHAPE, Plan, catalog, suite
    from keel.drill.scorecard import all_kept, format_scorecard

    small = args.suite != "full"  # the quick shape: a small model and batch
    steps = args.steps or max(30 if small else 40, 3 * args.interval)
    plan = Plan(steps=steps, interval=args.interval)
    scenarios = catalog(plan)
    if args.list:
        for s in scenarios.values():
            print(f"{s.name:26} {s.promise}")
        return 0
    chosen = suite(args.suite, plan)
    if args.scenario:
        names = [n.strip() for n in args.scenario.split(",") if n.strip()]
        if unknown := [n for n in names if n not in scenarios]:
            raise KeelError(f"--scenario {','.join(unknown)}: no such scenario; expected one of "
                            f"{', '.join(scenarios)}")
        chosen = [scenarios[n] for n in names]
    config = config_path(args)  # a file: --config was checked as it was read
    if args.chaos:
        from keel.drill.chaos import parse_duration, run_chaos, step_seconds

        try:
            mtbf_s, duration_s = parse_duration(args.mtbf), parse_duration(args.duration)
        except ValueError as e:
            raise KeelError(f"--mtbf {args.mtbf} --duration {args.duration}: {e}") from None
    check_writable_dir(args.workdir, "--workdir")  # its default too, before any run starts
    say = (lambda line: None) if args.json else (lambda line: print(f"drill: {line}", file=sys.stderr, flush=True))
    drill = Drill(args.workdir, list(args.overrides), config=config, nproc=args.nproc, steps=steps,
                  interval=args.interval, timeout=args.timeout, say=say,
                  shape=list(QUICK_SHAPE) if small else [])
    try:
        ensure_corpus(load_config(config, [*drill.base(steps), *drill.overrides]), verbose=not args.json)
        if args.chaos:
            if args.steps is None:  # long enough for `--duration` of training at this config's step time
                drill.steps = max(3 * args.interval, math.ceil(duration_s / step_seconds(
                    drill.reference((), drill.steps), drill.steps) / args.interval) * args.interval)
            results, baseline = [run_chaos(drill, args.seed, mtbf_s, duration_s)], None
        else:
            baseline = drill.baseline()
            results = with_baseline(drill.run_all(chosen), baseline, args.interval)
    except DrillError as e:
        print(f"keel: drill failed: {e}", file=sys.stderr, flush=True)
        return 1
    path = drill.save(results, baseline, suite=args.suite, chaos=args.chaos)
    if args.json:
        print(json.dumps(results, default=str))
    else:
        print(format_scorecard(results, baseline))
        print(f"wrote {path}; `keel report {args.workdir}` shows it")
    return 0 if all_kept(results) else 1
