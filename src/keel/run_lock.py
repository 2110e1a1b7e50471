"""One job per run directory: a second `keel train` on the same directory refuses instead of
interleaving its checkpoints and logs with the first one's."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from keel.errors import KeelError

LOCK = ".lock"
HELD_ENV = "KEEL_RUN_LOCK_HELD"  # set for the workers of a job whose launcher holds the lock


class RunLock:
    """An exclusive advisory lock (flock) on RUN_DIR/.lock, held for the life of the job and released
    by the kernel when the holder exits, however it exits."""

    def __init__(self, run_dir: Path, node: str = "") -> None:
        """`node`: in an elastic multi-node job each node's launcher holds its own lock (.lock.NODE)."""
        self.run_dir, self.name = run_dir, LOCK + (f".{node}" if node else "")
        self.fd = -1

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise KeelError(f"run directory {str(self.run_dir)!r} is in use by another keel job ({holder}); wait for "
                            f"it to end or pass another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        self.fd = fd
        os.environ[HELD_ENV] = str(self.run_dir.resolve())
        return self

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            os.environ.pop(HELD_ENV, None)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def held_by_launcher(run_dir: Path) -> bool:
    return os.environ.get(HELD_ENV) == str(run_dir.resolve())


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on {info['host']}, since {started}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"
