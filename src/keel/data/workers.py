"""Tasks over a prepare's input files, in worker processes, with a progress line of MB/s and ETA.

Every task leaves its result in files with a completion marker, so the order in which tasks finish does
not matter and a task that is run twice writes the same bytes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context


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


def run_tasks(task: Callable, items: list[tuple], workers: int, progress: Progress) -> None:
    """Run `task(*item)` for every item, in worker processes when there are several, advancing the progress by
    each item's first element's size and number of files. Results are files with markers, so the order of
    completion is free."""
    if workers <= 1 or len(items) <= 1:
        for item in items:
            task(*item)
            progress.advance(item[0].size, len(item[0].files))
        return
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=one_thread) as pool:
        futures = {pool.submit(task, *item): item for item in items}
        for future in futures:  # in submission order; the first error is raised, the rest are cancelled
            try:
                future.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
            progress.advance(futures[future][0].size, len(futures[future][0].files))
