"""manifest.json: what a committed checkpoint holds, and the proof that it is whole.

The manifest is written last. It names every file of the checkpoint with its size and checksum, so a
missing, truncated or bit-flipped file is found before the state is trusted, and (`dcp_files`) the files
that DCP needs to load the tensors: its `.metadata` and every data file that `.metadata` points into.
The checksum is XXH3-128: it reads at memory speed (about 12 GB/s on one core, against under 2 GB/s for
sha256), so verifying a checkpoint before resuming costs a fraction of loading it; it guards against
corruption, not forgery.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from keel.checkpoint.storage import Storage

MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
FORMAT = 1
CHECKSUM = "xxh3_128"
_STEP = re.compile(r"step-(\d{6,})")
# DCP's data files, the RNG streams, and the memory tier's own files (keel.checkpoint.flat)
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp|rng-rank-(\d+)\.pt|flat-rank-(\d+)\.(?:bin|json)")
HELD = "held"  # in a node's copy of a checkpoint spread over nodes: the files it holds (keel.checkpoint.spread)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint that `checkpoints` listed."""
    step = step_of(name)
    if step is None:
        raise ValueError(f"{name!r} is not a checkpoint name (step-NNNNNN)")
    return step


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


def checkpoints(storage: Storage) -> list[str]:
    """Every checkpoint directory, oldest first, whether it verifies or not. In a directory a save
    is written as `step-NNNNNN.tmp/` and renamed: a `step-NNNNNN/` is a finished save even when its
    manifest has gone missing. On an object store a save is written in place and the manifest is
    its last object: there a step without a manifest is still being written (or was abandoned)."""
    steps = sorted((step_of(n), n) for n in storage.names() if step_of(n) is not None)
    return [n for _, n in steps if not storage.remote or storage.exists(f"{n}/{MANIFEST}")]


def committed(storage: Storage) -> list[str]:
    """Names of the checkpoints that have a manifest, oldest first."""
    return [n for n in checkpoints(storage) if storage.exists(f"{n}/{MANIFEST}")]


def uncommitted(storage: Storage) -> list[str]:
    """What a crashed save leaves behind: staging directories (on an object store, steps without a
    manifest). Nothing else is ever removed as unfinished."""
    staging = [n for n in storage.names() if n.endswith(".tmp") and step_of(n.removesuffix(".tmp"))]
    if storage.remote:
        staging += [n for n in storage.names() if step_of(n) is not None and not storage.exists(f"{n}/{MANIFEST}")]
    return staging


def aside_name(name: str, problem: str) -> str:
    """`step-NNNNNN.corrupt-<why>`: where a checkpoint that does not verify is kept, out of the way."""
    return f"{name}.corrupt-{next((slug for words, slug in _SLUGS if words in problem), 'unloadable')}"


# What each problem found by `verify` says, and the word its set-aside directory is named with.
_SLUGS = ((f"no {MANIFEST}", "no-manifest"), ("unreadable", "unreadable-manifest"), ("is missing", "missing-file"),
          ("bytes, the manifest says", "truncated"), ("checksum", "checksum"))


def is_set_aside(name: str) -> bool:
    """Whether `name` is one that `aside_name` made."""
    return ".corrupt-" in name and step_of(name.split(".", 1)[0]) is not None


def check_files(storage: Storage, name: str, manifest: dict, which: Iterable[str] | None = None,
                checksums: bool = True) -> list[str]:
    """Problems found in the files of a checkpoint (all of them, those a node's copy holds, or `which`):
    missing, wrong size, wrong checksum. Empty when they are whole."""
    if "unreadable" in manifest:
        return [manifest["unreadable"]]
    present = storage.files(name)
    problems = []
    for fname in sorted(which if which is not None else manifest.get(HELD, manifest["files"])):
        want = manifest["files"][fname]
        if fname not in present:
            problems.append(f"{fname} is missing")
        elif present[fname] != want["size"]:
            problems.append(f"{fname} has {present[fname]} bytes, the manifest says {want['size']}")
        elif checksums and storage.digest(f"{name}/{fname}") != want[CHECKSUM]:
            problems.append(f"{fname} does not match its checksum in the manifest (corrupted)")
    return problems


def missing_tensors(manifest: dict) -> list[str]:
    """The files DCP needs that the manifest does not list: a checkpoint without them has no model or
    optimizer state. A manifest that predates `dcp_files` must list `.metadata` and a `.distcp` file."""
    if "unreadable" in manifest:
        return []
    files = manifest["files"]
    needed = manifest.get("dcp_files")
    if isinstance(needed, list):
        missing = [f for f in needed if f not in files]
    else:
        missing = [f for f in [DCP_METADATA] if f not in files]
        missing += [] if any(f.endswith(".distcp") for f in files) else ["every .distcp data file"]
    return [f"{f} is missing (DCP needs it to load the model and optimizer state)" for f in missing]


def verify(storage: Storage, name: str, checksums: bool = True) -> list[str]:
    """Everything wrong with checkpoint `name` (empty: verified)."""
    manifest = read_manifest(storage, name)
    if manifest is None:
        return [f"no {MANIFEST}" + (": the save did not finish" if storage.remote else " (it was removed or lost)")]
    return missing_tensors(manifest) + check_files(storage, name, manifest, checksums=checksums)


def manifest_json(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1) + "\n").encode()


def writer_rank(fname: str) -> int:
    """The rank that wrote a checkpoint file, and so checksums it: rank 0 for the shared files."""
    m = _RANK_FILE.fullmatch(fname)
    return int(next(g for g in m.groups() if g is not None)) if m else 0
