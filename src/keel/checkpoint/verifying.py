"""The checks of one checkpoint's files before it is loaded, run on a background thread.

DCP trusts `.metadata`, so it is checked first, on its own; then this rank's share of the other files. A
rank's share is the files it wrote when the checkpoint was saved with this number of processes (its own
shard, its RNG streams; rank 0 the shared files): the files its load reads, which the checksums then
bring into the page cache. Saved with another number of processes, the files are dealt out in turn.

A resume starts these checks as soon as it knows which checkpoint it will load, before the model is
built, and the load waits only for what is not finished by then.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from keel.checkpoint.manifest import check_files
from keel.checkpoint.storage import Storage

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp|rng-rank-(\d+)\.pt")


def share(files: list[str], rank: int, world_size: int, saved_by: int) -> list[str]:
    """The files other than `.metadata` that `rank` checks."""
    others = sorted(f for f in files if f != ".metadata")
    if saved_by != world_size:
        return others[rank::world_size]
    return [f for f in others if _writer(f) == rank]


def _writer(fname: str) -> int:
    m = _RANK_FILE.fullmatch(fname)
    return int(m.group(1) or m.group(2)) if m else 0


@dataclass
class Verification:
    """The problems found in `.metadata` and in this rank's share of one checkpoint, as they come."""

    path: str
    manifest: dict
    metadata: Future[list[str]] = field(default_factory=Future)
    rest: Future[list[str]] = field(default_factory=Future)


def start(storage: Storage, name: str, manifest: dict, rank: int, world_size: int,
          checksums: bool) -> Verification:
    """Check checkpoint `name` (whose manifest is `manifest`) on a daemon thread: a process that must end
    meanwhile does not wait for it."""
    verification = Verification(storage.path(name), manifest)
    mine = share(list(manifest.get("files", {})), rank, world_size, int(manifest.get("world_size", 0)))

    def run() -> None:
        for future, which in ((verification.metadata, [".metadata"]), (verification.rest, mine)):
            try:
                with storage.reading(name):  # pruning leaves it alone meanwhile
                    future.set_result(check_files(storage, name, manifest,
                                                  [f for f in which if f in manifest.get("files", {})], checksums))
            except BaseException as e:  # raised where the load asks for the verdict
                future.set_exception(e)

    threading.Thread(target=run, name="keel-verify", daemon=True).start()
    return verification
