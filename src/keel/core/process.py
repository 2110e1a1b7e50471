"""How a `keel` process ends."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


def exit_now(code: int) -> None:
    """Exit with `code` the way the interpreter would (atexit handlers, buffered output), without its
    teardown: with torch loaded, freeing every module one by one takes about a second per process, in
    the launcher and in every worker, after the run directory holds everything. A process that still
    has a non-daemon thread ends the ordinary way, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader is gone
            stream.flush()
    os._exit(code)
