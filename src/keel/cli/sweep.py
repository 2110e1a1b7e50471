"""`keel sweep`: a grid of real training runs over a base config, with the optimum learning rate per width, its
drift across widths and the learning rate it transfers to a target; or, with --coord-check, the coordinate check
of μP against the standard parametrization."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from keel.cli.config import add_config_args, config_from_args, config_path
from keel.cli.pathargs import PathArg, writes_dir
from keel.errors import ConfigError

if TYPE_CHECKING:
    from keel.config import Config
    from keel.sweep.run import Sweep


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="tune on proxies: --grid runs a grid of training runs (e.g. learning rate x "
                        "width) and reports the optimum per width and the transferred learning rate; --coord-check "
                        "shows whether every layer's activations stay width-independent")
    add_config_args(sw)
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=LO..HI:N|A,B,C",
                    help="an axis of the grid: N log-spaced values from LO to HI, or a list (repeatable)")
    sw.add_argument("--steps", type=int, default=None, help="training steps per point (default: the config's "
                    "train.steps; 5 for --coord-check)")
    sw.add_argument("--parallel", default="auto", help="points at once (default auto: one per CPU core, or one per "
                    "GPU)")
    sw.add_argument("--target", action="append", default=[], metavar="KEY=VALUE",
                    help="the config to recommend a learning rate for: the base config with these overrides, e.g. "
                    "model.dim=2048 (repeatable)")
    sw.add_argument("--out", action=PathArg, check=writes_dir, default=None,
                    help="the sweep directory (default sweeps/<config name>; "
                    "./coord-check for --coord-check)")
    sw.add_argument("--coord-check", action="store_true", help="run the coordinate check instead of a grid")
    sw.add_argument("--widths", default="1,2,4,8", help="--coord-check: width multipliers of model.dim")
    sw.add_argument("--batch", type=int, default=4, help="--coord-check: sequences of train.seq_len tokens per step")
    sw.set_defaults(handler=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: expected a positive number of steps")
    if args.coord_check:
        if args.grid or args.target:
            raise ConfigError("--coord-check runs no grid: leave out --grid and --target")
        return _coord_check(args)
    return _grid(args)


def _coord_check(args: argparse.Namespace) -> int:
    import torch

    from keel.paths import check_writable_dir
    from keel.sweep.coord_check import coord_check, parse_multipliers
    from keel.sweep.page import write_page

    cfg = config_from_args(args)
    multipliers = parse_multipliers(args.widths)
    if cfg.model.tie_embeddings:
        raise ConfigError("the coordinate check trains μP, which needs model.tie_embeddings = false")
    out = args.out or Path("coord-check")
    check_writable_dir(out, "--out")
    steps = args.steps or 5
    check = coord_check(cfg, multipliers, steps, args.batch, torch.device("cpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "coord_check.json").write_text(json.dumps(check.to_json(), indent=1) + "\n")
    page = write_page(check, out / "coord_check.html")
    for parametrization in check.rms:
        growth = " · ".join(f"step {s} {check.growth(parametrization, s):.2f}×" for s in range(1, steps + 1))
        print(f"{parametrization}: block RMS at x{multipliers[-1]} over x{multipliers[0]}: {growth}")
    print(f"wrote {out / 'coord_check.json'} and {page}")
    return 0


def _parallel(text: str, points: int, devices: list[str] | None) -> int:
    if text == "auto":
        return max(1, min(points, len(devices) if devices else os.cpu_count() or 1))
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--parallel {text!r}: expected a positive number of points at once, or auto")
    if devices and int(text) > len(devices):
        raise ConfigError(f"--parallel {text}: this machine has {len(devices)} GPU(s), one point per GPU")
    return int(text)


def _devices(device: str) -> list[str] | None:
    """The GPUs a sweep spreads its points over, one point each; None on the CPU."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None
    return [str(i) for i in range(torch.cuda.device_count())]


def _grid(args: argparse.Namespace) -> int:
    from keel.cli.data import ensure_corpus
    from keel.config import load_config
    from keel.parallel.degrees import resolve_degrees
    from keel.paths import check_writable_dir
    from keel.rundir.lock import RunLock
    from keel.sweep.grid import expand, parse_grid, point_configs
    from keel.sweep.run import Slots, Sweep, run_points

    base = config_from_args(args)
    axes = parse_grid(args.grid, args.overrides)
    steps = args.steps or base.train.steps
    fixed = [*args.overrides, f"train.steps={steps}"]
    path = config_path(args)
    points = expand(axes)
    configs = point_configs(str(path) if path else None, fixed, points)
    for cfg in configs:
        resolve_degrees(cfg, 1)  # each point is one process
    target = load_config(path, [*args.overrides, *args.target]) if args.target else None
    out = args.out or Path("sweeps") / base.name
    check_writable_dir(out, "--out")
    sweep = Sweep(out, str(path) if path else None, list(args.overrides), axes, steps, base, points, configs)
    sweep.check_spec()
    devices = _devices(base.train.device)
    count = _parallel(args.parallel, len(points), devices)
    slots = Slots(count, max(1, (os.cpu_count() or 1) // count), devices)
    for data in {c.data.dir: c for c in configs}.values():
        ensure_corpus(data, verbose=True)  # once, before the points: they all read it
    with RunLock(out):
        sweep.open()
        code = run_points(sweep, slots, lambda line: print(line, flush=True))
        _report(sweep, target, args.target)
    return code


def _report(sweep: Sweep, target: Config | None, target_overrides: list[str]) -> None:
    from keel.sweep.analysis import recommend, summarize
    from keel.sweep.page import write_sweep_page
    from keel.sweep.run import results

    result = results(sweep, summarize)
    if target is not None:
        result["target"] = {"overrides": target_overrides, "width": target.model.dim,
                            "lrs": {s["group"]: recommend(s, target.model.dim) for s in result["series"]}}
    (sweep.root / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    page = write_sweep_page(result, sweep.root / "sweep.html", result.get("target"))
    for line in summary_lines(result):
        print(line)
    print(f"wrote {sweep.root / 'sweep.json'} and {page}")


def summary_lines(result: dict) -> list[str]:
    lines = []
    for s in result["series"]:
        lines.append(f"{s['group'] or 'all points'}:")
        for w in s["widths"]:
            lr = "-" if w["optimum_lr"] is None else f"{w['optimum_lr']:.3g}" + (" (at the grid's edge)"
                                                                                 if w["optimum_at_edge"] else "")
            best = "all diverged" if w["best_loss"] is None else f"{w['best_loss']:.4f}"
            lines.append(f"  width {w['width']}: optimal lr {lr}, best loss {best}, LR sensitivity "
                         f"{w['sensitivity']:.4f}")
        t = s["transfer"]
        if t["slope"] is not None:
            lines.append(f"  the optimum moves {t['drift']:.2f}× ({t['grid_steps']:.1f} grid steps) across widths; "
                         f"fitted lr* ∝ width^{t['slope']:.2f}")
        if (target := result.get("target")) and (lr := target["lrs"].get(s["group"])) is not None:
            lines.append(f"  recommended lr at width {target['width']}: {lr:.3g}")
    if not result["complete"]:
        lines.append(f"{sum(not p['done'] for p in result['points'])} point(s) not finished: run the same command "
                     f"again")
    return lines
