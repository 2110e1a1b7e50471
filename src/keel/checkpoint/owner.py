"""Who writes a save that is not committed yet, and when what it left may be removed.

The rank 0 of the job saving claims the save's staging name (`step-NNNNNN.tmp`; on an object store the
step itself) before anything is written there, and holds the claim until the checkpoint is committed or
the unfinished save removed. On a directory (local or NFS) the claim is an exclusive flock on
`CHECKPOINT_DIR/.locks/step-NNNNNN.tmp`, which the kernel drops when the writer ends, however it ends; the
file names the writer: host, boot id, pid and the process's start time, replica group and run directory.
On an object store, which has no locks, the claim is an object of that name holding the same record.

What a save left is removed (by a start, or by a save of the same step) only when its writer is proven
gone: its lock can be taken and its record names a process of this machine (same boot id) that has
ended, or whose pid now belongs to a later process. A writer on another machine cannot be seen from this
one, and a lock on a network file system may be local to each client, so a save written from elsewhere
(or before saves were claimed) is removed only once nothing in it has changed for `ABANDONED_AFTER_S`.
Anything else is left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from keel.checkpoint.storage import Storage
from keel.core.replica import GROUP_ENV
from keel.errors import CheckpointError
from keel.rundir.events import host

# How long a save written from another machine must have been untouched before it counts as abandoned:
# longer than any save takes to write (its files change as they are written), short enough that space
# comes back within the day.
ABANDONED_AFTER_S = 3600.0


def _boot_id() -> str:
    """This machine's boot (Linux): two processes with the same one see each other's pids."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None when there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def writer_record(run: str) -> dict:
    """This process as the writer of a save of the run at `run`."""
    return {"host": host(), "boot": _boot_id(), "pid": os.getpid(), "start": _started(os.getpid()),
            "group": os.environ.get(GROUP_ENV), "run": run, "since": time.time()}


def describe(record: dict | None) -> str:
    if not record:
        return "a writer that left no record"
    group = f", replica group {record['group']}" if record.get("group") is not None else ""
    return f"pid {record.get('pid')} on {record.get('host')}{group}"


def _parse(raw: bytes) -> dict | None:
    """A writer's record, None when there is none or it is not one (cut short by a full volume, say)."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not (isinstance(record, dict) and isinstance(record.get("pid"), int) and isinstance(record.get("boot"), str)):
        return None
    return record


def judge(storage: Storage, name: str, record: dict | None, now: float | None = None) -> tuple[bool, str]:
    """Whether what a save left at `name` is abandoned, with why, given the record of its writer (the
    lock, where there is one, must be held by the caller: a writer holding it is alive)."""
    if record and record["boot"] and record["boot"] == _boot_id():
        if record["pid"] != os.getpid() and _started(record["pid"]) == record.get("start"):
            return False, f"being written by {describe(record)}"
        return True, f"its writer, {describe(record)}, has ended"
    changed = storage.newest_change(name)
    stamps = [t for t in (changed, (record or {}).get("since")) if isinstance(t, (int, float))]
    age = (now or time.time()) - max(stamps) if stamps else ABANDONED_AFTER_S
    writer = f"written by {describe(record)}, a process this machine cannot see" if record else "its writer unknown"
    if age >= ABANDONED_AFTER_S:
        return True, f"untouched for {age:.0f} s, {writer}"
    return False, f"{writer}, changed {age:.0f} s ago: kept until untouched for {ABANDONED_AFTER_S:.0f} s"


def _lock(path: str) -> int | None:
    """An fd holding the exclusive flock of the file at `path` (created if need be), or None when another
    process holds it. A holder that removed the file meanwhile leaves its lock on a name no one else opens:
    the file at `path` then is locked instead."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _read(fd: int) -> dict | None:
    return _parse(os.pread(fd, 1 << 16, 0))


@dataclass
class Claim:
    """A save's claim on its staging name, held until `release`."""

    storage: Storage
    name: str
    fd: int = -1

    def release(self, done: bool) -> None:
        """Drop the claim. Once the save is committed or removed (`done`) its record goes too; otherwise it
        stays with what the save left, for a later start to judge by (this process may live on)."""
        record = self.storage.lock_name(self.name)
        if done and self.fd < 0:
            self.storage.remove(record)
        elif done:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.storage.path(record))
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim(storage: Storage, name: str, run: str) -> Claim:
    """Make this process the writer of the save at staging name `name`, first removing what an abandoned
    save of the same step left there. Raises CheckpointError when its writer is not proven gone."""
    record = json.dumps(writer_record(run)).encode()
    if storage.remote:
        if (left := _remote_record(storage, name)) is not None:
            abandoned, why = judge(storage, name, left)
            if not abandoned:
                raise CheckpointError(f"{storage.path(name)} is {why}; this save is skipped")
        storage.remove(name)  # a crashed save of the same step, or the step saved before (replaced)
        storage.write_durably(storage.lock_name(name), record)
        return Claim(storage, name)
    fd = _lock(storage.path(storage.lock_name(name)))
    if fd is None:
        raise CheckpointError(f"{storage.path(name)} is being written by another process; this save is skipped")
    try:
        if storage.exists(name):
            abandoned, why = judge(storage, name, _read(fd))
            if not abandoned:
                raise CheckpointError(f"{storage.path(name)} is {why}; this save is skipped")
            storage.remove(name)
        with contextlib.suppress(OSError):  # a full volume: the lock alone still keeps starts away meanwhile
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
    except BaseException:
        os.close(fd)
        raise
    return Claim(storage, name, fd)


@contextlib.contextmanager
def unclaimed(storage: Storage, name: str) -> Iterator[bool]:
    """Whether no writer holds the claim on staging name `name` (a local directory's), holding its lock
    meanwhile so that none takes it."""
    lock = storage.path(storage.lock_name(name))
    fd = _lock(lock)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        if not storage.exists(name):  # no save of it left: its lock file goes too
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
        os.close(fd)


def _remote_record(storage: Storage, name: str) -> dict | None:
    try:
        return _parse(storage.read_bytes(storage.lock_name(name)))
    except FileNotFoundError:
        return None


def remove_if_abandoned(storage: Storage, name: str) -> tuple[bool, str]:
    """Remove what a save left at `name` if its writer is proven gone. Returns whether it was removed, and
    why (or why not; empty when it went meanwhile: committed, or removed by its writer)."""
    if storage.remote:
        record = _remote_record(storage, name)
        abandoned, why = judge(storage, name, record)
        if abandoned:
            storage.remove(name)
            storage.remove(storage.lock_name(name))
        return abandoned, why
    lock = storage.path(storage.lock_name(name))
    fd = _lock(lock)
    if fd is None:
        return False, f"being written by {describe(_read_file(lock))}"
    try:
        if not storage.exists(name):
            os.unlink(lock)
            return False, ""
        abandoned, why = judge(storage, name, _read(fd))
        if abandoned:
            storage.remove(name)
            os.unlink(lock)
        return abandoned, why
    finally:
        os.close(fd)


def _read_file(path: str) -> dict | None:
    try:
        return _parse(Path(path).read_bytes())
    except OSError:
        return None
