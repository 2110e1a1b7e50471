"""One job per run directory: a second `keel train` on the same directory refuses instead of
interleaving its checkpoints and logs with the first one's, and it refuses for as long as any worker of
the first job still lives: the job's launcher holds RUN_DIR/.lock, and each of its workers a shared lock
on RUN_DIR/.lock.workers, which the next job's launcher must be able to take exclusively."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from keel.errors import KeelError

LOCK = ".lock"
WORKERS = ".lock.workers"
HELD_ENV = "KEEL_RUN_LOCK_HELD"  # set for the workers of a job whose launcher holds the lock
WORKERS_ENV = "KEEL_WORKERS_LOCK"  # the file this job's workers lock, shared
_held: dict[str, int] = {}  # the workers' locks, held until the process ends


class RunLock:
    """An exclusive advisory lock (flock) on RUN_DIR/.lock, held for the life of the job and released
    by the kernel when the holder exits, however it exits."""

    def __init__(self, run_dir: Path, node: str = "") -> None:
        """`node`: in an elastic multi-node job each node's launcher holds its own lock (.lock.NODE)."""
        suffix = f".{node}" if node else ""
        self.run_dir, self.name, self.workers = run_dir, LOCK + suffix, WORKERS + suffix
        self.fd = -1

    def check_free(self) -> None:
        """Refuse now if another job holds the run directory, creating nothing: the checks made before the
        lock is taken (the run's settings against its checkpoints) would otherwise answer for a run in use."""
        try:
            fd = os.open(self.run_dir / self.name, os.O_RDWR)
        except OSError:
            return  # no lock file (a new run) or none this process may open: `acquire` decides
        self._take(fd)
        os.close(fd)  # the exclusive lock goes with it

    def _take(self, fd: int) -> None:
        """The exclusive lock on `fd`, or a KeelError naming its holder (and `fd` closed)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise KeelError(f"run directory {str(self.run_dir)!r} is in use by another keel job ({holder}); wait for "
                            f"it to end or pass another --run-dir") from None

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._take(fd)
        workers = self.run_dir / self.workers
        if left := _workers_alive(workers):
            os.close(fd)
            raise KeelError(f"run directory {str(self.run_dir)!r} is still in use by workers of an earlier keel job "
                            f"({left}); wait for them to end or stop them, or pass another --run-dir")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        self.fd = fd
        os.environ[HELD_ENV] = str(self.run_dir.resolve())
        os.environ[WORKERS_ENV] = str(workers.resolve())
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


def hold_as_worker(run_dir: Path) -> None:
    """A worker's share of the job's hold on the run directory, once the job's lock is held; the kernel
    releases it when the worker ends, however it ends."""
    path = os.environ.get(WORKERS_ENV) or str((run_dir / WORKERS).resolve())
    if path not in _held:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a starting job checks it (microseconds)
        _held[path] = fd


def _workers_alive(path: Path) -> str:
    """Who still holds the workers' lock (empty: nobody)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pids = _holders(path)
        return f"pids {', '.join(map(str, pids))}" if pids else f"they hold {path.name}"
    finally:
        os.close(fd)  # closing also releases the exclusive lock, so that this job's own workers can share it
    return ""


def _holders(path: Path) -> list[int]:
    """Processes of this host with `path` open (Linux /proc)."""
    target, pids = str(path.resolve()), []
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):
            continue
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:
            continue
    return sorted(pids)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on {info['host']}, since {started}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"
