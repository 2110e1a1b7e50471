"""How a `keel` process ends, and how its background work lets it."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def in_background(work: Callable[[], T], name: str) -> Future[T]:
    """Run `work` on a daemon thread; its result (or exception) in the future returned. A process that ends
    (or fails) with such work in flight exits at once rather than joining it, and `exit_now` skips the
    interpreter's teardown only where every thread but the main one is a daemon."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            done.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def exit_now(code: int) -> None:
    """Exit with `code` the way the interpreter would (atexit handlers, buffered output), without its
    teardown: with torch loaded, freeing every module one by one takes about a second per process, in
    the launcher and in every worker, after the run directory holds everything. A process that still
    has a non-daemon thread ends the ordinary way, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    run_exit_handlers()
    os._exit(code)


def run_exit_handlers() -> None:
    """What the interpreter does at exit before its teardown: the atexit handlers, buffered output flushed.
    A forked process (a worker the launcher's server forks) ends without them unless it calls this."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader is gone
            stream.flush()
