"""Tasks over a prepare's input files, in worker processes, with a progress line of MB/s and ETA.

Every task leaves its result in files with a completion marker, so the order in which tasks finish does
not matter and a task that is run twice writes the same bytes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.context import BaseContext


class Progress:
    """One line of progress: done/total MB, MB/s and ETA; redrawn in place on a terminal, else every 10 s."""

    def __init__(self, label: str, total_bytes: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total_bytes, enabled
        self.done, self.files, self.start, self.last = 0, 0, time.monotonic(), 0.0
        self.tty = enabled and sys.stderr.isatty()

    def advance(self, nbytes: int, files: int = 1) -> None:
        self.done += nbytes
        self.files += files
        now = time.monotonic()
        if self.enabled and (self.tty or now - self.last >= 10 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            line = (f"{self.label}: {self.files} files, {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, "
                    f"{rate / 1e6:,.1f} MB/s, ETA {eta:,.0f} s")
            print(f"\r{line}\033[K" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def one_thread() -> None:
    """A worker process keeps to one core: the workers are the parallelism (Hugging Face's encoder would
    otherwise start a thread per core in each of them)."""
    os.environ["RAYON_NUM_THREADS"] = "1"


def _start_method() -> BaseContext:
    """fork when this process runs one thread: a forked worker starts with every module imported (a spawned one
    imports numpy and keel again, a quarter of a second of CPU). With other threads running (a training job's
    launcher prepares its corpus), a fork could copy a lock that one of them holds: spawn."""
    if threading.active_count() == 1 and "fork" in get_all_start_methods():
        return get_context("fork")
    return get_context("spawn")


class Workers:
    """The worker processes of one prepare, started at its first parallel stage and kept for the next: starting
    a worker (an interpreter, numpy, keel's data modules) costs about as much CPU as scanning megabytes."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def run(self, task: Callable, items: list[tuple], progress: Progress) -> None:
        """Run `task(*item)` for every item, in the worker processes when there are several, advancing the
        progress by each item's first element's size and number of files. Results are files with markers, so
        the order of completion is free."""
        if self.workers <= 1 or len(items) <= 1:
            for item in items:
                task(*item)
                progress.advance(item[0].size, len(item[0].files))
            return
        if self.pool is None:
            self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=_start_method(),
                                            initializer=one_thread)
        futures = {self.pool.submit(task, *item): item for item in items}
        for future in futures:  # in submission order; the first error is raised, the rest are cancelled
            future.result()
            progress.advance(futures[future][0].size, len(futures[future][0].files))
