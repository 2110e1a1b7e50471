"""manifest.json: what a committed checkpoint holds, and the proof that it is whole.

The manifest is written last. It names every file of the checkpoint with its size and checksum, so a
missing, truncated or bit-flipped file is found before the state is trusted. The checksum is XXH3-128:
it reads at memory speed (about 12 GB/s on one core, against under 2 GB/s for sha256), so verifying a
checkpoint before resuming costs a fraction of loading it; it guards against corruption, not forgery.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from keel.checkpoint.storage import Storage

MANIFEST = "manifest.json"
FORMAT = 1
CHECKSUM = "xxh3_128"
_STEP = re.compile(r"step-(\d{6,})")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def read_manifest(storage: Storage, name: str) -> dict | None:
    """The manifest of `name`, or None when it has none (an unfinished checkpoint)."""
    try:
        raw = storage.read_bytes(f"{name}/{MANIFEST}")
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no file list")
    except ValueError as e:
        return {"unreadable": f"{MANIFEST} is unreadable ({e})"}
    return manifest


def committed(storage: Storage) -> list[str]:
    """Names of the checkpoints that have a manifest, oldest first."""
    steps = sorted((step_of(n), n) for n in storage.names() if step_of(n) is not None)
    return [n for _, n in steps if storage.exists(f"{n}/{MANIFEST}")]


def uncommitted(storage: Storage) -> list[str]:
    """What a crashed save leaves behind: staging directories, and steps without a manifest."""
    left = [n for n in storage.names() if n.endswith((".tmp", ".replaced")) and step_of(n.rsplit(".", 1)[0])]
    return left + [n for n in storage.names() if step_of(n) is not None and not storage.exists(f"{n}/{MANIFEST}")]


def check_files(storage: Storage, name: str, manifest: dict, which: Iterable[str] | None = None,
                checksums: bool = True) -> list[str]:
    """Problems found in the files of a checkpoint (all of them, or `which`): missing, wrong size,
    wrong checksum. Empty when they are whole."""
    if "unreadable" in manifest:
        return [manifest["unreadable"]]
    present = storage.files(name)
    problems = []
    for fname in sorted(which if which is not None else manifest["files"]):
        want = manifest["files"][fname]
        if fname not in present:
            problems.append(f"{fname} is missing")
        elif present[fname] != want["size"]:
            problems.append(f"{fname} has {present[fname]} bytes, the manifest says {want['size']}")
        elif checksums and storage.digest(f"{name}/{fname}") != want[CHECKSUM]:
            problems.append(f"{fname} does not match its checksum in the manifest (corrupted)")
    return problems


def verify(storage: Storage, name: str, checksums: bool = True) -> list[str]:
    """Everything wrong with checkpoint `name` (empty: verified)."""
    manifest = read_manifest(storage, name)
    if manifest is None:
        return [f"no {MANIFEST}: the save did not finish"]
    return check_files(storage, name, manifest, checksums=checksums)


def manifest_json(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1) + "\n").encode()
