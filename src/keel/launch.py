"""`keel train --nproc N`: hand the command to torchrun's elastic agent, which starts N workers."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from keel.errors import EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE

LAUNCHER_FLAGS = ("--nproc", "--max-restarts")
PASSED_THROUGH = (EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE)


def worker_argv(argv: list[str]) -> list[str]:
    """The user's command without the flags that only the launcher reads."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCHER_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in LAUNCHER_FLAGS)):
            out.append(arg)
    return out


def launch(nproc: int, max_restarts: int, argv: list[str]) -> int:
    """Run the workers under torchrun (standalone c10d rendezvous on a free port). Exit code: that
    of the first worker to fail when it reports bad input, a guard's stop, a pause or a quarantine;
    1 for any other failure."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Workers restarted by the agent must not share the rendezvous store: they would read the
    # previous attempt's addresses and fail to connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "--module", "keel", *worker_argv(argv)])
    try:
        run(args)
    except ChildFailedError as e:
        # The first worker to fail holds the cause; the agent then stops the others with signals.
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode in PASSED_THROUGH else 1
    return 0
