"""`keel config`, and the --config FILE and KEY=VALUE arguments of every command that runs a config."""

from __future__ import annotations

import argparse
from pathlib import Path

from keel.cli.pathargs import SHIPPED, PathArg, config_file
from keel.config import Config, load_config, reference, to_toml

DEFAULT_CONFIG = Path("configs/tiny.toml")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action=PathArg, check=config_file, help=f"TOML config, or the name of a shipped one "
                   f"(tiny, small, llama3_8b, ...) (default: {DEFAULT_CONFIG})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=50")


def config_path(args: argparse.Namespace) -> Path | None:
    """--config (a file, else a shipped config of that name), else configs/tiny.toml where there is one, else
    None: the built-in defaults, which are the shipped tiny config."""
    given: Path | None = args.config
    if given is None:
        return DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None
    shipped = SHIPPED / f"{given.name.removesuffix('.toml')}.toml"
    if not given.exists() and given.parent == Path(".") and shipped.is_file():
        return shipped
    return given


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
