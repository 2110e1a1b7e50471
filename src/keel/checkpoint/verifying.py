"""The checks of one checkpoint's files before it is loaded, run on a background thread.

DCP trusts `.metadata`, so it is checked first, on its own, with the manifest's list of the files DCP
needs; then this rank's share of the other files. A rank's share is the files it wrote when the
checkpoint was saved with this number of processes (its own shard, its RNG streams; rank 0 the shared
files): the files its load reads, which the checksums then bring into the page cache. Saved with
another number of processes, the files are dealt out in turn.

A resume starts these checks as soon as it knows which checkpoint it will load, before the model is
built, and the load waits only for what is not finished by then.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from keel.checkpoint.manifest import check_files, missing_tensors, writer_rank
from keel.checkpoint.storage import Storage


def share(files: list[str], rank: int, world_size: int, saved_by: int) -> list[str]:
    """The files other than `.metadata` that `rank` checks."""
    others = sorted(f for f in files if f != ".metadata")
    if saved_by != world_size:
        return others[rank::world_size]
    return [f for f in others if writer_rank(f) == rank]


def _stamps(storage: Storage, name: str, files: list[str]) -> dict[str, tuple[int, int]]:
    """Size and modification time of each local file (an object store's are not compared)."""
    if storage.remote:
        return {}
    stamps = {}
    for fname in files:
        with contextlib.suppress(OSError):
            st = os.stat(storage.path(f"{name}/{fname}"))
            stamps[fname] = (st.st_size, st.st_mtime_ns)
    return stamps


@dataclass
class Verification:
    """The problems found in `.metadata` and in this rank's share of one checkpoint, as they come, and the
    files' sizes and modification times taken before they were read."""

    storage: Storage
    name: str
    manifest: dict
    stamps: dict[str, tuple[int, int]]
    metadata: Future[list[str]] = field(default_factory=Future)
    rest: Future[list[str]] = field(default_factory=Future)

    @property
    def path(self) -> str:
        return self.storage.path(self.name)

    def unchanged(self) -> bool:
        """No file checked was written since its checks began."""
        return _stamps(self.storage, self.name, list(self.stamps)) == self.stamps


def start(storage: Storage, name: str, manifest: dict, rank: int, world_size: int,
          checksums: bool) -> Verification:
    """Check checkpoint `name` (whose manifest is `manifest`) on a daemon thread: a process that must end
    meanwhile does not wait for it."""
    mine = share(list(manifest.get("files", {})), rank, world_size, int(manifest.get("world_size", 0)))
    verification = Verification(storage, name, manifest, _stamps(storage, name, [".metadata", *mine]))

    def run() -> None:
        for future, which in ((verification.metadata, [".metadata"]), (verification.rest, mine)):
            try:
                with storage.reading(name):  # pruning leaves it alone meanwhile
                    missing = missing_tensors(manifest) if future is verification.metadata else []
                    future.set_result(missing + check_files(storage, name, manifest,
                                                            [f for f in which if f in manifest.get("files", {})],
                                                            checksums))
            except BaseException as e:  # raised where the load asks for the verdict
                future.set_exception(e)

    threading.Thread(target=run, name="keel-verify", daemon=True).start()
    return verification
