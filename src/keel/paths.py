"""The one check of every path a command takes, input or output, made before the command reads or writes
anything: each problem is a one-line KeelError naming the path, what is wrong and what would do."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from keel.errors import KeelError

# Kernel file systems: they exist, root may "write" to them, yet no directory or file can be made there.
VIRTUAL_FILE_SYSTEMS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs",
                                  "pstore", "bpf", "configfs", "efivarfs", "fusectl", "mqueue", "binfmt_misc"})
PATH_MAX = 4096  # bytes of a path with its final NUL (Linux's limits.h), where pathconf cannot say
NAME_MAX = 255  # bytes of one name, where the file system cannot say
SHOWN_CHARS = 300  # a longer path (only a broken one is) is shown by its ends: a message stays one readable line


def shown(path: str | Path) -> str:
    """`path` quoted for a message: whole when short, else its ends and its length."""
    text = str(path)
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:160]!r}…{text[-80:]!r} ({len(text)} characters)"


def _limit(path: str, name: str, default: int) -> int:
    """The pathconf limit `name` of the volume that holds `path` (or would): asked of its closest parent."""
    for parent in [Path(path), *Path(path).parents]:
        try:
            return os.pathconf(parent, name)
        except (OSError, ValueError):
            continue
    return default


def check_name(path: str | Path, what: str, valid: str, error: type[KeelError] = KeelError) -> str:
    """What can be said of a path without opening it: it is not empty, is text without NUL, and fits the
    system's length limits (ENAMETOOLONG). Returns the path as text; a problem raises `error`."""
    try:
        return _check_name(str(path), what, valid)
    except KeelError as e:
        raise error(str(e)) from None


def _check_name(text: str, what: str, valid: str) -> str:
    if not text:
        raise KeelError(f"{what} is empty, which names no file; {valid}")
    if "\0" in text:
        raise KeelError(f"{what} {shown(text)} holds a NUL character, which no path may; {valid}")
    try:
        raw = os.fsencode(text)
    except UnicodeEncodeError:
        raise KeelError(f"{what} {shown(text)} is not valid text for a path; {valid}") from None
    most = _limit(text, "PC_PATH_MAX", PATH_MAX) - 1
    if len(raw) > most:
        raise KeelError(f"{what} {shown(text)} is {len(raw)} bytes long, over the system's limit of {most}; "
                        f"{valid}")
    longest = _limit(text, "PC_NAME_MAX", NAME_MAX)
    for part in raw.split(b"/"):
        if len(part) > longest:
            raise KeelError(f"{what} {shown(text)} holds a name of {len(part)} bytes ({os.fsdecode(part)[:16]!r}…), "
                            f"over the file system's limit of {longest}; {valid}")
    return text


def _unreachable(what: str, path: str | Path, e: OSError, valid: str) -> KeelError:
    problem = {errno.ELOOP: "is a loop of symbolic links (or a chain of more than 40)",
               errno.ENOTDIR: "lies under a file, not a directory",
               errno.EACCES: "cannot be reached: permission denied",
               errno.EPERM: "cannot be reached: operation not permitted",
               errno.ENAMETOOLONG: "is too long for the system once its links are followed"}
    return KeelError(f"{what} {shown(path)} {problem.get(e.errno or 0, f'cannot be reached: {e.strerror or e}')}; "
                     f"{valid}")


def _stat(path: str | Path, what: str, valid: str, to_create: bool = False) -> os.stat_result | None:
    """The status of what `path` names, its links followed; None when nothing is there (or, `to_create`,
    when a file is in the way: the caller names it)."""
    try:
        return os.stat(path)
    except NotADirectoryError as e:
        if to_create:
            return None
        raise _unreachable(what, path, e, valid) from None
    except FileNotFoundError:
        if os.path.islink(path):
            raise KeelError(f"{what} {shown(path)} is a symbolic link to {shown(os.readlink(path))}, which does "
                            f"not exist; {valid}") from None
        return None
    except OSError as e:
        raise _unreachable(what, path, e, valid) from None


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file or directory"


def check_input(path: str | Path, what: str, kind: str, valid: str, error: type[KeelError] = KeelError) -> Path:
    """`path` names what a command reads: an existing `kind` ("file", "dir" or "any" of the two) that this
    process can open. Opens it (and closes it) to find out; changes nothing. A problem raises `error`."""
    try:
        return _check_input(path, what, kind, valid)
    except KeelError as e:
        raise error(str(e)) from None


def _check_input(path: str | Path, what: str, kind: str, valid: str) -> Path:
    text = check_name(path, what, valid)
    found = _stat(text, what, valid)
    if found is None:
        raise KeelError(f"{what} {shown(text)} does not exist; {valid}")
    wanted = {"file": stat.S_ISREG, "dir": stat.S_ISDIR}.get(kind, lambda m: stat.S_ISREG(m) or stat.S_ISDIR(m))
    if not wanted(found.st_mode):
        expected = {"file": "a file", "dir": "a directory"}.get(kind, "a file or directory")
        raise KeelError(f"{what} {shown(text)} is {kind_of(found.st_mode)}, not {expected}; {valid}")
    try:
        if stat.S_ISDIR(found.st_mode):
            with os.scandir(text):
                pass
        else:
            os.close(os.open(text, os.O_RDONLY | os.O_NOCTTY))
    except OSError as e:
        raise KeelError(f"{what} {shown(text)} cannot be read: {e.strerror or e}; {valid}") from None
    return Path(text)


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


def check_writable_dir(path: str | Path, what: str) -> Path:
    """`path` must be a directory this process can write in, or one it can create: its nearest existing
    parent is a writable directory on a file system that holds files. Creates nothing."""
    return _check_output(path, what, stat.S_ISDIR, "a directory", ", not a directory",
                         "pass a directory (it is created when missing)")


def check_writable_file(path: str | Path, what: str) -> Path:
    """`path` names a file a command writes: an existing file it may replace, or a new one in a directory it
    can write in or create. Creates nothing."""
    return _check_output(path, what, stat.S_ISREG, "a file", "", "pass the path of a file to write")


def _check_output(path: str | Path, what: str, wanted: Callable[[int], bool], noun: str, not_noun: str,
                  valid: str) -> Path:
    """What an output path names is of the `wanted` kind where it exists, and can be written or created."""
    text = check_name(path, what, valid)
    found = _stat(text, what, valid, to_create=True)
    if found is not None and not wanted(found.st_mode):
        raise KeelError(f"{what} {shown(text)} is {kind_of(found.st_mode)}{not_noun}; {valid}")
    _check_creatable(text, what, noun, valid)
    return Path(text)


def _check_creatable(text: str, what: str, noun: str, valid: str) -> None:
    """What `text` names, or its closest existing parent where it is not there yet, lies on a file system that
    holds files, and this process may write there."""
    absolute = Path(text).absolute()
    try:
        base = nearest_existing(absolute)
    except OSError as e:
        raise _unreachable(what, text, e, valid) from None
    shown_as = f"{what} {shown(text)}"
    if base != absolute and not base.is_dir():
        raise KeelError(f"{shown_as} cannot be created: {shown(base)} is a file; pass a path under a directory")
    kind = file_system_type(base)
    if kind in VIRTUAL_FILE_SYSTEMS:
        raise KeelError(f"{shown_as} is on the kernel's {kind} file system, which holds no files; pass {noun} on "
                        f"a disk")
    if not os.access(base, os.W_OK | (os.X_OK if base.is_dir() else 0)):
        why = "is on a read-only file system" if os.statvfs(base).f_flag & os.ST_RDONLY else "is not writable"
        verb = why if base == absolute else f"cannot be created: {shown(base)} {why}"
        raise KeelError(f"{shown_as} {verb}; pass {noun} this user may write in")
