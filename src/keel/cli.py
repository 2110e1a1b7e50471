"""`keel` command line: train, pause, status, report, quarantine, plan, drill, data prepare, ckpt, config."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from keel.config import Config, SourceConfig, check_vocab_size, load_config, reference, resolve_layout, to_toml
from keel.errors import EXIT_BAD_INPUT, EXIT_PAUSED, ConfigError, KeelError

DEFAULT_CONFIG = Path("configs/tiny.toml")


def _load(args: argparse.Namespace) -> Config:
    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    return load_config(path, args.overrides)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help=f"TOML config (default: {DEFAULT_CONFIG})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.steps=50")


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line, like every other bad input: the usage block would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"keel: error: {message} (`{self.prog} --help` lists the arguments)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="keel", description="LLM pre-training, from one CPU to thousands of GPUs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train (or resume) a model")
    _add_config_args(t)
    t.add_argument("--run-dir", type=Path, help="run directory (default: runs/<config name>)")
    t.add_argument("--resume", default="auto",
                   help="auto: latest checkpoint of the run directory (default) · never: start fresh · PATH: "
                        "that checkpoint")
    t.add_argument("--nproc", type=int, default=None,
                   help="launch N processes on this machine through torchrun's elastic agent")
    t.add_argument("--max-restarts", type=int, default=None,
                   help="worker-group restarts the elastic agent may make (default: health.max_restarts)")
    t.add_argument("--nnodes", default="1", help="MIN:MAX nodes of an elastic job: run the same command on every "
                   "node (with --rdzv-endpoint); the job goes on with at least MIN")
    t.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (one node's address) for "
                   "--nnodes")
    t.add_argument("--accept-change", action="append", default=[], metavar="KEY[,KEY]",
                   help="resume although these identity fields changed (e.g. train.seq_len for a longer context "
                        "phase); the change is recorded in events.jsonl and every later manifest")
    t.add_argument("--quiet", action="store_true", help="no progress on the console, only warnings, errors and "
                   "alerts (everything still goes to RUN_DIR/logs)")

    pa = sub.add_parser("pause", help="ask a running job to checkpoint at the next step and exit 75")
    pa.add_argument("run_dir", type=Path)
    r = sub.add_parser("report", help="write RUN_DIR/report.html: curves, step time, goodput, hardware, events")
    r.add_argument("run_dir", type=Path)
    r.add_argument("--out", type=Path, help="where to write it (default RUN_DIR/report.html)")
    st = sub.add_parser("status", help="state, step, ETA, loss, goodput, last checkpoint, alerts, last events")
    st.add_argument("run_dir", type=Path)
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.add_argument("--events", type=int, default=5, help="last events shown")
    q = sub.add_parser("quarantine", help="keep a node out of a run: its launcher leaves, the others go on")
    q.add_argument("run_dir", type=Path)
    q.add_argument("node", help="node name (KEEL_NODE of its launcher, else its host name)")
    q.add_argument("--reason", default="keel quarantine", help="recorded in quarantine.json")
    q.add_argument("--release", action="store_true", help="let the node back in")

    pl = sub.add_parser("plan", help="size a run before booking the cluster: layout, memory, step time, checkpoint "
                        "interval, wall time, goodput and cost with failures")
    _add_config_args(pl)
    pl.add_argument("--gpus", type=int, required=True, help="accelerators of the job")
    pl.add_argument("--hardware", default="h100", help="accelerator key: h100, h100-pcie, h200, a100, a100-40, b200, "
                    "mi300x, l40s, tpu-v4, tpu-v5p, ...")
    pl.add_argument("--tokens", type=float, required=True, help="the run's token budget, e.g. 15e12")
    pl.add_argument("--price", type=float, default=None, help="price per accelerator-hour (default: see README)")
    pl.add_argument("--storage-gbps", type=float, default=2000.0, help="aggregate checkpoint write bandwidth in "
                    "GB/s (default 2000, Llama 3's storage)")
    pl.add_argument("--mtbf-hours", type=float, default=None, help="mean hours between failures of one "
                    "accelerator (default: derived from the Llama 3 report)")
    pl.add_argument("--calibrate", type=Path, metavar="RUN_DIR", help="fit the efficiency factors to a measured run")
    pl.add_argument("--trials", type=int, default=2000, help="Monte Carlo trials")
    pl.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    pl.add_argument("--json", action="store_true", help="one JSON object")
    pl.add_argument("--html", type=Path, metavar="FILE", help="also write plots to this HTML file")

    dr = sub.add_parser("drill", help="rehearse failures on real runs and check each recovery against a clean run")
    _add_config_args(dr)
    dr.add_argument("--suite", choices=("quick", "full"), default="quick",
                    help="quick: one scenario of each recovery on a small model and batch (minutes); full: every "
                         "scenario on the config as given")
    dr.add_argument("--scenario", help="NAME[,NAME]: only these scenarios (`--list` names them)")
    dr.add_argument("--list", action="store_true", help="print the catalog: each scenario and its promise")
    dr.add_argument("--chaos", action="store_true", help="one run with faults drawn at random from the catalog")
    dr.add_argument("--mtbf", default="30s", help="chaos: mean time between faults, e.g. 30s, 2m")
    dr.add_argument("--duration", default="10m", help="chaos: training time of the run, e.g. 10m, 1h")
    dr.add_argument("--seed", type=int, default=0, help="chaos: seed of the faults drawn")
    dr.add_argument("--nproc", type=int, default=2, help="processes of each run")
    dr.add_argument("--steps", type=int, default=None, help="steps of each run (default 30 quick, 40 full)")
    dr.add_argument("--interval", type=int, default=10, help="checkpoint interval of each run")
    dr.add_argument("--workdir", type=Path, default=Path("runs/drill"),
                    help="runs, cached clean references and drill.json (`keel report` shows it)")
    dr.add_argument("--timeout", type=float, default=600.0, help="seconds one launch may take")
    dr.add_argument("--json", action="store_true", help="one JSON object per scenario, as a list")
    d = sub.add_parser("data", help="prepare token shards")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="turn sources into token shards and print corpus statistics")
    _add_config_args(prep)
    prep.add_argument("--source", action="append", help="file, directory, glob or 'stdlib', as one source named "
                      "'main' (repeatable; default: data.sources)")
    prep.add_argument("--out", type=Path, help="output directory (default: data.dir)")
    prep.add_argument("--workers", type=int, help="worker processes (default: data.workers)")
    prep.add_argument("--force", action="store_true", help="replace a corpus prepared from other sources")
    st = dsub.add_parser("stats", help="documents in and out, what every filter and dedup removed, tokens per "
                         "source, document lengths")
    st.add_argument("dir", type=Path, help="a prepared corpus")
    st.add_argument("--json", action="store_true", help="print stats.json")

    k = sub.add_parser("ckpt", help="list, verify and export checkpoints")
    ksub = k.add_subparsers(dest="ckpt_command", required=True)
    ls = ksub.add_parser("ls", help="steps, sizes, age and state of a run's checkpoints")
    ls.add_argument("path", help="run directory, checkpoints directory or URL, or one checkpoint")
    ls.add_argument("--verify", action="store_true", help="also check every file's checksum (reads everything)")
    ver = ksub.add_parser("verify", help="check manifests and every file's size and checksum")
    ver.add_argument("path", help="run directory, checkpoints directory or URL, or one checkpoint")
    exp = ksub.add_parser("export", help="write a checkpoint's model in another format")
    exp.add_argument("path", help="run directory (its newest verified checkpoint) or one checkpoint")
    exp.add_argument("--format", choices=("hf",), default="hf", help="hf: Hugging Face Llama safetensors")
    exp.add_argument("--out", type=Path, required=True, help="output directory (must not exist or be empty)")
    exp.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the exported weights")
    exp.add_argument("--tokenizer", type=Path, help="the run's tokenizer.json or prepared corpus directory (default: "
                     "the corpus recorded in the checkpoint; its sha256 must match)")

    c = sub.add_parser("config", help="print the resolved config, or the reference of every option")
    _add_config_args(c)
    c.add_argument("--reference", action="store_true", help="print every option as a Markdown table")
    return p


def in_torchrun_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def ensure_corpus(cfg: Config, verbose: bool) -> None:
    """Prepare the built-in corpus at its default place when it is missing; any other corpus must exist, and
    the model's vocabulary must hold its tokenizer's."""
    from keel.data.prepare import BUILTIN_STDLIB, describe, prepare
    from keel.data.shards import FORMAT_VERSION, MANIFEST, open_corpus

    defaults = Config().data
    builtin = cfg.data.dir == defaults.dir and [s.paths for s in cfg.data.sources.values()] == [[BUILTIN_STDLIB]]
    manifest_path = Path(cfg.data.dir) / MANIFEST
    # The built-in corpus is (re)built when missing or prepared by a keel that wrote another format.
    if builtin and (not manifest_path.exists() or json.loads(manifest_path.read_text()).get("format_version")
                    != FORMAT_VERSION):
        if verbose:
            print(f"preparing the built-in corpus (Python standard library sources) into {cfg.data.dir} ...",
                  flush=True)
        manifest = prepare(cfg.data, cfg.data.dir, force=True, progress=verbose)
        if verbose:
            print(describe(manifest), flush=True)
    corpus = open_corpus(cfg.data.dir, cfg.data.verify_checksums)
    check_vocab_size(cfg, corpus.vocab_size)
    return corpus


def accepted_changes(cfg: Config, flags: list[str]) -> tuple[str, ...]:
    """The identity fields a resume may change on purpose: `--accept-change`, and the corpus when
    data.allow_corpus_change is set."""
    from keel.checkpoint.identity import check_accept_keys

    keys = check_accept_keys(k.strip() for flag in flags for k in flag.split(","))
    return tuple(sorted(set(keys) | ({"data.corpus"} if cfg.data.allow_corpus_change else set())))


def cmd_train(args: argparse.Namespace) -> int:
    from keel.health.lifeline import die_with_launcher
    from keel.health.signals import stop_signals_kept

    worker = in_torchrun_worker()
    if worker:
        die_with_launcher()
    with stop_signals_kept():  # from here on a SIGTERM or SIGUSR1 is a pause, whatever the job is doing
        return _train_command(args, worker)


def _train_command(args: argparse.Namespace, worker: bool) -> int:
    from keel.checkpoint.identity import run_identity
    from keel.checkpoint.manager import check_resume, check_resume_identity, checkpoint_root
    from keel.checkpoint.manifest import committed
    from keel.health.signals import stop_requested_early
    from keel.launch import launch
    from keel.parallel.mesh import pick_device
    from keel.rundir.lock import RunLock, held_by_launcher
    from keel.rundir.quarantine import node_name

    cfg = _load(args)
    run_dir = args.run_dir or Path("runs") / cfg.name
    check_train_args(args, cfg, run_dir)
    if args.quiet:
        os.environ["KEEL_QUIET"] = "1"  # the workers' consoles too
    nproc = 1 if worker or args.nproc is None else args.nproc
    elastic = not worker and args.nnodes != "1"
    if elastic:
        check_elastic(args.nnodes, args.rdzv_endpoint, run_dir)
    max_restarts = cfg.health.max_restarts if args.max_restarts is None else args.max_restarts
    if not worker and not elastic:
        resolve_layout(cfg, nproc)
    pick_device(cfg.train.device)  # a missing device fails here, before any process starts
    accepted = accepted_changes(cfg, args.accept_change)
    corpus = ensure_corpus(cfg, verbose=not worker or os.environ.get("RANK") == "0")
    storage = checkpoint_root(cfg, run_dir)
    resume = args.resume
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and committed(storage):
        resume = "auto"  # restarted by the elastic agent: continue from this run's own latest checkpoint
    if not worker:
        check_resume(storage, resume)  # a bad --resume fails here, before any process starts
        check_resume_identity(storage, resume, run_identity(cfg, corpus.fingerprint, corpus.manifest["tokenizer"]),
                              accepted)
        if cfg.model.init_from:
            from keel.checkpoint.export import check_hf_matches

            check_hf_matches(Path(cfg.model.init_from.removeprefix("hf:")), cfg.model)
    if not worker and (received := stop_requested_early()):
        print(f"keel: {received} received before the job started; nothing was changed, run the same command to "
              f"start it", flush=True)
        return EXIT_PAUSED
    # The launcher holds the run directory for the whole job (each node's launcher its own lock in an
    # elastic job); torchrun's own workers lock it in rank 0.
    lock = RunLock(run_dir, node_name() if elastic else "")
    with lock if not worker and not held_by_launcher(run_dir) else contextlib.nullcontext():
        if nproc > 1 or max_restarts > 0 or elastic:
            return launch(nproc, max_restarts, args.argv, run_dir, nnodes=args.nnodes,
                          rdzv_endpoint=args.rdzv_endpoint, rdzv_timeout_s=cfg.health.rendezvous_timeout_s,
                          shutdown_grace_s=cfg.health.shutdown_grace_s,
                          no_progress_restarts=cfg.health.no_progress_restarts)
        from keel.drill.faults import as_callbacks
        from keel.train.trainer import train

        # The drill's faults reach the loop as ordinary callbacks, after the configured ones.
        return train(cfg, run_dir, resume, accepted, [*cfg.callbacks, *as_callbacks(cfg.drill.inject, run_dir)])


def check_train_args(args: argparse.Namespace, cfg: Config, run_dir: Path) -> None:
    """What a start can check from its arguments and config alone, before it creates anything."""
    from keel.drill.faults import check_injections
    from keel.paths import check_writable_dir
    from keel.train.callbacks import check_callbacks

    if args.nproc is not None and args.nproc < 1:
        raise KeelError(f"--nproc {args.nproc}: expected a positive number of processes")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise KeelError(f"--max-restarts {args.max_restarts}: expected 0 or more restarts")
    check_writable_dir(run_dir, "--run-dir" if args.run_dir else "the run directory")
    storage = cfg.checkpoint.dir
    if storage and ("://" not in storage or storage.startswith("file://")):
        check_writable_dir(Path(storage.removeprefix("file://")), "checkpoint.dir")
    resume = args.resume
    if resume not in ("auto", "never") and "://" not in resume and Path(resume).exists() and not Path(resume).is_dir():
        raise KeelError(f"--resume {resume!r} is a file; pass a checkpoints/step-NNNNNN directory, auto or never")
    check_callbacks(cfg.callbacks)
    check_injections(cfg.drill.inject)


def check_elastic(nnodes: str, endpoint: str, run_dir: Path) -> None:
    from keel.rundir.quarantine import is_quarantined, node_name

    lo, _, hi = nnodes.partition(":")
    if not (lo.isdigit() and (hi or lo).isdigit() and 0 < int(lo) <= int(hi or lo)):
        raise KeelError(f"--nnodes {nnodes!r}: expected MIN:MAX with 0 < MIN <= MAX, e.g. 1:2")
    host, _, port = endpoint.rpartition(":")
    if not (host and port.isdigit()):
        raise KeelError(f"--rdzv-endpoint {endpoint!r}: an elastic job (--nnodes {nnodes}) needs HOST:PORT of the "
                        f"rendezvous, the same on every node")
    if is_quarantined(run_dir, node_name()):
        raise KeelError(f"node {node_name()} is listed in {run_dir / 'quarantine.json'}; it does not rejoin the run "
                        f"(`keel quarantine {run_dir} {node_name()} --release` lets it back in)")


def cmd_pause(args: argparse.Namespace) -> int:
    from keel.health.signals import request_pause
    from keel.rundir.status import job_alive

    if not job_alive(args.run_dir):
        raise KeelError(f"no keel job is running in {args.run_dir}; `keel status {args.run_dir}` shows where it "
                        f"stands")
    path = request_pause(args.run_dir)
    print(f"asked the job in {args.run_dir} to pause at its next step ({path}); `keel status {args.run_dir}` "
          f"shows when it has")
    return 0


def cmd_status(args: argparse.Namespace) -> int:

    from keel.report.status import summary, summary_lines

    info = summary(args.run_dir, args.events)
    print(json.dumps(info) if args.json else "\n".join(summary_lines(info)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from keel.plan.cost import DEFAULT_PRICE_PER_HOUR
    from keel.plan.failures import DEFAULT_DEVICE_MTBF_H
    from keel.plan.report import Question, answer, lines, to_json, write_html

    q = Question(_load(args), args.gpus, args.hardware, args.tokens,
                 price=DEFAULT_PRICE_PER_HOUR if args.price is None else args.price, storage_gbs=args.storage_gbps,
                 mtbf_hours=DEFAULT_DEVICE_MTBF_H if args.mtbf_hours is None else args.mtbf_hours,
                 calibrate_from=args.calibrate, trials=args.trials, seed=args.seed)
    a = answer(q)
    print(to_json(a) if args.json else "\n".join(lines(a)))
    if args.html:
        print(f"wrote {write_html(q, a, args.html)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    import math

    from keel.drill.runner import Drill, DrillError, with_baseline
    from keel.drill.scenarios import QUICK_SHAPE, Plan, catalog, suite
    from keel.drill.scorecard import all_kept, format_scorecard

    steps = args.steps or max(30 if args.suite == "quick" else 40, 3 * args.interval)
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
    config = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    if config is not None and not config.is_file():
        raise KeelError(f"--config {config}: no such file; pass a TOML config such as {DEFAULT_CONFIG}")
    if args.chaos:
        from keel.drill.chaos import parse_duration, run_chaos, step_seconds

        try:
            mtbf_s, duration_s = parse_duration(args.mtbf), parse_duration(args.duration)
        except ValueError as e:
            raise KeelError(f"--mtbf {args.mtbf} --duration {args.duration}: {e}") from None
    say = (lambda line: None) if args.json else (lambda line: print(f"drill: {line}", file=sys.stderr, flush=True))
    drill = Drill(args.workdir, list(args.overrides), config=config, nproc=args.nproc, steps=steps,
                  interval=args.interval, timeout=args.timeout, say=say,
                  shape=list(QUICK_SHAPE) if args.suite == "quick" else [])
    try:
        ensure_corpus(load_config(config, drill.base(steps)), verbose=not args.json)
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


def cmd_report(args: argparse.Namespace) -> int:
    from keel.report.html import write_report

    path = write_report(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    from keel.rundir.quarantine import add_to_quarantine, release

    if not args.run_dir.is_dir():
        raise KeelError(f"run directory {str(args.run_dir)!r} does not exist")
    if args.release:
        n = release(args.run_dir, args.node)
        print(f"released {args.node} ({n} record(s) removed from {args.run_dir / 'quarantine.json'})")
    else:
        add_to_quarantine(args.run_dir, [args.node], source="keel quarantine", reason=args.reason)
        print(f"quarantined {args.node}: its launcher leaves the job; the other nodes go on without it")
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from keel.checkpoint.inspect import find_checkpoints, format_rows, latest_verified, list_rows, verdict
    from keel.checkpoint.manifest import read_manifest, verify

    if args.ckpt_command == "export":
        import torch

        from keel.checkpoint.export import check_export_target, export_hf
        from keel.checkpoint.hf_tokenizer import checkpoint_tokenizer
        from keel.config import ModelConfig

        check_export_target(args.out)  # before the checkpoint's read lock is taken: a bad --out creates nothing
        storage, name = latest_verified(args.path)
        manifest = read_manifest(storage, name)
        tokenizer = checkpoint_tokenizer(manifest.get("tokenizer"), storage.path(name), args.tokenizer)
        with storage.reading(name):
            files = export_hf(storage.path(name), ModelConfig(**manifest["model"]), args.out,
                              dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, tokenizer=tokenizer)
        print(f"exported {storage.path(name)} (step {manifest['step']}) to {args.out}: "
              f"{', '.join(f.name for f in files)}")
        return 0
    storage, names = find_checkpoints(args.path)
    if args.ckpt_command == "ls":
        print("\n".join(format_rows(list_rows(storage, names, checksums=args.verify))))
        return 0
    bad = 0
    for name in names:
        if verdict(name):  # being written, left by a crash, or set aside: not resumed
            print(f"{storage.path(name)}: {verdict(name)}")
            continue
        problems = verify(storage, name)
        print(f"{storage.path(name)}: {'verified' if not problems else 'FAILED: ' + '; '.join(problems)}")
        bad += bool(problems)
    if bad:
        total = sum(not verdict(n) for n in names)
        raise KeelError(f"{bad} of {total} checkpoints under {args.path} failed verification; `keel train` resumes "
                        f"the newest that verifies and sets the others aside")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from keel.data.prepare import describe, prepare
    from keel.data.stats import format_stats, load_stats

    if args.data_command == "stats":
        stats = load_stats(args.dir)
        print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
        return 0
    cfg = _load(args)
    if args.source:
        cfg.data.sources = {"main": SourceConfig(paths=args.source)}
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: expected at least 1")
        cfg.data.workers = args.workers
    out = args.out or Path(cfg.data.dir)
    started = time.perf_counter()
    manifest = prepare(cfg.data, out, force=args.force, progress=True)
    print(f"corpus in {out} ({time.perf_counter() - started:.1f} s; `keel data stats {out}` for what was removed)")
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
    handler = {"train": cmd_train, "data": cmd_data, "ckpt": cmd_ckpt, "config": cmd_config, "pause": cmd_pause,
               "status": cmd_status, "quarantine": cmd_quarantine, "report": cmd_report,
               "plan": cmd_plan, "drill": cmd_drill}[args.command]
    try:
        return handler(args)
    except KeelError as e:
        return _bad_input(str(e), e.exit_code, e.every_rank)
    except USER_PATH_ERRORS as e:
        if e.filename is None:  # not about a path the user gave: a fault to see in full
            raise
        return _bad_input(f"{str(e.filename)!r}: {e.strerror}")


# A path the user named that is missing, of the wrong kind or forbidden; any other exception is a fault of keel
# or of the machine and keeps its traceback.
USER_PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def _bad_input(message: str, code: int = EXIT_BAD_INPUT, every_rank: bool = False) -> int:
    """One line on stderr; `every_rank`: every rank met the same error, so rank 0 alone says it."""
    rank = os.environ.get("RANK", "0")
    where = "" if rank == "0" else f" (rank {rank})"
    if rank == "0" or not every_rank:
        print(f"keel: error{where}: {' '.join(message.split(chr(10)))}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
