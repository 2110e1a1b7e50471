"""Token shards: flat numpy memmaps of one split each, described and checksummed by manifest.json."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from keel.errors import DataError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: shards per source (a file without "source" belongs to the one source, "main")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class Corpus:
    """A prepared corpus: its manifest and one memmap per shard, grouped by split."""

    dir: Path
    manifest: dict
    splits: dict[str, list[np.memmap]]
    sources: dict[str, list[np.memmap]]  # the training shards of every source, in the manifest's order

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DataError(f"data directory {str(directory)!r} does not exist; run `keel data prepare --out "
                        f"{directory}` or set data.dir to a prepared corpus")
    if not path.is_file():
        raise DataError(f"{str(directory)!r} holds no {MANIFEST}: not a prepared corpus; run `keel data prepare "
                        f"--out {directory}`")
    try:
        manifest = json.loads(path.read_text())
        manifest["files"], manifest["fingerprint"]  # noqa: B018 - required keys
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{str(path)!r} is not a valid corpus manifest ({e}); prepare the corpus again") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{str(directory)!r} was prepared in corpus format {manifest.get('format_version')}, this keel "
                        f"reads format {FORMAT_VERSION}; prepare it again (`keel data prepare --out {directory} "
                        f"--force`)")
    return manifest


def open_corpus(directory: str | Path, verify_checksums: bool = True) -> Corpus:
    """Open a prepared corpus; every shard must have the size, and optionally the sha256, that the
    manifest records."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    dtype = np.dtype(manifest["dtype"])
    splits: dict[str, list[np.memmap]] = {"train": [], "val": []}
    sources: dict[str, list[np.memmap]] = {}
    for entry in manifest["files"]:
        path = directory / entry["name"]
        expected = entry["tokens"] * dtype.itemsize
        if not path.is_file():
            raise DataError(f"shard {str(path)!r} listed in the manifest is missing; prepare the corpus again")
        if path.stat().st_size != expected:
            raise DataError(f"shard {str(path)!r} has {path.stat().st_size} bytes, the manifest says {expected}: "
                            f"truncated or altered; prepare the corpus again")
        if verify_checksums and sha256_file(path) != entry["sha256"]:
            raise DataError(f"shard {str(path)!r} fails its sha256 check against the manifest: altered or "
                            f"corrupt; prepare the corpus again")
        shard = np.memmap(path, dtype=dtype, mode="r")
        splits[entry["split"]].append(shard)
        if entry["split"] == "train":
            sources.setdefault(entry.get("source", "main"), []).append(shard)
    return Corpus(directory, manifest, splits, sources)
