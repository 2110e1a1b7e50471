"""Token shards: flat token files of one source and split each, described and checksummed by manifest.json;
written in fixed-size pieces by `ShardWriter`, opened as read-only memmaps by `open_corpus`."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from keel.errors import DataError
from keel.paths import check_input

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: shards per source (a file without "source" belongs to the one source, "main")
# The corpus this job verified, as `verified_key` describes it: the launcher hashes the shards once, its
# workers (and those the elastic agent restarts) inherit the key and hash nothing while it still matches.
VERIFIED_ENV = "KEEL_CORPUS_VERIFIED"


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


def read_manifest(directory: str | Path) -> dict:
    check_input(directory, "data directory", "dir", "set data.dir to a prepared corpus (`keel data prepare --out "
                "DIR` makes one)", DataError)
    path = Path(directory) / MANIFEST
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


def verified_key(directory: Path, manifest: dict) -> str:
    """What a verification of the corpus in `directory` vouches for: its fingerprint and the identity of the
    manifest and of every shard file (inode, size, modification and change times), so that a file replaced
    or written to since then no longer matches and is hashed again."""
    files = [MANIFEST, *(entry["name"] for entry in manifest["files"])]
    stats: list = []
    for name in files:
        try:
            st = (directory / name).stat()
        except FileNotFoundError:  # never a verified corpus: open_corpus names the missing file
            stats.append(None)
            continue
        stats.append((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    described = json.dumps([str(directory.resolve()), manifest["fingerprint"], stats])
    return hashlib.sha256(described.encode()).hexdigest()


def open_corpus(directory: str | Path, verify_checksums: bool = True) -> Corpus:
    """Open a prepared corpus; every shard must have the size, and optionally the sha256, that the
    manifest records. The sha256 is checked once per job: not again while this process's environment
    holds the key of a verification of these very files (VERIFIED_ENV)."""
    manifest = read_manifest(directory)  # before Path(): an empty data.dir is not the working directory
    directory = Path(directory)
    key = verified_key(directory, manifest) if verify_checksums else ""  # taken before the files are read
    verify_checksums = verify_checksums and os.environ.get(VERIFIED_ENV) != key
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
    if verify_checksums:
        os.environ[VERIFIED_ENV] = key
    return Corpus(directory, manifest, splits, sources)


class ShardWriter:
    """Writes one source's split as files of `size` tokens each (the last one shorter), appending an entry
    (name, source, split, tokens, sha256) per finished file to `entries`."""

    def __init__(self, directory: Path, prefix: str, source: str, split: str, dtype: np.dtype, size: int,
                 entries: list[dict]) -> None:
        self.directory, self.prefix, self.source, self.split = directory, prefix, source, split
        self.dtype, self.size, self.entries = dtype, size, entries
        self.file: BinaryIO | None = None
        self.in_file, self.written, self.number = 0, 0, 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.file is None:
                self.name = f"{self.prefix}-{self.number:05d}.bin"
                # open across calls: one shard takes the tokens of many inputs
                self.file = open(self.directory / self.name, "wb")  # noqa: SIM115
                self.in_file, self.hash = 0, hashlib.sha256()
            take = tokens[: self.size - self.in_file]
            data = np.ascontiguousarray(take, dtype=self.dtype).data.cast("B")  # no copy when it is one already
            self.file.write(data)
            self.hash.update(data)
            self.in_file += len(take)
            self.written += len(take)
            tokens = tokens[len(take):]
            if self.in_file == self.size:
                self._end(self.file)

    def _end(self, file: BinaryIO) -> None:
        file.close()
        self.entries.append({"name": self.name, "source": self.source, "split": self.split, "tokens": self.in_file,
                             "sha256": self.hash.hexdigest()})
        self.file, self.number = None, self.number + 1

    def close(self) -> None:
        if self.file is not None:
            self._end(self.file)
