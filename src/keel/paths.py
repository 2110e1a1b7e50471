"""Checks of the directories a command will write, made before it writes anything."""

from __future__ import annotations

import os
from pathlib import Path

from keel.errors import KeelError

# Kernel file systems: they exist, root may "write" to them, yet no directory or file can be made there.
VIRTUAL_FILE_SYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs",
                                  "pstore", "bpf", "configfs", "efivarfs", "fusectl", "mqueue", "binfmt_misc"})


def nearest_existing(path: Path) -> Path:
    """`path` or, when it is not created yet, the closest parent that exists: the volume it will be on.
    Only "does not exist" walks up: EACCES, ESTALE or EIO there are faults of the volume itself, and the
    parent may be another volume."""
    while True:
        try:
            os.stat(path)
            return path
        except (FileNotFoundError, NotADirectoryError):
            if path == path.parent:
                raise
            path = path.parent


def file_system_type(path: Path) -> str:
    """The type of the mount holding `path` ("" where the mount table cannot be read)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return ""
    return kind


def check_writable_dir(path: Path, what: str) -> None:
    """`path` must be a directory this process can write in, or one it can create: its nearest existing
    parent is a writable directory on a file system that holds files. Creates nothing."""
    shown = f"{what} {str(path)!r}"
    absolute = Path(path).absolute()
    if absolute.exists() and not absolute.is_dir():
        raise KeelError(f"{shown} is a file, not a directory; pass a directory (it is created when missing)")
    try:
        base = nearest_existing(absolute)
    except OSError as e:
        raise KeelError(f"{shown} cannot be reached: {e.strerror or e}") from None
    if not base.is_dir():
        raise KeelError(f"{shown} cannot be created: {str(base)!r} is a file; pass a path under a directory")
    kind = file_system_type(base)
    if kind in VIRTUAL_FILE_SYSTEMS:
        raise KeelError(f"{shown} is on the kernel's {kind} file system, which holds no files; pass a directory "
                        f"on a disk")
    if not os.access(base, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if os.statvfs(base).f_flag & os.ST_RDONLY else "is not writable"
        verb = why if base == absolute else f"cannot be created: {str(base)!r} {why}"
        raise KeelError(f"{shown} {verb}; pass a directory this user may write in")
