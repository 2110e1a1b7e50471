"""`keel data prepare|stats`, and the corpus a run needs before it starts."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from keel.cli.config import add_config_args, config_from_args
from keel.cli.pathargs import PathArg, reads, source, writes_dir
from keel.config import Config, SourceConfig, check_vocab_size
from keel.errors import ConfigError

if TYPE_CHECKING:
    from keel.data.shards import Corpus


def add_parsers(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="prepare token shards")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="turn sources into token shards and print corpus statistics")
    add_config_args(prep)
    prep.add_argument("--source", action=PathArg, check=source, append=True,
                      help="file, directory, glob or 'stdlib', as one source named "
                      "'main' (repeatable; default: data.sources)")
    prep.add_argument("--out", action=PathArg, check=writes_dir, help="output directory (default: data.dir)")
    prep.add_argument("--workers", type=int, help="worker processes (default: data.workers)")
    prep.add_argument("--force", action="store_true", help="replace a corpus prepared from other sources")
    st = dsub.add_parser("stats", help="documents in and out, what every filter and dedup removed, tokens per "
                         "source, document lengths")
    st.add_argument("dir", action=PathArg, check=reads("dir", "pass a prepared corpus directory"),
                    help="a prepared corpus")
    st.add_argument("--json", action="store_true", help="print stats.json")
    d.set_defaults(handler=cmd_data)


def ensure_corpus(cfg: Config, verbose: bool) -> Corpus:
    """Prepare the built-in corpus at its default place when it is missing; any other corpus must exist, and
    the model's vocabulary must hold its tokenizer's."""
    from keel.data.prepare import BUILTIN_STDLIB, describe, prepare
    from keel.data.shards import FORMAT_VERSION, MANIFEST, open_corpus
    from keel.paths import check_writable_dir

    defaults = Config().data
    builtin = cfg.data.dir == defaults.dir and [s.paths for s in cfg.data.sources.values()] == [[BUILTIN_STDLIB]]
    manifest_path = Path(cfg.data.dir) / MANIFEST
    # The built-in corpus is (re)built when missing or prepared by a keel that wrote another format.
    if builtin and (not manifest_path.exists() or json.loads(manifest_path.read_text()).get("format_version")
                    != FORMAT_VERSION):
        check_writable_dir(cfg.data.dir, "data.dir (the built-in corpus, prepared there)")
        if verbose:
            print(f"preparing the built-in corpus (Python standard library sources) into {cfg.data.dir} ...",
                  flush=True)
        manifest = prepare(cfg.data, cfg.data.dir, force=True, progress=verbose)
        if verbose:
            print(describe(manifest), flush=True)
    corpus = open_corpus(cfg.data.dir, cfg.data.verify_checksums)
    check_vocab_size(cfg, corpus.vocab_size)
    return corpus


def cmd_data(args: argparse.Namespace) -> int:
    from keel.data.prepare import describe, prepare
    from keel.data.stats import format_stats, load_stats
    from keel.paths import check_writable_dir

    if args.data_command == "stats":
        stats = load_stats(args.dir)
        print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
        return 0
    cfg = config_from_args(args)
    if args.source:
        cfg.data.sources = {"main": SourceConfig(paths=args.source)}
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: expected at least 1")
        cfg.data.workers = args.workers
    out = args.out or check_writable_dir(cfg.data.dir, "data.dir")  # --out was checked as it was read
    started = time.perf_counter()
    manifest = prepare(cfg.data, out, force=args.force, progress=True)
    print(f"corpus in {out} ({time.perf_counter() - started:.1f} s; `keel data stats {out}` for what was removed)")
    print(describe(manifest))
    return 0
