"""`keel` command line: train, pause, status, report, quarantine, plan, sweep, drill, data prepare, ckpt, eval,
config, completion."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import NoReturn

from keel.cli import ckpt, completion, config, data, drill, evaluate, ops, plan, sweep, train
from keel.cli.hints import key_value_hint
from keel.errors import EXIT_BAD_INPUT, KeelError
from keel.paths import shown

# The command families in the order `keel --help` lists them.
FAMILIES = (train, ops, plan, sweep, drill, data, ckpt, evaluate, config, completion)


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line, like every other bad input: the usage block would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"keel: error: {message} (`{self.prog} --help` lists the arguments)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="keel", description="LLM pre-training, from one CPU to thousands of GPUs.")
    sub = p.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The profiler's own library prints a line to stderr at every start and stop of a profiled step; its
    # messages stay available with KINETO_LOG_LEVEL set.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    p = parser()
    # Overrides may come before, between or after options: whatever is left over must be KEY=VALUE.
    try:
        args, rest = p.parse_known_args(argv)  # every path argument is checked here (keel.cli.pathargs)
    except KeelError as e:
        return _bad_input(str(e), e.exit_code, e.every_rank)
    unknown = [a for a in rest if "=" not in a or a.startswith("-")]
    flags = [a for a in unknown if a.startswith("-")]
    if flags and hasattr(args, "overrides") and (hint := key_value_hint(args.command, flags, argv)):
        p.exit(EXIT_BAD_INPUT, f"keel: error: unrecognized arguments: {' '.join(flags)}; {hint}\n")
    if unknown or (rest and not hasattr(args, "overrides")):
        p.error(f"unrecognized arguments: {' '.join(unknown or rest)}")
    if rest:
        args.overrides = args.overrides + rest
    args.argv = argv
    try:
        return args.handler(args)
    except BrokenPipeError:  # the reader went away (`keel config --reference | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeelError as e:
        return _bad_input(str(e), e.exit_code, e.every_rank)
    except OSError as e:
        if e.filename is None or not (isinstance(e, USER_PATH_ERRORS) or e.errno in USER_PATH_ERRNOS):
            raise  # not about a path the user gave: a fault to see in full
        return _bad_input(f"{shown(e.filename)}: {e.strerror}")


def forked_worker(launcher_env: dict[str, str], argv: list[str]) -> None:
    """A worker of `keel train --nproc N`, forked by the launcher's worker server (keel.launch): `keel ARGV`
    as `python -m keel` runs it. A code other than 0 is the process's exit code; 0 returns to the agent,
    which ends the workers once every one has returned."""
    from keel.core.process import run_exit_handlers
    from keel.worker_server import become_worker

    become_worker(launcher_env)
    try:
        code = main(argv)
    finally:
        run_exit_handlers()
    if code:
        raise SystemExit(code)


# A path the user named that is missing, of the wrong kind or forbidden; any other exception is a fault of keel
# or of the machine and keeps its traceback.
USER_PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
USER_PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP)


def _bad_input(message: str, code: int = EXIT_BAD_INPUT, every_rank: bool = False) -> int:
    """One line on stderr; `every_rank`: every rank met the same error, so rank 0 alone says it."""
    rank = os.environ.get("RANK", "0")
    where = "" if rank == "0" else f" (rank {rank})"
    if rank == "0" or not every_rank:
        print(f"keel: error{where}: {' '.join(message.split(chr(10)))}", file=sys.stderr, flush=True)
    return code
