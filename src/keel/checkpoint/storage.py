"""Where checkpoints live: a local (or NFS) directory, or an fsspec URL such as `s3://bucket/prefix`.

Both kinds commit the same way: a checkpoint exists once its `manifest.json` exists, and the manifest
is written after every other file is durable. They differ only in how the last step is made atomic:
a directory is written as `step-NNNNNN.tmp/` and renamed, while an object store, which has no rename,
writes the files in place and the manifest object last (a single PUT is atomic).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from keel.errors import CheckpointError

if TYPE_CHECKING:  # DCP is imported by what reads or writes a checkpoint, not by what only lists one
    from torch.distributed.checkpoint import StorageReader, StorageWriter

LATEST = "latest"
LOCKS = ".locks"  # the readers' and writers' lock files of a directory's checkpoints
_CHUNK = 8 << 20
# Faults of the volume rather than of keel: a full disk or quota, a read-only or vanished mount, no permission.
VOLUME_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
                           errno.ESTALE, errno.ENOTCONN, errno.ENODEV, errno.EIO})


class LocalFiles:
    """What Storage asks of a local directory, answered as fsspec's local file system answers it."""

    def invalidate_cache(self) -> None:
        """Nothing is cached."""

    def ls(self, path: str, detail: bool = False) -> list[str]:
        return [os.path.join(path, entry) for entry in os.listdir(path)]

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def find(self, base: str, detail: bool = True) -> dict[str, dict[str, int]]:
        """Every file under `base`, with its size."""
        found = {}
        for root, _, names in os.walk(base):
            for entry in names:
                path = os.path.join(root, entry)
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    found[path] = {"size": os.stat(path).st_size}
        return found

    def cat_file(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def rm(self, path: str, recursive: bool = False) -> None:
        if recursive and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


class Storage:
    """One checkpoint root. Names passed to its methods are relative to the root (`step-000100`,
    `step-000100/manifest.json`)."""

    def __init__(self, root: str | Path) -> None:
        root = str(root)
        self.remote = "://" in root and not root.startswith("file://")
        self.root = root.rstrip("/") if self.remote else str(Path(root.removeprefix("file://")).absolute())
        self.fs: Any = LocalFiles()
        if self.remote:
            import fsspec  # a third of a second of every process's start: only for an object store

            try:
                self.fs, _ = fsspec.core.url_to_fs(self.root)
            except (ImportError, ValueError) as e:
                raise CheckpointError(f"checkpoint storage {root!r} cannot be opened ({e}); install the "
                                      f"filesystem's package (for s3://: pip install 'keel-pretrain[s3]')") from None

    def __str__(self) -> str:
        return self.root

    def path(self, name: str = "") -> str:
        return f"{self.root}/{name}" if name else self.root

    # ------------------------------------------------------------------ reading

    def names(self) -> list[str]:
        """Entries directly under the root."""
        self.fs.invalidate_cache()
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def files(self, name: str) -> dict[str, int]:
        """Every file under `name` with its size, by path relative to it."""
        base = (self.fs._strip_protocol(self.path(name)) if self.remote else self.path(name)).rstrip("/")
        self.fs.invalidate_cache()  # other ranks and processes write here too
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(base) + 1:]: int(info["size"]) for p, info in found.items()}

    def newest_change(self, name: str) -> float | None:
        """When anything under `name` last changed (seconds since the epoch), None when nothing is there or
        the store does not say."""
        if self.remote:
            base = self.fs._strip_protocol(self.path(name)).rstrip("/")
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return None
            return max((t for info in found.values() if (t := _modified(info)) is not None), default=None)
        stamps = []
        for root, _, names in os.walk(self.path(name)):
            for entry in ["", *names]:
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                    stamps.append(os.stat(os.path.join(root, entry)).st_mtime)
        return max(stamps, default=None)

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def digest(self, name: str) -> str:
        """XXH3-128 of one file: mapped into memory when local (no copy), streamed otherwise."""
        h = xxhash.xxh3_128()
        if not self.remote:
            with open(self.path(name), "rb") as f:
                if os.fstat(f.fileno()).st_size:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                        h.update(mapped)
            return h.hexdigest()
        with self.fs.open(self.path(name), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def reader(self, name: str) -> StorageReader:
        from torch.distributed.checkpoint import FileSystemReader

        if self.remote:
            from keel.core.torch_private import fsspec_checkpoint_io

            reader, _ = fsspec_checkpoint_io()
            return reader(self.path(name))
        return FileSystemReader(self.path(name))

    # ------------------------------------------------------------------ writing

    def writer(self, name: str) -> StorageWriter:
        """DCP's writer for a checkpoint: on a local directory, one that checksums as it writes (`digests`)."""
        if self.remote:
            from keel.core.torch_private import fsspec_checkpoint_io

            _, writer = fsspec_checkpoint_io()
            return writer(self.path(name), sync_files=False)
        from keel.checkpoint.digesting import DigestingWriter

        return DigestingWriter(self.path(name))

    def makedirs(self, name: str) -> None:
        self.fs.makedirs(self.path(name), exist_ok=True)

    def write_durably(self, name: str, data: bytes) -> None:
        """Write a whole file and make it durable before returning."""
        if self.remote:
            self.fs.pipe_file(self.path(name), data)
            return
        with open(self.path(name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def rename(self, name: str, new: str) -> None:
        """Move a checkpoint to another name under the root (an object store copies it)."""
        if self.remote:
            self.fs.mv(self.path(name), self.path(new), recursive=True)
            return
        Path(self.path(name)).rename(self.path(new))
        self.sync_dir("")

    def free_bytes(self) -> int | None:
        """Free bytes on the volume of the root (of the nearest directory above it that exists); None
        on an object store."""
        if self.remote:
            return None
        path = Path(self.root)
        try:  # a path this user may not even look at is no volume it can measure
            while not path.exists() and path != path.parent:
                path = path.parent
            return shutil.disk_usage(path).free
        except OSError:
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name), recursive=True)

    def staging_name(self, final: str) -> str:
        """Where a checkpoint is written before it is committed."""
        return final if self.remote else final + ".tmp"

    def sync_dir(self, name: str) -> None:
        """Make a directory's entries durable (a no-op on object stores)."""
        if not self.remote:
            fsync_path(self.path(name))

    def publish(self, staging: str, final: str) -> None:
        """Make a fully written checkpoint visible under its final name."""
        if self.remote:
            return
        self.sync_dir(staging)
        target = Path(self.path(final))
        if target.exists():  # the same step saved again after resuming from an older checkpoint
            replaced = target.with_name(target.name + ".replaced")
            self.remove(replaced.name)
            target.rename(replaced)
            Path(self.path(staging)).rename(target)
            self.remove(replaced.name)
        else:
            Path(self.path(staging)).rename(target)
        self.sync_dir("")

    def set_latest(self, name: str) -> None:
        """Point `latest` at a committed checkpoint, atomically: a symlink swapped by rename, or one object."""
        if self.remote:
            self.fs.pipe_file(self.path(LATEST), name.encode())
            return
        link = Path(self.path(LATEST + ".tmp"))
        link.unlink(missing_ok=True)
        link.symlink_to(name)
        link.rename(self.path(LATEST))
        self.sync_dir("")

    def latest(self) -> str | None:
        try:
            if not self.remote:
                return os.readlink(self.path(LATEST))
            return self.read_bytes(LATEST).decode().strip()
        except (FileNotFoundError, OSError):
            return None

    # ------------------------------------------------------------------ readers vs pruning

    @contextlib.contextmanager
    def reading(self, name: str) -> Iterator[None]:
        """Hold a shared lock on a checkpoint while reading it, so that pruning leaves it alone.
        Object stores have no locks: there, prune with keep_last large enough for your readers."""
        if self.remote:
            yield
            return
        fd = os.open(self._lock_path(name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def remove_unless_read(self, name: str) -> bool:
        """Remove a checkpoint unless some process is reading it; True when removed."""
        if self.remote:
            self.remove(name)
            return True
        lock = self._lock_path(name)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.remove(name)
            os.unlink(lock)
            return True
        finally:
            os.close(fd)

    def lock_name(self, name: str) -> str:
        """The name of the lock file of `name` (on an object store, of the object that stands for one)."""
        if not self.remote:
            (Path(self.root) / LOCKS).mkdir(parents=True, exist_ok=True)
        return f"{LOCKS}/{name}"

    def _lock_path(self, name: str) -> str:
        return self.path(self.lock_name(name))


def _modified(info: dict) -> float | None:
    """When an object store says a file was last modified (each names it its own way)."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
    return None


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def volume_error(e: BaseException) -> OSError | None:
    """The volume's error behind `e`, however it is wrapped: DCP gathers each rank's exception into a
    CheckpointException, and torch's zip writer raises a RuntimeError from the failed write."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in VOLUME_ERRNOS:
            return x
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            todo += [err for err, _ in x.failures.values()]
    return None


def fsync_path(path: str | Path) -> None:
    """fsync a local file or directory by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def locate(path: str | Path) -> tuple[Storage, str]:
    """The storage root holding a checkpoint path, and the checkpoint's name in it."""
    text = str(path).rstrip("/")
    if "://" in text and not text.startswith("file://"):
        root, _, name = text.rpartition("/")
        return Storage(root), name
    local = Path(text.removeprefix("file://")).absolute()
    return Storage(local.parent), local.name
