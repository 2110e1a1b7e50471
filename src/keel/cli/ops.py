"""Commands on a run directory while or after it runs: pause, status, report, runs, quarantine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.cli.pathargs import PathArg, reads, writes_file
from keel.errors import KeelError

RUN_DIR = reads("dir", "pass the run directory of a keel train job")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pa = sub.add_parser("pause", help="ask a running job to checkpoint at the next step and exit 75")
    pa.add_argument("run_dir", action=PathArg, check=RUN_DIR, metavar="RUN_DIR",
                    help="the run directory of the job to pause (its --run-dir)")
    pa.set_defaults(handler=cmd_pause)
    r = sub.add_parser("report", help="write RUN_DIR/report.html: curves, step time, goodput, hardware, events; "
                       "with several run directories, one page comparing them")
    r.add_argument("run_dirs", action=PathArg, check=RUN_DIR, nargs="+", metavar="RUN_DIR",
                   help="the run directory of a keel train job; several to compare them")
    r.add_argument("--out", action=PathArg, check=writes_file,
                   help="where to write it (default RUN_DIR/report.html; for several runs "
                   "./compare.html)")
    r.set_defaults(handler=cmd_report)
    ls = sub.add_parser("runs", help="the run directories under DIR: state, step, losses, goodput")
    ls.add_argument("root", action=PathArg, check=reads("dir", "pass a directory holding run directories"), nargs="?",
                    default=Path("runs"), metavar="DIR",
                    help="where to look (default ./runs)")
    ls.add_argument("--json", action="store_true", help="one JSON array")
    ls.set_defaults(handler=cmd_runs)
    st = sub.add_parser("status", help="state, step, ETA, loss, goodput, last checkpoint, alerts, last events")
    st.add_argument("run_dir", action=PathArg, check=RUN_DIR, metavar="RUN_DIR",
                    help="the run directory of a keel train job, running or not")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.add_argument("--events", type=int, default=5, help="last events shown")
    st.set_defaults(handler=cmd_status)
    q = sub.add_parser("quarantine", help="keep a node out of a run: its launcher leaves, the others go on")
    q.add_argument("run_dir", action=PathArg, check=RUN_DIR, metavar="RUN_DIR",
                   help="the run directory of the elastic job (quarantine.json is kept there)")
    q.add_argument("node", help="node name (KEEL_NODE of its launcher, else its host name)")
    q.add_argument("--reason", default="keel quarantine", help="recorded in quarantine.json")
    q.add_argument("--release", action="store_true", help="let the node back in")
    q.set_defaults(handler=cmd_quarantine)


def cmd_pause(args: argparse.Namespace) -> int:
    from keel.health.signals import request_pause
    from keel.rundir.status import job_alive

    if not job_alive(args.run_dir):
        raise KeelError(f"no keel job is running in {args.run_dir}; `keel status {args.run_dir}` shows where it "
                        f"stands")
    # A run of replica groups: every group pauses (each is a run directory of its own under groups/).
    groups = sorted(p for p in (args.run_dir / "groups").glob("*") if (p / "status.json").exists())
    path = [request_pause(group) for group in groups][0] if groups else request_pause(args.run_dir)
    print(f"asked the job in {args.run_dir} to pause at its next step ({path}); `keel status {args.run_dir}` "
          f"shows when it has")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from keel.report.status import summary, summary_lines

    info = summary(args.run_dir, args.events)
    print(json.dumps(info) if args.json else "\n".join(summary_lines(info)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from keel.paths import check_writable_file
    from keel.report.compare import write_comparison
    from keel.report.html import write_report

    several = len(args.run_dirs) > 1
    if args.out is None:  # the default place is checked like a given one, before anything is read
        args.out = check_writable_file(Path("compare.html") if several else args.run_dirs[0] / "report.html",
                                       "the report")
    path = write_comparison(args.run_dirs, args.out) if several else write_report(args.run_dirs[0], args.out)
    print(f"wrote {path}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from keel.report.compare import list_runs, runs_lines
    from keel.report.status import json_safe

    rows = list_runs(args.root)
    print(json.dumps(json_safe(rows)) if args.json else "\n".join(runs_lines(rows, args.root)))
    return 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    from keel.paths import check_writable_dir
    from keel.rundir.quarantine import add_to_quarantine, release

    check_writable_dir(args.run_dir, "RUN_DIR")  # quarantine.json is written there
    if args.release:
        n = release(args.run_dir, args.node)
        print(f"released {args.node} ({n} record(s) removed from {args.run_dir / 'quarantine.json'})")
    else:
        add_to_quarantine(args.run_dir, [args.node], source="keel quarantine", reason=args.reason)
        print(f"quarantined {args.node}: its launcher leaves the job; the other nodes go on without it")
    return 0

