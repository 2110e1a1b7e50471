"""`keel train`: the checks a start makes before it creates anything, then the launcher or the training loop."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from keel.cli.config import add_config_args, config_from_args
from keel.cli.data import ensure_corpus
from keel.cli.pathargs import PathArg, resume, writes_dir
from keel.config import Config
from keel.errors import EXIT_PAUSED, ConfigError, KeelError
from keel.parallel.degrees import resolve_degrees

if TYPE_CHECKING:
    import torch


def add_parsers(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train (or resume) a model")
    add_config_args(t)
    t.add_argument("--run-dir", action=PathArg, check=writes_dir, help="run directory (default: runs/<config name>)")
    t.add_argument("--resume", default="auto", action=PathArg, check=resume,
                   help="auto: latest checkpoint of the run directory (default) · never: start fresh · PATH: "
                        "that checkpoint")
    t.add_argument("--nproc", type=int, default=None,
                   help="launch N processes on this machine through torchrun's elastic agent")
    t.add_argument("--replica-groups", type=int, default=None, metavar="R",
                   help="R replica groups of --nproc processes each (fault_tolerance.replica_groups): a failed group "
                        "heals from the live ones while they keep training")
    t.add_argument("--max-restarts", type=int, default=None,
                   help="worker-group restarts the elastic agent may make (default: health.max_restarts)")
    t.add_argument("--nnodes", default="1", help="MIN:MAX nodes of an elastic job: run the same command on every "
                   "node (with --rdzv-endpoint); the job goes on with at least MIN")
    t.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the c10d rendezvous (one node's address) for "
                   "--nnodes")
    t.add_argument("--local-addr", default="", help="this node's address as the other nodes reach it, for --nnodes "
                   "(default: its host name); the node whose address is the --rdzv-endpoint host hosts the "
                   "rendezvous")
    t.add_argument("--accept-change", action="append", default=[], metavar="KEY[,KEY]",
                   help="resume although these identity fields changed (e.g. train.seq_len for a longer context "
                        "phase), or take a finished run as it is although these settings changed (e.g. optim.lr); "
                        "the change is recorded in events.jsonl (and every later manifest)")
    t.add_argument("--quiet", action="store_true", help="no progress on the console, only warnings, errors and "
                   "alerts (everything still goes to RUN_DIR/logs)")
    t.set_defaults(handler=cmd_train)


def in_torchrun_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def accepted_changes(cfg: Config, flags: list[str]) -> tuple[str, ...]:
    """The identity fields a resume (and the settings a finished run) may change on purpose: `--accept-change`,
    and the corpus when data.allow_corpus_change is set."""
    from keel.checkpoint.identity import check_accept_keys

    keys = check_accept_keys(k.strip() for flag in flags for k in flag.split(","))
    return tuple(sorted(set(keys) | ({"data.corpus"} if cfg.data.allow_corpus_change else set())))


def cmd_train(args: argparse.Namespace) -> int:
    from keel.health.lifeline import die_with_launcher
    from keel.health.signals import stop_signals_kept

    worker = in_torchrun_worker()
    if args.replica_groups is not None:
        if args.replica_groups < 1:
            raise KeelError(f"--replica-groups {args.replica_groups}: expected a positive number of groups")
        args.overrides.append(f"fault_tolerance.replica_groups={args.replica_groups}")
    if worker:
        die_with_launcher()
    with stop_signals_kept():  # from here on a SIGTERM or SIGUSR1 is a pause, whatever the job is doing
        return _train_command(args, worker)


def _train_command(args: argparse.Namespace, worker: bool) -> int:
    from keel.core.replica import GROUP_ENV
    from keel.worker_server import start_worker_server

    cfg = config_from_args(args)
    nproc = 1 if worker or args.nproc is None else args.nproc
    elastic = not worker and args.nnodes != "1"
    groups = cfg.fault_tolerance.replica_groups
    in_groups = groups > 1 and GROUP_ENV not in os.environ and not worker  # a launcher per group, not one here
    launches = not worker and not in_groups and (nproc > 1 or restart_budget(args, cfg) > 0 or elastic or groups > 1)
    if launches and nproc > 0:  # a bad --nproc is refused below, and the server ends with this process
        start_worker_server(nproc)  # first: its imports (torch's among them) overlap everything below
    code = _checked_start(args, cfg, worker, nproc, elastic, launches, in_groups)
    if code == 0 and not worker and GROUP_ENV not in os.environ:  # the whole job, not one group's part
        run_dir = args.run_dir or Path("runs") / cfg.name
        report_to_trackers(cfg, run_dir, run_dir / "groups" / "0" if in_groups else run_dir)
    return code


def report_to_trackers(cfg: Config, run_dir: Path, logged_from: Path) -> None:
    """A finished run's report, written and attached to the tracker runs it logged to (from `logged_from`)."""
    from keel.monitor.trackers import attach_report, enabled_trackers
    from keel.report.html import write_report

    if not enabled_trackers(cfg):
        return
    try:
        report = write_report(run_dir)
    except (KeelError, OSError) as e:
        print(f"keel: warning: the report for the trackers could not be written: {e}", flush=True)
        return
    for problem in attach_report(cfg, logged_from, report):
        print(f"keel: warning: {problem}", flush=True)


def _checked_start(args: argparse.Namespace, cfg: Config, worker: bool, nproc: int, elastic: bool, launches: bool,
                   in_groups: bool) -> int:
    from keel.checkpoint.identity import run_identity
    from keel.checkpoint.memory import resume_on_restart
    from keel.checkpoint.resume import check_resume, check_resume_identity, checkpoint_root
    from keel.health.signals import stop_requested_early
    from keel.rundir.lock import RunLock, held_by_launcher
    from keel.rundir.quarantine import node_name

    run_dir = args.run_dir or Path("runs") / cfg.name
    check_train_args(args, cfg, run_dir)
    if args.quiet:
        os.environ["KEEL_QUIET"] = "1"  # the workers' consoles too
    if elastic:
        check_elastic(args.nnodes, args.rdzv_endpoint, run_dir)
    max_restarts = restart_budget(args, cfg)
    if not worker and not elastic:
        resolve_degrees(cfg, nproc)
    check_device(cfg, worker, nproc, in_groups)
    accepted = accepted_changes(cfg, args.accept_change)
    corpus = ensure_corpus(cfg, verbose=not worker or os.environ.get("RANK") == "0")
    storage = checkpoint_root(cfg, run_dir)
    resume = resume_on_restart(cfg, storage, args.resume)
    lock = RunLock(run_dir, node_name() if elastic else "")
    if not worker and not held_by_launcher(run_dir):
        lock.check_free()  # a run in use is said to be so, not judged by the checkpoints its job is writing
    if not worker:
        check_resume(storage, resume)  # a bad --resume fails here, before any process starts
        check_resume_identity(storage, resume, cfg, run_identity(cfg, corpus.fingerprint,
                                                                 corpus.manifest["tokenizer"]), accepted)
        check_init_from(cfg)
    if not worker and (received := stop_requested_early()):
        print(f"keel: {received} received before the job started; nothing was changed, run the same command to "
              f"start it", flush=True)
        return EXIT_PAUSED
    # The launcher holds the run directory for the whole job (each node's launcher its own lock in an
    # elastic job); torchrun's own workers lock it in rank 0.
    with lock if not worker and not held_by_launcher(run_dir) else contextlib.nullcontext():
        if in_groups:
            from keel.groups import launch_groups  # the replica groups' code only where there are groups

            return launch_groups(cfg, args.argv, run_dir, nproc, max_restarts)
        if launches:
            return _launch_node(args, cfg, run_dir, nproc, max_restarts)
        from keel.drill.faults import as_callbacks
        from keel.train.worker import train

        # The drill's faults reach the loop as ordinary callbacks, after the configured ones.
        return train(cfg, run_dir, resume, accepted, [*cfg.callbacks, *as_callbacks(cfg.drill.inject, run_dir)])


def _launch_node(args: argparse.Namespace, cfg: Config, run_dir: Path, nproc: int, max_restarts: int) -> int:
    """This node's launcher: its workers under the elastic agent, meeting the other nodes' where there are."""
    from keel.checkpoint.memory import held_in_memory
    from keel.cli import forked_worker
    from keel.launch import Rendezvous, launch

    with held_in_memory(cfg, run_dir, nproc):  # the memory tier outlives the workers, not the job
        nodes = Rendezvous(args.nnodes, args.rdzv_endpoint, args.local_addr, cfg.health.rendezvous_timeout_s)
        return launch(nproc, max_restarts, args.argv, run_dir, forked_worker, nodes,
                      shutdown_grace_s=cfg.health.shutdown_grace_s,
                      no_progress_restarts=cfg.health.no_progress_restarts, cut_off_limit=cfg.health.cut_off_limit,
                      flap_limit=cfg.health.flap_limit, in_process_restart=in_process_restarts(cfg, args.nnodes))


def in_process_restarts(cfg: Config, nnodes: str) -> bool:
    """Whether this job restarts a killed worker alone (health.in_process_restart), and where it was asked for
    but cannot, the line that says why."""
    from keel.parallel.mesh import pick_device

    if not cfg.health.in_process_restart:
        return False
    why = ("this job spans nodes" if nnodes != "1" else
           "its replica groups heal a group from a live one instead" if cfg.fault_tolerance.replica_groups > 1 else
           "its workers run on CUDA, where a collective whose peer died hangs until its timeout instead of failing"
           if pick_device(cfg.train.device).type != "cpu" else "")
    if why:
        print(f"keel: health.in_process_restart applies to one-node CPU jobs, and {why}: a killed worker restarts "
              f"every worker", flush=True)
    return not why


def check_init_from(cfg: Config) -> None:
    """The Hugging Face weights a fresh run starts from fit its model, checked before any process starts."""
    if cfg.model.init_from:
        from keel.checkpoint.export import check_hf_matches

        check_hf_matches(Path(cfg.model.init_from.removeprefix("hf:")), cfg.model)


def check_device(cfg: Config, worker: bool, nproc: int, in_groups: bool) -> None:
    """A missing device fails here, before any process starts; more processes than a CPU's cores are said once,
    by the launcher of the whole job."""
    from keel.core.replica import GROUP_ENV
    from keel.parallel.mesh import pick_device

    device = pick_device(cfg.train.device)
    check_float8(cfg, device)
    if not worker and GROUP_ENV not in os.environ:
        warn_oversubscribed(device, nproc, cfg.fault_tolerance.replica_groups if in_groups else 1)


def check_float8(cfg: Config, device: torch.device) -> None:
    """train.precision = fp8 needs torchao, and on a GPU torch.compile, which fuses the float8 casts into the
    GEMMs' neighbours (eager, they cost more than the float8 GEMMs save)."""
    if cfg.train.precision != "fp8":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("train.precision = fp8 needs torchao: pip install 'keel-pretrain[fp8]'")
    if device.type == "cuda" and not cfg.parallel.compile:
        raise ConfigError("train.precision = fp8 on a GPU needs parallel.compile = true (eager float8 casts cost "
                          "more than the float8 GEMMs save)")


def visible_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which a container or `taskset` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warn_oversubscribed(device: torch.device, nproc: int, groups: int) -> None:
    """On a CPU more processes than cores take turns on them, and every step of every process slows; on GPUs
    each process has a device of its own, and its cores are not what bounds the processes."""
    cores, processes = visible_cores(), nproc * groups
    if device.type != "cpu" or processes <= cores:
        return
    started = f"--nproc {nproc} x {groups} replica groups start" if groups > 1 else f"--nproc {nproc} starts"
    print(f"keel: warning: {started} {processes} processes on {cores} visible CPU cores: they take turns on the "
          f"cores and every step of every process is slower (up to --nproc {max(1, cores // groups)} runs at full "
          f"speed)", file=sys.stderr, flush=True)


def restart_budget(args: argparse.Namespace, cfg: Config) -> int:
    """The worker-group restarts the agent may make: --max-restarts, else each replica group's own budget,
    else health.max_restarts."""
    if args.max_restarts is not None:
        return int(args.max_restarts)
    return cfg.fault_tolerance.max_restarts if cfg.fault_tolerance.replica_groups > 1 else cfg.health.max_restarts


def check_train_args(args: argparse.Namespace, cfg: Config, run_dir: Path) -> None:
    """What a start can check from its arguments and config alone, before it creates anything."""
    from keel.checkpoint.memory import check_memory_tier
    from keel.drill.faults import check_injections
    from keel.monitor.run_monitor import check_exporter_ports
    from keel.monitor.tracking.registry import check_trackers
    from keel.paths import check_input, check_writable_dir
    from keel.train.callbacks import check_callbacks

    if args.nproc is not None and args.nproc < 1:
        raise KeelError(f"--nproc {args.nproc}: expected a positive number of processes")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise KeelError(f"--max-restarts {args.max_restarts}: expected 0 or more restarts")
    if args.local_addr and args.nnodes == "1":
        raise KeelError(f"--local-addr {args.local_addr}: a node's address is for an elastic job; pass --nnodes "
                        f"MIN:MAX and --rdzv-endpoint too, or leave it out")
    check_writable_dir(run_dir, "--run-dir" if args.run_dir else "the run directory")
    storage = cfg.checkpoint.dir
    if storage and ("://" not in storage or storage.startswith("file://")):
        check_writable_dir(Path(storage.removeprefix("file://")), "checkpoint.dir")
    if cfg.model.init_from:
        check_input(cfg.model.init_from.removeprefix("hf:"), "model.init_from", "dir",
                    "pass hf:DIR, a Hugging Face Llama directory")
    check_callbacks(cfg.callbacks)
    check_trackers(cfg)
    if not in_torchrun_worker():  # the launcher: a port set in the config and taken, before any worker binds one
        check_exporter_ports(cfg.monitor, args.nproc or 1)
        check_memory_tier(cfg, restart_budget(args, cfg))
    if cfg.eval.downstream_tasks:
        for include in cfg.eval.downstream_include:
            check_input(include, "eval.downstream_include", "dir", "pass directories of lm-eval task YAML files")
        from keel.downstream.tasks import check_tasks

        check_tasks(cfg.eval.downstream_tasks, cfg.eval.downstream_include)
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

