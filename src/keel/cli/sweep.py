"""`keel sweep --coord-check`: the coordinate check of μP against the standard parametrization."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.cli.config import add_config_args, config_from_args
from keel.errors import ConfigError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="tune on proxies: --coord-check trains the config's model at widths x1, x2, "
                        "... under sp and mup and shows which one keeps every layer's activations width-independent")
    add_config_args(sw)
    sw.add_argument("--coord-check", action="store_true", help="run the coordinate check")
    sw.add_argument("--widths", default="1,2,4,8", help="width multipliers of model.dim (default 1,2,4,8)")
    sw.add_argument("--steps", type=int, default=5, help="training steps per width (default 5)")
    sw.add_argument("--batch", type=int, default=4, help="sequences of train.seq_len tokens per step (default 4)")
    sw.add_argument("--out", type=Path, default=Path("coord-check"), help="directory for coord_check.json and "
                    "coord_check.html (default ./coord-check)")
    sw.set_defaults(handler=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    import torch

    from keel.paths import check_writable_dir
    from keel.sweep.coord_check import coord_check, parse_multipliers
    from keel.sweep.page import write_page

    if not args.coord_check:
        raise ConfigError("keel sweep needs --coord-check (the coordinate check is what it runs)")
    cfg = config_from_args(args)
    multipliers = parse_multipliers(args.widths)
    if cfg.model.tie_embeddings:
        raise ConfigError("the coordinate check trains μP, which needs model.tie_embeddings = false")
    check_writable_dir(args.out, "--out")
    check = coord_check(cfg, multipliers, args.steps, args.batch, torch.device("cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coord_check.json").write_text(json.dumps(check.to_json(), indent=1) + "\n")
    page = write_page(check, args.out / "coord_check.html")
    for parametrization in check.rms:
        growth = " · ".join(f"step {s} {check.growth(parametrization, s):.2f}×" for s in range(1, args.steps + 1))
        print(f"{parametrization}: block RMS at x{multipliers[-1]} over x{multipliers[0]}: {growth}")
    print(f"wrote {args.out / 'coord_check.json'} and {page}")
    return 0
