"""`keel` command line: train, data prepare, config."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from keel.config import Config, load_config, reference, resolve_layout, to_toml
from keel.errors import EXIT_BAD_INPUT, KeelError

DEFAULT_CONFIG = Path("configs/tiny.toml")


def _load(args: argparse.Namespace) -> Config:
    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    return load_config(path, args.overrides)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help=f"TOML config (default: {DEFAULT_CONFIG})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=50")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel", description="LLM pre-training, from one CPU to thousands of GPUs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) a model")
    _add_config_args(t)
    t.add_argument("--run-dir", type=Path, help="run directory (default: runs/<config name>)")
    t.add_argument("--resume", default="auto",
                   help="auto: latest checkpoint of the run directory (default) · never: start fresh · PATH: "
                        "that checkpoint")
    t.add_argument("--nproc", type=int, default=None,
                   help="launch N processes on this machine through torchrun's elastic agent")
    t.add_argument("--max-restarts", type=int, default=0, help="worker-group restarts the elastic agent may make")

    d = sub.add_parser("data", help="prepare token shards")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="turn sources into token shards and print corpus statistics")
    _add_config_args(prep)
    prep.add_argument("--source", action="append", help="file, directory or 'stdlib' (repeatable; default: "
                      "data.sources)")
    prep.add_argument("--out", type=Path, help="output directory (default: data.dir)")
    prep.add_argument("--force", action="store_true", help="replace a corpus prepared from other sources")

    c = sub.add_parser("config", help="print the resolved config, or the reference of every option")
    _add_config_args(c)
    c.add_argument("--reference", action="store_true", help="print every option as a Markdown table")
    return p


def in_torchrun_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def ensure_corpus(cfg: Config, verbose: bool) -> None:
    """Prepare the built-in corpus at its default place when it is missing; any other corpus must exist."""
    from keel.data.prepare import BUILTIN_STDLIB, describe, prepare
    from keel.data.shards import MANIFEST, open_corpus

    defaults = Config().data
    builtin = cfg.data.dir == defaults.dir and cfg.data.sources == [BUILTIN_STDLIB]
    if builtin and not (Path(cfg.data.dir) / MANIFEST).exists():
        if verbose:
            print(f"preparing the built-in corpus (Python standard library sources) into {cfg.data.dir} ...",
                  flush=True)
        manifest = prepare(cfg.data.sources, cfg.data.dir, cfg.data.tokenizer, cfg.data.val_fraction)
        if verbose:
            print(describe(manifest), flush=True)
    open_corpus(cfg.data.dir, cfg.data.verify_checksums)


def cmd_train(args: argparse.Namespace) -> int:
    from keel.checkpoint.manager import resolve_resume
    from keel.launch import launch
    from keel.parallel.mesh import pick_device

    cfg = _load(args)
    run_dir = args.run_dir or Path("runs") / cfg.name
    worker = in_torchrun_worker()
    nproc = 1 if worker or args.nproc is None else args.nproc
    if nproc < 1:
        raise KeelError(f"--nproc {nproc}: expected a positive number of processes")
    if not worker:
        resolve_layout(cfg, nproc)
    pick_device(cfg.train.device)  # a missing device fails here, before any process starts
    ensure_corpus(cfg, verbose=not worker or os.environ.get("RANK") == "0")
    resume = args.resume
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and resolve_resume(run_dir, "auto"):
        resume = "auto"  # restarted by the elastic agent: continue from this run's own latest checkpoint
    resolve_resume(run_dir, resume)  # a bad --resume fails here, before any process starts
    if nproc > 1 or args.max_restarts > 0:
        return launch(nproc, args.max_restarts, args.argv)
    from keel.train.trainer import train
    return train(cfg, run_dir, resume)


def cmd_data(args: argparse.Namespace) -> int:
    from keel.data.prepare import describe, prepare

    cfg = _load(args)
    sources = args.source or cfg.data.sources
    out = args.out or Path(cfg.data.dir)
    manifest = prepare(sources, out, cfg.data.tokenizer, cfg.data.val_fraction, force=args.force)
    print(f"corpus in {out}")
    print(describe(manifest))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        print("| key | type | default | meaning |\n|---|---|---|---|")
        for key, tp, default, help_text in reference():
            print(f"| `{key}` | {tp} | `{default}` | {help_text} |")
        return 0
    print(to_toml(_load(args)), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    # Overrides may come before, between or after options: whatever is left over must be KEY=VALUE.
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if "=" not in a or a.startswith("-")]
    if unknown or (rest and not hasattr(args, "overrides")):
        p.error(f"unrecognized arguments: {' '.join(unknown or rest)}")
    if rest:
        args.overrides = args.overrides + rest
    args.argv = argv
    handler = {"train": cmd_train, "data": cmd_data, "config": cmd_config}[args.command]
    try:
        return handler(args)
    except KeelError as e:
        rank = os.environ.get("RANK", "0")
        where = "" if rank == "0" else f" (rank {rank})"
        print(f"keel: error{where}: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
