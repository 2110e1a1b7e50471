"""`keel config`, and the --config FILE and KEY=VALUE arguments of every command that runs a config."""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.config import Config, load_config, reference, to_toml

DEFAULT_CONFIG = Path("configs/tiny.toml")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help=f"TOML config (default: {DEFAULT_CONFIG})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=50")


def config_path(args: argparse.Namespace) -> Path | None:
    """--config, else configs/tiny.toml where there is one, else None: the built-in defaults."""
    return args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(config_path(args), args.overrides)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="print the resolved config, or the reference of every option")
    add_config_args(c)
    c.add_argument("--reference", action="store_true", help="print every option as a Markdown table")
    c.set_defaults(handler=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        print("| key | type | default | meaning |\n|---|---|---|---|")
        for key, tp, default, help_text in reference():
            print(f"| `{key}` | {tp} | `{default}` | {help_text} |")
        return 0
    print(to_toml(config_from_args(args)), end="")
    return 0
